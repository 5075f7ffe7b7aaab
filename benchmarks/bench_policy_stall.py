"""What upstream's policy, run on the async worker thread, costs the serving thread; one run.

The main thread of a graph-mode server is host-bound between replays (launches, EPLB's
begin / end of batch). Upstream's async worker runs the rebalancing policy on a thread of the
same process, so the two share the GIL. Measured side by side, in blocks that alternate:

  * ``alone``: the main thread's step with no policy running;
  * ``in_thread``: the same step while a worker thread calls upstream's policy back to back,
    as upstream's worker does (one call per rearrangement, here continuously);
  * ``helper_process``: the same, the worker thread calling ``PolicyProcess`` instead (the
    policy in a helper process; the thread waits in a pipe read).

The step is ``--ops`` small matmuls (~0.3 ms of host work), a stand-in for a replay-launching
thread. Placements from both policy paths must be equal.

    python benchmarks/bench_policy_stall.py --out out/bench_policy_stall.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from pathlib import Path

import torch

from eplb_reference.bench.stats import percentile

# (layers, logical, redundant, groups, nodes, ranks): the default job's model; DeepSeek-V3 on 32 ranks
SHAPES = {"default": (2, 16, 4, 1, 1, 2), "deepseek_v3": (58, 256, 32, 8, 4, 32)}
MODES = ("alone", "in_thread", "helper_process")


def host_step(ops: int, x: torch.Tensor, w: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(ops):
        x @ w
    return time.perf_counter() - start


class PolicyLoop:
    """A thread calling ``rebalance`` back to back until stopped; keeps each call's duration."""

    def __init__(self, rebalance) -> None:
        self.rebalance = rebalance
        self.calls: list[float] = []
        self.placement: torch.Tensor | None = None
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                start = time.perf_counter()
                self.placement = self.rebalance()
                self.calls.append(time.perf_counter() - start)
        except BaseException as error:  # reported by stop()
            self.error = error

    def __enter__(self) -> PolicyLoop:
        self._thread.start()
        while not self.calls and self.error is None:  # the first call has run: the loop is warm
            time.sleep(0.001)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            raise self.error


def bench_shape(name: str, rounds: int, steps: int, ops: int) -> dict:
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    from eplb_reference.runtime.policy_process import PolicyProcess

    layers, logical, redundant, groups, nodes, ranks = SHAPES[name]
    gen = torch.Generator().manual_seed(layers)
    load = torch.randint(0, 1000, (layers, logical), generator=gen)  # [L, N] a skewed-enough window
    current = torch.cat([torch.arange(logical), torch.arange(redundant) % logical]).repeat(layers, 1)  # [L, P]
    args = (load, logical + redundant, groups, nodes, ranks, current)
    helper = PolicyProcess(DefaultEplbPolicy)
    x, w = torch.randn(16, 64), torch.randn(64, 64)
    rebalance = {"in_thread": lambda: DefaultEplbPolicy.rebalance_experts(*args),
                 "helper_process": lambda: helper.rebalance_experts(*args)}
    step_s = {mode: [] for mode in MODES}
    call_s = {mode: [] for mode in rebalance}
    placements = {}
    try:
        for round_index in range(rounds):
            order = MODES if round_index % 2 == 0 else MODES[::-1]
            for mode in order:
                if mode == "alone":
                    step_s[mode] += [host_step(ops, x, w) for _ in range(steps)]
                    continue
                with PolicyLoop(rebalance[mode]) as loop:
                    step_s[mode] += [host_step(ops, x, w) for _ in range(steps)]
                call_s[mode] += loop.calls
                placements[mode] = loop.placement
    finally:
        helper.close()
    placements_equal = torch.equal(placements["in_thread"], placements["helper_process"])
    if not placements_equal:
        raise AssertionError("the helper process returned a different placement than upstream's policy in-thread")
    p50 = {mode: statistics.median(s) * 1e3 for mode, s in step_s.items()}
    p99 = {mode: percentile([t * 1e3 for t in s], 99) for mode, s in step_s.items()}
    return {
        "shape": name,
        "layers": layers, "logical": logical, "redundant": redundant, "nodes": nodes, "ranks": ranks,
        "step_p50_ms": {mode: round(v, 3) for mode, v in p50.items()},
        "step_p99_ms": {mode: round(v, 3) for mode, v in p99.items()},
        "step_p99_over_alone_p50": {mode: round(p99[mode] / p50["alone"], 2) for mode in MODES},
        "policy_call_p50_ms": {mode: round(statistics.median(s) * 1e3, 2) for mode, s in call_s.items()},
        "policy_calls": {mode: len(s) for mode, s in call_s.items()},
        "placements_equal": placements_equal,
    }


def check_arguments(args: argparse.Namespace) -> None:
    """Bad input stops here, with the flag's name, before anything is timed."""
    for flag in ("rounds", "steps", "ops"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"bench_policy_stall: --{flag} must be >= 1, got {getattr(args, flag)}")
    unknown = [name for name in args.shapes if name not in SHAPES]
    if unknown:
        raise SystemExit(f"bench_policy_stall: --shapes: unknown {unknown}; expected some of {', '.join(SHAPES)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=6, help="alternating blocks per mode")
    parser.add_argument("--steps", type=int, default=100, help="main-thread steps per block")
    parser.add_argument("--ops", type=int, default=100, help="small matmuls per main-thread step")
    parser.add_argument("--out", default="out/bench_policy_stall.json")
    args = parser.parse_args()
    check_arguments(args)
    torch.set_num_threads(1)
    results = [bench_shape(name, args.rounds, args.steps, args.ops) for name in args.shapes]
    report = {"torch": torch.__version__, "machine": platform.machine(), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'shape':>12} {'mode':>15} {'step p50 ms':>12} {'step p99 ms':>12} {'p99/alone p50':>14} {'policy ms':>10}")
    for r in results:
        for mode in MODES:
            policy = r["policy_call_p50_ms"].get(mode)
            print(f"{r['shape']:>12} {mode:>15} {r['step_p50_ms'][mode]:>12.3f} {r['step_p99_ms'][mode]:>12.3f} "
                  f"{r['step_p99_over_alone_p50'][mode]:>14.2f} {'' if policy is None else f'{policy:.2f}':>10}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
