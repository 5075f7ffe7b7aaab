"""The coordinator: the one loop that both ``run --scale-plan`` and ``serve`` drive.

It hosts the run's TCP store, starts the member processes (and adopts members that join
from outside), and at each ``tick`` reads what happened: members that reported or died,
members its ``FailureDetector`` finds hung (fenced: killed, recovered from as a death),
the outcome of the pending resize. It announces generations -- a resize asked for
(``request``), a recovery of the survivors -- and keeps a pool of warm spares, replacing
those that die. Members do the rest between two of their steps (``member_process.py``).

Every event is logged under ``eplb_graph.elastic``, one line each with its generation and
members. ``tick`` returns what a driver acts on: a generation that switched (and the members
that left it), a resize given up, a member lost. (It runs past 300 lines: members, resizes and
recoveries read and write the same records, and are read together.)
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace

from eplb_reference.elastic.liveness import FailureDetector
from eplb_reference.elastic.processes import MemberProcesses
from eplb_reference.elastic.records import HISTORY, Events, Fault, ResizeRequest, trim_oldest
from eplb_reference.elastic.protocol import STOP, Abandoned, Board, Generation, Release, RunSecret, Switched
from eplb_reference.elastic.reshuffle import check_new_size
from eplb_reference.elastic.spec import ElasticSpec
from eplb_reference.elastic.store import listening_store

log = logging.getLogger("eplb_graph.elastic.coordinator")


class Coordinator:
    def __init__(self, spec: ElasticSpec, *, spares: int = 0, recover_failures: bool = False,
                 startup_s: float = 300.0, secret: RunSecret | None = None, history: int = HISTORY) -> None:
        """``spec.store_port`` 0: the store takes a free port, and the spec the members get names it.
        ``recover_failures``: a member that reports an error is recovered from as a death (the
        server); otherwise it fails the run (``failures``). ``secret``: the run's (``proof.py``),
        generated when not given; the members started here get it. ``history``: how many resizes,
        faults, lost and reported members are kept (older ones are counted only)."""
        self.store = listening_store(spec.store_host, spec.store_port, spec.timeout_s)
        self.spec = replace(spec, store_port=self.store.port)
        self.secret = secret or RunSecret.generate()
        self.board = Board(self.store, spec.name, self.secret)
        self.board.publish_spec(self.spec.to_json())
        self.processes = MemberProcesses(self.spec, self.secret)
        self.detector = FailureDetector(self.board, self.spec.hang_s, startup_s)
        self.spares_wanted, self.recover_failures = spares, recover_failures
        self.num_local = spec.cfg.num_physical // spec.cfg.ranks
        self.members: tuple[int, ...] = ()
        self.current, self.next_index = 0, 1
        self.history = history
        self.requests: deque[ResizeRequest] = deque(maxlen=history)  # the last resizes and recoveries
        self.spares: list[int] = []
        self.roles: dict[int, str] = {}  # every member not yet reported nor lost: serving, joining, spare
        self.reports: dict[int, dict] = {}
        self.failures: dict[int, str] = {}  # what the run cannot go on without
        self.faults: deque[Fault] = deque(maxlen=history)  # the last members lost
        self.fault_count = 0  # every member lost since the start
        self.dead: dict[int, float] = {}  # member -> when it was lost (happened, else detected)
        self.happened: dict[int, float] = {}  # what a driver did itself: member -> when (kill, stop)
        self.announced: dict[int, tuple[int, ...]] = {}  # generations whose keys are kept: index -> members

    # -- members ------------------------------------------------------------------------

    def start_first_generation(self, size: int) -> None:
        self.board.reserve_member_ids(size)
        self.members = tuple(range(size))
        self._announce(Generation(0, self.members))
        for member in self.members:
            self._start(member, 0, "serving")
        log.info("generation 0 announced: members %s", list(self.members))
        self.top_up_spares()

    def _start(self, member: int, first_generation: int | None, role: str) -> None:
        self.processes.start(member, first_generation)
        self.roles[member] = role
        self.detector.watch(member, time.monotonic())

    def top_up_spares(self) -> None:
        """Warm spares: member processes that build and compile now and wait to be assigned."""
        while len(self.spares) < self.spares_wanted:
            member = self.board.new_member_id()
            self._start(member, None, "spare")
            self.spares.append(member)
            log.info("spare member %d started", member)

    def release_spares(self) -> None:
        """No resize is left: the spares end without serving."""
        self.spares_wanted = 0
        for member in self.spares:
            self.board.assign(member, STOP)
            self.roles[member] = "leaving"
        self.spares = []

    def progress(self) -> int:
        return self.board.step()

    def pending(self) -> ResizeRequest | None:
        return self.requests[-1] if self.requests and self.requests[-1].outcome == "pending" else None

    def settled(self) -> bool:
        """Every member has reported or is lost."""
        return not self.roles

    # -- resizes ------------------------------------------------------------------------

    def request(self, new_size: int, *, hold: bool = False) -> ResizeRequest:
        """Assigns spares (or starts new processes) to join, announces the next generation.
        ``hold``: its members prepare but do not switch before ``release``."""
        check_new_size(new_size, self.spec.cfg.num_experts, self.num_local, self.spec.max_ranks)
        if self.pending() is not None:
            raise RuntimeError(f"generation {self.pending().generation} is still pending")
        index, self.next_index = self.next_index, self.next_index + 1
        if hold:  # before the announcement: every member reads it when it starts preparing
            self.board.hold(index)
        members = self.members[:new_size]
        while len(members) < new_size:
            if self.spares:
                member = self.spares.pop(0)
                self.board.assign(member, index)
                self.roles[member] = "joining"
            else:
                member = self.board.new_member_id()
                self._start(member, index, "joining")
            members += (member,)
        request = ResizeRequest(index, len(self.members), new_size, time.monotonic(), self.progress(), members)
        self.requests.append(request)
        self._announce(Generation(index, members))
        log.info("generation %d announced: resize %d -> %d, members %s%s", index, len(self.members), new_size,
                 list(members), " (held for a drain)" if hold else "")
        return request

    def release(self, request: ResizeRequest, release: Release) -> None:
        """A held resize may switch (GO), or is given up (ABANDON): its joiners leave, its groups go."""
        self.board.release(request.generation, release)
        log.info("generation %d %s after the drain", request.generation,
                 "released" if release is Release.GO else "given up")

    def give_up(self, request: ResizeRequest, why: str) -> bool:
        """Gives a pending resize up unless it switched first; True where it is given up."""
        return isinstance(self.board.abandon(request.generation, why), Abandoned)

    # -- the loop's body ----------------------------------------------------------------

    def tick(self, now: float | None = None) -> Events:
        """One look at the store and the processes; what changed (``now``: the monotonic clock)."""
        events, now = Events(), time.monotonic() if now is None else now
        for offer in self.board.offers():  # warm, from outside the process tree
            member = offer["member"]
            self.processes.adopt(member)  # its offer's host and pid are only its word: logged, never acted on
            self.roles[member] = "spare"
            self.spares.append(member)
            self.detector.watch(member, now)
            log.info("spare member %d offered itself from outside (says pid %s on %s)", member, offer.get("pid"),
                     offer.get("host"))
        lost = self._collect(now) + self._hung(now)
        events.lost.extend(lost)
        for fault in lost:
            if fault.member in self.spares:
                self.spares.remove(fault.member)
        self.recover_without([f for f in lost if f.role != "spare"], now)
        request = self.pending()
        if request is not None:
            outcome = self.board.outcome(request.generation)
            if isinstance(outcome, Switched):
                events.switched.append((request, self._switched(request, now)))
            elif isinstance(outcome, Abandoned):
                request.outcome, request.why_abandoned, request.settled_s = "abandoned", outcome.why, now
                for member in request.members:
                    if self.roles.get(member) == "joining":
                        self.roles[member] = "leaving"
                log.info("generation %d given up (%s): members %s serve on", request.generation, outcome.why,
                         list(self.members))
                events.abandoned.append(request)
        self._forget_generations()
        self.top_up_spares()
        return events

    def _announce(self, generation: Generation) -> None:
        self.board.announce(generation)
        self.announced[generation.index] = generation.members

    def _forget_generations(self) -> None:
        """The keys of generations before the one serving, once no member of theirs may still read
        them (a joiner of one given up may be slow to learn it): the store stays bounded."""
        for index, members in list(self.announced.items()):
            if index < self.current and not any(m in self.roles and m not in self.members for m in members):
                self.board.forget_generation(index)
                del self.announced[index]

    def _collect(self, now: float) -> list[Fault]:
        """Reports in; members gone without one (deaths), and those that reported an error."""
        lost = []
        for member in list(self.roles):
            report = self.board.take_report(member)
            if report is None and self.processes.exited(member):
                report = self.board.take_report(member)  # it may have reported just before it exited
                if report is None:
                    code = self.processes.exit_code(member)
                    lost.append(self._lose(member, "died", f"exited with code {code}, no report", now))
                    continue
            if report is None:
                continue
            if "error" in report:
                if not self.recover_failures and self.roles[member] != "spare":
                    self.failures[member] = report["error"]
                    trim_oldest(self.failures, self.history)
                lost.append(self._lose(member, "failed", report["error"].splitlines()[0], now))
                continue
            self.reports[member] = report
            trim_oldest(self.reports, self.history)
            self._forget(member)
        return lost

    def _hung(self, now: float) -> list[Fault]:
        request = self.pending()  # during a recovery its survivors are the group whose collectives compare
        serving = request.members if request is not None and request.kind == "recovery" else self.members
        hung = self.detector.look(serving, now)
        lost = []
        for member, why in hung.items():
            if member not in self.roles:
                continue
            self.board.fence(member, why)
            self.processes.kill(member)
            log.warning("member %d fenced: %s", member, why)
            lost.append(self._lose(member, "hung", why, now))
        return lost

    def _lose(self, member: int, kind: str, why: str, now: float) -> Fault:
        fault = Fault(member, kind, why, self.roles[member], now, self.happened.get(member))
        self.faults.append(fault)
        self.fault_count += 1
        self.dead[member] = fault.happened_s or now
        trim_oldest(self.dead, self.history)
        log.warning("member %d lost (%s, %s): %s", member, kind, fault.role, why)
        self._forget(member)
        return fault

    def faults_since(self, count: int) -> list[Fault]:
        """The members lost after the first ``count`` (``fault_count`` then), of those still kept."""
        return list(self.faults)[max(0, len(self.faults) - (self.fault_count - count)):]

    def _forget(self, member: int) -> None:
        self.roles.pop(member, None)
        self.happened.pop(member, None)
        self.detector.forget(member)
        self.board.forget_member(member)

    def _switched(self, request: ResizeRequest, now: float) -> tuple[int, ...]:
        request.outcome, request.settled_s = "switched", now
        gone = tuple(m for m in self.members if m not in request.members)
        self.members, self.current = request.members, request.generation
        for member in self.members:
            if member in self.roles:
                self.roles[member] = "serving"
        for member in gone:
            if member in self.roles:
                self.roles[member] = "leaving"
        log.info("generation %d switched: %s %d -> %d in %.2f s, members %s", request.generation, request.kind,
                 request.old_size, request.new_size, now - request.requested_s, list(self.members))
        # members of it lost before the switch was seen: recovered from in it
        self.recover_without([f for f in self.faults if f.member in self.members and f.recovery is None], now)
        return gone

    def recover_without(self, lost: list[Fault], now: float) -> int:
        """Members lost together (one recovery leaves them all out): the survivors get a recovery
        generation. A pending resize they were to join is given up; one whose serving group they
        broke is given up as broken (its members recover). A switch written first wins, and the
        members lost are recovered from once it is seen. Returns how many were recovered from."""
        request = self.pending()
        joiners = [f.member for f in lost if request is not None and f.member in request.members
                   and f.member not in self.members]
        serving = [f for f in lost if f.member in self.members]
        if joiners:  # the serving group is intact: rank 0 reads the give-up at its next step
            self.board.abandon(request.generation, f"member {', '.join(map(str, joiners))} died")
        if request is not None and serving:  # the serving group broke: its members recover
            why = f"member {', '.join(str(f.member) for f in serving)} lost"
            if isinstance(self.board.abandon(request.generation, why, broken=True), Switched):
                return 0  # rank 0 switched first: once that is seen, they are recovered from
            request.outcome, request.why_abandoned, request.settled_s = "abandoned", why, now
            log.info("generation %d given up (%s)", request.generation, why)
        if not serving:
            return 0
        gone = {f.member for f in serving} | set(self.dead)  # one lost before (its recovery given up) is gone too
        survivors = tuple(m for m in self.members if m not in gone)
        if len(survivors) * self.num_local < self.spec.cfg.num_experts:
            for fault in serving:  # what it failed with, where it said, stays first
                why = (f"lost and cannot be recovered from: {len(survivors)} survivors x {self.num_local} slots cannot "
                       f"host {self.spec.cfg.num_experts} experts")
                self.failures[fault.member] = (f"{self.failures[fault.member]}\n{why}" if fault.member in self.failures
                                               else why)
            return 0
        index, self.next_index = self.next_index, self.next_index + 1
        for fault in serving:
            fault.recovery = index
        self.requests.append(ResizeRequest(
            index, len(self.members), len(survivors), now, self.progress(), survivors, kind="recovery",
            died_s=min(f.happened_s or f.detected_s for f in serving), detected_s=min(f.detected_s for f in serving)))
        self._announce(Generation(index, survivors))
        self.board.announce_recovery(self.current, index)
        log.warning("generation %d announced: recovery of generation %d without members %s, survivors %s", index,
                    self.current, [f.member for f in serving], list(survivors))
        return len(serving)

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Every member stops at its next step and reports; spares leave; stragglers are killed past
        ``grace_s``. The reports that came are in ``reports``."""
        self.board.stop()
        self.release_spares()
        self.processes.stop_all(grace_s)
        for member in list(self.roles):
            report = self.board.take_report(member)
            if report is not None and "error" not in report:
                self.reports[member] = report
