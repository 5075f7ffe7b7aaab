"""One rank's share of the reference MoE decoder: the EP model, its no-EPLB reference, its EPLB state.

The one EP stack of the runtime. Every rank builds the same seeded decoder, keeps its slice
of the physical experts in the chosen quantization format, and registers one ``RankLayer``
(the global routing tables its routing op resolves by name) per MoE layer. ``run_rank``
compiles or captures the model; the multi-rank tests step it eagerly through
``RankStack.step``, which checks every output against the reference; ``bench_movement.py``
times the same models with ``timed_step``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from eplb_graph.core.layer_lookup import BatchFlags, LayerLookup
from eplb_reference.models.reference import TopKRouter, build_reference_model
from eplb_graph.core.placement import initial_placement
from eplb_reference.runtime.config import RunConfig
from eplb_reference.runtime.controller import EplbController, RankLayer
from eplb_reference.runtime.ep_moe import ExpertParallelMoE
from eplb_reference.runtime.step import check_output, rank_device
from eplb_reference.runtime.workload import Batch
from eplb_graph.upstream.capability import EplbWorkerError
from eplb_graph.upstream.kept_placement import PlacementKeeper
from eplb_graph.movement.weight_views import ExpertWeights, check_weight_view, expert_format


class RankModels(NamedTuple):
    model: nn.Module  # this rank's EP model (EPLB routing where cfg.eplb)
    reference: nn.Module  # the same decoder without EPLB: logical experts, one process, the same kernels
    rank_layers: list[RankLayer]  # one per MoE layer (none without EPLB)
    flags: BatchFlags  # the batch flags every layer's routing op reads


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
    router = TopKRouter.from_weight(router_weight.to(device), top_k)
    layer = ExpertParallelMoE(router, local_experts, key, rank, ep_size, group, shared_expert, expert_kernel)
    return layer, rank_layer


def logical_layer(moe: nn.Module, cfg: RunConfig) -> tuple[torch.Tensor, ExpertWeights, ExpertParallelMoE]:
    """One decoder MoE block as every EP layer starts from it: (router weight [E, H], the experts
    in the run's format in logical layout, the reference layer over them: no EPLB, one process)."""
    router = moe.gate.weight.detach().clone()
    logical_experts = expert_format(cfg.weight_format).from_float(moe.experts.w13.detach(), moe.experts.w2.detach())
    reference = ExpertParallelMoE(TopKRouter.from_weight(router.clone(), cfg.top_k), logical_experts, None,
                                  shared_expert=copy.deepcopy(moe.shared_expert), expert_kernel=cfg.expert_kernel)
    return router, logical_experts, reference


def build_rank_models(cfg: RunConfig, rank: int, ep_size: int, group) -> RankModels:
    """This rank's EP model and its reference, from one seeded decoder (the same on every rank)."""
    device = rank_device(cfg)
    logical = build_reference_model(cfg.model_config(), seed=cfg.seed, device=device)
    reference, model = copy.deepcopy(logical), copy.deepcopy(logical)
    flags = BatchFlags(device)
    rank_layers = []
    for index, block in enumerate(logical.layers):
        moe = block.mlp
        router, logical_experts, reference.layers[index].mlp = logical_layer(moe, cfg)
        key = f"run{rank}.{index}" if cfg.eplb else None
        model.layers[index].mlp, rank_layer = build_ep_layer(
            key, router, logical_experts, cfg.top_k, cfg.num_physical, rank, ep_size, group, flags,
            shared_expert=copy.deepcopy(moe.shared_expert), device=device, expert_kernel=cfg.expert_kernel,
        )
        if rank_layer is not None:
            rank_layers.append(rank_layer)
    # The expert weights are on the device already, so .to() keeps the very tensors the
    # RankLayers' weight views (what upstream's mover writes) name.
    return RankModels(model.to(device).eval(), reference.to(device).eval(), rank_layers, flags)


@dataclass
class RankStack:
    """A rank's models under its controller (None without EPLB), stepped one batch at a time."""

    cfg: RunConfig
    rank: int
    ep_size: int
    models: RankModels
    controller: EplbController | None
    max_abs_diff: list[float] = field(default_factory=list)  # per checked step, against the reference

    @property
    def rank_layers(self) -> list[RankLayer]:
        return self.models.rank_layers

    @property
    def flags(self) -> BatchFlags:
        return self.models.flags

    @torch.no_grad()
    def step(self, batch: Batch, *, is_prefill: bool | None = None, check: bool = True) -> torch.Tensor:
        """One eager forward; EPLB steps (and commits layers) only around it. ``is_prefill``
        overrides the batch's own phase (ranks may disagree on it). A collective that fails
        because a peer is gone raises ``EplbPeerLostError``."""
        controller = self.controller
        try:
            if controller is not None:
                controller.begin_batch(num_unpadded_tokens=batch.num_tokens,
                                       is_prefill=batch.is_prefill if is_prefill is None else is_prefill)
            out = self.models.model(batch.tokens)  # [1, S, V]
            if controller is not None:
                controller.end_batch()
        except RuntimeError as error:  # gloo: a peer's connection closed or timed out
            if controller is None or isinstance(error, EplbWorkerError):
                raise
            raise controller.peer_lost(error) from error
        if check:  # NaN or Inf where the reference is finite reads as an infinite difference
            real = slice(0, batch.num_tokens)
            checked = check_output(out[:, real], self.models.reference(batch.tokens)[:, real], 0.0)
            self.max_abs_diff.append(float("inf") if checked.nonfinite else checked.max_abs_diff)
        return out

    def local_weights_match_placement(self) -> bool:
        """Every local physical slot holds exactly its logical expert's (dequantized) weights."""
        num_local = self.cfg.num_physical // self.ep_size
        mine = slice(self.rank * num_local, (self.rank + 1) * num_local)
        for index, rank_layer in enumerate(self.rank_layers):
            placement = rank_layer.tables.physical_to_logical[mine]
            local = self.models.model.layers[index].mlp.experts.dequantized()
            logical = self.models.reference.layers[index].mlp.experts.dequantized()
            if not all(torch.equal(a, b[placement.to(b.device)]) for a, b in zip(local, logical)):
                return False
        return True

    def close(self) -> None:
        """Ends EPLB on this rank (every rank at the same step, before the groups go)."""
        if self.controller is not None:
            self.controller.close()


def build_rank_stack(cfg: RunConfig, rank: int, ep_size: int, group, **controller_options) -> RankStack:
    """The models and, where ``cfg.eplb``, the controller that binds their load buffers to
    upstream's (before any graph is compiled or captured); ``controller_options``: the rest of
    ``EplbController``'s (``load_phase``, ``transfer_timeout_s``). Window and interval come from
    the current vLLM config (``rank_session``)."""
    models = build_rank_models(cfg, rank, ep_size, group)
    controller = None
    if cfg.eplb:
        keeper = None
        if cfg.placement_file is not None:
            keeper = PlacementKeeper(cfg.placement_file, cfg.placement_identity(), ep_rank=rank, written_by="runtime")
        controller = EplbController(models.rank_layers, device=rank_device(cfg), policy_process=cfg.policy_process,
                                    stall_bound=cfg.stall_bound(), placement_keeper=keeper, **controller_options)
    return RankStack(cfg, rank, ep_size, models, controller)
