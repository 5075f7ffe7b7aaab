"""The throughput EPLB buys inside vLLM: expert parallel over two CPU workers, a skewed router.

vLLM's engine with EP over two workers (one core each, compiled), in two layouts (``--layouts``,
``eplb_arms.py``): ``tp2``, one engine over TP=2 stepped by the benchmark, and ``dp2``, the
OpenAI server with one engine core per DP rank driven by a client. On a checkpoint this benchmark
writes (``skewed_router.py``), in two configurations and two placements each:

* ``worst``: experts wide enough that expert compute dominates a step, float32, top-2 of 8; two
  hot experts (``--hot``) take about half of the routed pairs, unreplicated on one rank;
* ``natural``: a Qwen3-30B-A3B MoE layer (hidden 2048, moe_intermediate 768, top-8) over 32
  experts, bfloat16 where vLLM's CPU experts take it here (else float32), every expert's load
  following a Zipf law over a seeded order (``--zipf``);
* placement ``rank0`` / ``rank1``: the same skew with its experts on one rank or mirrored onto the
  other (which also controls for one core being faster).

For each, two arms, each its own engine, alternated for ``--rounds`` rounds (static first in even
rounds, rebalanced first in odd ones):

* **static**: EPLB on, never rebalancing (``step_interval`` beyond the run): upstream's initial
  placement kept, with the same routing and recording ops;
* **rebalanced**: EPLB on, ``step_interval`` ``--interval``: upstream's first rearrangement lands a
  quarter of it in, during the warm-up, and the next one after the timed phase.

Each arm serves warm-up requests (the rebalanced arm's until its rearrangement has committed on
every rank), then is timed over more with no rearrangement started in between (checked): the gain
of the placement, not the cost of moving to it, which ``bench_movement.py`` and
``bench_commit.py`` measure and a real ``step_interval`` of thousands of steps amortizes. Timed:
tokens/s (prompt and generated tokens the engines processed) and, under TP=2, the step times.
Balancedness is from upstream's own ``log_balancedness`` lines (each step's mean and max per-rank
load), summed over the timed steps; each rank's expert seconds are what
``eplb_graph::local_expert_pairs``' kernels took (``/metrics``' ``local_expert_seconds`` under
DP). The gain the balancedness predicts for the static arm's expert share ``f`` of a step (the
slower rank's expert seconds over wall time) is
``1 / (1 - f + f * balancedness_static / balancedness_rebalanced)``. ``rebalanced_over_static``
is the median of the rounds' ratios (each round's two arms ran back to back); the A/A ratio (the
second round's static arm over the first's) is the noise it reads against. Target, per run: at
least 80 % of the predicted gain, and >= 1.15 wherever the predicted gain is >= 1.25.

    python benchmarks/bench_vllm_eplb.py --out out/bench/bench_vllm_eplb.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eplb_arms import BALANCEDNESS, MEASURE_END, MEASURE_START, run_engine_arm, run_server_arm
from skewed_router import (NATURAL, add_skewed_checkpoint_arguments, check_hot, natural_checkpoint,
                           skewed_checkpoint, worst_bias, zipf_exponent)

from eplb_reference.bench.ray_head import free_ports
from eplb_reference.models.tiny_tokenizer import write_tiny_tokenizer

# the natural configuration's load: its steps cost about ten times the worst case's, so fewer,
# smaller batches (still enough steps for rebalancing to act before the timed requests)
NATURAL_LOAD = {"requests": 24, "warm_requests": 24, "batch_tokens": 256}
RESULT = "BENCH_ARM_RESULT "
# a predicted gain below this is within the A/A noise: its share of a measured one means nothing
PREDICTED_AT_LEAST = 1.05


def add_request_arguments(parser: argparse.ArgumentParser, *, requests: int, batch: int, batch_tokens: int) -> None:
    """Prefill-heavy requests and the engine's batch limits."""
    parser.add_argument("--requests", type=int, default=requests)
    parser.add_argument("--prompt-tokens", type=int, default=240)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--batch", type=int, default=batch, help="max_num_seqs")
    parser.add_argument("--batch-tokens", type=int, default=batch_tokens, help="max_num_batched_tokens")


def run_arm(args: argparse.Namespace) -> int:
    """A TP=2 arm in this process (``launch_arm``'s child): one JSON line."""
    print(RESULT + json.dumps(run_engine_arm(args)), flush=True)
    return 0


def timed_loads(output: str) -> list[tuple[float, float]]:
    """Each timed step's mean and max per-rank load, from upstream's lines between the markers
    (steps with no token, DP's idle waves, left out)."""
    measured = output.split(MEASURE_START, 1)[-1].split(MEASURE_END, 1)[0]
    return [(float(mean), float(most)) for mean, most in BALANCEDNESS.findall(measured) if float(mean) > 0]


def arm_balancedness(output: str) -> float | None:
    """Sum of the steps' mean per-rank load over the sum of their max (a large step weighs as
    its load does)."""
    loads = timed_loads(output)
    if not loads:
        return None
    return round(sum(mean for mean, _ in loads) / sum(most for _, most in loads), 4)


def launch_arm(arm: str, model: Path, args: argparse.Namespace, port: int) -> dict:
    """One arm: TP=2 in a child process, DP=2 through the OpenAI server."""
    if args.layout == "dp2":
        result, output = run_server_arm(argparse.Namespace(**{**vars(args), "arm": arm}), model,
                                        model.parent / f"{model.name}-{arm}-{time.monotonic_ns()}.log", port)
    else:
        result, output = launch_engine_arm(arm, model, args)
    if not BALANCEDNESS.search(output):
        raise SystemExit(f"arm {arm}: no balancedness line of upstream's in its log (log_balancedness)")
    steps_ms = sorted(s * 1e3 for s in result.pop("steps_s"))
    result.update(
        tokens_per_s=round(result["tokens"] / result["elapsed_s"], 1),
        step_p50_ms=round(statistics.median(steps_ms), 2) if steps_ms else None,
        step_p99_ms=round(steps_ms[min(len(steps_ms) - 1, int(0.99 * len(steps_ms)))], 2) if steps_ms else None,
        steps=len(steps_ms) or None,
        # the same tokens in more steps: smaller batches (under DP, requests spread unevenly over the engines)
        loaded_steps=len(timed_loads(output)),
        balancedness=arm_balancedness(output),
        expert_share=round(max(r["expert_seconds"] for r in result["ranks"]) / result["elapsed_s"], 4),
        upstream_rearrangements_logged=output.count("Rearranging experts (async mode) ..."),
    )
    return result


def launch_engine_arm(arm: str, model: Path, args: argparse.Namespace) -> tuple[dict, str]:
    """A TP=2 arm in a child process (this script with ``--arm``): its result and its output."""
    argv = [sys.executable, __file__, "--arm", arm, "--model", str(model)]
    for name in ("interval", "window", "redundant", "requests", "warm_requests", "prompt_tokens", "max_tokens", "batch",
                 "batch_tokens", "dtype"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    here = Path(__file__).resolve().parent  # the workers unpickle eplb_arms' functions by reference
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here)])})
    output = done.stdout + done.stderr
    lines = [line for line in output.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"arm {arm} failed ({done.returncode}):\n{output[-5000:]}")
    return json.loads(lines[-1][len(RESULT):]), output


def summarize(runs: list[dict], args: argparse.Namespace) -> dict:
    """One configuration's figures from its arms, in launch order (a round is two arms back to back)."""
    arms = {arm: [r for r in runs if r["arm"] == arm] for arm in ("static", "rebalanced")}
    median = lambda arm, key: statistics.median(r[key] for r in arms[arm])  # noqa: E731
    balancedness_static, balancedness_rebalanced = median("static", "balancedness"), median("rebalanced", "balancedness")
    share = median("static", "expert_share")
    predicted = 1 / (1 - share + share * balancedness_static / balancedness_rebalanced)
    tokens = {arm: [r["tokens_per_s"] for r in arms[arm]] for arm in arms}
    ratios = [rebalanced / static for static, rebalanced in zip(tokens["static"], tokens["rebalanced"])]
    measured = statistics.median(ratios)
    load = arms["static"][0]["logical_load"]  # None through the server: a client cannot read upstream's window
    hot = [e for e, bias in enumerate(worst_bias(args)) if bias] if args.config == "worst" else None
    gain_share = (measured - 1) / (predicted - 1) if predicted >= PREDICTED_AT_LEAST else None
    return {
        "layout": args.layout, "config": args.config, "placement": args.placement, "dtype": args.dtype,
        "rebalanced_over_static": round(measured, 3),
        "per_round_ratios": [round(ratio, 3) for ratio in ratios],
        "aa_ratio": round(tokens["static"][1] / tokens["static"][0], 3),
        "rebalanced_aa_ratio": round(tokens["rebalanced"][1] / tokens["rebalanced"][0], 3),
        "balancedness_static": round(balancedness_static, 4),
        "balancedness_rebalanced": round(balancedness_rebalanced, 4),
        "expert_share_static": round(share, 4),
        "predicted_gain": round(predicted, 3),
        "share_of_predicted_gain": round(gain_share, 3) if gain_share is not None else None,
        # at least 80 % of the predicted gain (where none is predicted: no loss beyond 80 % of the predicted one)
        "target_met": measured - 1 >= 0.8 * (predicted - 1) and (predicted < 1.25 or measured >= 1.15),
        "hot_experts": hot,
        "hot_share_of_pairs": round(sum(load[e] for e in hot) / max(1, sum(load)), 4) if hot and load else None,
        "load_max_over_mean": round(max(load) * len(load) / max(1, sum(load)), 3) if load else None,
        "zipf_exponent": zipf_exponent(load) if load else None,
        "tokens_per_s": tokens,
        "arms": runs,
    }


def configured(args: argparse.Namespace, config: str, placement: str, dtype: str,
               layout: str = "tp2") -> argparse.Namespace:
    """The arguments of one configuration in one placement and layout: the natural one at
    ``NATURAL``'s shape and ``NATURAL_LOAD``, in ``dtype``."""
    chosen = argparse.Namespace(**{**vars(args), "config": config, "placement": placement, "dtype": "float32",
                                   "layout": layout})
    if config == "natural":
        chosen.__dict__.update(NATURAL, **NATURAL_LOAD, dtype=dtype)
    return chosen


def host_dtype() -> str:
    """bfloat16 where vLLM's CPU experts run it on this host, else float32."""
    from bench_local_pairs import host_kernel

    return str(host_kernel()[1]).removeprefix("torch.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--layouts", nargs="+", choices=["tp2", "dp2"], default=["tp2", "dp2"],
                        help="TP=2 (one engine, stepped here) or DP=2 (the OpenAI server, driven by a client)")
    parser.add_argument("--configs", nargs="+", choices=["worst", "natural"], default=["worst", "natural"])
    parser.add_argument("--placements", nargs="+", choices=["rank0", "rank1"], default=["rank0", "rank1"])
    parser.add_argument("--rounds", type=int, default=3, help="static / rebalanced pairs, alternated (>= 2)")
    parser.add_argument("--arm", choices=["static", "rebalanced"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    add_skewed_checkpoint_arguments(parser, intermediate=2048)
    parser.add_argument("--zipf", type=float, default=1.0, help="the natural skew's Zipf exponent (router mass)")
    parser.add_argument("--seed", type=int, default=0, help="the natural skew's order of popularity")
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--interval", type=int, default=128,
                        help="the rebalanced arm's step_interval: its first rearrangement lands a quarter in "
                             "(upstream's start), the next one after the timed phase")
    parser.add_argument("--warm-requests", type=int, default=96)
    add_request_arguments(parser, requests=96, batch=16, batch_tokens=1024)
    args = parser.parse_args(argv)
    if args.arm:
        return run_arm(args)
    if args.out is None:
        parser.error("--out FILE is required")
    if args.rounds < 2:
        parser.error(f"--rounds must be >= 2 (the A/A pair), got {args.rounds}")
    if args.zipf <= 0:
        parser.error(f"--zipf must be > 0, got {args.zipf}")
    check_hot(parser, args)
    workdir = Path(tempfile.mkdtemp(prefix="eplb-graph-skewed-"))
    dtype = host_dtype() if "natural" in args.configs else "float32"
    results = []
    for config in args.configs:
        for placement in args.placements:
            model = workdir / f"{config}-{placement}"
            chosen = configured(args, config, placement, dtype)
            if config == "worst":
                skewed_checkpoint(parser, chosen, model)
            else:
                natural_checkpoint(chosen, model)
            write_tiny_tokenizer(model, 512)  # the server tokenizes (the checkpoints' vocabulary)
            for layout in args.layouts:
                chosen = configured(args, config, placement, dtype, layout)
                results.append(summarize(run_rounds(model, chosen), chosen))
                print(json.dumps({k: v for k, v in results[-1].items() if k != "arms"}), flush=True)
    report = {"benchmark": "bench_vllm_eplb", "runs": results, "target_met": all(r["target_met"] for r in results),
              "config": {k: v for k, v in vars(args).items() if k not in ("out", "arm", "model", "dtype")},
              "natural": {**NATURAL, **NATURAL_LOAD, "dtype": dtype}, "machine": f"{os.cpu_count()} cores, {platform.machine()}"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def run_rounds(model: Path, args: argparse.Namespace) -> list[dict]:
    """The arms of ``--rounds`` rounds, static first in even rounds and rebalanced first in odd ones."""
    runs = []
    for round_ in range(args.rounds):
        for arm in ("static", "rebalanced")[:: 1 if round_ % 2 == 0 else -1]:
            runs.append(launch_arm(arm, model, args, free_ports(1)[0]))
            print(f"{args.layout} {args.config} {args.placement} {arm}: {runs[-1]['tokens_per_s']} tokens/s, balancedness "
                  f"{runs[-1]['balancedness']}, expert share {runs[-1]['expert_share']}", flush=True)
    return runs


def write_report(args: argparse.Namespace, name: str, layout: str, summary: dict, runs: list[dict],
                 internal: tuple[str, ...]) -> None:
    """The JSON at ``--out`` (the summary, the config without the arms' internal flags, every run,
    the machine), and the summary on stdout."""
    report = {"benchmark": name, "layout": layout, **summary,
              "config": {k: v for k, v in vars(args).items() if k not in internal},
              "runs": runs, "machine": f"{os.cpu_count()} cores, {platform.machine()}"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"benchmark": name, **summary}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
