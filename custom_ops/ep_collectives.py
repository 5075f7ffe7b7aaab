"""EP collectives that find their group by name at run time, so a graph survives a resize.

    torch.ops.eplb_graph.ep_all_gather(x [T, C], group: str) -> [max_size * T, C]
    torch.ops.eplb_graph.ep_local_slots(physical_ids [R, K], group: str, num_local: int) -> [R, K]
    torch.ops.eplb_graph.ep_sum_own_rows(parts [max_size * T, ...], group: str) -> [T, ...]
    torch.ops.eplb_graph.ep_all_gatherv(tensors [[counts[rank], ...]], group: str) -> [[sum(counts), ...]]
    torch.ops.eplb_graph.ep_reduce_scatterv(x [sum(counts), ...], rows: SymInt, group: str) -> [rows, ...]

A functional collective in a compiled graph bakes its process group's name and size into
the graph (the all-gather's output shape is size x T), and a layer's EP rank is a Python
int a graph freezes. An elastic EP group changes all three. These ops name a group slot
instead, exactly as ``map_and_record_layer`` names its layer: the slot is resolved when
the op runs, so a compiled or captured graph follows the group the slot holds *now*.
Shapes are fixed at the slot's maximum size: the gather fills the rows of ranks that are
not members with zeros, and ``ep_local_slots`` gives those rows no local expert, so their
contributions are exactly zero and the sum over the members is the sum over all ranks.

Each op runs one blocking collective on the slot's gloo group (never several in flight).

The two ``v`` ops serve vLLM's data-parallel MoE dispatch on CPU, whose ranks hold different
token counts. The counts are the slot's (``TokenCountSlot.token_counts``), read when the op runs,
never an argument: a list argument would freeze the group's size into the graph (its length)
and with it the gathered length. The gather's fake gives every tensor gathered together one
fresh data-dependent length, so a graph can prove the gathered hidden states and top-k ids have
as many rows (traced collectives built per tensor could not), and the reduce-scatter returns
``rows``, the caller's own token count, a symbol the graph already holds. Gloo gathers equal
chunks, so each rank's rows travel padded to the most any rank holds.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
import torch.distributed as dist

EP_ALL_GATHER_SCHEMA = "ep_all_gather(Tensor x, str group) -> Tensor"
EP_LOCAL_SLOTS_SCHEMA = "ep_local_slots(Tensor physical_ids, str group, int num_local) -> Tensor"
EP_SUM_OWN_ROWS_SCHEMA = "ep_sum_own_rows(Tensor parts, str group) -> Tensor"
EP_ALL_GATHERV_SCHEMA = "ep_all_gatherv(Tensor[] tensors, str group) -> Tensor[]"
EP_REDUCE_SCATTERV_SCHEMA = "ep_reduce_scatterv(Tensor x, SymInt rows, str group) -> Tensor"


class EpGroupSlot(Protocol):
    """What the ops need of a group slot (``runtime.elastic.group.ElasticEpGroup``)."""

    max_size: int  # fixed for the slot's life: every graph's shapes are sized by it

    def current(self) -> tuple[dist.ProcessGroup | None, int, int]:
        """(process group, this process's rank in it, its size) now. The group is None for a group of
        one, or, for the ``v`` ops' slots, a rank that runs alone while the others serve (vLLM's new
        engine compiling before it joins): they then communicate nothing, every other member's rows
        taken as zeros."""
        ...


class TokenCountSlot(EpGroupSlot, Protocol):
    """A slot whose ranks hold different token counts in each step (the ``v`` ops' slots)."""

    def token_counts(self) -> list[int]:
        """Each member's token rows in the step under way, in rank order."""
        ...


class EpGroupRegistry:
    """Group name -> live slot, held weakly: a graph that names a slot gone fails clearly."""

    def __init__(self) -> None:
        self._slots: dict[str, weakref.ReferenceType] = {}

    def register(self, name: str, slot: EpGroupSlot) -> None:
        existing = self._slots.get(name)
        if existing is not None and existing() is not None and existing() is not slot:
            raise ValueError(f"EP group name {name!r} is already registered to another group")
        self._slots[name] = weakref.ref(slot)

    def unregister(self, name: str) -> None:
        self._slots.pop(name, None)

    def resolve(self, name: str) -> EpGroupSlot:
        ref = self._slots.get(name)
        slot = ref() if ref is not None else None
        if slot is None:
            raise KeyError(f"no live EP group named {name!r} (known: {sorted(self._slots)[:8]})")
        return slot


# The ops find slots from a string, so the index is process-wide, as the registrations are.
EP_GROUPS = EpGroupRegistry()


def ep_all_gather(x: torch.Tensor, group: str) -> torch.Tensor:
    slot = EP_GROUPS.resolve(group)
    pg, _, size = slot.current()
    rows = x.shape[0]
    out = x.new_zeros((slot.max_size * rows, *x.shape[1:]))  # [max_size * T, C]
    if pg is None:
        out[:rows] = x
    else:
        dist.all_gather(list(out[: size * rows].chunk(size)), x.contiguous(), group=pg)
    return out


def ep_all_gather_fake(x: torch.Tensor, group: str) -> torch.Tensor:
    return x.new_empty((EP_GROUPS.resolve(group).max_size * x.shape[0], *x.shape[1:]))


def ep_local_slots(physical_ids: torch.Tensor, group: str, num_local: int) -> torch.Tensor:
    """Each (row, k)'s slot among this rank's ``num_local`` experts, or -1: hosted elsewhere,
    or a row of a rank that is not a member (the gather's zero padding)."""
    slot = EP_GROUPS.resolve(group)
    _, rank, size = slot.current()
    rows_per_rank = physical_ids.shape[0] // slot.max_size
    local = physical_ids - rank * num_local  # [R, K]
    member_row = torch.arange(physical_ids.shape[0], device=physical_ids.device) < size * rows_per_rank  # [R]
    mine = (local >= 0) & (local < num_local) & member_row.unsqueeze(1)
    return torch.where(mine, local, torch.full_like(local, -1))


def ep_local_slots_fake(physical_ids: torch.Tensor, group: str, num_local: int) -> torch.Tensor:
    EP_GROUPS.resolve(group)  # a graph naming no live group fails when it is built
    return torch.empty_like(physical_ids)


def ep_sum_own_rows(parts: torch.Tensor, group: str) -> torch.Tensor:
    """The members' sum of ``parts`` [max_size * T, ...], this rank's T rows of it."""
    slot = EP_GROUPS.resolve(group)
    pg, rank, _ = slot.current()
    rows = parts.shape[0] // slot.max_size
    return summed_rows(parts, pg, rank * rows, rows)


def summed_rows(parts: torch.Tensor, pg: dist.ProcessGroup | None, start: int, rows: int) -> torch.Tensor:
    """The group's sum of ``parts``, its ``rows`` rows from ``start`` (one all-reduce: gloo's
    reduce-scatter takes equal chunks only)."""
    total = parts.contiguous().clone()
    if pg is not None:
        dist.all_reduce(total, group=pg)
    return total[start : start + rows].clone()


def ep_sum_own_rows_fake(parts: torch.Tensor, group: str) -> torch.Tensor:
    rows = parts.shape[0] // EP_GROUPS.resolve(group).max_size
    return parts.new_empty((rows, *parts.shape[1:]))


def step_counts(group: str) -> tuple[dist.ProcessGroup | None, int, list[int]]:
    """The slot's group, this rank and every member's token count now, checked against each other."""
    slot = EP_GROUPS.resolve(group)
    if not hasattr(slot, "token_counts"):
        raise RuntimeError(f"group {group!r} keeps no token counts: the variable-size ops need a TokenCountSlot")
    pg, rank, size = slot.current()
    counts = [int(count) for count in slot.token_counts()]
    if len(counts) != size:
        raise RuntimeError(f"group {group!r}: token counts {counts} must name each of its {size} members")
    if any(count < 0 for count in counts) or (size > 1 and min(counts) < 1):
        raise RuntimeError(f"group {group!r}: token counts {counts}: none negative, and one row at least on each "
                           f"member of a group of several (what a traced gather assumes)")
    return pg, rank, counts


def ep_all_gatherv(tensors: list[torch.Tensor], group: str) -> list[torch.Tensor]:
    """Each tensor's rows from every member, in rank order: [counts[rank], ...] -> [sum(counts), ...]."""
    pg, rank, counts = step_counts(group)
    gathered = []
    for x in tensors:
        if x.shape[0] != counts[rank]:
            raise RuntimeError(f"group {group!r}: rank {rank} holds {x.shape[0]} rows, but the step's token "
                               f"counts {counts} say {counts[rank]}")
        if pg is None:  # alone: the other members' rows are zeros (a rank warming up alone, see current())
            alone = x.new_zeros((sum(counts), *x.shape[1:]))  # [sum(counts), ...]
            alone[sum(counts[:rank]) : sum(counts[: rank + 1])] = x
            gathered.append(alone)
            continue
        padded = x.new_zeros((max(counts), *x.shape[1:]))  # [max(counts), ...]
        padded[: x.shape[0]] = x
        chunks = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(chunks, padded, group=pg)
        gathered.append(torch.cat([chunk[:rows] for chunk, rows in zip(chunks, counts)]))
    return gathered


def ep_all_gatherv_fake(tensors: list[torch.Tensor], group: str) -> list[torch.Tensor]:
    slot = EP_GROUPS.resolve(group)
    several = slot.max_size > 1
    total = torch.library.get_ctx().new_dynamic_size(min=1 if several else 0)  # sum(counts) in that step
    if several:  # vLLM runs every DP rank's step with a token or more (checked when it runs: step_counts),
        # so the gathered batch is neither empty nor this rank's own, and a graph can tell; said as
        # "not equal", since "more" would meet the traced batch's assumed size of 2 or more in the
        # graph's checks. A group of several stays several (vLLM's elastic EP keeps DP >= 2)
        torch._check(total != tensors[0].shape[0])
    return [x.new_empty((total, *x.shape[1:])) for x in tensors]


def ep_reduce_scatterv(x: torch.Tensor, rows: int, group: str) -> torch.Tensor:
    """The members' sum of ``x`` [sum(counts), ...], this rank's ``rows`` (= ``counts[rank]``) rows of it."""
    pg, rank, counts = step_counts(group)
    if x.shape[0] != sum(counts) or rows != counts[rank]:
        raise RuntimeError(f"group {group!r}: reduce_scatterv of {x.shape[0]} rows to {rows}, but the step's "
                           f"token counts {counts} sum to {sum(counts)} and give rank {rank} {counts[rank]}")
    return summed_rows(x, pg, sum(counts[:rank]), rows)


def ep_reduce_scatterv_fake(x: torch.Tensor, rows: int, group: str) -> torch.Tensor:
    EP_GROUPS.resolve(group)
    return x.new_empty((rows, *x.shape[1:]))


def register(lib: torch.library.Library, namespace: str) -> None:
    """The ops, one kernel for every device: each calls the slot's own process group."""
    for schema, name, kernel, fake in (
        (EP_ALL_GATHER_SCHEMA, "ep_all_gather", ep_all_gather, ep_all_gather_fake),
        (EP_LOCAL_SLOTS_SCHEMA, "ep_local_slots", ep_local_slots, ep_local_slots_fake),
        (EP_SUM_OWN_ROWS_SCHEMA, "ep_sum_own_rows", ep_sum_own_rows, ep_sum_own_rows_fake),
        (EP_ALL_GATHERV_SCHEMA, "ep_all_gatherv", ep_all_gatherv, ep_all_gatherv_fake),
        (EP_REDUCE_SCATTERV_SCHEMA, "ep_reduce_scatterv", ep_reduce_scatterv, ep_reduce_scatterv_fake),
    ):
        lib.define(schema)
        lib.impl(name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{namespace}::{name}", fake, lib=lib)
