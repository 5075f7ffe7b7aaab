"""The throughput EPLB buys inside vLLM: expert parallel over two CPU workers, a skewed router.

vLLM's engine at TP=2 + EP (one core per worker, compiled), on a checkpoint this benchmark writes:
Qwen3-MoE with experts wide enough that expert compute dominates a step, whose router sends
about half of the routed pairs to two hot experts (``--hot``) that vLLM's initial placement puts,
unreplicated, in rank 0's slots (the redundant slots copy experts 0..R-1 onto the last rank).
Two arms, each its own engine, alternated for ``--rounds`` rounds (static first in even
rounds, rebalanced first in odd ones, so neither always follows the other):

* **static**: EPLB on, never rebalancing (``step_interval`` beyond the run): upstream's initial
  placement kept (what a skew does to a deployment that does not rebalance), with the same
  routing and recording ops;
* **rebalanced**: EPLB on, rearranging every ``--interval`` steps from the first window on.

Each arm serves ``--warm-requests`` prefill-heavy requests (the rebalanced arm rearranges
during them), then is timed over ``--requests`` more: tokens/s (prompt and generated tokens
the engine processed) and the engine's step times. Balancedness is from upstream's own
``log_balancedness`` lines (each step's mean and max per-rank load), summed over the timed steps;
each rank's expert seconds are what ``eplb_graph::local_expert_pairs``' kernels took. The hot
share is measured from the load upstream recorded. The gain the balancedness predicts for the
static arm's expert share ``f`` of a step (the slower rank's expert seconds over wall time) is
``1 / (1 - f + f * balancedness_static / balancedness_rebalanced)``. Figures are medians over the
rounds; the A/A ratios (the second round's arm over the first's, and the arms' max / min) are the
noise the ratio reads against.

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

NEVER = 10**9
RESULT = "BENCH_ARM_RESULT "
MEASURE_START, MEASURE_END = "BENCH_MEASURE_START", "BENCH_MEASURE_END"
BALANCEDNESS = re.compile(r"EPLB step: \d+ for model \S+: avg_tokens=([\d.]+), max_tokens=(\d+), balancedness=[\d.]+")


def write_skewed_checkpoint(directory: Path, *, hidden: int, intermediate: int, layers: int, experts: int,
                            hot: list[int], bias: float) -> Path:
    """A Qwen3-MoE checkpoint whose routers favour ``hot``: every token embedding shares one
    direction, and each layer's router rows of the hot experts point along it by ``bias``."""
    import torch
    from safetensors.torch import load_file, save_file

    from eplb_reference.models.tiny_checkpoint import write_tiny_qwen3_moe_checkpoint

    write_tiny_qwen3_moe_checkpoint(directory, hidden_size=hidden, moe_intermediate_size=intermediate,
                                    intermediate_size=intermediate, num_hidden_layers=layers, num_experts=experts,
                                    num_attention_heads=2, num_key_value_heads=1, vocab_size=512)
    path = next(directory.glob("*.safetensors"))
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(1)
    shared = torch.randn(hidden, generator=generator)
    shared = shared / shared.norm()  # [H]
    tensors["model.embed_tokens.weight"] += 2.0 * shared
    for layer in range(layers):
        gate = tensors[f"model.layers.{layer}.mlp.gate.weight"]  # [E, H]
        gate[hot] += bias * shared
    save_file(tensors, path, metadata={"format": "pt"})
    return directory


def add_skewed_checkpoint_arguments(parser: argparse.ArgumentParser, *, intermediate: int) -> None:
    """The skewed checkpoint's shape and skew (this benchmark's and ``bench_kept_placement.py``'s)."""
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=intermediate)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--redundant", type=int, default=4)
    parser.add_argument("--hot", type=int, nargs="+", default=[4, 5], help="hot logical experts (rank 0's, unreplicated)")
    parser.add_argument("--bias", type=float, default=0.15, help="router bias towards the hot experts")


def add_request_arguments(parser: argparse.ArgumentParser, *, requests: int, batch: int, batch_tokens: int) -> None:
    """Prefill-heavy requests and the engine's batch limits."""
    parser.add_argument("--requests", type=int, default=requests)
    parser.add_argument("--prompt-tokens", type=int, default=240)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--batch", type=int, default=batch, help="max_num_seqs")
    parser.add_argument("--batch-tokens", type=int, default=batch_tokens, help="max_num_batched_tokens")


def skewed_checkpoint(parser: argparse.ArgumentParser, args: argparse.Namespace, directory: Path) -> Path:
    """The checkpoint ``add_skewed_checkpoint_arguments`` describes, its hot experts checked first."""
    if not all(args.redundant <= e < (args.experts + args.redundant) // 2 for e in args.hot):
        parser.error(f"--hot {args.hot}: hot experts must sit in rank 0's slots, unreplicated "
                     f"({args.redundant}..{(args.experts + args.redundant) // 2 - 1})")
    return write_skewed_checkpoint(directory, hidden=args.hidden, intermediate=args.intermediate, layers=args.layers,
                                   experts=args.experts, hot=args.hot, bias=args.bias)


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
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="float32", tensor_parallel_size=2, seed=0,
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
        steps, tokens, start = [], 0, time.perf_counter()
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
                 "batch_tokens"):
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


def summarize(runs: list[dict], hot: list[int]) -> dict:
    arms = {arm: [r for r in runs if r["arm"] == arm] for arm in ("static", "rebalanced")}
    median = lambda arm, key: statistics.median(r[key] for r in arms[arm])  # noqa: E731
    balancedness_static, balancedness_rebalanced = median("static", "balancedness"), median("rebalanced", "balancedness")
    share = median("static", "expert_share")
    predicted = 1 / (1 - share + share * balancedness_static / balancedness_rebalanced)
    measured = median("rebalanced", "tokens_per_s") / median("static", "tokens_per_s")
    tokens = {arm: [r["tokens_per_s"] for r in arms[arm]] for arm in arms}
    load = arms["static"][0]["logical_load"]
    return {
        "rebalanced_over_static": round(measured, 3),
        "aa_ratio": round(tokens["static"][1] / tokens["static"][0], 3),
        "rebalanced_aa_ratio": round(tokens["rebalanced"][1] / tokens["rebalanced"][0], 3),
        "static_spread": round(max(tokens["static"]) / min(tokens["static"]), 3),
        "balancedness_static": round(balancedness_static, 4),
        "balancedness_rebalanced": round(balancedness_rebalanced, 4),
        "expert_share_static": round(share, 4),
        "predicted_gain": round(predicted, 3),
        "share_of_predicted_gain": round((measured - 1) / (predicted - 1), 3) if predicted > 1 else None,
        "hot_experts": hot,
        "hot_share_of_pairs": round(sum(load[e] for e in hot) / max(1, sum(load)), 4),
        "tokens_per_s": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--layout", choices=["tp2"], default="tp2")
    parser.add_argument("--rounds", type=int, default=3, help="static / rebalanced pairs, alternated (>= 2)")
    parser.add_argument("--arm", choices=["static", "rebalanced"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    add_skewed_checkpoint_arguments(parser, intermediate=2048)
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
    model = skewed_checkpoint(parser, args, Path(tempfile.mkdtemp(prefix="eplb-graph-skewed-")))
    runs = []
    for arm in [arm for round_ in range(args.rounds) for arm in ("static", "rebalanced")[:: 1 if round_ % 2 == 0 else -1]]:
        runs.append(launch_arm(arm, model, args))
        print(f"{arm}: {runs[-1]['tokens_per_s']} tokens/s, balancedness {runs[-1]['balancedness']}, "
              f"expert share {runs[-1]['expert_share']}", flush=True)
    write_report(args, "bench_vllm_eplb", args.layout, summarize(runs, args.hot), runs, ("out", "arm", "model"))
    return 0


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
