"""The whole GPU comparison in one call: CUDA tests, the routing op, capture vs eager, the main job.

    python benchmarks/gpu_bench.py --out out/gpu        # about 6 minutes on one H200; table last

Stages, each a subprocess with its own timeout inside one overall budget (a stage that no
longer fits is reported as skipped, never silently dropped):

1. cuda_tests   every CUDA test: the Triton routing kernel against the CPU kernel (opcheck),
                the lookup refreshed in place under CUDA graph replay, CapturedForward with
                real CUDA graphs, and `eplb-graph run --device cuda --mode graph`
2. routing_op   the registered op against the inline composite on CUDA (T=16 and 4096)
3. bench        `eplb-graph bench --device cuda`: eager / compiled / graph (CUDA graphs) x
                EPLB off / on_idle / on_rearranging, default model, decode batch 16 per rank
4. run          `eplb-graph run --device cuda --mode graph` for 1100 steps: >= 100
                rearrangements with 0 recaptures, 0 recompiles and outputs checked every step
5. bench_large  the same bench as 3 at a larger shape (288 physical experts, top-8, width 1024)
6. bench_data_plane        `eplb-graph bench --device cuda --data-plane`: the routing op's cost
                           in eager / compiled / graph mode, one process, no vLLM needed (EPLB
                           off vs on at identity placement, outputs and recorded load checked)
7. bench_data_plane_large  the same at the larger shape

Ranks: one per visible GPU, at most 2 (NCCL runs one rank per GPU; on a one-GPU machine
the EP group has one rank, which still rebalances replicas and moves weights).
Needs torch with CUDA and this package installed into that environment (offline:
``pip install --no-deps --no-build-isolation -e .``). Stages 3-5 and the runtime's CUDA
tests need vLLM (EPLB's control plane is upstream's); where it is not importable they are
reported as skipped with the reason, and the vLLM-free stages (the ops, the lookup under
CUDA graph replay, CapturedForward, the routing op's timing, the data-plane benches) still
run: without vLLM, graph mode's speedup over eager and EPLB-on / EPLB-off are still measured.
The lent H200 image has no vLLM and cannot download one: ``--carry DIR`` installs the carry
``benchmarks/gpu_carry.py`` packs (vLLM's Python without its compiled kernels, and the
packages it needs that the image lacks, ~30 MB) into a scratch directory first, so every
stage runs there. The device call, with ``carry=[".gpu-carry"]``:

    python3 -m pip install -q --no-deps --no-build-isolation -e . && python3 benchmarks/gpu_bench.py \
        --carry .gpu-carry --out /tmp/gpu 2>&1 | tee $OUT/gpu_bench.log; cp /tmp/gpu/gpu_bench.json $OUT/

(``gpu_bench.json`` holds every stage's JSON, so it alone need come back from the device;
``--only bench,run`` in a second call reruns stages that ran out of budget.)
Writes ``gpu_bench.json`` beside each stage's own JSON under ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

VLLM_FREE_CUDA_TEST_FILES = [
    "tests/custom_ops/test_routing_ops.py",
    "tests/eplb_graph/test_layer_lookup.py",
    "tests/eplb_graph/test_graph_capture.py",
    "tests/eplb_graph/test_bench_data_plane.py",
]
RUNTIME_CUDA_TEST_FILES = ["tests/eplb_graph/test_runtime.py"]  # multi-rank runs: upstream's EPLB
LARGE_SHAPE = ["--experts", "256", "--redundant", "32", "--top-k", "8", "--hidden", "1024", "--intermediate", "512"]


def preflight() -> str | None:
    """Why this machine cannot run any stage, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not importable"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    try:
        import eplb_graph.custom_ops  # noqa: F401  (custom_ops/ installs under eplb_graph)
    except ImportError as error:
        return (f"eplb_graph is not installed in this environment: pip install --no-deps --no-build-isolation -e . "
                f"({error})")
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
    """Why upstream's EPLB control plane cannot be used here, or None."""
    try:
        import vllm.distributed.eplb.eplb_state  # noqa: F401
    except Exception as error:  # an ImportError, or a vLLM built for another torch
        return f"vLLM's EPLB control plane is not importable ({type(error).__name__}: {error})"
    return None


@dataclass
class Stage:
    name: str
    command: list[str]
    timeout_s: float
    json_file: Path | None = None
    skip_why: str | None = None  # set: reported as skipped, never run


def plan(out: Path, ranks: int, without_vllm: str | None) -> list[Stage]:
    """The stages in order; ``without_vllm``: why vLLM is missing (its stages are skipped)."""
    cli = [sys.executable, "-m", "eplb_graph.cli"]
    needs_vllm = None if without_vllm is None else f"needs vLLM: {without_vllm}"
    test_files = VLLM_FREE_CUDA_TEST_FILES + (RUNTIME_CUDA_TEST_FILES if without_vllm is None else [])
    bench_out, large_out, run_out = out / "bench", out / "bench_large", out / "run"
    plane_out, plane_large_out = out / "bench_data_plane", out / "bench_data_plane_large"
    return [
        Stage("cuda_tests", [sys.executable, "-m", "pytest", "-q", "-rs", "-k", "cuda", *test_files], 150),
        Stage("routing_op", [sys.executable, "benchmarks/bench_routing_ops.py", "--device", "cuda",
                             "--out", str(out / "routing_op.json")], 60, out / "routing_op.json"),
        Stage("bench", [*cli, "bench", "--device", "cuda", "--ranks", str(ranks), "--steps", "200",
                        "--out", str(bench_out)], 180, bench_out / "bench.json", needs_vllm),
        # the main job's targets (>= 100 rearrangements, 0 recaptures) before the larger shape's bench
        Stage("run", [*cli, "run", "--device", "cuda", "--mode", "graph", "--ranks", str(ranks), "--steps", "1100",
                      "--interval", "10", "--out", str(run_out)], 150, run_out / "report.json", needs_vllm),
        Stage("bench_large", [*cli, "bench", "--device", "cuda", "--ranks", str(ranks), "--steps", "100",
                              *LARGE_SHAPE, "--out", str(large_out)], 150, large_out / "bench.json", needs_vllm),
        # vLLM-free, last: where vLLM runs, the stages above are worth more of the budget. 180 s
        # each: up to four cold Inductor compiles per shape (off and on_idle, at capture sizes
        # 16 and 64 for graph mode); where vLLM is absent they have the rest of the budget
        Stage("bench_data_plane", [*cli, "bench", "--device", "cuda", "--data-plane", "--steps", "300",
                                   "--out", str(plane_out)], 180, plane_out / "bench.json"),
        Stage("bench_data_plane_large", [*cli, "bench", "--device", "cuda", "--data-plane", "--steps", "200",
                                         *LARGE_SHAPE, "--out", str(plane_large_out)], 180,
              plane_large_out / "bench.json"),
    ]


def select(stages: list[Stage], only: list[str] | None) -> list[Stage]:
    """``stages`` with those ``only`` leaves out reported as skipped (None: all run)."""
    for stage in stages:
        if only is not None and stage.name not in only:
            stage.skip_why = "not asked for (--only)"
    return stages


def exit_code(report: dict[str, dict], only: list[str] | None) -> int:
    """0 when every stage asked for ran and passed; a skip for lack of vLLM or budget counts as not."""
    asked = [entry for name, entry in report.items() if only is None or name in only]
    return 0 if all(entry["status"] == "ok" for entry in asked) else 1


class Stages:
    def __init__(self, budget_s: float) -> None:
        self.deadline = time.monotonic() + budget_s
        self.report: dict[str, dict] = {}

    def run(self, stage: Stage) -> dict:
        left = self.deadline - time.monotonic()
        if stage.skip_why is not None:
            entry = {"status": "skipped", "why": stage.skip_why}
        elif left < 30:
            entry = {"status": "skipped", "why": f"{left:.0f} s of the budget left"}
        else:
            start = time.monotonic()
            try:
                done = subprocess.run(stage.command, capture_output=True, text=True, timeout=min(stage.timeout_s, left))
                entry = {"status": "ok" if done.returncode == 0 else f"exit {done.returncode}",
                         "tail": (done.stdout + done.stderr)[-3000:]}
            except subprocess.TimeoutExpired:
                entry = {"status": f"timeout after {min(stage.timeout_s, left):.0f} s"}
            entry["seconds"] = round(time.monotonic() - start, 1)
            if stage.json_file is not None and stage.json_file.exists():
                entry["json"] = json.loads(stage.json_file.read_text())
        entry["command"] = " ".join(stage.command)
        self.report[stage.name] = entry
        print(f"[{stage.name}] {entry['status']} ({entry.get('seconds', 0)} s)", flush=True)
        return entry


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


def summary_rows(report: dict) -> list[str]:
    rows = [f"{'stage':<12} {'status':<22} figures"]
    for name, entry in report.items():
        data = entry.get("json", {})
        figures = ""
        if name == "cuda_tests":
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
        rows.append(f"{name:<12} {entry['status']:<22} {figures}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/gpu"))
    parser.add_argument("--budget-s", type=float, default=450, help="all stages together (the call must stay under 8 min)")
    parser.add_argument("--carry", type=Path, help="a carry of vLLM's control plane to install first (benchmarks/gpu_carry.py)")
    parser.add_argument("--only", type=lambda names: names.split(","), default=None,
                        help="these stages only, comma-separated (a second call rerunning one that ran out of time)")
    args = parser.parse_args()
    known = [stage.name for stage in plan(args.out, 1, None)]
    if args.only is not None and not set(args.only) <= set(known):
        parser.error(f"--only: unknown stage {sorted(set(args.only) - set(known))}; the stages are {known}")
    started = time.monotonic()  # the budget includes the carry and the preflight, which builds the C++ routing kernel
    try:
        carried = use_carry(args.carry) if args.carry is not None else None
    except RuntimeError as error:  # gpu_carry.CarryError
        print(f"gpu_bench: cannot use --carry {args.carry}: {error}", file=sys.stderr)
        return 2
    problem = preflight()
    if problem is not None:
        print(f"gpu_bench: cannot run here: {problem}", file=sys.stderr)
        return 2
    import torch

    from eplb_graph.custom_ops import CPU_LAYER_KERNEL

    args.out.mkdir(parents=True, exist_ok=True)
    ranks = min(2, torch.cuda.device_count())
    without_vllm = vllm_problem()
    if without_vllm is not None:
        print(f"gpu_bench: {without_vllm}; running the stages that do not need it", flush=True)
    stages = Stages(args.budget_s - (time.monotonic() - started))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    for stage in select(plan(args.out, ranks, without_vllm), args.only):
        stages.run(stage)

    report = {"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
              "ranks": ranks, "vllm": without_vllm or "importable", "vllm_carry": carried, "cpu_layer_kernel": CPU_LAYER_KERNEL,
              "stages": stages.report}
    (args.out / "gpu_bench.json").write_text(json.dumps(report, indent=2))
    from eplb_graph.bench import format_table

    for name in ("bench", "bench_data_plane"):  # the full bench, or without vLLM the data-plane one
        bench = stages.report[name].get("json")
        if bench is not None:
            print(f"\n{name}:\n{format_table(bench)}")
    print("\n".join(summary_rows(stages.report)))  # the table, last
    return exit_code(stages.report, args.only)


if __name__ == "__main__":
    sys.exit(main())
