"""The EPLB reshuffle of a resize: upstream's policy for the new size, upstream's weight move.

Scaling up, it runs after the switch, over the new group: the new ranks' slots were empty
(-1), the policy spreads the experts over every rank, and upstream's
``rearrange_expert_weights_inplace`` with a ``rank_mapping`` sends each joining rank its
experts. Scaling down, it runs before the switch, over the old group: the departing ranks'
experts move to the survivors before those processes go. Either way the weights move
first (every layer, every byte arrived) and only then does each lookup route by the new
placement, so no forward between two steps ever sees a placement its weights do not hold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from eplb_graph.movement.mover import GlooStagedCommunicator
from eplb_reference.runtime.controller import RankLayer


@dataclass
class Reshuffle:
    old_size: int
    new_size: int
    bytes_moved: int  # by this rank: sent + received
    placement_changes: int  # layers whose placement changed


def check_new_size(new_size: int, num_logical: int, num_local: int, max_size: int) -> None:
    """ValueError naming why a group cannot have ``new_size`` ranks."""
    if isinstance(new_size, bool) or not isinstance(new_size, int) or new_size < 1:
        raise ValueError(f"new EP size must be a positive integer, got {new_size!r}")
    if new_size > max_size:
        raise ValueError(f"cannot scale to {new_size} ranks: the group's maximum (--max-ranks) is {max_size}")
    if new_size * num_local < num_logical:
        raise ValueError(f"cannot scale to {new_size} ranks: {new_size} x {num_local} expert slots cannot host "
                         f"{num_logical} logical experts (at least {-(-num_logical // num_local)} ranks)")


def global_logical_load(load: torch.Tensor, pg: dist.ProcessGroup | None) -> torch.Tensor:
    """[L, num_logical] every rank's ``load`` [L, num_logical], summed over ranks."""
    load = load.to(torch.int64).clone()
    if pg is not None:
        dist.all_reduce(load, group=pg)
    return load


def from_rank_0(tensor: torch.Tensor, rank: int, pg: dist.ProcessGroup | None) -> torch.Tensor:
    """Rank 0's ``tensor`` (integers >= -1) on every rank: a sum where the others contribute zeros."""
    shifted = tensor + 1 if rank == 0 else torch.zeros_like(tensor)
    if pg is not None:
        dist.all_reduce(shifted, op=dist.ReduceOp.SUM, group=pg)
    return shifted - 1


def new_placement(load: torch.Tensor, num_local: int, new_size: int) -> torch.Tensor:
    """[L, num_local x new_size] upstream's default policy for ``new_size`` ranks on one node."""
    from vllm.distributed.eplb.policy import DefaultEplbPolicy

    # one token more per expert: a group that recorded nothing yet still spreads every expert
    phy2log = DefaultEplbPolicy.rebalance_experts(load.float() + 1.0, num_local * new_size, 1, 1, new_size)
    return torch.as_tensor(phy2log, dtype=torch.int64)


def reshuffle(layers: list[RankLayer], pg: dist.ProcessGroup | None, old_size: int, new_size: int,
              num_local: int, load: torch.Tensor, *, timeout_s: float = 60.0,
              on_collective: Callable[[], object] = lambda: None) -> Reshuffle:
    """Moves experts for a resize old_size -> new_size over ``pg`` (the new group scaling up,
    the old one scaling down), placed by this rank's ``load`` [L, num_logical] summed over the
    ranks (a joiner's is zeros), then routes every layer by the new placement. ``on_collective``:
    as each of its collectives starts (a layer's exchange is one), every rank the same."""
    from vllm.distributed.eplb.rebalance_execute import rearrange_expert_weights_inplace

    if pg is None:  # one rank before and after: nothing to move, and no policy run needed
        return Reshuffle(old_size, new_size, 0, 0)
    width = layers[0].tables.num_physical_experts  # num_local x max size: the tables' fixed width
    # [L, width] rank 0's: a joiner's copy dates from its prepare, and EPLB committed layers since
    on_collective()
    old = from_rank_0(torch.stack([layer.tables.physical_to_logical for layer in layers]), pg.rank(), pg)
    on_collective()
    new = new_placement(global_logical_load(load, pg), num_local, new_size)  # [L, num_local x new_size]
    communicator = GlooStagedCommunicator(pg, timeout_s=timeout_s, on_execute=on_collective)
    if new_size >= old_size:  # scale up: old ranks keep their numbers, the new ones start empty
        rank_mapping = {r: r for r in range(old_size)}
    else:  # scale down: the last ranks leave
        rank_mapping = {r: (r if r < new_size else -1) for r in range(old_size)}
    buffers = [torch.empty_like(t) for t in layers[0].weight_view]
    # upstream reads the direction from the group's size: the new group's scaling up, the old one's down
    rearrange_expert_weights_inplace(
        old[:, : num_local * old_size], new, [layer.weight_view for layer in layers], buffers, pg,
        communicator, rank_mapping=rank_mapping if new_size != old_size else None)
    moved = communicator.bytes_sent + communicator.bytes_received
    padded = torch.full((len(layers), width), -1, dtype=torch.int64)
    padded[:, : new.shape[1]] = new
    changes = sum(layer.commit_placement_(placement) for layer, placement in zip(layers, padded))
    for layer in layers:
        layer.tables.reset_load_()
    return Reshuffle(old_size, new_size, moved, changes)

