"""Placements: which logical expert each physical slot holds, checked and inverted.

A placement is upstream vLLM's ``physical_to_logical`` row: [num_physical] logical ids, one
per slot. Everything here is a plain function over placements on the host, in the style of
DeepSeek's ``eplb.py``; ``LayerLookup.refresh_`` and the upstream binding call them at every
layer commit, so they decide with a few numpy reductions and build a message only when a
placement is bad. ``check_expert_layout`` is the one check of an expert configuration
(counts, top-k, ranks), called by every entry point before any table or process exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from eplb_graph.core.layer_lookup import LayerLookup


def check_expert_layout(num_logical: int, num_redundant_experts: int, top_k: int, ranks: int) -> None:
    """Expert counts as a run, a stack or the demo is configured with: ValueError naming what is
    wrong, before any process or table exists."""
    if num_logical < 1:
        raise ValueError(f"experts must be >= 1, got {num_logical}")
    if num_redundant_experts < 0:
        raise ValueError(f"redundant experts must be >= 0, got {num_redundant_experts}")
    if not 0 < top_k <= num_logical:
        raise ValueError(f"top_k must be in [1, {num_logical}], got {top_k}")
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if (num_logical + num_redundant_experts) % ranks:
        raise ValueError(f"{num_logical + num_redundant_experts} physical experts do not divide over {ranks} ranks")


def initial_placement(num_logical_experts: int, num_redundant_experts: int) -> torch.Tensor:
    """[num_physical] int64: every logical expert once, then redundant slots round-robin.

    The same layout as upstream vLLM's ``build_initial_global_physical_to_logical_map``.
    """
    if num_logical_experts <= 0:
        raise ValueError(f"num_logical_experts must be positive, got {num_logical_experts}")
    if num_redundant_experts < 0:
        raise ValueError(f"num_redundant_experts must be >= 0, got {num_redundant_experts}")
    logical = torch.arange(num_logical_experts, dtype=torch.int64)
    redundant = torch.arange(num_redundant_experts, dtype=torch.int64) % num_logical_experts
    return torch.cat([logical, redundant])


def validate_placement(
    physical_to_logical: torch.Tensor,
    num_logical_experts: int,
    num_physical_experts: int,
    max_replicas: int,
    *,
    allow_empty: bool = False,
) -> torch.Tensor:
    """Checks a placement and returns it as a CPU int64 tensor [num_physical].

    Raises ValueError naming the first problem found: wrong rank, dtype or length,
    logical ids out of range, a logical expert with no replica, or more replicas
    than the lookup has slots for. ``allow_empty``: -1 marks a slot that hosts nothing
    (an elastic group's slots on ranks that are not members now). Runs at every layer commit, between two forwards:
    a few numpy reductions decide, and the message is worked out only for a bad one.
    """
    if not isinstance(physical_to_logical, torch.Tensor):
        physical_to_logical = torch.as_tensor(physical_to_logical)
    if physical_to_logical.dtype.is_floating_point or physical_to_logical.dtype.is_complex:
        raise ValueError(f"placement must hold integer logical ids, got dtype {physical_to_logical.dtype}")
    if physical_to_logical.dim() != 1:
        raise ValueError(f"placement must be 1-D [num_physical], got shape {tuple(physical_to_logical.shape)}")
    if physical_to_logical.numel() != num_physical_experts:
        raise ValueError(
            f"placement has {physical_to_logical.numel()} physical slots, expected {num_physical_experts}"
        )
    placement = physical_to_logical.detach().to("cpu", torch.int64)
    ids = placement.numpy()  # [num_physical], a view
    lowest = -1 if allow_empty else 0
    if ids.size and (ids.min() < lowest or ids.max() >= num_logical_experts):
        out_of_range = np.flatnonzero((ids < lowest) | (ids >= num_logical_experts))
        slot = int(out_of_range[0])
        raise ValueError(
            f"placement slot {slot} holds logical id {int(ids[slot])}, outside "
            f"[{lowest}, {num_logical_experts}) ({out_of_range.size} bad slot(s))"
        )
    counts = np.bincount(ids[ids >= 0] if allow_empty else ids, minlength=num_logical_experts)  # [num_logical]
    if counts.min() == 0:
        raise ValueError(f"logical experts {np.flatnonzero(counts == 0)[:8].tolist()} have no replica in the placement")
    if counts.max() > max_replicas:
        expert = int(np.argmax(counts > max_replicas))
        raise ValueError(
            f"logical expert {expert} has {int(counts[expert])} replicas, more than "
            f"max_replicas={max_replicas}"
        )
    return placement


def validate_layer_placements(placements: torch.Tensor, tables: list[LayerLookup]) -> None:
    """Checks a policy's [num_layers, num_physical] output against every layer's tables."""
    if placements.dim() != 2 or placements.shape[0] != len(tables):
        raise ValueError(f"policy returned placements of shape {tuple(placements.shape)}, expected {len(tables)} layers")
    for layer, placement in zip(tables, placements):
        validate_placement(placement, layer.num_logical_experts, layer.num_physical_experts, layer.max_replicas,
                           allow_empty=layer.allow_empty_slots)


def logical_maps(
    physical_to_logical: torch.Tensor, num_logical_experts: int, *, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverts placements: the physical slots of each logical expert, vectorized.

    The contract of upstream vLLM's ``eplb_state.compute_logical_maps`` (which loops over the
    physical slots in Python, on the main thread at every layer commit; ``bench_commit.py``
    times both), so it can stand in for it:

    Args:
        physical_to_logical: [num_physical] or [num_layers, num_physical] integer CPU tensor;
            -1 marks an empty slot (elastic scale-up) and is skipped.
        num_logical_experts: N.
        width: pad each expert's row to this many slots (ValueError if one has more
            replicas); None, as upstream: to the largest replica count present.

    Returns (same dtype as the input, the layer dim only if the input had one):
        logical_to_physical: [num_layers, N, width] slots of each expert in ascending order,
            -1 padded.
        replica_count: [num_layers, N].
    """
    if physical_to_logical.device.type != "cpu":
        raise ValueError(f"placements are inverted on the host, got a tensor on {physical_to_logical.device}")
    if physical_to_logical.dtype.is_floating_point or physical_to_logical.dtype.is_complex:
        raise ValueError(f"placements must hold integer logical ids, got dtype {physical_to_logical.dtype}")
    per_layer = physical_to_logical.dim() == 1
    placements = physical_to_logical.unsqueeze(0) if per_layer else physical_to_logical  # [L, P]
    if placements.dim() != 2:
        shape = tuple(physical_to_logical.shape)
        raise ValueError(f"placements must be [num_physical] or [num_layers, num_physical], got {shape}")
    ids = placements.numpy()  # numpy: a handful of calls on a few hundred ids, where torch's per-op cost would dominate
    if ids.size and ids.max() >= num_logical_experts:
        raise ValueError(f"placement holds logical id {int(ids.max())}, outside [-1, {num_logical_experts})")
    num_layers, num_physical = ids.shape
    # Each slot gets a group: its logical id, or N for an empty slot (written like the others --
    # every index stays in range, no mask -- and dropped at the end). Layer l's groups are
    # offset by l * (N + 1), so one stable sort of the flat groups orders every layer's slots
    # by logical id, ascending slot order within an id.
    group_width = num_logical_experts + 1
    groups = np.where(ids >= 0, ids, num_logical_experts)  # [L, P]
    if num_layers > 1:
        groups = groups + np.arange(0, num_layers * group_width, group_width)[:, None]
    groups = groups.ravel()  # [L * P]
    slots = np.argsort(groups, kind="stable")  # [L * P] flat slot indices, grouped
    sorted_groups = groups[slots]  # [L * P]
    counts = np.bincount(sorted_groups, minlength=num_layers * group_width)  # [L * (N + 1)]
    rank_in_group = np.arange(slots.size) - (np.cumsum(counts) - counts)[sorted_groups]  # [L * P]
    counts = counts.reshape(num_layers, group_width)  # [L, N + 1]
    replica_count = counts[:, :num_logical_experts]  # [L, N]
    max_replicas = int(replica_count.max()) if replica_count.size else 0
    if width is None:
        width = max_replicas
    elif max_replicas > width:
        raise ValueError(f"a logical expert has {max_replicas} replicas, more than width={width}")
    grouped = np.full((num_layers * group_width, max(width, int(counts.max()))), -1, dtype=ids.dtype)
    grouped[sorted_groups, rank_in_group] = slots % num_physical  # flat slot -> slot within its layer
    grouped = grouped.reshape(num_layers, group_width, -1)[:, :num_logical_experts, :width]  # [L, N, width]
    replica_count = replica_count.astype(ids.dtype)  # [L, N], the input's dtype
    if per_layer:  # the layer dim dropped in numpy: a torch squeeze is one more dispatcher call
        grouped, replica_count = grouped[0], replica_count[0]
    return torch.from_numpy(np.ascontiguousarray(grouped)), torch.from_numpy(replica_count)


def rank_loads(load: torch.Tensor, placement: torch.Tensor, ranks: int) -> torch.Tensor:
    """[L, ranks]: the load [L, num_logical] a placement [L, ranks x num_local] puts on each rank,
    each expert's load split evenly over its replicas (an empty slot, -1, holds none)."""
    hosted = placement >= 0
    experts = placement.clamp_min(0).long()
    replicas = torch.stack([torch.bincount(row[ok], minlength=load.shape[1]) for row, ok in zip(experts, hosted)])
    per_slot = torch.gather(load.double(), 1, experts) / torch.gather(replicas, 1, experts).clamp_min(1)  # [L, P]
    return (per_slot * hosted).reshape(placement.shape[0], ranks, -1).sum(-1)


def layer_balancedness(per_rank: torch.Tensor) -> torch.Tensor:
    """[...]: mean / max over ranks (the last dim) of a per-rank load, 1 when balanced; 0 where
    nothing was loaded."""
    per_rank = per_rank.double()
    most = per_rank.max(-1).values
    return torch.where(most > 0, per_rank.mean(-1) / most.clamp_min(torch.finfo(torch.float64).tiny), 0.0)


def build_lookup(
    placement: torch.Tensor, num_logical_experts: int, max_replicas: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Derives the routing tables from a *validated* CPU placement [num_physical].

    Returns:
        lookup: [num_logical, max_replicas] int32, physical slots of each logical expert
            in ascending order (upstream's order), -1 padded.
        replica_count: [num_logical] int32.
    """
    return logical_maps(placement.to(torch.int32), num_logical_experts, width=max_replicas)
