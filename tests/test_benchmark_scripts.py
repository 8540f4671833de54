"""The GPU benchmark scripts run end to end on their tiny CPU shapes and write the result keys the README cites;
without a CUDA device, the GPU-only ones stop at once with a one-line message and leave the committed results alone."""

from __future__ import annotations

import ast
import hashlib
import importlib
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from source_scan import jitted

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

GPU_ONLY = (
    "attention_configs", "attention_decode_scaling", "attention_key_tile", "cublas_bitwise_probe", "decode_heads",
    "decode_timeline", "gluon_decode_probe", "gluon_matmul_probe", "gluon_persistent_probe", "hbm_read_probe",
    "head_variants", "kernel_counters", "matmul_gated", "matmul_splitk", "matmul_variants", "ops_bench",
    "overlap_probe", "pair_depth_probe", "prefill_call_probe", "sampler_merge", "split_kv_sweep", "truncation_bench",
)  # fmt: skip
"""Benchmark scripts that measure on a CUDA GPU and have no CPU mode."""
CPU_MODE = {
    "attention_launch": "--host-only", "matmul_launch": "--host-only", "moe_bench": "--small",
    "prefill_chunks": "--tiny", "rollout_throughput": "--tiny", "scale_run": "--accelerator cpu --tiny",
    "train_step": "--small",
}  # fmt: skip
"""GPU benchmark scripts with a CPU mode: the flags that select it."""
CPU_ONLY = ("cpu_attention", "fp_fusion_sm90", "kernel_resources", "pair_sass", "restamp_commit", "reward_throughput",
            "rollout_host", "truncation_passes")  # fmt: skip
"""Scripts that run on the host alone (compiling for sm_90 at most)."""
MODULES = ("common", "roofline")
"""Modules of ``benchmarks`` the scripts import, with no command line of their own."""

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")


def _script(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python benchmarks/<script> *args`` from the repository root, its output captured."""
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args], capture_output=True, text=True, timeout=timeout,
        cwd=REPO,
    )  # fmt: skip


def _run(script: str, *args: str) -> None:
    proc = _script(script, *args)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def _results_snapshot() -> dict[str, str]:
    """SHA-256 of every file under ``benchmarks/results``, by relative path (a new or removed file shows too)."""
    return {
        str(f.relative_to(RESULTS)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(RESULTS.rglob("*"))
        if f.is_file()
    }


_STOP_DRIVER = """
import contextlib, io, json, runpy, sys, traceback
bench, scripts = sys.argv[1], sys.argv[2:]
sys.path.insert(0, bench)  # as `python benchmarks/<script>.py` puts the script's folder first
report = {}
for name in scripts:
    sys.argv = [f"{bench}/{name}.py"]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(sys.argv[0], run_name="__main__")
        status = 0
    except SystemExit as e:  # what the interpreter does with it: a string goes to stderr, status 1
        status = e.code if isinstance(e.code, int) else 1
        if e.code is not None and not isinstance(e.code, int):
            err.write(f"{e.code}\\n")
    except BaseException:
        status = "raised"
        err.write(traceback.format_exc())
    report[name] = {"status": status, "stderr": err.getvalue()}
print(json.dumps(report))
"""
"""Runs each named script of the folder ``argv[1]`` as ``__main__`` with no arguments, in one interpreter (torch and
the library imported once, not once per script), and prints per script its exit status and stderr as JSON."""


def test_benchmark_scripts_are_classified() -> None:
    """Every script of ``benchmarks`` is GPU-only, has a CPU mode or runs on the host, so the check below that the GPU
    ones stop without a GPU covers every one of them (a new script must be placed in one of the lists)."""
    stems = {p.stem for p in (REPO / "benchmarks").glob("*.py")}
    listed = [*GPU_ONLY, *CPU_MODE, *CPU_ONLY, *MODULES]
    assert len(listed) == len(set(listed))
    assert stems == set(listed)


@no_cuda
def test_gpu_scripts_stop_without_cuda() -> None:
    """Without a CUDA device, every GPU benchmark script run with its default arguments (none) exits with status 1 and
    a one-line message naming it, that it needs a CUDA GPU and, for one with a CPU mode, that mode's flags; no
    traceback, and no file under ``benchmarks/results`` written (they hold the GPU runs' numbers). The scripts run as
    ``__main__`` in one interpreter, which costs one import of torch and the library instead of one per script;
    :func:`test_gpu_script_stops_without_cuda` runs some of them as separate processes."""
    before = _results_snapshot()
    scripts = [*GPU_ONLY, *CPU_MODE]
    proc = subprocess.run([sys.executable, "-c", _STOP_DRIVER, str(REPO / "benchmarks"), *scripts],
                          capture_output=True, text=True, timeout=180, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert _results_snapshot() == before
    assert list(report) == scripts
    for name, run in report.items():
        err = run["stderr"]
        assert run["status"] == 1 and "Traceback" not in err, f"{name}: {run}"
        message = err.strip().splitlines()[-1]
        assert message.startswith(f"{name}.py needs a CUDA GPU"), f"{name}: {err[-2000:]}"
        assert message.endswith(f"run it with {CPU_MODE[name]}") if name in CPU_MODE else "run it" not in message


@no_cuda
@pytest.mark.parametrize("name", ["matmul_gated", "matmul_variants", "rollout_throughput"])
def test_gpu_script_stops_without_cuda(name: str) -> None:
    """``python benchmarks/<name>.py`` without a CUDA device: status 1, the one-line message on stderr (naming the
    CPU mode's flag where there is one), no traceback, the results untouched. Two scripts that used to overwrite their
    committed GPU result with an error, and one that used to run its GPU sizes on the CPU."""
    before = _results_snapshot()
    proc = _script(f"{name}.py", timeout=120)
    assert _results_snapshot() == before
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (message,) = proc.stderr.strip().splitlines()
    assert message.startswith(f"{name}.py needs a CUDA GPU")
    assert ("--tiny" in message) == (name == "rollout_throughput")
    assert "wrote" not in proc.stdout


def test_pair_depth_probe_refuses_a_build_given_twice() -> None:
    """Two specs of one build (the key tile written out or left to the default) would share a result row, so the
    probe refuses them before it looks for a GPU, naming the build; distinct builds pass that check (and, here, stop
    at the CUDA check instead)."""
    proc = _script("pair_depth_probe.py", "--variants", "3x3SFTZMC", "3x3x64SFTZMC", timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "3x3x64SFTZMC given more than once" in proc.stderr
    if not torch.cuda.is_available():
        distinct = _script("pair_depth_probe.py", "--variants", "3x3SFTZMC", "3x3S", timeout=120)
        assert distinct.returncode == 1
        assert "needs a CUDA GPU" in distinct.stderr and "more than once" not in distinct.stderr


def test_run_cases_writes_nothing_when_every_case_fails(tmp_path: Path) -> None:
    """``common.run_cases`` never writes a result whose every case failed: it raises and leaves ``out`` as it was. One
    case that succeeds is written with the failures beside it, and fails the exit code; all succeeding gives 0."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from common import run_cases
    finally:
        sys.path.remove(str(REPO / "benchmarks"))

    def measure(name: str) -> dict:
        if name.startswith("bad"):
            raise ValueError(f"no {name}")
        return {"value": name}

    out = tmp_path / "result.json"
    out.write_text("committed\n")
    with pytest.raises(RuntimeError, match=r"every case failed \(bad1, bad2\).*not written(.|\n)*ValueError: no bad1"):
        run_cases({}, "cases", ["bad1", "bad2"], measure, str(out))
    assert out.read_text() == "committed\n"
    assert run_cases({}, "cases", ["bad1", "ok", "bad2"], measure, str(out)) == 1
    res = json.loads(out.read_text())
    assert res["cases"] == {"ok": {"value": "ok"}} and set(res["errors"]) == {"bad1", "bad2"}
    assert run_cases({}, "cases", ["ok"], measure, str(out)) == 0
    assert json.loads(out.read_text()) == {"cases": {"ok": {"value": "ok"}}, "errors": {}}


def test_rollout_throughput_tiny(tmp_path: Path) -> None:
    out = tmp_path / "rollout.json"
    _run("rollout_throughput.py", "--tiny", "--engines", "exact", "native", "hf_generate", "--batches", "4",
         "--profile", "2", "--top-k", "20", "--top-p", "0.9", "--logprobs", "sampled", "--hf-calls", "3",
         "--gated-cublas-rows", "1", "0", "--out", str(out))  # fmt: skip
    res = json.loads(out.read_text())
    assert res["errors"] == {}
    assert "logprobs sampled" in res["setup"]["sampling"]
    assert res["setup"]["gated_cublas_rows"] == [1, 0]
    row = res["results"]["4"]
    exact = row["exact"]
    assert exact["tokens"] == 4 * res["setup"]["new_tokens"]
    assert {"decode_step_ms", "decode_step_walls_s", "profile"} <= exact.keys()
    assert "prefill_call" in exact["profile"]
    assert exact["kept_engine"]["same_as_default"] is True
    assert row["exactness_spot_check"]["all_bitwise_equal"] is True, row["exactness_spot_check"]
    assert "ratio_exact_over_native" in row
    hf = row["hf_generate"]  # the median of the timed calls
    assert len(hf["walls_s"]) == 3 and hf["seconds"] == sorted(hf["walls_s"])[1]
    assert hf["ms_per_step"] == hf["seconds"] * 1e3 / res["setup"]["new_tokens"]
    assert res["host_python_loop_ms"] > 0
    assert "ratio_exact_over_hf_generate" in row


def test_train_step_small(tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    _run("train_step.py", "--small", "--reps", "1", "--out", str(out))
    res = json.loads(out.read_text())
    for case in res["fwd_bwd"]["cases"].values():
        assert "exact_over_stock_speed" in case, case
    grpo = res["grpo_step"]
    assert "native_recompute_over_exact_time" in grpo, grpo
    assert set(grpo["exact"]["stages_s"]) == {"rollout", "update"}
    assert set(grpo["native_recompute"]["stages_s"]) == {"rollout", "scoring", "update"}


def test_rollout_host_stub(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    _run("rollout_host.py", "--batches", "4", "--new-tokens", "16", "--repeats", "1", "--out", str(out))
    row = json.loads(out.read_text())["results"]["4"]
    assert row["decode_steps"] == 8 and isinstance(row["step_us"], float)  # a difference of walls: noise may flip it
    assert set(row["parts_us"]) == {"schedule", "prepare", "launch", "wait", "collect", "postprocess"}
    assert set(row["gc_per_step"]) == {"gen0", "gen1", "gen2"}


def test_prefill_chunks_tiny(tmp_path: Path) -> None:
    """Two token budgets on the tiny CPU model: both run, chunk the prompts into different numbers of eager steps,
    and give the same completions bitwise (the script's row-invariance check)."""
    out = tmp_path / "chunks.json"
    _run("prefill_chunks.py", "--tiny", "--batch", "8", "--prompt-len", "16", "--new-tokens", "4", "--budgets", "32",
         "128", "--reps", "1", "--top", "3", "--out", str(out))  # fmt: skip
    res = json.loads(out.read_text())
    assert res["errors"] == {}
    small, large = res["budgets"]["32"], res["budgets"]["128"]
    assert small["eager_steps"] > large["eager_steps"]
    assert small["same_as_first_budget"] is True and large["same_as_first_budget"] is True
    assert len(large["cprofile_top_own_time"]) == 3


def test_kernel_counters_parses_ncu_raw_csv() -> None:
    """``kernel_counters.parse`` reads ncu's raw CSV (a units row, quoted numbers with thousands separators): the
    summary takes the first metric name present, the stalls are ranked, and a kernel row of the wrong width is
    dropped."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import kernel_counters as kc
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    head = ["ID", "Kernel Name", "gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
            stall.format("long_scoreboard"), stall.format("wait")]  # fmt: skip
    rows = [head, ["", "", "nsecond", "%", "", ""], ["0", "_attn_fwd_kernel", "54,612", "71.5", "9.25", "1.5"],
            ["1", "short row"]]  # fmt: skip
    report = "==PROF== Connected\n" + "\n".join(",".join(f'"{c}"' for c in r) for r in rows) + "\n"
    (kern,) = kc.parse(report)
    assert kern["name"] == "_attn_fwd_kernel"
    assert kern["summary"] == {"duration_ns": 54612.0, "dram_pct_of_peak": 71.5}
    assert list(kern["top_stalls_per_issue"]) == ["long_scoreboard", "wait"]


def test_kernel_counters_parses_ncu_source_csv() -> None:
    """``kernel_counters.parse_source`` reads ncu's source page (one table per kernel, SASS text per row): samples
    are summed by opcode (predicates skipped), the instructions are ranked by samples, and a short row is dropped."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import kernel_counters as kc
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)"]
    rows = [head, ["0x10", "LDG.E R2, desc[UR4][R4.64]", "120", "110"], ["0x20", "@!P0 BAR.SYNC.DEFER_BLOCKING 0x0",
            "30", "30"], ["0x30", "LDG.E.128 R8, desc[UR4][R6.64]", "1,200", "1,100"], ["0x40", "short"]]  # fmt: skip
    report = "==PROF== Connected\n" + "\n".join(",".join(f'"{c}"' for c in r) for r in rows) + "\n"
    (kern,) = kc.parse_source(report)
    assert kern["samples_by_opcode"] == {"LDG": 1320.0, "BAR": 30.0}
    assert [r["Address"] for r in kern["top_instructions"]] == ["0x30", "0x10", "0x20"]
    assert kern["total_samples"] == 1350.0 and kern["instructions"] == 3
    (region,) = kern["hot_regions"]  # three instructions, each within the others' context: one region
    assert [line.split("|")[0].strip() for line in region] == ["0x00000", "0x00010", "0x00020"]
    assert region[2].split("|")[1].strip() == "1200" and region[2].endswith("LDG.E.128 R8, desc[UR4][R6.64]")


def test_kernel_counters_hot_regions_split_and_merge() -> None:
    """Neighbourhoods of hot instructions far apart stay separate regions; close ones merge into one."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import kernel_counters as kc
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    col = "samples"
    rows = [{"Address": hex(0x100 + 16 * i), "Source": f"NOP{i}", col: 0.0} for i in range(100)]
    for i in (20, 22, 80):
        rows[i][col] = 10.0
    regions = kc.hot_regions(rows, col)
    before, after = kc.CONTEXT
    assert len(regions) == 2
    assert len(regions[0]) == (22 + after + 1) - (20 - before) and regions[0][0].endswith(f"NOP{20 - before}")
    assert len(regions[1]) == before + after + 1 and regions[1][before].endswith("NOP80")


def test_kernel_resources_compiles_on_the_host(tmp_path: Path) -> None:
    """``kernel_resources.py`` compiles the decode attention launch and a gated matmul variant for sm_90 without a
    GPU and reports registers, spills, shared memory and the programs per SM they allow."""
    import pytest

    pytest.importorskip("triton.backends.nvidia")
    out = tmp_path / "resources.json"
    _run("kernel_resources.py", "--cases", "attn_decode_w2_s2", "gated64", "--out", str(out))
    res = json.loads(out.read_text())
    assert res["errors"] == {}
    for case in res["cases"].values():
        assert case["registers_per_thread"] > 0 and case["shared_bytes"] > 0
        fit = case["programs_per_sm"]
        assert fit["fit"] == min(fit["registers"], fit["shared_memory"], fit["threads"], fit["programs"]) >= 1
    assert res["cases"]["attn_decode_w2_s2"]["num_warps"] == 2
    for case in res["cases"].values():
        ops = case["sass_top_opcodes"]
        assert case["sass_instructions"] >= sum(ops.values()) > 0 and len(ops) == 16


def test_sass_instruction_pattern() -> None:
    """The instruction pattern of ``kernel_resources.py`` matches every address width and predicated instructions,
    and not the address-less lines of a listing."""
    import re
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from kernel_resources import SASS_INSTRUCTION
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    listing = (
        "        Function : _attn_fwd_kernel\n"
        "        /*0000*/                   LDC R1, c[0x0][0x28] ;\n"
        "        /*fff0*/              @!P0 BRA `(.L_x_7) ;\n"
        "        /*10000*/                  HMMA.16816.F32.BF16 R4, R8, R12, R4 ;\n"
        "        /*1a3c0*/              @UP1 LDGSTS.E.BYPASS.128 [R3], desc[UR6][R4.64] ;\n"
        "                                                                  /* 0x000fe20000000f00 */\n"
    )
    assert re.findall(SASS_INSTRUCTION, listing) == ["LDC", "BRA", "HMMA.16816.F32.BF16", "LDGSTS.E.BYPASS.128"]


def _unresolved_rlexact_names(source: str) -> list[str]:
    """``module.attr`` references of ``source`` into ``rlexact`` modules (``from rlexact... import m [as a]``,
    ``import rlexact...``) whose attribute the module does not have, and ``from rlexact.x import name`` of names that
    do not exist; as ``"line: module.attr"``."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlexact"):
            module = importlib.import_module(node.module)
            for a in node.names:
                if hasattr(module, a.name):
                    value = getattr(module, a.name)
                    if isinstance(value, type(module)):
                        aliases[a.asname or a.name] = value.__name__
                else:
                    try:
                        aliases[a.asname or a.name] = importlib.import_module(f"{node.module}.{a.name}").__name__
                    except ImportError:
                        missing.append(f"{node.lineno}: {node.module}.{a.name}")
        elif isinstance(node, ast.Import):
            aliases.update({a.asname or a.name: a.name for a in node.names if a.name.startswith("rlexact")})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if not hasattr(importlib.import_module(aliases[node.value.id]), node.attr):
                missing.append(f"{node.lineno}: {aliases[node.value.id]}.{node.attr}")
    return missing


def test_benchmarks_reference_existing_library_names() -> None:
    """The GPU-only benchmark scripts (most never run on the CPU) name only attributes the library still has: a
    renamed private helper (``triton_matmul._ensure_allocator`` became ``ensure_allocator``) fails here instead of
    on the GPU machine. Negative control: a reference to a missing attribute is reported."""
    bad = {
        p.name: miss
        for p in sorted((REPO / "benchmarks").glob("*.py"))
        if (miss := _unresolved_rlexact_names(p.read_text()))
    }
    assert bad == {}
    stale = "from rlexact.ops import triton_matmul as tmm\ntmm.ensure_allocator()\ntmm._ensure_allocator()\n"
    assert _unresolved_rlexact_names(stale) == ["3: rlexact.ops.triton_matmul._ensure_allocator"]


def _library_kernel_names() -> set[str]:
    """Names of the ``jit`` functions of the library that are launched (named ``*kernel*``)."""
    sources = (REPO / "src" / "rlexact").rglob("*.py")
    return {name for path in sources for name in jitted(ast.parse(path.read_text())) if "kernel" in name}


def test_every_library_kernel_has_a_profile_category(monkeypatch: pytest.MonkeyPatch) -> None:
    """``rollout_throughput.py --profile`` attributes every kernel the library launches to a named category, so none
    of the library's time is reported as ``"other"`` (the Gluon prefill kernels once were). Negative control: a
    name no category claims is ``"other"``."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    rt = importlib.import_module("rollout_throughput")
    names = _library_kernel_names()
    assert {"_pair_kernel", "_fwd_kernel", "_mm_ptr_kernel", "_attn_decode_kernel"} <= names
    assert {n: rt.kernel_category(n) for n in names if rt.kernel_category(n) == "other"} == {}
    assert rt.kernel_category("_pair_kernel") == rt.kernel_category("_fwd_kernel") == "attention"
    assert rt.kernel_category("void at::native::vectorized_gather_kernel<16, long>") == "other"


def test_restamp_commit_names_the_commit_whose_code_ran(tmp_path: Path) -> None:
    """A result labelled with an older commit but holding the digest of a newer commit's sources is restamped with
    the newer one (the recorded label kept); a correctly labelled result is left byte for byte; a digest that no
    commit has is refused and the file left as it is."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import restamp_commit as rc
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    from rlexact.envinfo import commit_sources, digest_files

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "src" / "rlexact").mkdir(parents=True)
    (tmp_path / "benchmarks").mkdir()
    shas = []
    for version in ("1", "2"):
        (tmp_path / "src" / "rlexact" / "ops.py").write_text(f"VERSION = {version}\n")
        git("add", "-A")
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", version)
        shas.append(git("rev-parse", "HEAD"))
    old, new = shas
    digest_new = digest_files(commit_sources(new, tmp_path))
    assert digest_files(commit_sources(old, tmp_path)) != digest_new
    mislabelled, right, unknown = (tmp_path / f"{n}.json" for n in ("mislabelled", "right", "unknown"))
    labelled_old = {"benchmark": "b", "commit": old, "source_digest": digest_new, "x": 1.5}
    mislabelled.write_text(json.dumps(labelled_old, indent=1))
    right.write_text(json.dumps({"commit": new, "source_digest": digest_new}, indent=2))
    unknown.write_text(json.dumps({"commit": old, "source_digest": "0" * 64}))
    before_right, before_unknown = right.read_text(), unknown.read_text()
    commits, digests = rc.history(tmp_path, 10), {}
    assert "restamped" in rc.restamp(mislabelled, tmp_path, commits, digests, "cmd")
    fixed = json.loads(mislabelled.read_text())
    assert fixed == {"benchmark": "b", "commit": new, "commit_as_recorded": old, "restamped_by": "cmd",
                     "source_digest": digest_new, "x": 1.5}  # fmt: skip
    assert list(fixed)[:4] == ["benchmark", "commit", "commit_as_recorded", "restamped_by"]
    assert "unchanged" in rc.restamp(right, tmp_path, commits, digests, "cmd")
    assert right.read_text() == before_right
    with pytest.raises(LookupError, match="re-run its benchmark"):
        rc.restamp(unknown, tmp_path, commits, digests, "cmd")
    assert unknown.read_text() == before_unknown


def test_interleaved_alternates_and_reports_the_ratio_spread() -> None:
    """``common.interleaved`` times the two calls in alternating order (under a clock that drifts with every call) and
    reports both series and the median and range of the per-round ratios of the second call's time to the first's."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from common import interleaved
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    order: list[str] = []
    clock = iter(range(1, 100))  # each timed call runs a little slower than the one before

    def timer(fn: object) -> float:
        order.append(fn())
        return 10.0 + next(clock) * (2.0 if order[-1] == "b" else 1.0)

    res = interleaved(("x", lambda: "a"), ("y", lambda: "b"), timer, rounds=4)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert res["x_ms"] == [11.0, 14.0, 15.0, 18.0] and res["y_ms"] == [14.0, 16.0, 22.0, 24.0]
    ratios = sorted(y / x for x, y in zip(res["x_ms"], res["y_ms"]))
    assert res["ratio_min"] == ratios[0] and res["ratio_max"] == ratios[-1]
    assert res["ratio_median"] == (ratios[1] + ratios[2]) / 2 and res["rounds"] == 4
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        interleaved(("x", lambda: "a"), ("y", lambda: "b"), timer, rounds=0)
    order.clear()
    res = interleaved(("x", lambda: "a"), ("y", lambda: "b"), timer, rounds=3, others={"z": lambda: "c"})
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert set(res) == {"rounds", "x_ms", "y_ms", "z_ms", "ratio_median", "ratio_min", "ratio_max"}
    assert res["ratio_median"] == statistics.median(y / x for x, y in zip(res["x_ms"], res["y_ms"]))
    with pytest.raises(ValueError, match="arm names must differ"):
        interleaved(("x", lambda: "a"), ("y", lambda: "b"), timer, others={"x": lambda: "c"})
