"""Surviving a dead member: the survivors' placement without it, its lost experts back from disk.

When a member dies (or is fenced: it hung) the survivors' next collective fails. The
coordinator announces a recovery generation of the survivors, who build its group and keep
every expert they hold where it is: each survivor's slots move, whole, to its new rank.
Experts that had a replica on a survivor keep serving from it; an expert whose every replica
died takes over the slot of the expert with the most replicas left, and that slot is loaded
from the model's weight source on disk (``save_expert_source``), not from a peer.

``recover_into`` is one attempt at a recovery generation, on the member's own group, models
and EPLB; it returns what the member then records (``Recovered``). The member decides when
to try, and what a failed attempt means (``member.decide_recovery``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from eplb_reference.models.reference import build_reference_model
from eplb_reference.runtime.config import RunConfig
from eplb_reference.runtime.controller import RankLayer
from eplb_reference.elastic.protocol import Abandoned, Board, Generation, Switched
from eplb_reference.elastic.reshuffle import from_rank_0
from eplb_reference.runtime.stack import logical_layer


class LostPeer(RuntimeError):
    """The serving group lost a member (the commit point, or a recovery, was given up for it)."""


def save_expert_source(cfg: RunConfig, path: Path) -> Path:
    """Every layer's logical experts, in the run's format, as the members' weight source on disk."""
    model = build_reference_model(cfg.model_config(), seed=cfg.seed)
    experts = [[t.clone() for t in logical_layer(copy.deepcopy(block.mlp), cfg)[1].weight_view()]
               for block in model.layers]
    torch.save(experts, path)
    return path


def surviving_placement(placement: torch.Tensor, survivor_ranks: list[int], num_local: int,
                        num_logical: int) -> torch.Tensor:
    """[L, width] the placement over the survivors (their old ranks, in new rank order), -1 padded,
    with every expert that lost all its replicas put in a survivor's empty slot (a joiner's, before
    its experts arrived) or else in place of a replica of the expert that has the most left (the
    lowest such slot: every survivor computes the same)."""
    num_layers = placement.shape[0]
    recovered = torch.full_like(placement, -1)
    for layer in range(num_layers):
        rows = torch.cat([placement[layer, r * num_local : (r + 1) * num_local] for r in survivor_ranks])
        counts = torch.bincount(rows[rows >= 0], minlength=num_logical)
        for expert in torch.nonzero(counts == 0).flatten().tolist():
            empty = torch.nonzero(rows < 0).flatten()
            donor = int(torch.argmax(counts))  # the first expert with the most replicas
            if empty.numel():
                slot = int(empty[0])
            elif counts[donor] >= 2:
                slot = int(torch.nonzero(rows == donor)[0])
                counts[donor] -= 1
            else:
                raise RuntimeError(f"layer {layer}: {len(survivor_ranks)} survivors cannot host expert {expert}")
            rows[slot], counts[expert] = expert, 1
        recovered[layer, : rows.numel()] = rows
    return recovered


def reload_lost_experts(layers: list[RankLayer], recovered: torch.Tensor, old_rank: int, new_rank: int,
                        num_local: int, source: Path, *, everything: bool = False) -> int:
    """Loads this member's slots whose expert changed from ``source`` (``everything``: every hosted
    slot, after a weight move the failure interrupted); routes by ``recovered`` afterwards.
    Returns how many slots were loaded."""
    old = [layer.tables.physical_to_logical[old_rank * num_local : (old_rank + 1) * num_local] for layer in layers]
    mine = recovered[:, new_rank * num_local : (new_rank + 1) * num_local]  # [L, num_local]
    changed = [torch.nonzero((row >= 0) if everything else (row != before)).flatten().tolist()
               for row, before in zip(mine, old)]
    loaded = 0
    if any(changed):
        experts = torch.load(source, mmap=True, weights_only=True)  # [L][tensors], each [num_logical, ...]
        for layer, slots, row, source_tensors in zip(layers, changed, mine, experts):
            for slot in slots:
                for local, logical in zip(layer.weight_view, source_tensors):
                    local[slot].copy_(logical[int(row[slot])])
                loaded += 1
    for layer, placement in zip(layers, recovered):
        layer.commit_placement_(placement)
        layer.tables.reset_load_()
    return loaded


def requeued_requests(dead: dict[int, int], dead_ranks: dict[int, int], failed_ranks: list[int],
                      resume_step: int, first_step: int = 0) -> list[tuple[int, int]]:
    """The (step, rank) requests no survivor completed: the dead members' steps after the last one
    each completed (``dead``: member -> last served step, -1 for none) and from the broken
    generation's ``first_step`` on (a joiner owes nothing from before it), and the step before
    ``resume_step`` of the survivors whose forward failed (``failed_ranks``, old ranks)."""
    requests = {(step, dead_ranks[member]) for member, served in dead.items()
                for step in range(max(served + 1, first_step), resume_step)}
    requests |= {(resume_step - 1, rank) for rank in failed_ranks}
    return sorted(requests)


@dataclass
class Recovered:
    generation: Generation
    experts_reloaded: int
    requests_requeued: int
    resume_step: int


def all_max(tensor: torch.Tensor, pg: dist.ProcessGroup | None) -> torch.Tensor:
    if pg is not None:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=pg)
    return tensor


def recover_into(member: int, index: int, broken: Generation, own: torch.Tensor, *, stale: bool, step: int,
                 board: Board, group, layers: list[RankLayer], num_local: int, num_logical: int, source: Path,
                 timeout_s: float, serve_owed: Callable[[Generation, Generation, int], int],
                 poll: Callable[[], None]) -> Recovered:
    """One attempt at recovery generation ``index`` from ``own`` [L, width], this member's placement
    in ``broken`` (``stale``: its weights may not hold it). Builds the generation's group on ``group``,
    agrees on rank 0's placement, reloads what died, serves what ``serve_owed`` says was lost, and
    meets the others at the generation's commit point. Raises ``LostPeer`` where the coordinator
    gave the generation up (another member died), or whatever a collective raised."""
    generation = board.generation(index, timeout_s)
    given_up = lambda: isinstance(board.outcome(index), Abandoned)  # noqa: E731
    if not group.switch_when_built(generation, given_up=given_up, poll=poll):
        raise LostPeer(f"recovery generation {index} was given up: another member died")
    # a failure inside a weight move can leave the members' tables a commit apart: all take rank 0's
    placement = from_rank_0(own, group.rank, group.current()[0])
    recovered = surviving_placement(placement, [broken.rank_of(m) for m in generation.members], num_local,
                                    num_logical)
    stale = stale or not torch.equal(own, placement)  # weights unlike the agreed placement
    loaded = reload_lost_experts(layers, recovered, broken.rank_of(member), group.rank, num_local, source,
                                 everything=stale)
    resume = int(all_max(torch.tensor([step]), group.current()[0])[0])
    requeued = serve_owed(broken, generation, resume)
    if group.rank == 0:
        outcome = board.commit(index, Switched(resume, broken.size))
    else:
        outcome = board.wait_outcome(index, timeout_s)
    if isinstance(outcome, Abandoned):
        raise LostPeer(f"recovery generation {index} was given up: {outcome.why}")
    return Recovered(generation, loaded, requeued, resume)


def serve_lost_batches(board: Board, member: int, group, broken: Generation, generation: Generation, step: int,
                       resume: int, serve_batch: Callable[[int, int | None, int], None]) -> int:
    """The scripted run's batches nobody completed at the failure, each served by one survivor
    (everyone else serves an empty batch beside it); returns how many."""
    failed = torch.zeros(broken.size, dtype=torch.int64)
    failed[broken.rank_of(member)] = step < resume
    failed = all_max(failed, group.current()[0])
    dead = [m for m in broken.members if m not in generation.members]

    def last_served(m: int) -> int:  # as its rank in the broken generation (not a batch served again for a peer)
        rank = broken.rank_of(m)
        return max((s for s, r, n in board.served_log(m) if (r, n) == (rank, broken.size)), default=-1)

    outcome = board.outcome(broken.index)  # the broken generation's first step; generation 0 has none
    first_step = outcome.first_step if isinstance(outcome, Switched) else 0
    owed = requeued_requests({m: last_served(m) for m in dead}, {m: broken.rank_of(m) for m in dead},
                             torch.nonzero(failed).flatten().tolist(), resume, first_step)
    # a recovery given up under a second death may have served some already (the second dead too)
    done = {(s, r) for m in broken.members for s, r, n in board.served_log(m) if n == broken.size and s >= first_step}
    requests = [request for request in owed if request not in done]
    for start in range(0, len(requests), generation.size):
        chunk = requests[start : start + generation.size]
        owed_step, rank = chunk[group.rank] if group.rank < len(chunk) else (0, None)
        serve_batch(owed_step, rank, broken.size)
    return len(requests)


def recovery_record(recovered: Recovered, broken: Generation, started_s: float) -> dict:
    """What a member reports of one recovery it took part in."""
    return {"generation": recovered.generation.index, "old_size": broken.size, "new_size": recovered.generation.size,
            "lost_members": [m for m in broken.members if m not in recovered.generation.members],
            "experts_reloaded": recovered.experts_reloaded, "requests_requeued": recovered.requests_requeued,
            "recovery_s": time.monotonic() - started_s, "resume_step": recovered.resume_step}
