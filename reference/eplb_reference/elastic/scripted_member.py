"""A member of the scripted run (``run --scale-plan``): the runtime's workload, one batch per rank per step.

Every member of a generation serves batch (step, its rank) at each step, checked against the
one-process reference; each batch it completes is appended to its log in the store, so what a
member that dies had delivered survives it. After a recovery the survivors serve, one each,
the batches nobody completed (``recovery.serve_lost_batches``).
"""

from __future__ import annotations

import time

import torch

from eplb_reference.runtime.compile import unique_graphs
from eplb_reference.elastic.member_process import ElasticMember
from eplb_reference.elastic.protocol import Generation
from eplb_reference.elastic.recovery import serve_lost_batches
from eplb_reference.runtime.step import check_output
from eplb_reference.runtime.workload import make_batch


class ScriptedMember(ElasticMember):
    def _warm_up(self) -> None:
        """One forward per capture size, recording nothing."""
        self.models.flags.set_(record=False, num_unpadded_tokens=0)
        for size in sorted(self.cfg.workload().capture_sizes_used()):
            self.forward(torch.zeros(1, size, dtype=torch.long))
        self.graphs_after_warmup = unique_graphs()

    def should_stop(self) -> bool:
        return self.step >= self.cfg.steps

    def has_work(self) -> bool:
        return True

    def serve_step(self) -> None:
        self.serve_batch(self.step, self.group.rank)
        self.result.step_end_s.append(time.monotonic())
        self.result.step_size.append(self.group.size)
        self.result.steps.append(self.step)

    def serve_owed(self, broken: Generation, generation: Generation, resume: int) -> int:
        return serve_lost_batches(self.board, self.member, self.group, broken, generation, self.step, resume,
                                  lambda step, rank, size: self.serve_batch(step, rank, size=size))

    def serve_batch(self, step: int, rank: int | None, *, size: int | None = None) -> None:
        """One collective forward of request (step, rank): its batch, checked against the reference;
        ``rank`` None: an empty batch beside the others' (a recovery's catch-up step)."""
        batch = make_batch(self.cfg.workload(), step, 0 if rank is None else rank)
        tokens = batch.tokens if rank is not None else torch.zeros(1, min(self.cfg.capture_sizes), dtype=torch.long)
        num_tokens = batch.num_tokens if rank is not None else 0
        self.eplb.begin_batch(num_unpadded_tokens=num_tokens, is_prefill=batch.is_prefill, record=rank is not None)
        out = self.forward(tokens)
        self.after_forward()
        if rank is None:
            return
        self.result.tokens += num_tokens
        self.board.served(self.member, step, rank, size or self.group.size)  # a member that dies delivered these
        if self.cfg.check_outputs:
            real = slice(0, num_tokens)
            check = check_output(out[:, real], self.models.reference(tokens)[:, real], self.cfg.output_tolerance)
            self.result.max_abs_diff = max(self.result.max_abs_diff, check.max_abs_diff)
            self.result.output_mismatches += not check.ok
