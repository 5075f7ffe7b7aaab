"""A placement file kept by one EP group under upstream's ``EplbState`` (the vLLM plugin, the runtime).

At start, EP rank 0 reads the file and sends what it found to the other ranks over the EP CPU
group (only its node needs the file); every rank checks it against the model it serves (identity
and the bound layers' tables), and the ranks agree before anything moves: a file one rank cannot
use is refused on all of them, and nothing is half-applied. The experts then move to it through
upstream's own rearrangement (``UpstreamBinding.restore``), before the first forward, and the
first rearrangement waits a full interval (upstream starts a fresh state at three quarters of one,
to leave its initial placement early). While serving, EP rank 0 alone hands each fully committed
placement to a background writer (the disk never delays a step), and writes once more at close.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from eplb_graph.core.placement_file import (
    PlacementFileError,
    PlacementIdentity,
    PlacementRecord,
    PlacementWriter,
    check_fits,
    check_writable,
    load,
)
from eplb_graph.upstream import patches
from eplb_graph.upstream.binding import UpstreamBinding

ABSENT, READY, REFUSED = "absent", "ready", "refused"


def from_first_rank(value: object, group: torch.distributed.ProcessGroup | None) -> object:
    """EP rank 0's ``value`` on every rank of ``group`` (pickled over the gloo CPU group)."""
    if group is None or torch.distributed.get_world_size(group) == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=torch.distributed.get_global_rank(group, 0), group=group)
    return box[0]


def gather(problem: str, group: torch.distributed.ProcessGroup | None) -> list[str]:
    """Every rank's ``problem`` ("" for none), in EP rank order."""
    if group is None or torch.distributed.get_world_size(group) == 1:
        return [problem]
    problems: list = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(problems, problem, group=group)
    return problems


def refusal(problems: list[str]) -> PlacementFileError | None:
    """The one error every rank raises when any rank cannot use the file, naming each."""
    named = [f"EP rank {rank}: {problem}" for rank, problem in enumerate(problems) if problem]
    return PlacementFileError("; ".join(named)) if named else None


class PlacementKeeper:
    """Restores one EP group's experts from a placement file and keeps the file current."""

    def __init__(self, path: str | os.PathLike, identity: PlacementIdentity, *, ep_rank: int, written_by: str) -> None:
        self.path = Path(path)
        self.identity = identity
        self.ep_rank = ep_rank
        self.written_by = written_by
        self.restored: PlacementRecord | None = None
        self.submitted_after = 0  # rearrangements finished when the last record was handed to the writer
        # upstream assigns last_expert_load anew when a rearrangement starts, which may be the step
        # that finishes the previous one: each window is taken when its rearrangement starts
        self.window_in_flight: torch.Tensor | None = None
        self.window_source: torch.Tensor | None = None  # upstream's tensor it was copied from (a new one per start)
        self.committed_window: torch.Tensor | None = None
        # one writer per EP group: only its directory must take the file (checked in read)
        self.writer = PlacementWriter(self.path) if ep_rank == 0 else None

    def read(self) -> tuple[str, object]:
        """EP rank 0's finding: the file absent, refused (why: also a directory that cannot take
        it), or ready (the record)."""
        try:
            check_writable(self.path)
            if not self.path.exists():
                return ABSENT, None
            record = load(self.path)
            check_fits(record, self.identity, self.path)
        except Exception as error:  # noqa: BLE001  (whatever the file makes us raise, every rank must hear)
            return REFUSED, str(error)
        return READY, record

    def restore(self, binding: UpstreamBinding, eplb_state, group) -> PlacementRecord | None:
        """Every EP rank calls it at start, before the first forward: moves the experts to the file's
        placement (None: no file, a cold start). PlacementFileError, on every rank, before any move."""
        status, found = from_first_rank(self.read() if self.ep_rank == 0 else None, group)
        if status == ABSENT:
            return None
        model_state = next(iter(eplb_state.model_states.values()))  # the served model's (a drafter's after it)
        problem = found if status == REFUSED and self.ep_rank == 0 else ""  # rank 0's finding, named once
        if status == READY:
            try:  # this rank's own identity and tables
                check_fits(found, self.identity, self.path)
                binding.check_placements(model_state, found.physical_to_logical)
            except Exception as error:  # noqa: BLE001  (raised alone, it would leave the others in the gather)
                problem = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
        error = refusal(gather(problem, group))
        if error is not None:
            raise error
        binding.restore(model_state, found.physical_to_logical)
        patches.configure("restore.full_first_interval", 0, on=eplb_state)
        self.restored, self.committed_window = found, found.load_window
        return found

    def snapshot(self, model_state, rearrangements: int, window: torch.Tensor | None) -> PlacementRecord:
        """The committed placement now ([L, P], host), with the window it was computed from."""
        previous = 0 if self.restored is None else self.restored.rearrangements
        return PlacementRecord(self.identity, model_state.physical_to_logical_map.cpu().clone(), window,
                               rearrangements + previous, self.written_by)

    def after_step(self, model_state, rearrangements_finished: int, in_flight: bool) -> None:
        """After each of upstream's steps, on EP rank 0: a rearrangement fully committed since the
        last write is written; one that started takes its window."""
        if self.writer is None:
            return
        if rearrangements_finished > self.submitted_after:
            self.submitted_after = rearrangements_finished
            self.committed_window = self.window_in_flight
            self.writer.submit(self.snapshot(model_state, rearrangements_finished, self.committed_window))
        if in_flight and model_state.last_expert_load is not self.window_source:  # upstream started one
            self.window_source = model_state.last_expert_load
            self.window_in_flight = model_state.last_expert_load.detach().cpu().double().clone()  # [L, N]

    def abandon(self) -> None:
        """Start failed: the writer ends, and the file stays as it was."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def close(self, model_state, rearrangements_finished: int) -> None:
        """At shutdown: the committed placement written once more (each layer as committed so far,
        also mid-rearrangement), unless it is still the one restored; then the writer is flushed."""
        if self.writer is None:
            return
        committed = model_state.physical_to_logical_map.cpu()
        if self.restored is None or not torch.equal(committed, self.restored.physical_to_logical):
            self.writer.submit(self.snapshot(model_state, rearrangements_finished, self.committed_window))
        self.writer.close()
        self.writer = None
