"""Surviving a dead member: the survivors' placement without it, its lost experts back from disk.

When a member dies (SIGKILL: no goodbye) the survivors' next collective fails at once
(gloo sees the connection reset; a member that hangs instead is bounded by the group's
timeout). The coordinator announces a recovery generation of the survivors, who build its
group and keep every expert they hold where it is: each survivor's slots move, whole, to
its new rank. Experts that had a replica on a survivor keep serving from it; an expert
whose every replica died takes over the slot of the expert with the most replicas left,
and that slot is loaded from the model's weight source on disk (``save_expert_source``),
not from a peer. The dead member's in-flight batches are then served by the survivors.
"""

from __future__ import annotations

import copy
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from eplb_graph.models.reference import build_reference_model
from eplb_graph.runtime.config import RunConfig
from eplb_graph.runtime.controller import RankLayer
from eplb_graph.runtime.elastic_group import ElasticGroupError, read_generation
from eplb_graph.runtime.elastic_reshuffle import from_rank_0
from eplb_graph.runtime.elastic_spec import LostPeer, given_up, settle_switch
from eplb_graph.runtime.stack import logical_layer


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
        experts = torch.load(source, mmap=True)  # [L][tensors], each [num_logical, ...]
        for layer, slots, row, source_tensors in zip(layers, changed, mine, experts):
            for slot in slots:
                for local, logical in zip(layer.weight_view, source_tensors):
                    local[slot].copy_(logical[int(row[slot])])
                loaded += 1
    for layer, placement in zip(layers, recovered):
        layer.commit_placement_(placement)
        layer.tables.reset_load_()
    return loaded


def is_lost_peer(error: BaseException) -> bool:
    """A gloo collective that failed because a peer is gone (reset, closed, or timed out)."""
    text = str(error)
    return isinstance(error, LostPeer) or isinstance(error, RuntimeError) and any(
        sign in text for sign in ("Connection reset", "Connection closed", "Read error", "Timed out", "timed out"))


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


def recover(member, error: str) -> None:
    """An ``ElasticMember`` after a collective failed on a lost peer: join the survivors' generation
    the coordinator announces, recover the placement, serve what the dead left in flight. Another
    death during the recovery makes the coordinator give that generation up and announce the next:
    the survivors start over from the broken generation's placement, every slot from disk."""
    spec, store, group = member.spec, member.store, member.group
    started = time.monotonic()
    broken = group.generation
    own = torch.stack([layer.tables.physical_to_logical for layer in member.models.rank_layers])  # [L, width]
    stale, index = member.reshuffling, None
    while True:
        member.eplb.discard()  # before the abort: nothing may keep the broken groups alive
        group.abandon_standby()
        group.abort()  # our peers still inside a collective of the broken group fail now, not at its timeout
        member.pending = None
        index = _next_recovery(member, broken, error, after=index)
        try:
            loaded, requeued, resume = _recover_into(member, broken, index, own, stale)
            break
        except RuntimeError as failure:
            if not (is_lost_peer(failure) or isinstance(failure, ElasticGroupError)):
                raise
            error, stale = str(failure), True  # weights may hold the given-up generation's placement
    member.reshuffling = False
    member.step, member.next_generation = resume, index + 1
    member.result.recoveries.append({
        "generation": index, "old_size": broken.size, "new_size": group.size,
        "lost_members": [m for m in broken.members if m not in group.generation.members],
        "experts_reloaded": loaded, "requests_requeued": requeued, "recovery_s": time.monotonic() - started,
        "resume_step": resume,
    })


def _next_recovery(member, broken, error: str, *, after: int | None) -> int:
    """The recovery generation the coordinator announced for ``broken``, once it is not ``after``
    (the one just given up); bounded by the collective timeout."""
    spec, store = member.spec, member.store
    key = spec.key("recovery", broken.index)
    deadline = time.monotonic() + spec.timeout_s
    while time.monotonic() < deadline:
        try:
            store.wait([key], timedelta(seconds=max(0.1, deadline - time.monotonic())))
        except RuntimeError:  # DistStoreError: the wait timed out
            break
        index = int(store.get(key))
        if index != after:
            return index
        time.sleep(0.05)
    raise RuntimeError(f"member {member.member}: a peer was lost ({error}) and no recovery generation "
                       f"came within {spec.timeout_s:.0f} s") from None


def _recover_into(member, broken, index: int, own: torch.Tensor, stale: bool) -> tuple[int, int, int]:
    """One attempt at recovery generation ``index`` from ``own`` [L, width], this member's placement
    in ``broken``; (slots loaded from disk, batches served again, the step serving resumes at)."""
    spec, store, group, cfg = member.spec, member.store, member.group, member.cfg
    switch = spec.key("gen", index, "switch")
    generation = read_generation(store, spec.name, index, spec.timeout_s)
    if not group.switch_when_built(generation, given_up=lambda: given_up(store, switch)):
        raise LostPeer(f"recovery generation {index} was given up: another member died")
    layers, num_local = member.models.rank_layers, member.models.num_local
    # a failure inside a weight move can leave the members' tables a commit apart: all take rank 0's
    placement = from_rank_0(own, group.rank, group.process_group)
    recovered = surviving_placement(placement, [broken.rank_of(m) for m in generation.members], num_local,
                                    cfg.num_experts)
    stale = stale or not torch.equal(own, placement)  # weights unlike the agreed placement
    loaded = reload_lost_experts(layers, recovered, broken.rank_of(member.member), group.rank, num_local,
                                 Path(spec.expert_source), everything=stale)
    resume = _all_max(torch.tensor([member.step]), group.process_group)[0].item()
    requeued = member.serve_what_was_lost(broken, generation, resume)
    member.eplb.start(group)
    settle_switch(store, switch, f"{resume},{broken.size}", commit=group.rank == 0, timeout_s=spec.timeout_s)
    return loaded, requeued, resume


def _all_max(tensor: torch.Tensor, pg) -> torch.Tensor:
    if pg is not None:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=pg)
    return tensor


def served_log(store, key: str) -> list[list[int]]:
    """A member's completed batches, [step, rank, group size] each, as it appended them to the store."""
    if not store.check([key]):
        return []
    return [[int(part) for part in entry.split(":")] for entry in store.get(key).decode().split(";") if entry]


def _last_served(store, key: str, rank: int, size: int) -> int:
    """The last step a member completed as ``rank`` of a group of ``size`` (not a batch it served
    again for a dead peer)."""
    return max((step for step, r, n in served_log(store, key) if (r, n) == (rank, size)), default=-1)


def serve_lost_batches(member, broken, generation, resume: int) -> int:
    """The scripted run's batches nobody completed at the failure, each served by one survivor
    (everyone else serves an empty batch beside it); returns how many."""
    store, spec, group = member.store, member.spec, member.group
    failed = torch.zeros(broken.size, dtype=torch.int64)
    failed[broken.rank_of(member.member)] = member.step < resume
    failed = _all_max(failed, group.process_group)
    dead = [m for m in broken.members if m not in generation.members]
    served = {m: _last_served(store, spec.key("served_log", m), broken.rank_of(m), broken.size) for m in dead}
    switch = spec.key("gen", broken.index, "switch")  # "first step,old size"; generation 0 has none
    first_step = int(store.get(switch).decode().split(",")[0]) if broken.index > 0 else 0
    owed = requeued_requests(served, {m: broken.rank_of(m) for m in dead},
                             torch.nonzero(failed).flatten().tolist(), resume, first_step)
    # a recovery given up under a second death may have served some already (the second dead too)
    done = {(step, rank) for m in broken.members for step, rank, size in served_log(store, spec.key("served_log", m))
            if size == broken.size and step >= first_step}
    requests = [request for request in owed if request not in done]
    for start in range(0, len(requests), generation.size):
        chunk = requests[start : start + generation.size]
        step, rank = chunk[group.rank] if group.rank < len(chunk) else (0, None)
        member.serve_batch(step, rank, size=broken.size)
    return len(requests)
