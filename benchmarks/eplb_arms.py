"""One arm of bench_vllm_eplb.py: an engine served warm requests, then timed over more.

* ``run_engine_arm`` (TP=2): vLLM's ``LLM`` over two workers, stepped by hand in the arm's own
  process; each worker's figures read through ``collective_rpc``.
* ``run_server_arm`` (DP=2): vLLM's OpenAI server, one engine core per DP rank, driven by a
  client that keeps every engine's batch full; each worker's figures read from ``/metrics``.

Both hold the rebalanced arm's warm-up until its rearrangement has committed on every rank and
check that none started in the timed phase, and both return the same fields (the server arm has
no step times and no logical load: a client sees neither).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_server import complete, per_rank, scrape, served

# the plugin publishes its work counters alone at most this often: the server arm waits that long,
# then steps every engine once
from eplb_graph.vllm_plugin.metrics import WORK_PUBLISH_S

NEVER = 10**9  # the static arm's step_interval: beyond any run
SETTLE_BATCHES = 8  # warm batches the rebalanced arm may add for its rearrangement to commit
MEASURE_START, MEASURE_END = "BENCH_MEASURE_START", "BENCH_MEASURE_END"
BALANCEDNESS = re.compile(r"EPLB step: \d+ for model \S+: avg_tokens=([\d.]+), max_tokens=(\d+), balancedness=[\d.]+")


def eplb_config(args: argparse.Namespace) -> dict:
    return {"window_size": args.window, "step_interval": NEVER if args.arm == "static" else args.interval,
            "num_redundant_experts": args.redundant, "use_async": True, "log_balancedness": True}


def prompt(index: int, length: int) -> list[int]:
    """The ``index``-th request's token ids (in the checkpoints' vocabulary of 512)."""
    return [(7 * index + 13 * j) % 500 + 3 for j in range(length)]


def settled(counters) -> bool:
    """Every rank committed a rearrangement and has none in flight."""
    return all(c["rearrangements"] >= 1 and not c["in_flight"] for c in counters)


def worker_counters(worker) -> dict:
    """One worker's EPLB figures (run in each worker by ``collective_rpc``)."""
    eplb = worker.model_runner.eplb_graph
    summary = eplb.summary()
    state = next(iter(worker.model_runner.eplb_state.model_states.values()))
    load = state.expert_load_window.sum(dim=0)  # [L, num_physical]
    placement = state.physical_to_logical_map  # [L, num_physical]
    logical = logical_load(load, placement, state.model.num_logical_experts)
    pairs, seconds = eplb.local_work()
    return {"ep_rank": summary["ep_rank"], "expert_seconds": seconds, "pairs": pairs,
            "rearrangements": summary["rearrangements_committed"],
            "in_flight": state.rebalanced,  # upstream's async rearrangement started and not yet committed
            "logical_load": logical}


def logical_load(load, placement, num_logical: int) -> list[int]:
    """Load per logical expert, summed over layers and replicas."""
    import torch

    logical = torch.zeros(num_logical, dtype=torch.int64)
    logical.index_add_(0, placement.flatten().long().cpu(), load.flatten().long().cpu())
    return logical.tolist()


def timed(args: argparse.Namespace, arm_counters, serve, mark) -> dict:
    """Warm (until settled, for the rebalanced arm), then timed: ``serve(count, first_id)`` returns
    (step seconds, elapsed); ``arm_counters()`` each rank's figures by EP rank; ``mark(marker)``
    bounds the timed phase in the arm's log."""
    served = args.warm_requests
    serve(served, 0)
    before = arm_counters()
    for _ in range(SETTLE_BATCHES):  # the rebalanced arm times its committed placement, not a move
        if args.arm == "static" or settled(before.values()):
            break
        serve(args.batch, served)
        served += args.batch
        before = arm_counters()
    if args.arm == "rebalanced" and not settled(before.values()):
        raise SystemExit(f"no rearrangement committed in the warm-up: {list(before.values())}")
    mark(MEASURE_START)
    steps, elapsed = serve(args.requests, served)
    after = arm_counters()
    mark(MEASURE_END)
    moved = [r for r in after if after[r]["in_flight"] or after[r]["rearrangements"] != before[r]["rearrangements"]]
    if moved:
        raise SystemExit(f"a rearrangement started in the timed phase on EP ranks {moved}: raise --interval")
    ranks = [{"ep_rank": r, "expert_seconds": after[r]["expert_seconds"] - before[r]["expert_seconds"],
              "pairs": after[r]["pairs"] - before[r]["pairs"], "rearrangements_total": after[r]["rearrangements"]}
             for r in sorted(after)]
    return {"arm": args.arm, "tokens": args.requests * (args.prompt_tokens + args.max_tokens), "elapsed_s": elapsed,
            "steps_s": steps, "ranks": ranks, "logical_load": after[min(after)].get("logical_load")}


def run_engine_arm(args: argparse.Namespace) -> dict:
    """TP=2: one ``LLM`` in this process, its engine stepped here (so each step is timed)."""
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
                      VLLM_ENABLE_V1_MULTIPROCESSING="0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, tensor_parallel_size=2, seed=0,
              max_model_len=args.prompt_tokens + args.max_tokens + 8, max_num_seqs=args.batch,
              max_num_batched_tokens=args.batch_tokens, enable_expert_parallel=True, enable_eplb=True,
              eplb_config=eplb_config(args))
    engine = llm.llm_engine
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    def serve(count: int, first_id: int) -> tuple[list[float], float]:
        for i in range(first_id, first_id + count):
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompt(i, args.prompt_tokens)), sampling)
        steps, start = [], time.perf_counter()
        while engine.has_unfinished_requests():
            before = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - before)
        return steps, time.perf_counter() - start

    return timed(args, lambda: {c["ep_rank"]: c for c in llm.collective_rpc(worker_counters)}, serve,
                 lambda marker: print(marker, flush=True))


def server_counters(families: dict[str, list]) -> dict[int, dict]:
    """Each worker's figures from a ``/metrics`` scrape (the plugin's counters, by EP rank)."""
    read = {name: per_rank(families, f"eplb_graph:{name}") for name in
            ("local_expert_seconds", "local_pairs_computed", "rearrangements_started", "rearrangements_finished")}
    return {int(rank): {"ep_rank": int(rank), "expert_seconds": read["local_expert_seconds"][rank],
                        "pairs": int(read["local_pairs_computed"][rank]),
                        "rearrangements": int(read["rearrangements_finished"][rank]),
                        "in_flight": read["rearrangements_started"][rank] > read["rearrangements_finished"][rank]}
            for rank in read["rearrangements_finished"]}


def run_server_arm(args: argparse.Namespace, model: Path, log: Path, port: int) -> tuple[dict, str]:
    """DP=2: the OpenAI server, a client keeping ``--batch`` requests in flight per DP rank; the
    result and the server's log of the arm."""
    server_args = ["--model", str(model), "--dtype", args.dtype, "--seed", "0", "--data-parallel-size", "2",
                   "--max-model-len", str(args.prompt_tokens + args.max_tokens + 8), "--max-num-seqs", str(args.batch),
                   "--max-num-batched-tokens", str(args.batch_tokens), "--enable-expert-parallel", "--enable-eplb",
                   "--eplb-config", json.dumps(eplb_config(args))]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    with served(server_args, env, log, port), ThreadPoolExecutor(2 * args.batch) as pool:
        def serve(count: int, first_id: int) -> tuple[list[float], float]:
            start = time.perf_counter()
            list(pool.map(lambda i: complete(port, str(model), prompt(i, args.prompt_tokens), args.max_tokens),
                          range(first_id, first_id + count)))
            return [], time.perf_counter() - start

        def counters() -> dict[int, dict]:
            time.sleep(WORK_PUBLISH_S)  # then one step on every engine publishes its work counters
            list(pool.map(lambda i: complete(port, str(model), [3], 1), range(2)))
            return server_counters(scrape(port))

        marks = []
        result = timed(args, counters, serve, lambda marker: marks.append(log.stat().st_size))
    text = log.read_bytes()
    start, end = marks
    return result, (text[:start] + f"\n{MEASURE_START}\n".encode() + text[start:end] + f"\n{MEASURE_END}\n".encode()
                    + text[end:]).decode(errors="replace")
