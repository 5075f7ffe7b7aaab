"""One member's share of the reference decoder in an elastic run, sized for the group's maximum.

Experts per rank stay fixed, as upstream's elastic EP keeps them: ``num_local`` slots on
each rank, ``num_local x max_ranks`` physical slots in every routing table and load buffer
from the start, so no tensor a graph holds is ever reallocated by a resize. Slots of ranks
that are not members hold -1 (nothing routes there). A founding member starts with its
slice of the initial placement; a member that joins later starts with placeholder (zero)
experts and placeholder non-expert weights, and receives both the non-expert weights and
the placement from rank 0 before it serves (``receive_state``).
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
import torch.distributed as dist

from eplb_graph.core.layer_lookup import BatchFlags, LayerLookup
from eplb_reference.models.reference import TopKRouter, build_reference_model
from eplb_graph.core.placement import initial_placement
from eplb_reference.runtime.config import RunConfig
from eplb_reference.runtime.controller import RankLayer
from eplb_reference.runtime.ep_moe import ExpertParallelMoE
from eplb_reference.runtime.stack import logical_layer
from eplb_graph.movement.weight_views import check_weight_view

STATE_TAG = 7  # gloo tag of the state a joining member receives


class ElasticModels(NamedTuple):
    model: torch.nn.Module  # this member's EP model, its layers naming the elastic group
    reference: torch.nn.Module  # the one-process decoder without EPLB: what every output is checked against
    rank_layers: list[RankLayer]
    flags: BatchFlags
    num_local: int  # physical expert slots per rank, fixed for the run
    load: torch.Tensor  # [L, num_local x max_ranks] int32: the layers' load rows, upstream's window reads them


def max_placement(cfg: RunConfig, max_ranks: int) -> torch.Tensor:
    """[num_local x max_ranks] the initial placement over ``cfg.ranks`` ranks, -1 beyond them."""
    num_local = cfg.num_physical // cfg.ranks
    placement = torch.full((num_local * max_ranks,), -1, dtype=torch.int64)
    placement[: cfg.num_physical] = initial_placement(cfg.num_experts, cfg.num_physical - cfg.num_experts)
    return placement


def build_elastic_models(cfg: RunConfig, member: int, founding_rank: int | None, max_ranks: int,
                         group_name: str) -> ElasticModels:
    """``founding_rank``: this member's rank in the first generation, or None for a member that
    joins later (placeholder weights until ``receive_state``)."""
    logical = build_reference_model(cfg.model_config(), seed=cfg.seed)
    reference = copy.deepcopy(logical)
    served = copy.deepcopy(logical) if founding_rank is not None else build_reference_model(
        cfg.model_config(), seed=cfg.seed + 1 + member)  # placeholder non-expert weights
    placement = max_placement(cfg, max_ranks)
    num_local = cfg.num_physical // cfg.ranks
    num_physical = num_local * max_ranks
    flags = BatchFlags("cpu")
    load = torch.zeros(len(logical.layers), num_physical, dtype=torch.int32)  # upstream's load dtype
    rank_layers = []
    for index, block in enumerate(logical.layers):
        _, logical_experts, reference.layers[index].mlp = logical_layer(block.mlp, cfg)
        if founding_rank is None:
            local = type(logical_experts)(*[t.new_zeros((num_local, *t.shape[1:])) for t in logical_experts.weight_view()])
        else:
            slots = placement[founding_rank * num_local : (founding_rank + 1) * num_local]
            local = type(logical_experts)(*[t[slots].clone() for t in logical_experts.weight_view()])
        check_weight_view(local, num_local)
        key = f"elastic{member}.{index}"
        tables = LayerLookup(cfg.num_experts, num_physical, max_replicas=num_physical - cfg.num_experts + 1,
                             placement=placement, allow_empty_slots=True)
        tables.bind_load_(load[index])  # before any graph is built: every generation's controller records here
        rank_layers.append(RankLayer(key, tables, flags, local.weight_view()))
        served_block = served.layers[index].mlp
        served.layers[index].mlp = ExpertParallelMoE(
            TopKRouter.from_weight(served_block.gate.weight.detach().clone(), cfg.top_k), local, key,
            shared_expert=served_block.shared_expert, expert_kernel=cfg.expert_kernel, elastic_group=group_name)
    return ElasticModels(served.eval(), reference.eval(), rank_layers, flags, num_local, load)


def non_expert_tensors(models: ElasticModels) -> list[torch.Tensor]:
    """Every parameter and buffer of the served model but the experts, in a fixed order."""
    experts = {id(t) for layer in models.rank_layers for t in layer.weight_view}
    tensors = list(models.model.parameters()) + list(models.model.buffers())
    return [t for t in tensors if id(t) not in experts]


def send_state(models: ElasticModels, pg: dist.ProcessGroup, to_rank: int) -> int:
    """Rank 0's non-expert weights and every layer's placement to a joining member; bytes sent."""
    placements = torch.stack([layer.tables.physical_to_logical for layer in models.rank_layers])  # [L, P]
    tensors = [placements] + [t.detach() for t in non_expert_tensors(models)]
    for tensor in tensors:
        pg.send([tensor.contiguous()], to_rank, STATE_TAG).wait()
    return sum(t.numel() * t.element_size() for t in tensors)


def receive_state(models: ElasticModels, pg: dist.ProcessGroup, timeout_s: float) -> None:
    """What ``send_state`` sent, into this member's own tensors (the placement into its lookups)."""
    from datetime import timedelta

    placements = torch.empty(len(models.rank_layers), models.rank_layers[0].tables.num_physical_experts,
                             dtype=torch.int64)
    pg.recv([placements], 0, STATE_TAG).wait(timedelta(seconds=timeout_s))
    for tensor in non_expert_tensors(models):
        buffer = torch.empty_like(tensor)
        pg.recv([buffer], 0, STATE_TAG).wait(timedelta(seconds=timeout_s))
        tensor.data.copy_(buffer)
    for layer, placement in zip(models.rank_layers, placements):
        layer.commit_placement_(placement)
