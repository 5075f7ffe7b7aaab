"""What being elastic costs a step, and that the cost does not grow with the requests served.

Two measures, one run:

* **fixed vs elastic, same workload**: the runtime's fixed group (``eplb-graph run``'s ranks)
  and an elastic group that never resizes (``run --scale-plan`` with one size: its control
  all-reduce and store reads each step, its keep-alive thread), on the same config, the same
  scripted batches, alternated fixed / elastic / fixed / elastic. Both are timed the same way:
  the gaps between rank 0's consecutive step ends, every step (outputs unchecked in both);
  the A/A row (fixed against fixed) is the noise the ratio reads against.
* **serving, O(1) in requests**: ``eplb-graph serve``'s group under continuous traffic; each
  member times its control per step served (its store reads, the inbox's new requests among
  them, and the control all-reduce). The median over the last steps against the first ones
  stays near 1 however many requests went through, and the store holds as many keys at the
  end as after the first requests.

    python benchmarks/bench_elastic_control.py --out out/bench_elastic_control.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path

from eplb_reference.runtime.config import RunConfig


def step_gaps_ms(ends: list[float], skip: int) -> list[float]:
    """The gaps between consecutive step ends (ms), after ``skip`` warm-up steps."""
    ends = ends[skip:]
    return [(b - a) * 1e3 for a, b in zip(ends, ends[1:])]


def fixed_run(cfg: RunConfig, skip: int) -> list[float]:
    from eplb_reference.runtime.launch import run_ranks
    from eplb_reference.runtime.rank import run_rank_and_shut_down

    results = run_ranks(run_rank_and_shut_down, cfg.ranks, cfg, timeout_s=600)
    return step_gaps_ms(results[0]["step_end_s"], skip)


def elastic_run(cfg: RunConfig, skip: int) -> list[float]:
    from eplb_reference.elastic.scripted import run_elastic

    raw = run_elastic(cfg, (cfg.ranks,), cfg.ranks, spares=0, timeout_s=600)
    rank0 = next(m for m in raw["members"] if m["member"] == 0)
    return step_gaps_ms(rank0["step_end_s"], skip)


def p50(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def fixed_vs_elastic(cfg: RunConfig, rounds: int, skip: int) -> dict:
    runs = {"fixed": [], "elastic": []}
    for _ in range(rounds):
        runs["fixed"].append(fixed_run(cfg, skip))
        runs["elastic"].append(elastic_run(cfg, skip))
    fixed = [p50(gaps) for gaps in runs["fixed"]]
    elastic = [p50(gaps) for gaps in runs["elastic"]]
    return {
        "steps": cfg.steps, "mode": cfg.mode, "ranks": cfg.ranks, "rounds": rounds,
        "fixed_step_p50_ms": fixed, "elastic_step_p50_ms": elastic,
        "elastic_over_fixed": round(statistics.median(elastic) / statistics.median(fixed), 3),
        "fixed_a_over_a": round(max(fixed) / min(fixed), 3),
    }


def serving_control(cfg: RunConfig, requests: int, clients: int) -> dict:
    from eplb_reference.elastic.server import ElasticServer

    server = ElasticServer(cfg, cfg.ranks, spares=0).start()
    stop, answered = threading.Event(), []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set() and len(answered) < requests:
            prompt = [rng.randrange(cfg.vocab_size) for _ in range(rng.randrange(1, 8))]
            answered.append(server.generate(prompt, rng.randrange(1, 8), timeout_s=300))

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    while len(answered) < min(50, requests):
        time.sleep(0.05)
    keys_early = server.coordinator.board.size()
    for thread in threads:
        thread.join()
    keys_late = server.coordinator.board.size()
    seconds = time.monotonic() - started
    server.shutdown()
    rank0 = server.coordinator.reports[0]
    first, last = rank0["control_ms"], rank0["control_ms_last"] or rank0["control_ms"]
    fifth = max(1, min(len(first), len(last)) // 5)
    first, last = p50(first[:fifth]), p50(last[-fifth:])
    return {
        "requests": len(answered), "seconds": round(seconds, 1), "steps_served": rank0["steps_served"],
        "mismatches": sum(not a["matches_reference"] for a in answered),
        "control_ms_p50_first_fifth": first, "control_ms_p50_last_fifth": last,
        "last_over_first": round(last / first, 3), "store_keys_after_50_requests": keys_early,
        "store_keys_at_the_end": keys_late,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2, help="fixed / elastic pairs, alternated")
    parser.add_argument("--requests", type=int, default=1500, help="requests through the serving group")
    parser.add_argument("--mode", default="compiled")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch

    cfg = RunConfig(mode=args.mode, ranks=2, steps=args.steps, check_outputs=False, collect_load_stats=False)
    cfg.validate()
    report = {
        "machine": f"{platform.machine()}, torch {torch.__version__}",
        "fixed_vs_elastic": fixed_vs_elastic(cfg, args.rounds, skip=len(cfg.capture_sizes)),
        "serving": serving_control(replace(cfg, mode="eager", steps=1, check_outputs=True), args.requests, clients=3),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
