"""A serving member: greedy generation of queued requests, batched continuously, checked as it goes.

Requests reach a member through its inbox, a queue in the TCP store (``Board.push_request``:
the request id, the prompt and how many tokens to generate): each step the member pops what
arrived since the last one (as many store calls as requests, never a re-read) and fills up to
``rows`` batch rows of ``seq`` tokens. The members' one control all-reduce per step says
whether any of them has work: an idle step skips the forward everywhere. Each row takes its
argmax token; the one-process reference decoder runs the same rows beside it, so a request
whose every token equals the reference's on the same prefix generated exactly the
reference's greedy tokens. A finished request goes to the run's result queue, once. A member
leaving the group hands its unfinished requests back; a member that dies hands nothing back,
and the server re-queues what it had assigned to it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from eplb_reference.runtime.compile import unique_graphs
from eplb_reference.elastic.member_process import ElasticMember
from eplb_reference.elastic.protocol import Board, Generation
from eplb_reference.elastic.spec import ElasticSpec, MemberResult

IDLE_WAIT_S = 0.002  # an idle step's pause, so an idle group does not spin its cores
KEPT_STEPS = 1000  # per-step records a server member keeps: the first ones and the last ones, however long it serves


@dataclass
class Active:
    rid: int
    tokens: list[int]
    remaining: int
    matches_reference: bool = True
    generated: list[int] = field(default_factory=list)


class ServingMember(ElasticMember):
    def __init__(self, member: int, spec: ElasticSpec, first_generation: int | None, board: Board, *,
                 offer: bool = False) -> None:
        self.shape = spec.serve
        self.queue: list[dict] = []
        self.active: list[Active] = []
        self.step_ms: float | None = None
        self.control_last: deque[float] = deque(maxlen=KEPT_STEPS)
        super().__init__(member, spec, first_generation, board, offer=offer)

    def _warm_up(self) -> None:
        self.models.flags.set_(record=False, num_unpadded_tokens=0)
        self.forward(torch.zeros(self.shape.rows, self.shape.seq, dtype=torch.long))
        self.graphs_after_warmup = unique_graphs()

    def should_stop(self) -> bool:
        return self.group.rank == 0 and self.board.stopped()  # the all-reduce tells the others

    def has_work(self) -> bool:
        self.queue.extend(self.board.pop_requests(self.member))
        while self.queue and len(self.active) < self.shape.rows:
            request = self.queue.pop(0)
            self.active.append(Active(request["rid"], list(request["prompt_token_ids"]), request["max_new_tokens"]))
        if not self.active:
            time.sleep(IDLE_WAIT_S)
        return bool(self.active)

    def last_step_ms(self) -> float | None:
        step_ms, self.step_ms = self.step_ms, None
        return step_ms

    def serve_owed(self, broken: Generation, generation: Generation, resume: int) -> int:
        return 0  # the server re-queues a dead member's requests; this member's rows carry on

    def on_leave(self) -> None:
        """Leaving the group (scaled down): every unfinished request goes back to the server."""
        unfinished = [a.rid for a in self.active] + [r["rid"] for r in self.queue]
        self.board.hand_back(self.member, unfinished)
        self.active, self.queue = [], []

    def record_control(self, ms: float) -> None:
        """Memory bounded in the steps served: the first ``KEPT_STEPS`` and the last ones."""
        kept = self.result.control_ms if len(self.result.control_ms) < KEPT_STEPS else self.control_last
        kept.append(ms)
        self.result.steps_served += 1

    def run(self) -> MemberResult:
        result = super().run()
        result.control_ms_last = list(self.control_last)
        return result

    def serve_step(self) -> None:
        started = time.monotonic()
        self._generate_one_token()
        self.step_ms = (time.monotonic() - started) * 1e3

    def _generate_one_token(self) -> None:
        tokens = torch.zeros(self.shape.rows, self.shape.seq, dtype=torch.long)  # [B, S], rows right-padded
        for row, active in enumerate(self.active):
            tokens[row, : len(active.tokens)] = torch.tensor(active.tokens)
        # causal attention: a row's last real position does not see its padding (load records it, though)
        self.eplb.begin_batch(num_unpadded_tokens=tokens.numel(), is_prefill=False)
        logits = self.forward(tokens)  # [B, S, V]
        self.after_forward()
        expected = self.models.reference(tokens) if self.cfg.check_outputs else logits
        finished = []
        for row, active in enumerate(self.active):
            last = len(active.tokens) - 1
            token = int(logits[row, last].argmax())
            active.matches_reference &= token == int(expected[row, last].argmax())
            active.tokens.append(token)
            active.generated.append(token)
            active.remaining -= 1
            if active.remaining == 0:
                finished.append(active)
        for active in finished:
            self.active.remove(active)
            self.result.tokens += len(active.generated)
            self.result.output_mismatches += not active.matches_reference
            self.board.push_result({"rid": active.rid, "token_ids": active.generated,
                                    "matches_reference": active.matches_reference, "member": self.member})
