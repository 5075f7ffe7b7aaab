"""A stack of expert-parallel MoE layers on one rank, under upstream EPLB via our adapters.

Used by the multi-rank tests and the movement benchmark: every rank builds the same
seeded logical experts, keeps its slice of the physical layout in the chosen
quantization format, and runs batches through the layers with ``begin_batch`` /
``end_batch`` around each forward -- the only place EPLB steps and layers commit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eplb_graph.controller import EplbController, RankLayer
from eplb_graph.expert_parallel import ExpertParallelMoE, LinearTopKRouter, reference_moe
from eplb_graph.layer_lookup import BatchFlags, LayerLookup, check_expert_layout, initial_placement
from eplb_graph.upstream_compat import EplbWorkerError
from eplb_graph.weight_views import ExpertWeights, check_expert_kernel, check_weight_view, expert_format


@dataclass(frozen=True)
class StackSpec:
    num_layers: int = 2
    num_logical: int = 8
    num_redundant: int = 4
    hidden: int = 32
    intermediate: int = 16
    top_k: int = 2
    tokens_per_rank: int = 16
    weight_format: str = "unquantized"
    expert_kernel: str = "pairs"  # see weight_views
    seed: int = 0

    @property
    def num_physical(self) -> int:
        return self.num_logical + self.num_redundant

    def validate(self, ep_size: int) -> None:
        """Every check that can fail, before a rank process (or any state) exists."""
        fmt = expert_format(self.weight_format)
        for name in ("num_layers", "hidden", "intermediate", "tokens_per_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        fmt.check_dims(self.hidden, self.intermediate)
        check_expert_kernel(self.expert_kernel)
        check_expert_layout(self.num_logical, self.num_redundant, self.top_k, ep_size)


def logical_weights(spec: StackSpec) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer: (router [E, H], w13 [E, 2I, H], w2 [E, H, I]), identical on every rank."""
    gen = torch.Generator().manual_seed(spec.seed)
    layers = []
    for _ in range(spec.num_layers):
        router = torch.randn(spec.num_logical, spec.hidden, generator=gen)
        w13 = torch.randn(spec.num_logical, 2 * spec.intermediate, spec.hidden, generator=gen) * spec.hidden**-0.5
        w2 = torch.randn(spec.num_logical, spec.hidden, spec.intermediate, generator=gen) * spec.intermediate**-0.5
        layers.append((router, w13, w2))
    return layers


def skewed_batch(spec: StackSpec, step: int, rank: int, drift_every: int = 0) -> torch.Tensor:
    """[T, H] tokens aimed at a hot set of experts; the hot set drifts every `drift_every` steps."""
    gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + step * 101 + rank)
    phase = step // drift_every if drift_every else 0
    hot = torch.Generator().manual_seed(spec.seed + phase)
    direction = torch.randn(spec.hidden, generator=hot)
    return 0.3 * torch.randn(spec.tokens_per_rank, spec.hidden, generator=gen) + direction


@dataclass
class RankStack:
    spec: StackSpec
    rank: int
    ep_size: int
    layers: list[ExpertParallelMoE]
    rank_layers: list[RankLayer]
    references: list  # per layer: (router, logical ExpertWeights)
    controller: EplbController
    flags: BatchFlags
    max_abs_diff: list[float] = field(default_factory=list)

    def forward(self, x: torch.Tensor, *, is_prefill: bool = False, check: bool = True) -> torch.Tensor:
        """One batch through every layer; EPLB steps (and commits layers) only after it."""
        try:
            self.controller.begin_batch(num_unpadded_tokens=x.shape[0], is_prefill=is_prefill)
            for layer, (router, logical_experts) in zip(self.layers, self.references):
                out = layer(x)
                if check:
                    expected = reference_moe(x, router, logical_experts, self.spec.top_k, self.spec.expert_kernel)
                    self.max_abs_diff.append(float((out - expected).abs().max()))
                x = x + out
            self.controller.end_batch()
        except RuntimeError as error:  # gloo: a peer's connection closed or timed out
            if isinstance(error, EplbWorkerError):
                raise
            raise self.controller.peer_lost(error) from error
        return x

    def local_weights_match_placement(self) -> bool:
        """Every local physical slot holds exactly its logical expert's (dequantized) weights."""
        num_local = self.spec.num_physical // self.ep_size
        for rank_layer, layer, (_, logical_experts) in zip(self.rank_layers, self.layers, self.references):
            placement = rank_layer.tables.physical_to_logical[self.rank * num_local : (self.rank + 1) * num_local]
            for local, expected in zip(layer.experts.dequantized(), logical_experts.dequantized()):
                if not torch.equal(local, expected[placement]):
                    return False
        return True


def build_ep_layer(
    key: str | None,
    router_weight: torch.Tensor,  # [num_logical, H]
    logical_experts: ExpertWeights,  # quantised once, in logical layout
    top_k: int,
    num_physical: int,
    rank: int,
    ep_size: int,
    group,
    flags: BatchFlags,
    shared_expert=None,
    device: torch.device | str = "cpu",
    expert_kernel: str = "pairs",
) -> tuple[ExpertParallelMoE, RankLayer | None]:
    """One EP MoE layer on this rank at the initial placement: its local slice of the physical
    experts and, with a key, the RankLayer (global routing tables) its routing op resolves.
    Experts and tables are created on ``device`` (the flags must live there too), so the
    weight views the mover writes are the tensors the layer computes with."""
    num_logical = logical_experts.num_experts
    num_local = num_physical // ep_size
    placement = initial_placement(num_logical, num_physical - num_logical)
    local_slots = placement[rank * num_local : (rank + 1) * num_local]
    local_experts = type(logical_experts)(*[t[local_slots].to(device) for t in logical_experts.weight_view()])
    check_weight_view(local_experts, num_local)
    rank_layer = None
    if key is not None:
        tables = LayerLookup(num_logical, num_physical, placement=placement, device=device)
        rank_layer = RankLayer(key, tables, flags, local_experts.weight_view())
    router = LinearTopKRouter(router_weight.to(device), top_k)
    layer = ExpertParallelMoE(router, local_experts, key, rank, ep_size, group, shared_expert, expert_kernel)
    return layer, rank_layer


def build_rank_stack(
    spec: StackSpec, rank: int, ep_size: int, *, load_phase: str = "all", transfer_timeout_s: float = 30.0,
    policy_process: bool = False,
) -> RankStack:
    """The stack under a controller; window and interval come from the current vLLM config."""
    from vllm.distributed.parallel_state import get_ep_group

    spec.validate(ep_size)  # unsupported formats and shapes fail here, before any state
    fmt = expert_format(spec.weight_format)
    group = get_ep_group().device_group if ep_size > 1 else None
    flags = BatchFlags()
    layers, rank_layers, references = [], [], []
    for index, (router, w13, w2) in enumerate(logical_weights(spec)):
        logical_experts = fmt.from_float(w13, w2)  # quantised once, in logical layout
        layer, rank_layer = build_ep_layer(
            f"ep{rank}.{index}", router, logical_experts, spec.top_k, spec.num_physical, rank, ep_size, group, flags,
            expert_kernel=spec.expert_kernel,
        )
        layers.append(layer)
        rank_layers.append(rank_layer)
        references.append((router, logical_experts))
    controller = EplbController(
        rank_layers, load_phase=load_phase, transfer_timeout_s=transfer_timeout_s, policy_process=policy_process
    )
    return RankStack(spec, rank, ep_size, layers, rank_layers, references, controller, flags)
