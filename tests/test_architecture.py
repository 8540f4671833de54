"""The dependency rules of src/rlexact (docs/design.md, "Dependency direction"), read from the source with ``ast``:
no import cycles, imports only from the same or a lower layer, no private names across modules.

Every import counts, including function-level ones; imports under ``if TYPE_CHECKING:`` do not (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "rlexact"

LAYERS: dict[str, int] = {
    # 0: no rlexact imports below them (kernels, pure functions, helpers)
    "ops": 0,
    "algorithms": 0,
    "batch": 0,
    "char_tokenizer": 0,
    "checkpoint": 0,
    "checks": 0,
    "envinfo": 0,
    "reduction": 0,
    "requirements": 0,
    "resources": 0,
    "rewards": 0,
    # 1: the exact model
    "models": 1,
    # 2: model-level helpers shared by the generator and the trainer
    "distributed": 2,
    "logprobs": 2,
    # 3: the generator
    "rollout": 3,
    # 4: the trainer's configuration, data and RL callbacks
    "config": 4,
    "callbacks": 4,
    "data": 4,
    # 5: the stages of the training step
    "trainer": 5,
    # 6: the LightningModule
    "module": 6,
    # 7: entry points
    "cli": 7,
    "demo": 7,
    "export": 7,
    "study": 7,
}
"""Layer of each top-level module / package of rlexact: a module may import from its own layer or a lower one."""

KNOWN_UPWARD: set[tuple[str, str]] = set()
"""Upward imports that exist today and are to be removed; the test fails when one disappears, so the list shrinks."""

PACKAGE_PRIVATE = {"rlexact.ops"}
"""Packages whose modules share underscore-prefixed helpers among themselves (the Triton launchers share launch
helpers); a private name still never leaves the package."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str) -> list[tuple[str, str | None]]:
    """``(imported module, imported name or None)`` for every rlexact import of module ``name`` that runs."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, str | None]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, None) for a in child.names if a.name.split(".")[0] == "rlexact")
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    keep = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(keep + ([base] if base else []))
                if base.split(".")[0] == "rlexact":
                    for alias in child.names:
                        sub = f"{base}.{alias.name}"
                        found.append((sub, None) if sub in MODULES else (base, alias.name))
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name in MODULES:
        targets = {mod for mod, _ in _imports(name)}
        graph[name] = {t for t in targets if t in MODULES and t not in (name, "rlexact")}  # the root package re-exports
    return graph


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def test_every_module_has_a_layer() -> None:
    unplaced = sorted({n.split(".")[1] for n in MODULES if n != "rlexact" and _layer(n) is None})
    assert not unplaced, f"add these to LAYERS in tests/test_architecture.py and docs/design.md: {unplaced}"


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_cycle_detection_negative_control() -> None:
    graph = _graph()
    graph["rlexact.models.forward"] = graph["rlexact.models.forward"] | {"rlexact.rollout.engine"}
    assert any("rlexact.rollout.engine" in c and "rlexact.models.forward" in c for c in _cycles(graph))


def test_imports_flow_down_the_layers() -> None:
    upward = {
        (src, dst)
        for src, targets in _graph().items()
        for dst in targets
        if _layer(src) is not None and _layer(dst) is not None and _layer(dst) > _layer(src)
    }
    assert upward - KNOWN_UPWARD == set(), "imports against the dependency direction"
    assert KNOWN_UPWARD - upward == set(), "a known upward import is gone: remove it from KNOWN_UPWARD"


def test_no_private_names_cross_modules() -> None:
    leaks = []
    for name in MODULES:
        for mod, imported in _imports(name):
            package = next((p for p in PACKAGE_PRIVATE if name.startswith(p + ".") or name == p), None)
            inside = package is not None and (mod == package or mod.startswith(package + "."))
            private_module = any(part.startswith("_") and part != "__init__" for part in mod.split("."))
            same_package = mod.rpartition(".")[0] == name.rpartition(".")[0]
            if imported is not None and imported.startswith("_") and not inside:
                leaks.append(f"{name} imports {mod}.{imported}")
            elif private_module and not same_package and not inside:
                leaks.append(f"{name} imports private module {mod}")
    assert leaks == []
