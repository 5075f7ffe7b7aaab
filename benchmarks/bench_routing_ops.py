"""Cost of the registered ``eplb_graph::map_and_record`` against the same math inline.

The registered op runs the kernel that serves the device: on the CPU the C++ kernel where it
could be built, else the torch composite behind the dispatcher (the report's cpu_kernel:
"native" or "composite"; EPLB_GRAPH_NATIVE_KERNEL=0 chooses the composite). The inline side is
always the composite called from Python. Both are timed interleaved, round after round, in
one process, so machine noise hits both alike; the figures are medians and the targets
are ratios (registered / inline): <= 1.5 at T=16 and <= 1.1 at T=4096.

    python benchmarks/bench_routing_ops.py --out out/bench_routing_ops.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import eplb_graph
from eplb_graph import BatchFlags, LayerLookup
from eplb_graph.custom_ops.routing import map_and_record_composite
from eplb_graph.core.placement import check_expert_layout

TARGETS = {16: 1.5, 4096: 1.1}


def _time_per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def bench(num_tokens: int, top_k: int, num_logical: int, num_redundant_experts: int, rounds: int, device: str) -> dict:
    gen = torch.Generator().manual_seed(num_tokens)
    placement = torch.cat([torch.arange(num_logical), torch.randint(0, num_logical, (num_redundant_experts,), generator=gen)])
    layer = LayerLookup(num_logical, num_logical + num_redundant_experts, placement=placement, device=device)
    batch = BatchFlags(device)
    batch.set_(record=True, num_unpadded_tokens=num_tokens)
    ids = torch.randint(0, num_logical, (num_tokens, top_k), generator=gen).to(device)  # [T, K]
    args = (ids, layer.lookup, layer.replica_count, layer.load, batch.record_enabled, batch.num_unpadded_tokens)
    registered = lambda: torch.ops.eplb_graph.map_and_record(*args)  # noqa: E731
    inline = lambda: map_and_record_composite(*args)  # noqa: E731
    assert torch.equal(registered(), inline())

    # calls per timing sample: about 2 ms of work, so timer resolution does not matter
    per_call = _time_per_call(inline, 20)
    calls = max(1, int(2e-3 / max(per_call, 1e-7)))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    registered_s, inline_s = [], []
    for _ in range(rounds):
        for fn, samples in ((registered, registered_s), (inline, inline_s)):
            sync()
            samples.append(_time_per_call(fn, calls))
            sync()
    registered_us = statistics.median(registered_s) * 1e6
    inline_us = statistics.median(inline_s) * 1e6
    ratio = registered_us / inline_us
    result = {
        "num_tokens": num_tokens,
        "top_k": top_k,
        "registered_us": round(registered_us, 2),
        "inline_us": round(inline_us, 2),
        "ratio": round(ratio, 3),
    }
    if num_tokens in TARGETS:
        result["target_ratio"] = TARGETS[num_tokens]
        result["meets_target"] = ratio <= TARGETS[num_tokens]
    return result


def check_arguments(args: argparse.Namespace) -> None:
    """Bad input stops here, with the flag's name, before anything is timed."""
    if min(args.tokens) < 0:
        raise SystemExit(f"bench_routing_ops: --tokens must be >= 0, got {min(args.tokens)}")
    if args.rounds < 1:
        raise SystemExit(f"bench_routing_ops: --rounds must be >= 1, got {args.rounds}")
    try:
        check_expert_layout(args.num_logical, args.num_redundant_experts, args.top_k, ranks=1)
    except ValueError as error:
        raise SystemExit(f"bench_routing_ops: {error}") from None
    if args.device not in ("cpu", "cuda"):
        raise SystemExit(f"bench_routing_ops: --device must be cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_routing_ops: --device cuda, but torch.cuda.is_available() is False here")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 4096])
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--num-logical", type=int, default=256)
    parser.add_argument("--num-redundant-experts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("out/bench_routing_ops.json"))
    args = parser.parse_args()
    check_arguments(args)

    torch.set_num_threads(1)  # the two sides compete for nothing; ratios are per-thread work
    results = [
        bench(t, args.top_k, args.num_logical, args.num_redundant_experts, args.rounds, args.device) for t in args.tokens
    ]
    report = {
        "benchmark": "map_and_record registered op vs inline torch composite (eager)",
        "device": args.device,
        "cpu_kernel": eplb_graph.custom_ops.CPU_LAYER_KERNEL if args.device == "cpu" else None,
        "cuda_kernel": eplb_graph.custom_ops.CUDA_KERNEL if args.device == "cuda" else None,
        "torch": torch.__version__,
        "eplb_graph": getattr(eplb_graph, "__version__", "0.1.0"),
        "machine": platform.processor() or platform.machine(),
        "num_logical": args.num_logical,
        "num_redundant_experts": args.num_redundant_experts,
        "results": results,
        # null when no size with a target was asked for (--tokens): nothing was held to one
        "all_targets_met": all(r["meets_target"] for r in results if "meets_target" in r)
        if any("meets_target" in r for r in results) else None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"the registered op runs the {report['cpu_kernel'] or report['cuda_kernel']} {args.device} kernel")
    print(f"{'T':>6} {'registered us':>14} {'inline us':>10} {'ratio':>6}  target")
    for r in results:
        target = f"<= {r['target_ratio']} {'ok' if r['meets_target'] else 'MISSED'}" if "target_ratio" in r else ""
        print(f"{r['num_tokens']:>6} {r['registered_us']:>14.1f} {r['inline_us']:>10.1f} {r['ratio']:>6.3f}  {target}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
