"""One member process of an elastic run: its life, its steps, and what ``member.py`` decides at each.

A founder builds generation 0 with its peers; a joiner warms up alone and joins the generation
it is assigned (a spare waits for one). Each step it reads a ``View`` (rank 0 reads the
coordinator's keys), votes, and one MAX all-reduce gives every member of the serving generation
the same decision; the step's forward runs, then the decision (``member_transitions.py``:
prepare the next generation, give it up, switch). Upstream's async EPLB runs between resizes
(``eplb.py``): drained before a switch, started after it.

A step that raises, whatever raised, makes the member ask the coordinator: a recovery
generation announced for its group means a peer was lost, and the member recovers; none
within the bound means the failure was its own.

No graph is compiled or captured on the serving path: every shape is the maximum size's.
"""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist

from eplb_reference.runtime.compile import prepare_forward, unique_graphs
from eplb_reference.elastic.eplb import ElasticEplb
from eplb_reference.elastic.group import ElasticEpGroup
from eplb_reference.elastic.liveness import KeepAliveThread
from eplb_reference.elastic.member import Act, Control, JoinView, View, decide, decide_join, vote
from eplb_reference.elastic.member_transitions import POLL_S, MemberTransitions, Pending, failure_text
from eplb_reference.elastic.protocol import STOP, Board, Generation, Phase, Release, Switched
from eplb_reference.elastic.spec import ElasticSpec, MemberResult
from eplb_reference.elastic.stack import build_elastic_models, receive_state
from eplb_reference.elastic.store import address_towards


class Leaving(Exception):
    """A joiner or spare leaves without serving (its resize given up, or not needed)."""


class ElasticMember(MemberTransitions):
    """The member's life, resizes and recoveries; what it serves is a subclass's (``scripted_member.py``,
    ``serving.py``). ``first_generation`` 0: a founding member; an index: a member that joins that generation
    at once; None: a warm spare, which builds and compiles now and joins when assigned one
    (``offer``: a spare started from outside the coordinator's process tree offers itself once warm)."""

    def __init__(self, member: int, spec: ElasticSpec, first_generation: int | None, board: Board, *,
                 offer: bool = False) -> None:
        self.member, self.spec, self.cfg, self.board = member, spec, spec.cfg, board
        self.group = ElasticEpGroup(spec.group_name, board, member, spec.max_ranks, timeout_s=spec.timeout_s,
                                    eplb_group=spec.cfg.eplb,
                                    gloo_host=address_towards(spec.store_host, spec.store_port))
        self.alive = KeepAliveThread(board, member, spec.beat_s, self.group.counted).start()
        self.result = MemberResult(member)
        self.pending: Pending | None = None
        self.step, self.next_generation = 0, 1
        self.reshuffling = False  # inside a weight move: a failure leaves weights unlike the lookups
        self.failure: str | None = None  # a step that failed while joining: recovered from before serving
        founding_rank = board.generation(0, spec.timeout_s).rank_of(member) if first_generation == 0 else None
        self.models = build_elastic_models(self.cfg, member, founding_rank, spec.max_ranks, spec.group_name)
        self.forward = prepare_forward(self.models.model, self.cfg, self.models.rank_layers, [])
        self.eplb = ElasticEplb(self.models, self.cfg, timeout_s=spec.timeout_s)
        if first_generation == 0:
            self.group.switch_when_built(board.generation(0, spec.timeout_s), given_up=lambda: False,
                                         poll=self.alive.mark)
            self._warm_up()
            self.eplb.start(self.group)
            self.alive.set_phase(Phase.SERVING)
            return
        with self.group.solo():  # a joiner's graphs exist before it is asked to serve
            self._warm_up()
        if offer:
            self.board.offer(member, socket.gethostname(), os.getpid())
        try:
            self.join(self._wait_for_assignment() if first_generation is None else first_generation)
        except Leaving:
            self.alive.stop()  # not needed, or its resize given up: no keep-alive outlives it
            raise

    def _wait_for_assignment(self) -> int:
        """A warm spare waits for the generation it is to join, as long as the run lasts."""
        self.alive.set_phase(Phase.SPARE)
        while not self.board.stopped():
            value = self.board.assignment(self.member)
            self.alive.mark()
            if value == STOP:
                break
            if value is not None:
                return value
            time.sleep(POLL_S)
        raise Leaving(f"spare member {self.member} was not needed")

    def join(self, index: int) -> None:
        """Builds generation ``index`` beside nothing, takes rank 0's state, says ready, and serves
        once the switch wins; leaves where the resize is given up (by itself past its bound too)."""
        started, said_ready = time.monotonic(), False
        since = started  # the joiner's own bound counts from here (a drain's hold does not count)
        self.alive.set_phase(Phase.JOINING)
        generation = self.board.generation(index, self.spec.timeout_s)
        self.group.build_standby(generation, after_build=lambda pg: receive_state(self.models, pg, self.spec.timeout_s))
        while True:
            self.alive.mark()
            if self.board.held(index) and self.board.release_of(index) is None:
                since = time.monotonic()
            standby = self.group.standby
            error = standby.error if standby.done() else None
            view = JoinView(built=standby.done() and error is None, build_error=None if error is None else str(error),
                            said_ready=said_ready, outcome=self.board.outcome(index),
                            waited_s=time.monotonic() - since, bound_s=self.spec.deadline_s + self.spec.timeout_s)
            act, outcome = decide_join(view), view.outcome
            if act is Act.SAY_READY:
                self.board.say_ready(index, self.member)
                said_ready, self.result.join_prepare_s = True, time.monotonic() - started
            elif act is Act.GIVE_UP:  # a compare-and-set: the switch, where it won, still counts this member in
                why = view.build_error or f"no switch within {view.bound_s:g} s"
                outcome = self.board.abandon(index, f"member {self.member} gave up joining: {why}")
                act = Act.SWITCHED if isinstance(outcome, Switched) else Act.LEAVE
            elif act is Act.WAIT:
                time.sleep(POLL_S)
            if act is Act.LEAVE:
                self.group.abandon_standby()
                raise Leaving(f"member {self.member}: the resize to generation {index} was given up")
            if act is Act.SWITCHED:
                break
        self.group.switch_()
        self.step = outcome.first_step
        try:
            self._after_switch(generation, outcome.old_size, self.eplb.logical_load(), joined=True)
        except Exception:  # a peer died during the reshuffle: run() recovers first
            self.failure = failure_text()

    # -- serving -----------------------------------------------------------------------

    def run(self) -> MemberResult:
        failure, self.failure = self.failure, None
        while True:
            if failure is not None:  # outside the handler: its traceback no longer holds the broken group
                self._recover(failure)
                failure = None
            try:
                if not self._one_step():
                    break
            except Exception:
                failure = failure_text()
        self.result.eplb = self.eplb.summary()
        self.result.recompiles = unique_graphs() - self.graphs_after_warmup
        self.group.leave()
        self.alive.stop()  # its keys are the coordinator's to forget once it reports
        self.result.store_values_dropped = dict(self.board.skipped + self.alive.board.skipped)
        return self.result

    def _one_step(self) -> bool:
        """One step and the decision after it; False: this member left the group or the run ended."""
        self.alive.mark()
        started = time.perf_counter()
        view = self._view()
        mine, why = vote(view)
        with self.alive.waiting():
            agreed = Control.from_list(self._all_max(mine.as_list()))
            act = decide(self.pending is not None, agreed)
            if act is not Act.STOP and agreed.work:
                self.record_control((time.perf_counter() - started) * 1e3)  # the reads and the all-reduce
                self.serve_step()
        if act is Act.STOP:
            if self.pending is not None:
                self._give_up(why or "the run ended before the resize could switch")
            with self.alive.waiting():
                self.eplb.stop()  # every member of the last generation, at its last step (lockstep)
            return False
        self.step += 1
        if self.group.rank == 0:
            self.board.publish_step(self.step, self.last_step_ms())
        if act is Act.PREPARE:
            self._prepare(self.board.generation(self.next_generation, self.spec.timeout_s))
        elif act is Act.GIVE_UP:
            self._give_up(why or "another member gave it up")
        elif act is Act.SWITCH:
            return self._switch()
        return True

    def _all_max(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values)
        pg, _, _ = self.group.current()
        if pg is not None:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=pg)
        return tensor.tolist()

    def _view(self) -> View:
        rank, pending = self.group.rank, self.pending
        common = {"rank": rank, "stop": self.should_stop(), "work": self.has_work()}
        if pending is None:
            return View(announced=rank == 0 and self.board.announced(self.next_generation), **common)
        generation, standby = pending.generation, self.group.standby
        error = standby.error if standby is not None and standby.done() else None
        mine = {"pending": generation.index, "in_pending": self.member in generation.members,
                "standby_built": standby is not None and standby.done() and error is None,
                "standby_error": None if error is None else str(error)}
        if rank != 0:
            return View(**mine, **common)
        release = self.board.release_of(generation.index) if pending.held else None
        if release is Release.GO and pending.held:
            pending.held, pending.since_s = False, time.monotonic()  # the deadline counts from the release
        joiners = [m for m in generation.members if m not in self.group.generation.members]
        return View(**mine, **common, outcome=self.board.outcome(generation.index), held=pending.held,
                    release=release, not_ready=tuple(self.board.not_ready(generation.index, joiners)),
                    released_for_s=0.0 if pending.held else time.monotonic() - pending.since_s,
                    deadline_s=self.spec.deadline_s)

    # -- what the scripted workload and the server do differently (scripted_member.py, serving.py) ----

    def _warm_up(self) -> None:
        """One forward of every shape the member serves, recording nothing: the graphs exist before
        serving; sets ``graphs_after_warmup``."""
        raise NotImplementedError

    def should_stop(self) -> bool:
        raise NotImplementedError

    def has_work(self) -> bool:
        raise NotImplementedError

    def serve_step(self) -> None:
        """This step's forward (every member of the generation runs one)."""
        raise NotImplementedError

    def serve_owed(self, broken: Generation, generation: Generation, resume: int) -> int:
        """After a recovery, what the failure left unserved; returns how many batches."""
        raise NotImplementedError

    def last_step_ms(self) -> float | None:
        return None

    def record_control(self, ms: float) -> None:
        """A step's control time (its store reads and the control all-reduce)."""
        self.result.control_ms.append(ms)
        self.result.steps_served += 1

    def on_leave(self) -> None:
        """This member is not in the generation the group switched to (a server's hands its requests back)."""

    def after_forward(self) -> None:
        """Upstream's EPLB step; rank 0 tells the coordinator when a rearrangement finished (``/metrics``)."""
        if self.eplb.end_batch() and self.group.rank == 0:
            self.board.count_rearrangement(self.eplb.balancedness())
