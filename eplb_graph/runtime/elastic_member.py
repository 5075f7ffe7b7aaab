"""One member process of an elastic run: serve steps, and resize the group between two of them.

Between every two steps the members of the current generation exchange one small control
all-reduce (MAX over [next generation announced, not ready, give up]), so all of them take
the same decision at the same step -- the bounded form of the two-stage barrier of
upstream's elastic EP: a member that is not ready yet holds the switch for a step, never
the group, and past ``deadline_s`` the resize is given up at once and the group serves on
at its size. A resize:

1. *announced* (the coordinator writes the next generation; rank 0 sees it, the control
   all-reduce tells everyone): each member of the new generation starts building its
   gloo group in a thread, and rank 0, once it is built, sends each joining member the
   non-expert weights and the placement; joining members warm their graphs up alone
   (``ElasticEpGroup.solo``) and say ready in the store;
2. *ready everywhere* (and released, where the coordinator holds the resize while it drains
   requests; or given up, where the drain timed out): scaling down, the departing ranks' experts move to the survivors
   over the old group; then the switch: rank 0 writes the step, every member swaps its
   group slot (the graphs follow: the EP ops resolve the group by name); departing
   members leave; scaling up, the experts are spread over the new ranks over the new group.
   Upstream's async EPLB (``elastic_eplb``) runs between resizes: each generation's is
   drained before the switch, and its recorded load places the experts of the new size;
   the new generation starts its own once they are in place.

Rank 0's write of the switch is the resize's commit point, a compare-and-set against the
coordinator's: a joiner that dies before it makes the coordinator ask rank 0 to give the
resize up (``cancel``, read with the release), and a member of the serving group that dies
makes the coordinator give it up itself, so the two never both win; the other members read
the winner before they switch or leave (``settle_switch``).

No graph is compiled or captured on the serving path: every shape is the maximum size's.

Longer than one reading because the member's three phases (join, serve, switch) share its
state and are read together; what members share and report is ``elastic_spec``'s, recovery
from a dead member ``elastic_recovery``'s.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist

from eplb_graph.runtime.compile import prepare_forward, unique_graphs
from eplb_graph.runtime.elastic_eplb import ElasticEplb, elastic_eplb_session
from eplb_graph.runtime.elastic_group import (
    ElasticEpGroup, ElasticGroupError, Generation, generation_announced, read_generation,
)
from eplb_graph.runtime.elastic_recovery import is_lost_peer, recover, serve_lost_batches
from eplb_graph.runtime.elastic_reshuffle import reshuffle
from eplb_graph.runtime.elastic_spec import (
    ABANDONED, ElasticSpec, MemberResult, ResizeAbandoned, given_up, settle_switch,
)
from eplb_graph.runtime.elastic_stack import build_elastic_models, receive_state, send_state
from eplb_graph.runtime.step import check_output
from eplb_graph.runtime.workload import make_batch


class ElasticMember:
    """``first_generation`` 0: a founding member; an index: a member that joins that generation
    at once; None: a warm spare, which builds and compiles now and joins when assigned one."""

    def __init__(self, member: int, spec: ElasticSpec, first_generation: int | None) -> None:
        self.member, self.spec, self.cfg = member, spec, spec.cfg
        self.store = spec.connect()
        self.group = ElasticEpGroup(spec.name, self.store, member, spec.max_ranks, timeout_s=spec.timeout_s,
                                    connect=spec.connect, eplb_group=spec.cfg.eplb)
        self.result = MemberResult(member)
        self.workload = self.cfg.workload()
        self.pending: tuple[Generation, float] | None = None  # announced, since (monotonic)
        self.released_s: float | None = None  # rank 0: since when the pending resize may switch (not held)
        self.step = 0
        self.reshuffling = False  # inside a resize's weight move: a failure leaves weights unlike the lookups
        self.lost_peer: str | None = None  # a peer lost while joining, recovered from before serving
        founding_rank = None
        if first_generation == 0:
            founding_rank = read_generation(self.store, spec.name, 0, spec.timeout_s).rank_of(member)
        self.models = build_elastic_models(self.cfg, member, founding_rank, spec.max_ranks, spec.name)
        self.forward = prepare_forward(self.models.model, self.cfg, self.models.rank_layers, [])
        self.eplb = ElasticEplb(self.models, self.cfg, timeout_s=spec.timeout_s)
        if first_generation == 0:
            self.group.join(0)
            self._warm_up()
            self.eplb.start(self.group)
            self.next_generation = 1
            return
        with self.group.solo():  # a joiner's graphs exist before it is asked to serve
            self._warm_up()
        if first_generation is None:
            first_generation = self._wait_for_assignment()
        self.join(first_generation)

    def _wait_for_assignment(self) -> int:
        """A spare waits (blocked in the store, no CPU) for the generation it is to join."""
        key = self.spec.key("spare", self.member)
        self.store.wait([key], timedelta(days=1))  # the coordinator writes it, or "stop" at the end
        value = self.store.get(key).decode()
        if value == "stop":
            raise ResizeAbandoned(f"spare member {self.member} was not needed")
        return int(value)

    def join(self, index: int) -> None:
        started = time.monotonic()
        generation = read_generation(self.store, self.spec.name, index, self.spec.timeout_s)
        try:
            switched = self.group.switch_when_built(generation, given_up=lambda: self._abandoned(index),
                                                    after_build=lambda pg: receive_state(self.models, pg, self.spec.timeout_s))
        except ElasticGroupError:  # a group given up under us (a peer gone) is not this member's failure:
            self._wait_for_switch(index)  # rank 0 gives the resize up (bounded): ResizeAbandoned
            raise
        if not switched:
            raise ResizeAbandoned(f"member {self.member}: the resize to generation {index} was given up")
        self.result.join_prepare_s = time.monotonic() - started
        self.store.set(self.spec.key("gen", index, "ready", self.member), "1")
        self.step, old_size = self._wait_for_switch(index)
        try:
            self._after_switch(generation, old_size, self.eplb.logical_load(), joined=True)
        except RuntimeError as error:  # a peer died during the reshuffle: run() recovers first
            if self.spec.expert_source is None or not is_lost_peer(error):
                raise
            self.lost_peer = str(error)

    def _warm_up(self) -> None:
        """One forward per capture size, recording nothing: the graphs exist before serving."""
        sizes = sorted(self.workload.capture_sizes_used())
        self.models.flags.set_(record=False, num_unpadded_tokens=0)
        for size in sizes:
            self.forward(torch.zeros(1, size, dtype=torch.long))
        self.graphs_after_warmup = unique_graphs()

    def _wait_for_switch(self, index: int) -> tuple[int, int]:
        """(the first step at the new size, the old size), once rank 0 switched; bounded."""
        key = self.spec.key("gen", index, "switch")
        try:
            self.store.wait([key], timedelta(seconds=self.spec.deadline_s + self.spec.timeout_s))
        except RuntimeError as error:  # DistStoreError: the wait timed out
            raise ResizeAbandoned(f"member {self.member}: no switch to generation {index} within the deadline") from error
        if self._abandoned(index):
            raise ResizeAbandoned(f"member {self.member}: the resize to generation {index} was given up")
        step, old_size = map(int, self.store.get(key).decode().split(","))
        return step, old_size

    def _abandoned(self, index: int) -> bool:
        return given_up(self.store, self.spec.key("gen", index, "switch"))

    # -- serving -----------------------------------------------------------------------

    def run(self) -> MemberResult:
        if self.lost_peer is not None:
            recover(self, self.lost_peer)
        while self.serving():
            lost_peer = None
            try:
                self._serve_one()
                if not self._between_steps():
                    break
            except RuntimeError as error:
                if self.spec.expert_source is None or not is_lost_peer(error):
                    raise
                lost_peer = str(error)
            if lost_peer is not None:  # outside the handler: its traceback no longer holds the broken group
                recover(self, lost_peer)
        else:
            if self.pending is not None:
                self._give_up("the run ended before the resize could switch")
            self.eplb.stop()  # every member of the last generation, at its last step
        self.result.eplb = self.eplb.summary()
        self.result.recompiles = unique_graphs() - self.graphs_after_warmup
        self.group.leave()
        return self.result

    def serving(self) -> bool:
        return self.step < self.cfg.steps

    def on_leave(self) -> None:
        """This member is not in the generation the group switches to (a serving member hands its
        requests back here)."""

    def serve_what_was_lost(self, broken: Generation, generation: Generation, resume: int) -> int:
        """After a recovery: the batches the failure left unserved (``elastic_recovery``)."""
        return serve_lost_batches(self, broken, generation, resume)

    def _serve_one(self) -> None:
        self.serve_batch(self.step, self.group.rank)
        result = self.result
        result.step_end_s.append(time.monotonic())
        result.step_size.append(self.group.size)
        result.steps.append(self.step)
        self.step += 1
        if self.group.rank == 0:
            self.store.set(self.spec.key("step"), str(self.step))  # the coordinator's clock

    def serve_batch(self, step: int, rank: int, *, size: int | None = None) -> None:
        """One collective forward of request (step, rank): its batch, checked against the reference;
        ``rank`` None: an empty batch beside the others' (a recovery's catch-up step)."""
        batch = make_batch(self.workload, step, 0 if rank is None else rank)
        tokens = batch.tokens if rank is not None else torch.zeros(1, min(self.cfg.capture_sizes), dtype=torch.long)
        num_tokens = batch.num_tokens if rank is not None else 0
        self.eplb.begin_batch(num_unpadded_tokens=num_tokens, is_prefill=batch.is_prefill, record=rank is not None)
        out = self.forward(tokens)
        self._after_forward()
        if rank is None:
            return
        result = self.result
        result.tokens += num_tokens
        # in the store, not only in this process: a member that dies has delivered these
        self.store.append(self.spec.key("served_log", self.member), f"{step}:{rank}:{size or self.group.size};")
        if self.cfg.check_outputs:
            real = slice(0, num_tokens)
            check = check_output(out[:, real], self.models.reference(tokens)[:, real], self.cfg.output_tolerance)
            result.max_abs_diff = max(result.max_abs_diff, check.max_abs_diff)
            result.output_mismatches += not check.ok

    def _after_forward(self) -> None:
        """Upstream's EPLB step; rank 0 tells the coordinator when a rearrangement finished (``/metrics``)."""
        if self.eplb.end_batch() and self.group.rank == 0:
            self.store.add(self.spec.key("eplb", "rearrangements"), 1)
            self.store.set(self.spec.key("eplb", "balancedness"), f"{self.eplb.balancedness():.4f}")

    def _between_steps(self) -> bool:
        """The control all-reduce and what it decides; False: this member left the group."""
        control = torch.zeros(3)  # [announced, not ready, give up]
        rank, why = self.group.rank, None
        if self.pending is None:
            control[0] = rank == 0 and generation_announced(self.store, self.spec.name, self.next_generation)
        else:
            release = self._release() if rank == 0 else "go"
            control[1] = not self._ready() or release == "wait"
            why = self._why_give_up(release)
            control[2] = why is not None
        pg, _, size = self.group.current()
        if pg is not None:
            dist.all_reduce(control, op=dist.ReduceOp.MAX, group=pg)
        if self.pending is None and control[0]:
            self._prepare(read_generation(self.store, self.spec.name, self.next_generation, self.spec.timeout_s))
        elif self.pending is not None and control[2]:
            self._give_up(why or "another member could not build the new group")
        elif self.pending is not None and not control[1]:
            return self._switch()
        return True

    # -- resizing ----------------------------------------------------------------------

    def _joiners(self, generation: Generation) -> list[int]:
        current = set(self.group.generation.members)
        return [member for member in generation.members if member not in current]

    def _prepare(self, generation: Generation) -> None:
        self.pending = (generation, time.monotonic())
        held = self.store.check([self.spec.key("gen", generation.index, "hold")])
        self.released_s = None if held else self.pending[1]
        if self.member not in generation.members:
            return  # departing: nothing to build
        joiner_ranks = [generation.rank_of(m) for m in self._joiners(generation)]

        def send(pg: dist.ProcessGroup) -> None:  # on the standby thread, once the group is built
            for joiner in joiner_ranks:
                self.result.state_bytes_sent += send_state(self.models, pg, joiner)

        self.group.build_standby(generation, after_build=send if self.group.rank == 0 and joiner_ranks else None)

    def _release(self) -> str:
        """Rank 0: "go" once the pending resize may switch, "wait" while the coordinator holds it (a
        drain of requests runs beside the preparation), "abandon" where the coordinator gave it up."""
        if self.released_s is not None:
            return "go"
        generation, _ = self.pending
        key = self.spec.key("gen", generation.index, "release")
        value = self.store.get(key).decode() if self.store.check([key]) else "wait"
        if value == "go":
            self.released_s = time.monotonic()  # the deadline counts from here
        return value

    def _why_give_up(self, release: str) -> str | None:
        """Why the pending resize must be given up, as far as this member sees (rank 0 also reads
        the coordinator's keys and keeps the deadline); None: it may go on."""
        failed = self.group.standby_failed()
        if failed is not None:
            return f"member {self.member} could not build the new group: {failed}"
        if self.group.rank != 0:
            return None
        generation, _ = self.pending
        cancel = self.spec.key("gen", generation.index, "cancel")
        if self.store.check([cancel]):  # the coordinator asks: a joiner died
            return f"member {self.store.get(cancel).decode()} died"
        if release == "abandon":
            return "the drain of requests timed out"
        if release == "go" and time.monotonic() - self.released_s > self.spec.deadline_s:
            late = [m for m in self._joiners(generation)
                    if not self.store.check([self.spec.key("gen", generation.index, "ready", m)])]
            return (f"not ready within the {self.spec.deadline_s:g} s resize deadline"
                    + (f" (members {', '.join(map(str, late))} not ready)" if late else ""))
        return None

    def _ready(self) -> bool:
        generation, _ = self.pending
        if self.member not in generation.members:
            return True
        ready = [self.spec.key("gen", generation.index, "ready", m) for m in self._joiners(generation)]
        return self.group.standby_ready() and (not ready or self.store.check(ready))

    def _give_up(self, why: str) -> None:
        generation, _ = self.pending
        self.group.abandon_standby()
        if self.group.rank == 0:  # the joiners waiting for the switch learn it from the same key
            self.store.set(self.spec.key("gen", generation.index, "why_abandoned"), why)
            self.store.set(self.spec.key("gen", generation.index, "switch"), ABANDONED)
        self.result.abandoned.append(generation.index)
        self.pending, self.next_generation = None, generation.index + 1

    def _switch(self) -> bool:
        generation, announced = self.pending
        old_size, new_size = self.group.size, generation.size
        started = time.monotonic()
        moved = 0
        load = self.eplb.stop()  # upstream's rearrangement in flight ends here, on every member
        if new_size < old_size:  # the departing ranks' experts go to the survivors first, over the old group
            self.reshuffling = True
            moved = reshuffle(self.models.rank_layers, self.group.process_group, old_size, new_size,
                              self.models.num_local, load, timeout_s=self.spec.timeout_s).bytes_moved
            self.reshuffling = False
        # the commit point (after it the coordinator counts the new generation); given up: recover
        settle_switch(self.store, self.spec.key("gen", generation.index, "switch"), f"{self.step},{old_size}",
                      commit=self.group.rank == 0, timeout_s=self.spec.timeout_s)
        self.pending, self.next_generation = None, generation.index + 1
        if self.member not in generation.members:
            self.result.left_at_step = self.step
            self.on_leave()
            return False
        self.group.switch_()
        self._after_switch(generation, old_size, load, started=started, moved=moved)
        return True

    def _after_switch(self, generation: Generation, old_size: int, load: torch.Tensor, *, joined: bool = False,
                      started: float | None = None, moved: int = 0) -> None:
        """``load`` [L, num_logical]: what this member recorded in the old generation (a joiner: nothing)."""
        started = time.monotonic() if started is None else started
        self.next_generation = generation.index + 1
        if generation.size > old_size:  # the new ranks get their experts, over the new group
            self.reshuffling = True
            moved += reshuffle(self.models.rank_layers, self.group.process_group, old_size, generation.size,
                               self.models.num_local, load, timeout_s=self.spec.timeout_s).bytes_moved
            self.reshuffling = False
        self.eplb.start(self.group)
        self.result.resizes.append({
            "generation": generation.index, "old_size": old_size, "new_size": generation.size,
            "first_step": self.step, "joined": joined, "switch_s": time.monotonic() - started, "bytes_moved": moved,
        })


def run_member(member: int, max_ranks: int, store_address: str, spec: ElasticSpec,
               first_generation: int | None) -> dict:
    """A member process's body (``launch._entry`` calls it as a rank function)."""
    torch.set_num_threads(1)
    with torch.no_grad(), elastic_eplb_session(spec.cfg, spec.name, max_ranks):
        try:
            return asdict(ElasticMember(member, spec, first_generation).run())
        except ResizeAbandoned as abandoned:
            return {"member": member, "abandoned_join": str(abandoned)}
