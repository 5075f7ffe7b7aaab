"""What a member does at the transitions ``member.py`` decides: prepare, give up, switch, recover.

A mixin of ``ElasticMember`` (its state is the member's: ``pending``, ``step``, the group, the
models, upstream's EPLB). A switch moves the departing ranks' experts first (scaling down),
waits in one more all-reduce for every member to be past its step and its weight move, meets
the others at the commit point (``Board.commit``; the first writer of a generation's outcome
wins), then swaps the group slot -- the graphs follow: the EP ops resolve the group by name --
and spreads the experts over the new ranks (scaling up). A recovery goes into the generation
the coordinator announces for the broken one, dropping the broken group only then; where none
comes within the bound, the failure was the member's own and it fails.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from eplb_reference.elastic.member import Act, RecoveryView, after_commit, decide_recovery
from eplb_reference.elastic.protocol import Generation, Phase, Switched
from eplb_reference.elastic.recovery import LostPeer, Recovered, recover_into, recovery_record
from eplb_reference.elastic.reshuffle import reshuffle
from eplb_reference.elastic.stack import send_state

log = logging.getLogger("eplb_graph.elastic.member")
POLL_S = 0.05  # how often a member not stepping looks at the store (a timed-out store wait warns each time)


def failure_text() -> str:
    """The exception being handled, as text, with its frames' locals cleared: nothing it raised
    through (a collective's process group among them) is kept alive by it, so a broken group
    closes its connections as soon as the member drops it."""
    text = traceback.format_exc()
    traceback.clear_frames(sys.exc_info()[2])
    return text


@dataclass
class Pending:
    generation: Generation
    held: bool  # a drain holds it until the coordinator releases it
    since_s: float  # the deadline counts from here: the announcement, or the release of a held resize


class MemberTransitions:
    """The transitions, on ``ElasticMember``'s state (``member_process.py`` sets every attribute used)."""

    def _prepare(self, generation: Generation) -> None:
        held = self.board.held(generation.index)
        self.pending = Pending(generation, held, time.monotonic())
        self.alive.set_phase(Phase.PREPARING)
        if self.member not in generation.members:
            return  # departing: nothing to build
        joiner_ranks = [generation.rank_of(m) for m in generation.members if m not in self.group.generation.members]

        def send(pg: dist.ProcessGroup) -> None:  # on the standby thread, once the group is built
            for joiner in joiner_ranks:
                self.result.state_bytes_sent += send_state(self.models, pg, joiner)

        self.group.build_standby(generation, after_build=send if self.group.rank == 0 and joiner_ranks else None)

    def _give_up(self, why: str) -> None:
        generation = self.pending.generation
        self.group.abandon_standby()
        if self.group.rank == 0:  # written before anyone leaves: the joiners learn it from the same key
            self.board.abandon(generation.index, why)
        log.info("member %d: resize to generation %d %s given up: %s", self.member, generation.index,
                 list(generation.members), why)
        self.result.abandoned.append(generation.index)
        self.pending, self.next_generation = None, generation.index + 1
        self.alive.set_phase(Phase.SERVING)

    def _switch(self) -> bool:
        generation = self.pending.generation
        old_size, new_size = self.group.size, generation.size
        started, moved = time.monotonic(), 0
        with self.alive.waiting():
            load = self.eplb.stop()  # upstream's rearrangement in flight ends here, on every member (lockstep)
            if new_size < old_size:  # the departing ranks' experts go to the survivors first, over the old group
                moved = self._reshuffle(old_size, new_size, load)
            # every member past its step and its weight move before anyone commits: a member that failed
            # on the way never gets here, nobody does, and the group recovers whole from the old generation
            self._all_max([0.0])
            switched = Switched(self.step, old_size)
            if self.group.rank == 0:
                outcome = self.board.commit(generation.index, switched)
            else:  # rank 0 gone before its commit: the coordinator's give-up comes instead
                outcome = self.board.wait_outcome(generation.index, self.spec.timeout_s)
        act = after_commit(outcome, self.member in generation.members)
        self.pending, self.next_generation = None, generation.index + 1
        if act is Act.RECOVER:
            raise LostPeer(f"the resize to generation {generation.index} was given up: {outcome.why}")
        if act is Act.RESUME:  # given up by someone else at the very end: the group serves on at its size
            self.group.abandon_standby()
            if new_size < old_size:  # the experts moved off the departing ranks go back over every rank
                with self.alive.waiting():
                    self._reshuffle(new_size, old_size, self.eplb.logical_load())
            self.result.abandoned.append(generation.index)
            self.eplb.start(self.group)
            self.alive.set_phase(Phase.SERVING)
            return True
        if act is Act.LEAVE:
            self.result.left_at_step = self.step
            self.on_leave()
            return False
        self.group.switch_()
        self._after_switch(generation, old_size, load, started=started, moved=moved)
        return True

    def _reshuffle(self, old_size: int, new_size: int, load: torch.Tensor) -> int:
        self.reshuffling = True
        moved = reshuffle(self.models.rank_layers, self.group.process_group, old_size, new_size,
                          self.models.num_local, load, timeout_s=self.spec.timeout_s,
                          on_collective=self.group.current).bytes_moved  # the keep-alive counts each
        self.reshuffling = False
        return moved

    def _after_switch(self, generation: Generation, old_size: int, load: torch.Tensor, *, joined: bool = False,
                      started: float | None = None, moved: int = 0) -> None:
        """``load`` [L, num_logical]: what this member recorded in the old generation (a joiner: nothing)."""
        started = time.monotonic() if started is None else started
        self.next_generation = generation.index + 1
        self.alive.set_phase(Phase.SERVING)
        if generation.size > old_size:  # the new ranks get their experts, over the new group
            with self.alive.waiting():
                moved += self._reshuffle(old_size, generation.size, load)
        self.eplb.start(self.group)
        self.result.resizes.append({
            "generation": generation.index, "old_size": old_size, "new_size": generation.size,
            "first_step": self.step, "joined": joined, "switch_s": time.monotonic() - started, "bytes_moved": moved,
        })

    # -- recovering --------------------------------------------------------------------

    def _recover(self, failure: str) -> None:
        """A step failed: recover into the generation the coordinator announces for the broken one,
        or fail where it announces none within the bound (the failure was this member's own). The
        broken group is dropped only once a recovery is announced: a member whose own failure it
        was leaves its peers whole, to be recovered from as a death once it fails."""
        started = time.monotonic()
        broken = self.group.generation
        self.alive.set_phase(Phase.RECOVERING)
        own = torch.stack([layer.tables.physical_to_logical for layer in self.models.rank_layers])  # [L, width]
        stale, tried, since = self.reshuffling, None, started
        self.group.abandon_standby()
        self.pending, bound = None, self.spec.detection_bound_s
        while True:
            self.alive.mark()
            view = RecoveryView(self.board.recovery_of(broken.index), tried, time.monotonic() - since, bound)
            act = decide_recovery(view)
            if act is Act.FAIL:
                raise RuntimeError(f"member {self.member}: a step failed and no recovery of generation "
                                   f"{broken.index} was announced within {bound:g} s; the failure:\n{failure}")
            if act is Act.WAIT:
                time.sleep(POLL_S)
                continue
            if tried is None:  # a peer was lost: the broken group goes, and a peer inside one of its
                self.eplb.discard()  # collectives fails now, not at its timeout (nothing may keep it alive)
                self.group.abort()
            try:
                recovered = self._recover_into(view.announced, broken, own, stale)
                break
            except Exception:  # another member died meanwhile: the coordinator announces the next
                failure, tried, stale, since = failure_text(), view.announced, True, time.monotonic()
                self.group.abandon_standby()
                self.group.abort()
        self.reshuffling = False
        self.step, self.next_generation = recovered.resume_step, recovered.generation.index + 1
        self.result.recoveries.append(recovery_record(recovered, broken, started))
        self.alive.set_phase(Phase.SERVING)

    def _recover_into(self, index: int, broken: Generation, own: torch.Tensor, stale: bool) -> Recovered:
        with self.alive.waiting():  # its collectives go through the group slot: the keep-alive counts them
            recovered = recover_into(
                self.member, index, broken, own, stale=stale, step=self.step, board=self.board, group=self.group,
                layers=self.models.rank_layers, num_local=self.models.num_local, num_logical=self.cfg.num_experts,
                source=self.spec.expert_source, timeout_s=self.spec.timeout_s, serve_owed=self.serve_owed,
                poll=self.alive.mark)
        self.eplb.start(self.group)
        return recovered
