"""The throughput EPLB buys inside vLLM: expert parallel over two CPU workers, a skewed router.

vLLM's engine at TP=2 + EP (one core per worker, compiled), on a checkpoint this benchmark writes
(``skewed_router.py``), in two configurations and two placements each:

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
* **rebalanced**: EPLB on, rearranging every ``--interval`` steps from the first window on.

Each arm serves warm-up requests (the rebalanced arm rearranges during them), then is timed over
more: tokens/s (prompt and generated tokens the engine processed) and the engine's step times.
Balancedness is from upstream's own ``log_balancedness`` lines (each step's mean and max per-rank
load), summed over the timed steps; each rank's expert seconds are what
``eplb_graph::local_expert_pairs``' kernels took. The gain the balancedness predicts for the
static arm's expert share ``f`` of a step (the slower rank's expert seconds over wall time) is
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
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from skewed_router import (NATURAL, add_skewed_checkpoint_arguments, check_hot, natural_checkpoint,
                           skewed_checkpoint, worst_bias, zipf_exponent)

NEVER = 10**9
# the natural configuration's load: its steps cost about ten times the worst case's, so fewer,
# smaller batches (still enough steps for rebalancing to act before the timed requests)
NATURAL_LOAD = {"requests": 24, "warm_requests": 24, "batch_tokens": 256}
RESULT = "BENCH_ARM_RESULT "
MEASURE_START, MEASURE_END = "BENCH_MEASURE_START", "BENCH_MEASURE_END"
BALANCEDNESS = re.compile(r"EPLB step: \d+ for model \S+: avg_tokens=([\d.]+), max_tokens=(\d+), balancedness=[\d.]+")


def add_request_arguments(parser: argparse.ArgumentParser, *, requests: int, batch: int, batch_tokens: int) -> None:
    """Prefill-heavy requests and the engine's batch limits."""
    parser.add_argument("--requests", type=int, default=requests)
    parser.add_argument("--prompt-tokens", type=int, default=240)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--batch", type=int, default=batch, help="max_num_seqs")
    parser.add_argument("--batch-tokens", type=int, default=batch_tokens, help="max_num_batched_tokens")


def worker_counters(worker) -> dict:
    """One worker's EPLB figures (run in each worker by ``collective_rpc``)."""
    eplb = worker.model_runner.eplb_graph
    summary = eplb.summary()
    state = next(iter(worker.model_runner.eplb_state.model_states.values()))
    load = state.expert_load_window.sum(dim=0)  # [L, num_physical]
    placement = state.physical_to_logical_map  # [L, num_physical]
    logical = logical_load(load, placement, state.model.num_logical_experts)
    return {"ep_rank": summary["ep_rank"], "expert_seconds": summary["local_expert_seconds"],
            "pairs": sum(summary["local_pairs_computed"].values()),
            "rearrangements": summary["rearrangements_committed"], "bytes_received": summary["bytes_received"],
            "graphs_compiled_while_serving": summary["graphs_compiled_while_serving"],
            "logical_load": logical}


def logical_load(load, placement, num_logical: int) -> list[int]:
    """Load per logical expert, summed over layers and replicas."""
    import torch

    logical = torch.zeros(num_logical, dtype=torch.int64)
    logical.index_add_(0, placement.flatten().long().cpu(), load.flatten().long().cpu())
    return logical.tolist()


def run_arm(args: argparse.Namespace) -> int:
    """One engine, in this process: warm, then timed; prints one JSON line."""
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
                      VLLM_ENABLE_V1_MULTIPROCESSING="0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    interval = NEVER if args.arm == "static" else args.interval
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, tensor_parallel_size=2, seed=0,
              max_model_len=args.prompt_tokens + args.max_tokens + 8, max_num_seqs=args.batch,
              max_num_batched_tokens=args.batch_tokens, enable_expert_parallel=True, enable_eplb=True,
              eplb_config={"window_size": args.window, "step_interval": interval, "num_redundant_experts": args.redundant,
                           "use_async": True, "log_balancedness": True})
    engine = llm.llm_engine
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    def serve(count: int, first_id: int) -> tuple[list[float], int, float]:
        for i in range(count):
            ids = [(7 * (first_id + i) + 13 * j) % 500 + 3 for j in range(args.prompt_tokens)]
            engine.add_request(str(first_id + i), TokensPrompt(prompt_token_ids=ids), sampling)
        steps, start = [], time.perf_counter()
        while engine.has_unfinished_requests():
            before = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - before)
        return steps, count * (args.prompt_tokens + args.max_tokens), time.perf_counter() - start

    serve(args.warm_requests, 0)
    before = {c["ep_rank"]: c for c in llm.collective_rpc(worker_counters)}
    print(MEASURE_START, flush=True)
    steps, tokens, elapsed = serve(args.requests, args.warm_requests)
    print(MEASURE_END, flush=True)
    after = {c["ep_rank"]: c for c in llm.collective_rpc(worker_counters)}
    ranks = [{"ep_rank": r, "expert_seconds": after[r]["expert_seconds"] - before[r]["expert_seconds"],
              "pairs": after[r]["pairs"] - before[r]["pairs"], "rearrangements_total": after[r]["rearrangements"],
              "bytes_received_total": after[r]["bytes_received"],
              "graphs_compiled_while_serving": after[r]["graphs_compiled_while_serving"]} for r in sorted(after)]
    result = {"arm": args.arm, "tokens": tokens, "elapsed_s": elapsed, "steps_s": steps, "ranks": ranks,
              "logical_load": after[0]["logical_load"]}
    print(RESULT + json.dumps(result), flush=True)
    return 0


def arm_balancedness(output: str) -> float | None:
    """Sum of the steps' mean per-rank load over the sum of their max, from upstream's lines
    between the markers (a large step weighs as its load does)."""
    measured = output.split(MEASURE_START, 1)[-1].split(MEASURE_END, 1)[0]
    loads = [(float(mean), float(most)) for mean, most in BALANCEDNESS.findall(measured)]
    if not loads:
        return None
    return round(sum(mean for mean, _ in loads) / sum(most for _, most in loads), 4)


def launch_arm(arm: str, model: Path, args: argparse.Namespace) -> dict:
    argv = [sys.executable, __file__, "--arm", arm, "--model", str(model)]
    for name in ("interval", "window", "redundant", "requests", "warm_requests", "prompt_tokens", "max_tokens", "batch",
                 "batch_tokens", "dtype"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    output = done.stdout + done.stderr
    lines = [line for line in output.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"arm {arm} failed ({done.returncode}):\n{output[-5000:]}")
    if not BALANCEDNESS.search(output):
        raise SystemExit(f"arm {arm}: no balancedness line of upstream's in its log (log_balancedness)")
    result = json.loads(lines[-1][len(RESULT):])
    steps_ms = sorted(s * 1e3 for s in result.pop("steps_s"))
    result.update(
        tokens_per_s=round(result["tokens"] / result["elapsed_s"], 1),
        step_p50_ms=round(statistics.median(steps_ms), 2),
        step_p99_ms=round(steps_ms[min(len(steps_ms) - 1, int(0.99 * len(steps_ms)))], 2),
        steps=len(steps_ms),
        balancedness=arm_balancedness(output),
        expert_share=round(max(r["expert_seconds"] for r in result["ranks"]) / result["elapsed_s"], 4),
        upstream_rearrangements_logged=output.count("Rearranging experts (async mode) ..."),
    )
    return result


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
    load = arms["static"][0]["logical_load"]
    hot = [e for e, bias in enumerate(worst_bias(args)) if bias] if args.config == "worst" else None
    gain_share = (measured - 1) / (predicted - 1) if predicted > 1 else None
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
        "hot_share_of_pairs": round(sum(load[e] for e in hot) / max(1, sum(load)), 4) if hot else None,
        "load_max_over_mean": round(max(load) * len(load) / max(1, sum(load)), 3),
        "zipf_exponent": zipf_exponent(load),
        "tokens_per_s": tokens,
        "arms": runs,
    }


def configured(args: argparse.Namespace, config: str, placement: str, dtype: str) -> argparse.Namespace:
    """The arguments of one configuration in one placement: the natural one at ``NATURAL``'s shape
    and ``NATURAL_LOAD``, in ``dtype``."""
    chosen = argparse.Namespace(**{**vars(args), "config": config, "placement": placement, "dtype": "float32"})
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
    parser.add_argument("--layout", choices=["tp2"], default="tp2")
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
    parser.add_argument("--interval", type=int, default=16)
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
            chosen = configured(args, config, placement, dtype)
            model = workdir / f"{config}-{placement}"
            if config == "worst":
                skewed_checkpoint(parser, chosen, model)
            else:
                natural_checkpoint(chosen, model)
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
            runs.append(launch_arm(arm, model, args))
            print(f"{args.config} {args.placement} {arm}: {runs[-1]['tokens_per_s']} tokens/s, balancedness "
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
