"""`eplb-graph demo`: one compiled router layer, rebalanced live by upstream's policy.

The smallest honest end-to-end use of what exists: the reference decoder's router (linear ->
softmax -> top-k) compiled with ``fullgraph=True`` calls ``eplb_graph::map_and_record``; the
runtime's skewed workload (``runtime.workload``) records load per physical expert; upstream vLLM's ``DefaultEplbPolicy`` turns
that load into a new placement; ``LayerLookup.refresh_`` writes it in place; the same
compiled graph keeps running, now balanced, without recompiling.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from eplb_graph.core.layer_lookup import BatchFlags, LayerLookup
from eplb_reference.models.reference import ReferenceMoEConfig, build_reference_model
from eplb_graph.core.placement import check_expert_layout
from eplb_reference.runtime.compile import unique_graphs
from eplb_reference.runtime.report import balancedness
from eplb_reference.runtime.workload import WorkloadSpec, make_batch


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


class DemoRouter:
    """The reference decoder's embedding and first router over a ``LayerLookup``, and the runtime's
    skewed workload (a hot vocabulary slice, so a hot set of experts) over its vocabulary."""

    def __init__(self, num_logical: int, num_redundant_experts: int, top_k: int, tokens: int, seed: int) -> None:
        config = ReferenceMoEConfig(num_layers=1, num_experts=num_logical, top_k=top_k)
        model = build_reference_model(config, seed=seed)
        self.embed, self.gate = model.embed, model.layers[0].mlp.gate
        self.layer = LayerLookup(num_logical, num_logical + num_redundant_experts)
        self.flags = BatchFlags()
        self.flags.set_(record=True, num_unpadded_tokens=tokens)
        self.workload = WorkloadSpec(vocab_size=config.vocab_size, seed=seed, capture_sizes=(tokens,),
                                     decode_tokens=tokens, prefill_tokens=tokens)

    def logical_ids(self, token_ids: torch.Tensor) -> torch.Tensor:  # [1, T] -> [T, K]
        return self.gate(self.embed(token_ids[0]))[1]

    def route(self, token_ids: torch.Tensor) -> torch.Tensor:  # [1, T] -> [T, K] physical ids
        layer, flags = self.layer, self.flags
        return torch.ops.eplb_graph.map_and_record(
            self.logical_ids(token_ids), layer.lookup, layer.replica_count, layer.load, flags.record_enabled,
            flags.num_unpadded_tokens,
        )


def run_demo(
    *,
    num_logical: int = 64,
    num_redundant_experts: int = 16,
    ranks: int = 4,
    top_k: int = 4,
    tokens: int = 128,
    steps: int = 20,
    backend: str = "inductor",
    seed: int = 0,
) -> DemoReport:
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    check_expert_layout(num_logical, num_redundant_experts, top_k, ranks)
    for name, value in (("steps", steps), ("tokens", tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    num_physical = num_logical + num_redundant_experts
    router = DemoRouter(num_logical, num_redundant_experts, top_k, tokens, seed)
    layer = router.layer
    compiled = torch.compile(router.route, backend=backend, fullgraph=True)
    workload = [make_batch(router.workload, step, 0).tokens for step in range(steps)]
    pointer = layer.lookup.data_ptr()

    graphs_before = unique_graphs()
    start = time.perf_counter()
    compiled(workload[0])
    compile_s = time.perf_counter() - start
    layer.reset_load_()
    for token_ids in workload:
        compiled(token_ids)
    before = rank_balancedness(layer.load, ranks)

    new_placement = DefaultEplbPolicy.rebalance_experts(
        layer.logical_load().unsqueeze(0), num_physical, 1, 1, ranks, layer.physical_to_logical.unsqueeze(0)
    )[0]
    layer.refresh_(new_placement)
    layer.reset_load_()
    hosting_ok = True
    with torch._dynamo.config.patch(error_on_recompile=True):
        for token_ids in workload:
            physical = compiled(token_ids)
            hosting_ok &= bool(torch.equal(layer.physical_to_logical[physical], router.logical_ids(token_ids)))
    after = rank_balancedness(layer.load, ranks)
    recompiles = unique_graphs() - graphs_before - 1
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
