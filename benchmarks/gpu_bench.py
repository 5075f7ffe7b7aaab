"""Every GPU check and timing of eplb-graph in one device call, ordered to spend a borrowed GPU well.

    python3 benchmarks/gpu_bench.py --carry .gpu-carry --report $OUT/gpu_bench.json

The first call runs the stages below in this order, each a subprocess with its own timeout
inside one budget (``gpu_stages.py`` says how they run, are killed and reported); the
vLLM-free stages come first, since they are the likeliest to pass and need nothing carried:

1. cuda_tests          vLLM-free CUDA tests: the Triton routing kernel against the CPU kernel
                       (opcheck), the lookup refreshed in place under CUDA graph replay,
                       CapturedForward with real CUDA graphs, the data-plane bench on CUDA
2. routing_op          the registered op against the inline composite on CUDA (T=1..4096)
3. bench_data_plane    `eplb-graph bench --device cuda --data-plane`: the routing op's cost in
                       eager / compiled / graph (CUDA graphs) mode, one process, no vLLM
4. runtime_tests       the runtime's CUDA test (`eplb-graph run --device cuda --mode graph`)
5. run                 `eplb-graph run --device cuda --mode graph`, 1100 steps: >= 100
                       rearrangements, 0 recaptures, 0 recompiles, outputs checked every step
6. bench               `eplb-graph bench --device cuda`: eager / compiled / graph x EPLB off /
                       on_idle / on_rearranging, default model, decode 16 per rank

A second call, ``--only bench_data_plane_large,bench_large``, runs the larger shape (288
physical experts, top-8, width 1024). Stages 4-6 need vLLM (EPLB's control plane is
upstream's); ``--carry DIR`` installs the carry ``benchmarks/gpu_carry.py`` packs, since the
lent image has none. A stage passes only when what it claims happened: tests ran (none
skipped), the ops ran through Triton (``cuda_kernel``), rearrangements happened, no graph
was captured again.

``--dry-run`` runs the same plumbing on the host (``make gpu-dryrun``): each CUDA stage
replaced by its CPU equivalent, the same budget and report, and ``run`` made to time out
so the kill of a stage with rank processes and its partial output are exercised too.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_stages import Stage, StageRunner, exit_code, tests_ran  # noqa: E402

VLLM_FREE_TEST_FILES = [
    "tests/custom_ops/test_routing_ops.py",
    "tests/eplb_graph/core/test_layer_lookup.py",
    "tests/eplb_graph/graph/test_graph_capture.py",
    "tests/eplb_reference/bench/test_data_plane.py",
]
RUNTIME_TEST_FILES = ["tests/eplb_reference/runtime/test_rank.py"]  # multi-rank runs: upstream's EPLB
LARGE_SHAPE = ["--experts", "256", "--redundant", "32", "--top-k", "8", "--hidden", "1024", "--intermediate", "512"]
SECOND_CALL = ("bench_data_plane_large", "bench_large")  # run only when --only names them
DEFAULT_BUDGET_S = 420  # the stage timeouts below add up to it; the device call's timeout_s is 480
RUN_STEPS, RUN_INTERVAL = 1100, 10


def preflight(dry_run: bool) -> str | None:
    """Why this machine cannot run the call, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not importable"
    if not dry_run and not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    try:
        import eplb_graph.custom_ops  # noqa: F401  (custom_ops/ installs under eplb_graph)
        import eplb_reference  # noqa: F401  (the runtime stages' eplb-graph run / bench)
    except ImportError as error:
        return (f"eplb_graph or eplb_reference is not installed in this environment: pip install --no-deps "
                f"--no-build-isolation -e . -e reference ({error})")
    return None


def use_carry(carry: Path) -> dict:
    """Installs a carry (``benchmarks/gpu_carry.py``) into a scratch site directory, first on this
    process's path and on every stage's ``PYTHONPATH``; returns what the report says of it."""
    spec = importlib.util.spec_from_file_location("gpu_carry", Path(__file__).with_name("gpu_carry.py"))
    gpu_carry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_carry)
    site = tempfile.mkdtemp(prefix="eplb-graph-carry-")
    try:
        manifest = gpu_carry.install(carry, Path(site))
    except gpu_carry.CarryError:  # says why; main reports it
        shutil.rmtree(site)
        raise
    sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))
    return {"site": site, "pins": manifest["pins"], "vllm_files_left_out": manifest["files_left_out"]}


def vllm_problem() -> str | None:
    """Why upstream's EPLB control plane cannot be used here, or None. vLLM's import would make
    every later compile serial (here and in each stage): the compile threads are kept."""
    from eplb_reference.runtime.groups import inductor_compile_threads_kept

    try:
        with inductor_compile_threads_kept():
            import vllm.distributed.eplb.eplb_state  # noqa: F401
    except Exception as error:  # an ImportError, or a vLLM built for another torch
        return f"vLLM's EPLB control plane is not importable ({type(error).__name__}: {error})"
    return None


# --- what each stage must show besides exiting 0 ------------------------------------------


def _json_problems(entry: dict, device: str) -> list[str]:
    data = entry.get("json")
    if data is None:
        return ["wrote no JSON"]
    problems = [f"check failed: {problem}" for problem in data.get("failed_checks", [])]
    if device == "cuda" and data.get("cuda_kernel") != "triton":
        problems.append(f"the ops ran through {data.get('cuda_kernel')!r}, not the Triton kernel")
    return problems


def _graph_problems(data: dict) -> list[str]:
    recaptured = [r for r in data.get("results", []) if r["mode"] == "graph" and r["recaptures"] != 0]
    return [f"graph {r['eplb']}: recaptures {r['recaptures']} (0 expected)" for r in recaptured]


def bench_check(device: str):
    def check(entry: dict) -> list[str]:
        problems = _json_problems(entry, device)
        data = entry.get("json") or {}
        problems += _graph_problems(data) if device == "cuda" else []
        for r in data.get("results", []):
            if r["eplb"] == "on_rearranging" and not r["rearrangements"]:
                problems.append(f"{r['mode']} on_rearranging: no rearrangement happened")
        return problems

    return check


def data_plane_check(device: str):
    def check(entry: dict) -> list[str]:
        problems = _json_problems(entry, device)
        return problems + (_graph_problems(entry.get("json") or {}) if device == "cuda" else [])

    return check


def run_check(device: str, min_rearrangements: int):
    def check(entry: dict) -> list[str]:
        problems = _json_problems(entry, device)
        data = entry.get("json") or {}
        if data and data["rearrangements"] < min_rearrangements:
            problems.append(f"{data['rearrangements']} rearrangements, {min_rearrangements} expected")
        if device == "cuda" and data and data["recaptures"] != 0:
            problems.append(f"recaptures {data['recaptures']} (0 expected)")
        return problems + [f"failed invariant: {problem}" for problem in data.get("failed_invariants", [])]

    return check


def routing_op_check(device: str):
    return lambda entry: _json_problems(entry, device)


# --- the plan ------------------------------------------------------------------------------


def plan(out: Path, ranks: int, without_vllm: str | None, *, dry_run: bool = False) -> list[Stage]:
    """Every stage in order; ``without_vllm``: why vLLM is missing (its stages are skipped).
    ``dry_run``: each CUDA stage's host equivalent, and ``run`` made to time out."""
    device, graph = ("cpu", "compiled") if dry_run else ("cuda", "graph")
    cli = [sys.executable, "-m", "eplb_reference.cli"]
    pytest = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k",
              "not cuda" if dry_run else "cuda"]
    needs_vllm = None if without_vllm is None else f"needs vLLM: {without_vllm}"
    steps = dict(bench=40 if dry_run else 200, large=20 if dry_run else 100, plane=100 if dry_run else 300)
    # on the host, the CUDA graph-mode run's equivalent: the compiled two-rank run, outputs checked
    runtime_tests = [*pytest[:-1], "rebalances_live and compiled" if dry_run else "cuda", *RUNTIME_TEST_FILES]
    o = {name: out / name for name in ("bench", "bench_large", "run", "bench_data_plane", "bench_data_plane_large")}
    return [
        Stage("cuda_tests", [*pytest, *VLLM_FREE_TEST_FILES], 75, check=tests_ran),
        Stage("routing_op", [sys.executable, "benchmarks/bench_routing_ops.py", "--device", device,
                             "--out", str(out / "routing_op.json")], 30, out / "routing_op.json",
              check=routing_op_check(device)),
        Stage("bench_data_plane", [*cli, "bench", "--device", device, "--data-plane", "--steps", str(steps["plane"]),
                                   "--out", str(o["bench_data_plane"])], 90, o["bench_data_plane"] / "bench.json",
              check=data_plane_check(device)),
        Stage("runtime_tests", runtime_tests, 60, skip_why=needs_vllm, check=tests_ran),
        Stage("run", [*cli, "run", "--device", device, "--mode", graph, "--ranks", str(ranks), "--steps",
                      str(RUN_STEPS), "--interval", str(RUN_INTERVAL), "--out", str(o["run"])],
              20 if dry_run else 75, o["run"] / "report.json", needs_vllm,
              check=run_check(device, RUN_STEPS // RUN_INTERVAL - 10), forced_timeout=dry_run),
        Stage("bench", [*cli, "bench", "--device", device, "--ranks", str(ranks), "--steps", str(steps["bench"]),
                        "--out", str(o["bench"])], 90, o["bench"] / "bench.json", needs_vllm, check=bench_check(device)),
        Stage("bench_data_plane_large", [*cli, "bench", "--device", device, "--data-plane", "--steps",
                                         str(steps["large"]), *LARGE_SHAPE, "--out", str(o["bench_data_plane_large"])],
              120, o["bench_data_plane_large"] / "bench.json", check=data_plane_check(device)),
        Stage("bench_large", [*cli, "bench", "--device", device, "--ranks", str(ranks), "--steps", str(steps["large"]),
                              *LARGE_SHAPE, "--out", str(o["bench_large"])], 150, o["bench_large"] / "bench.json",
              needs_vllm, check=bench_check(device)),
    ]


def select(stages: list[Stage], only: list[str] | None) -> list[Stage]:
    """The stages of this call: those ``only`` names, or without it the first call's (the large
    shapes wait for a second call); the others are reported as skipped, never run."""
    for stage in stages:
        if only is not None and stage.name not in only:
            stage.skip_why, stage.asked = "not asked for (--only)", False
        elif only is None and stage.name in SECOND_CALL:
            stage.skip_why, stage.asked = f"second call: --only {','.join(SECOND_CALL)}", False
    return stages


# --- the summary ---------------------------------------------------------------------------


def bench_figures(bench: dict) -> str:
    """A bench.json in one line: on_idle / off per mode, the rearranging ratio where measured,
    graph mode's speedup over eager, and any failed check."""
    parts = []
    for mode, ratios in bench.get("ratios", {}).items():
        if not isinstance(ratios, dict):
            continue
        part = f"{mode} on_idle/off {ratios.get('on_idle_over_off')} (A/A {ratios.get('off_twin_over_off')})"
        if "rearranging_p99_over_steady_p50" in ratios:
            part += f", rearranging p99/steady p50 {ratios['rearranging_p99_over_steady_p50']}"
        parts.append(part)
    speedup = bench.get("ratios", {}).get("graph_speedup_over_eager_decode")
    if speedup is not None:
        parts.append(f"graph speedup over eager {speedup}x")
    parts.extend(f"FAILED {problem}" for problem in bench.get("failed_checks", []))
    return "; ".join(parts)


def summary_rows(stages: dict) -> list[str]:
    rows = [f"{'stage':<22} {'status':<22} figures"]
    for name, entry in stages.items():
        data = entry.get("json", {})
        figures = ""
        if name.endswith("tests"):
            figures = ((entry.get("tail") or "").strip().splitlines() or [""])[-1]
        elif name.startswith("bench") and data:
            figures = bench_figures(data)
        elif name == "run" and data:
            figures = (f"rearrangements {data['rearrangements']}, recaptures {data['recaptures']}, recompiles "
                       f"{data['recompiles']}, mismatches {data['output_mismatches']}, balancedness "
                       f"{data['balancedness_without_eplb']} -> {data['balancedness_after']}, p50 {data['step_p50_ms']} ms")
        elif name == "routing_op" and data:
            figures = ", ".join(f"T={r['num_tokens']}: {r['registered_us']:.1f} vs {r['inline_us']:.1f} us"
                                for r in data.get("results", []))
        if entry["status"] == "skipped":
            figures = entry.get("why", "")
        rows.append(f"{name:<22} {entry['status']:<22} {figures}")
    return rows


def header(dry_run: bool, ranks: int, without_vllm: str | None, carried: dict | None) -> dict:
    """What the report says of the machine and of what served the ops."""
    import torch
    import torch._inductor.config as inductor_config

    from eplb_graph.custom_ops import CPU_LAYER_KERNEL, CUDA_KERNEL

    return {
        "dry_run": dry_run,
        "device": "cpu (dry run)" if dry_run else torch.cuda.get_device_name(),
        "gpus": 0 if dry_run else torch.cuda.device_count(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "ranks": ranks,
        "vllm": without_vllm or "importable",
        "vllm_carry": carried,
        "cuda_kernel": CUDA_KERNEL,
        "cpu_layer_kernel": CPU_LAYER_KERNEL,  # EPLB_GRAPH_NATIVE_KERNEL=0: no host kernel build here
        "inductor_compile_threads": inductor_config.compile_threads,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/gpu"), help="each stage's own output")
    parser.add_argument("--report", type=Path, help="gpu_bench.json, rewritten after every stage (default: OUT/gpu_bench.json)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="all stages together")
    parser.add_argument("--carry", type=Path, help="a carry of vLLM's control plane to install first (benchmarks/gpu_carry.py)")
    parser.add_argument("--only", type=lambda names: names.split(","), default=None,
                        help="these stages only, comma-separated (the second call, or a rerun)")
    parser.add_argument("--dry-run", action="store_true", help="the same call on the host, CUDA stages replaced")
    args = parser.parse_args(argv)
    known = [stage.name for stage in plan(args.out, 1, None)]
    if args.only is not None and not set(args.only) <= set(known):
        parser.error(f"--only: unknown stage {sorted(set(args.only) - set(known))}; the stages are {known}")
    args.report = args.report or args.out / "gpu_bench.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()  # the budget includes the carry and the preflight
    os.environ["EPLB_GRAPH_NATIVE_KERNEL"] = "0"  # the host C++ kernel serves no GPU stage: do not build it
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if args.dry_run:  # a vLLM built for CUDA (the carry) finds no platform on a host without one
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        carried = use_carry(args.carry) if args.carry is not None else None
    except RuntimeError as error:  # gpu_carry.CarryError
        print(f"gpu_bench: cannot use --carry {args.carry}: {error}", file=sys.stderr)
        return 2
    problem = preflight(args.dry_run)
    if problem is not None:
        print(f"gpu_bench: cannot run here: {problem}", file=sys.stderr)
        return 2
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    ranks = 2 if args.dry_run else min(2, torch.cuda.device_count())
    without_vllm = vllm_problem()
    if without_vllm is not None:
        print(f"gpu_bench: {without_vllm}; running the stages that do not need it", flush=True)
    stages = select(plan(args.out, ranks, without_vllm, dry_run=args.dry_run), args.only)
    runner = StageRunner(args.budget_s - (time.monotonic() - started), args.report,
                         header(args.dry_run, ranks, without_vllm, carried), args.out / "logs",
                         [stage.name for stage in stages])
    for stage in stages:
        runner.run(stage)

    from eplb_reference.bench.table import format_table

    for name in ("bench", "bench_data_plane"):  # the full bench, or without vLLM the data-plane one
        bench = runner.stages[name].get("json")
        if bench is not None:
            print(f"\n{name}:\n{format_table(bench)}")
    print("\n".join(summary_rows(runner.stages)))  # the table, last
    print(f"wrote {args.report}")
    return exit_code(runner.stages, [stage.name for stage in stages if stage.asked])


if __name__ == "__main__":
    sys.exit(main())
