"""A serving member: greedy generation of queued requests, batched continuously, checked as it goes.

Requests reach a member through the TCP store (``inbox/<member>``: request ids appended by
the server; ``req/<id>``: the prompt and how many tokens to generate). Each step the member
fills up to ``rows`` batch rows of ``seq`` tokens from its queue, every member runs one
collective forward (an idle step skips it everywhere: the members agree first), and each
row takes its argmax token. The one-process reference decoder runs the same rows beside it:
a request whose every token equals the reference's on the same prefix generated exactly the
reference's greedy tokens. A finished request's tokens go to ``res/<id>``. A member leaving
the group hands its unfinished requests back (``returned/<member>``) for the server to
queue elsewhere; a member that dies hands nothing back, and the server re-queues what it
had assigned to it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from eplb_graph.runtime.elastic_eplb import elastic_eplb_session
from eplb_graph.runtime.elastic_member import ElasticMember
from eplb_graph.runtime.elastic_spec import ElasticSpec, ResizeAbandoned

IDLE_WAIT_S = 0.002  # an idle step's pause, so an idle group does not spin its cores


@dataclass(frozen=True)
class ServeShape:
    rows: int = 4  # requests batched per member per step
    seq: int = 16  # prompt + generated tokens per request, at most

    def check(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len < 1 or max_new_tokens < 1:
            raise ValueError(f"a request needs a prompt and at least one new token, got {prompt_len} and "
                             f"{max_new_tokens}")
        if prompt_len + max_new_tokens > self.seq:
            raise ValueError(f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) exceeds the server's "
                             f"{self.seq} tokens per request")


@dataclass
class Active:
    rid: int
    tokens: list[int]
    remaining: int
    matches_reference: bool = True
    generated: list[int] = field(default_factory=list)


class ServingMember(ElasticMember):
    def __init__(self, member: int, spec: ElasticSpec, first_generation: int | None, shape: ServeShape) -> None:
        self.shape = shape
        self.queue: list[int] = []
        self.active: list[Active] = []
        self.inbox_seen = 0
        self.stopped = False
        super().__init__(member, spec, first_generation)

    def _warm_up(self) -> None:
        self.models.flags.set_(record=False, num_unpadded_tokens=0)
        self.forward(torch.zeros(self.shape.rows, self.shape.seq, dtype=torch.long))
        from eplb_graph.runtime.compile import unique_graphs

        self.graphs_after_warmup = unique_graphs()

    def serving(self) -> bool:
        return not self.stopped

    def serve_what_was_lost(self, broken, generation, resume: int) -> int:
        return 0  # the server re-queues a dead member's requests; this member's rows carry on

    def on_leave(self) -> None:
        """Leaving the group (scaled down): every unfinished request goes back to the server."""
        unfinished = [a.rid for a in self.active] + self.queue
        self.store.set(self.spec.key("returned", self.member), json.dumps(unfinished))
        self.active, self.queue = [], []

    # -- one step ----------------------------------------------------------------------

    def _serve_one(self) -> None:
        self._read_inbox()
        self._admit()
        signal = torch.tensor([float(bool(self.active)), float(self.stopped)])
        pg, _, _ = self.group.current()
        if pg is not None:
            dist.all_reduce(signal, op=dist.ReduceOp.MAX, group=pg)
        if signal[1]:  # anyone told to stop: all stop at this step
            self.stopped = True
        elif signal[0]:
            started = time.monotonic()
            self._generate_one_token()
            self.result.step_end_s.append(time.monotonic())
            if self.group.rank == 0:  # the last step's latency, for /metrics
                self.store.set(self.spec.key("step_ms"), f"{(self.result.step_end_s[-1] - started) * 1e3:.3f}")
            self.result.step_size.append(self.group.size)
            self.result.steps.append(self.step)
        else:
            time.sleep(IDLE_WAIT_S)
        self.step += 1
        if self.group.rank == 0:
            self.store.set(self.spec.key("step"), str(self.step))

    def _read_inbox(self) -> None:
        key = self.spec.key("inbox", self.member)
        if self.store.check([self.spec.key("stop")]):
            self.stopped = True
        if not self.store.check([key]):
            return
        entries = [e for e in self.store.get(key).decode().split(";") if e]
        self.queue.extend(int(e) for e in entries[self.inbox_seen:])
        self.inbox_seen = len(entries)

    def _admit(self) -> None:
        while self.queue and len(self.active) < self.shape.rows:
            rid = self.queue.pop(0)
            request = json.loads(self.store.get(self.spec.key("req", rid)))
            self.active.append(Active(rid, list(request["prompt_token_ids"]), request["max_new_tokens"]))

    def _generate_one_token(self) -> None:
        tokens = torch.zeros(self.shape.rows, self.shape.seq, dtype=torch.long)  # [B, S], rows right-padded
        for row, active in enumerate(self.active):
            tokens[row, : len(active.tokens)] = torch.tensor(active.tokens)
        # causal attention: a row's last real position does not see its padding (load records it, though)
        self.eplb.begin_batch(num_unpadded_tokens=tokens.numel(), is_prefill=False)
        logits = self.forward(tokens)  # [B, S, V]
        self._after_forward()
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
            self.store.set(self.spec.key("res", active.rid), json.dumps({
                "token_ids": active.generated, "matches_reference": active.matches_reference,
                "member": self.member}))


def run_serving_member(member: int, max_ranks: int, store_address: str, spec: ElasticSpec,
                       first_generation: int | None, shape: ServeShape) -> dict:
    """A serving member process's body (``launch._entry`` calls it as a rank function)."""
    from dataclasses import asdict

    torch.set_num_threads(1)
    with torch.no_grad(), elastic_eplb_session(spec.cfg, spec.name, max_ranks):
        try:
            return asdict(ServingMember(member, spec, first_generation, shape).run())
        except ResizeAbandoned as abandoned:
            return {"member": member, "abandoned_join": str(abandoned)}
