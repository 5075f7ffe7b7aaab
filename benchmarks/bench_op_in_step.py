"""What the routing op costs per call inside a compiled CPU step, against what it costs alone.

Called back to back ("hot") the op finds its code and tables in the CPU's caches; inside a step
it runs after the forward's own kernels have filled them, and costs more. Each round runs one
compiled EPLB-off forward of the default model, then times one call of each case right after
it ("cold", what a step pays) and once more at once ("hot"):

    routing_op    torch.ops.eplb_graph.map_and_record_layer on a live layer (what the pass
                  inserts), on the CPU kernel that serves it here (the report's cpu_layer_kernel:
                  native, the C++ kernel, where it could be built)
    composite_op  the same op with the torch composite behind a Python kernel (what serves it
                  where C++ cannot be built, or with EPLB_GRAPH_NATIVE_KERNEL=0)
    passthrough   a custom op with a Python kernel that only allocates its output: the floor
                  any Python-kernel op pays for the dispatcher's trip into Python
    composite     the composite called directly on the layer's tables (its own aten ops, no
                  trip into Python)
    nothing       an empty Python call: the timer's own floor

    python benchmarks/bench_op_in_step.py --out out/bench_op_in_step.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

NAMESPACE = "eplb_graph_bench_floor"


def register_comparison_ops(layer_kernel) -> torch.library.Library:
    """The routing op's schema twice: ``composite_op`` over ``layer_kernel`` (behind the op's
    Python kernel), ``passthrough`` whose kernel only allocates."""
    from eplb_graph.custom_ops.layer_routing import python_op_kernel

    lib = torch.library.Library(NAMESPACE, "DEF")
    for name in ("composite_op", "passthrough"):
        lib.define(f"{name}(Tensor topk_ids, str layer) -> Tensor")
    lib.impl("composite_op", python_op_kernel(layer_kernel), "CPU")
    lib.impl("passthrough", lambda topk_ids, layer: torch.empty_like(topk_ids), "CPU")
    return lib


def time_cases(cases: dict[str, Callable[[], object]], step: Callable[[int], object], rounds: int) -> dict:
    """Median µs per case, cold (right after ``step``) and hot (right after that)."""
    cold: dict[str, list[float]] = {name: [] for name in cases}
    hot: dict[str, list[float]] = {name: [] for name in cases}
    for index in range(rounds):
        for name, case in cases.items():
            step(index)
            start = time.perf_counter_ns()
            case()
            cold[name].append((time.perf_counter_ns() - start) / 1e3)
            start = time.perf_counter_ns()
            case()
            hot[name].append((time.perf_counter_ns() - start) / 1e3)
    return {name: {"cold_us": round(statistics.median(cold[name]), 2), "hot_us": round(statistics.median(hot[name]), 2)}
            for name in cases}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the forward (aot_eager: quick)")
    parser.add_argument("--out", type=Path, default=Path("out/bench_op_in_step.json"))
    args = parser.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"bench_op_in_step: --rounds must be >= 1, got {args.rounds}")

    from eplb_reference.bench.harness import decode_batches
    from eplb_graph.custom_ops import CPU_LAYER_KERNEL, LAYER_TABLES, layer_routing, routing
    from eplb_reference.runtime.compile import prepare_step
    from eplb_reference.runtime.config import RunConfig
    from eplb_reference.runtime.stack import build_rank_models

    torch.set_num_threads(1)  # the ranks' setting on this machine: one thread each
    cfg = RunConfig(ranks=1, mode="compiled", backend=args.backend)
    composite = layer_routing.on_tables(routing.map_and_record_composite)  # (ids, layer) -> physical ids
    library = register_comparison_ops(composite)  # held for the life of the registration
    with torch.no_grad():
        off_cfg, on_cfg = dataclasses.replace(cfg, eplb=False), dataclasses.replace(cfg, eplb=True)
        off_model, _, _, off_flags = build_rank_models(off_cfg, 0, 1, None)
        _, _, rank_layers, on_flags = build_rank_models(on_cfg, 0, 1, None)  # a live EPLB layer for the op
        on_flags.set_(record=True, num_unpadded_tokens=cfg.decode_tokens)
        forward, _ = prepare_step(off_model, off_cfg, [], off_flags, [])
        batches = decode_batches(cfg, 0, torch.device("cpu"))
        forward_us = []

        def step(index: int) -> None:
            start = time.perf_counter_ns()
            forward(batches[index % len(batches)].tokens)
            forward_us.append((time.perf_counter_ns() - start) / 1e3)

        layer = rank_layers[0]
        ids = torch.randint(0, cfg.num_experts, (cfg.decode_tokens, cfg.top_k))  # [T, K]
        routing_op = torch.ops.eplb_graph.map_and_record_layer.default
        composite_op = getattr(torch.ops, NAMESPACE).composite_op.default
        passthrough = getattr(torch.ops, NAMESPACE).passthrough.default
        cases = {
            "routing_op": lambda: routing_op(ids, layer.key),
            "composite_op": lambda: composite_op(ids, layer.key),
            "passthrough": lambda: passthrough(ids, layer.key),
            "composite": lambda: composite(ids, LAYER_TABLES.resolve(layer.key)),
            "nothing": lambda: None,
        }
        for index in range(20):  # compile, warm-up
            step(index)
            for case in cases.values():
                case()
        forward_us.clear()
        results = time_cases(cases, step, args.rounds)
    del library
    report = {
        "rounds": args.rounds,
        "backend": args.backend,
        "cpu_layer_kernel": CPU_LAYER_KERNEL,  # what routing_op ran
        "decode_tokens": cfg.decode_tokens,
        "top_k": cfg.top_k,
        "forward_p50_us": round(statistics.median(forward_us), 1),  # the compiled EPLB-off step the calls follow
        "calls": results,
        "routing_op_cold_over_hot": round(results["routing_op"]["cold_us"] / results["routing_op"]["hot_us"], 2),
        "composite_op_cold_over_routing_op_cold": round(
            results["composite_op"]["cold_us"] / results["routing_op"]["cold_us"], 2),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"routing_op runs the {CPU_LAYER_KERNEL} CPU kernel")
    print(f"{'call':<12} {'cold us':>8} {'hot us':>8}   (cold: right after a {report['forward_p50_us']} us compiled step)")
    for name, times in results.items():
        print(f"{name:<12} {times['cold_us']:>8.2f} {times['hot_us']:>8.2f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
