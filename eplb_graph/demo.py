"""`eplb-graph demo`: one compiled router layer, rebalanced live by upstream's policy.

The smallest honest end-to-end use of what exists: a router (linear -> softmax -> top-k)
compiled with ``fullgraph=True`` calls ``eplb_graph::map_and_record``; a skewed
workload records load per physical expert; upstream vLLM's ``DefaultEplbPolicy`` turns
that load into a new placement; ``LayerLookup.refresh_`` writes it in place; the same
compiled graph keeps running, now balanced, without recompiling.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from eplb_graph.layer_lookup import BatchFlags, LayerLookup, check_expert_layout
from eplb_graph.run_report import balancedness


@dataclass
class DemoReport:
    num_logical_experts: int
    num_physical_experts: int
    ranks: int
    steps_per_phase: int
    balancedness_before: float
    balancedness_after: float
    recompiles: int
    lookup_data_ptr_stable: bool
    routed_only_to_hosting_slots: bool
    compile_s: float


def rank_balancedness(physical_load: torch.Tensor, ranks: int) -> float:
    """Balancedness with physical slots split evenly and contiguously over ranks."""
    return balancedness(physical_load.reshape(ranks, -1).sum(-1))  # [ranks]


def skewed_router_logits(gen: torch.Generator, num_tokens: int, num_experts: int, hot: int) -> torch.Tensor:
    """[T, E] logits whose top-k concentrates on `hot` experts (a Zipf-like popularity)."""
    popularity = 3.0 / torch.arange(1, num_experts + 1, dtype=torch.float32).sqrt()
    popularity = popularity[torch.randperm(num_experts, generator=gen)]
    popularity[hot:] *= 0.25
    return popularity + 0.5 * torch.randn(num_tokens, num_experts, generator=gen)


def run_demo(
    *,
    num_logical: int = 64,
    num_redundant: int = 16,
    ranks: int = 4,
    top_k: int = 4,
    tokens: int = 128,
    steps: int = 20,
    backend: str = "inductor",
    seed: int = 0,
) -> DemoReport:
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    check_expert_layout(num_logical, num_redundant, top_k, ranks)
    for name, value in (("steps", steps), ("tokens", tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    num_physical = num_logical + num_redundant
    layer = LayerLookup(num_logical, num_physical)
    batch = BatchFlags()
    gen = torch.Generator().manual_seed(seed)

    def route(logits: torch.Tensor) -> torch.Tensor:  # [T, E] -> [T, K] physical ids
        _, logical_ids = torch.topk(logits.softmax(-1), top_k, dim=-1)  # [T, K]
        return torch.ops.eplb_graph.map_and_record(
            logical_ids, layer.lookup, layer.replica_count, layer.load, batch.record_enabled, batch.num_unpadded_tokens
        )

    compiled = torch.compile(route, backend=backend, fullgraph=True)
    workload = [skewed_router_logits(gen, tokens, num_logical, hot=8) for _ in range(steps)]
    batch.set_(record=True, num_unpadded_tokens=tokens)
    pointer = layer.lookup.data_ptr()

    start = time.perf_counter()
    compiled(workload[0])
    compile_s = time.perf_counter() - start
    layer.reset_load_()
    for logits in workload:
        compiled(logits)
    before = rank_balancedness(layer.load, ranks)

    new_placement = DefaultEplbPolicy.rebalance_experts(
        layer.logical_load().unsqueeze(0), num_physical, 1, 1, ranks, layer.physical_to_logical.unsqueeze(0)
    )[0]
    layer.refresh_(new_placement)
    layer.reset_load_()
    hosting_ok = True
    with torch._dynamo.config.patch(error_on_recompile=True):
        for logits in workload:
            physical = compiled(logits)
            logical = torch.topk(logits.softmax(-1), top_k, dim=-1).indices
            hosting_ok &= bool(torch.equal(layer.physical_to_logical[physical], logical))
    after = rank_balancedness(layer.load, ranks)
    recompiles = int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) - 1
    return DemoReport(
        num_logical_experts=num_logical,
        num_physical_experts=num_physical,
        ranks=ranks,
        steps_per_phase=steps,
        balancedness_before=round(before, 4),
        balancedness_after=round(after, 4),
        recompiles=recompiles,
        lookup_data_ptr_stable=layer.lookup.data_ptr() == pointer,
        routed_only_to_hosting_slots=hosting_ok,
        compile_s=round(compile_s, 2),
    )


def report_dict(report: DemoReport) -> dict:
    return asdict(report)
