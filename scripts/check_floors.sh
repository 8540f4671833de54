#!/usr/bin/env bash
# The CPU test suite at the lowest versions pyproject.toml allows. Every `name>=X` requirement of the package and of
# its dev extra becomes the constraint `name==X` in a fresh virtual environment (the floors: the GPU image's torch,
# Triton, transformers and Lightning, where the GPU results were measured), the package installs under those
# constraints, and the README's test command runs there.
#
#   scripts/check_floors.sh [VENV]      # default .venv-floors (ignored by git); .ci/run runs it after the suite
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-floors}
python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
constraints="$venv/floors.txt"
python - > "$constraints" << 'EOF'
import re
import sys

try:
    import tomllib
except ImportError:
    sys.exit("check_floors.sh: needs Python 3.11+ (tomllib) to read pyproject.toml")
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
pins = {}
for req in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?>=([0-9][^\s;,]*)\s*(;.*)?", req)
    if m is None:
        sys.exit(f"check_floors.sh: requirement {req!r} has no single '>=' floor to pin")
    pins[m.group(1)] = f"{m.group(1)}=={m.group(3)}{m.group(4) or ''}"
print("\n".join(pins.values()))
EOF
echo "floors: $(tr '\n' ' ' < "$constraints")"
python -m pip install -q -c "$constraints" -e ".[dev]"
python -m pip list 2> /dev/null | grep -i -E "^(torch|triton|transformers|lightning|torchmetrics|datasets|tensorboard|jsonargparse|math-verify|tqdm|pytest|pytest-timeout) "
python -m pytest -q -m "not gpu" --timeout=900
