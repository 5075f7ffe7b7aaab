"""Failure detection that covers hangs: members keep alive through the store, the coordinator judges.

A member's ``KeepAliveThread`` writes a ``KeepAlive`` every ``beat_s``: its beat count (the
process runs), its main thread's progress marks and the collectives it entered on its EP
group, and whether the main thread is inside a wait on its peers. The coordinator feeds
what it reads to a ``FailureDetector``, whose rules (``hung_members``) are a pure function
of what was seen and when, on the coordinator's own clock:

* *silent*: no beat for ``hang_s`` -- SIGSTOP, or a process-wide hang (the GIL held);
* *still*: beating, its main thread outside any wait on peers, no progress for ``hang_s`` --
  a deadlocked main thread (starting -- building, compiling -- it has ``startup_s``);
* *behind*: a member of the serving generation beating, waiting on its peers and not moving
  for twice ``hang_s``, while a peer of its generation entered more collectives (the others
  wait for it where it never arrived), or every peer gave the generation up (their collectives
  timed out around it). Twice: a member merely slow inside its forward looks the same, for a
  while, on a starved machine.

A hung member is fenced (killed, and its fence key makes it exit at its next beat if it
ever runs again) and recovered from exactly as a death is. A group stuck in one collective
with nobody behind is left to the collective's own timeout, which fails its members.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from eplb_reference.elastic.protocol import Board, KeepAlive, Phase

log = logging.getLogger("eplb_graph.elastic.liveness")

FENCED_EXIT = 70  # a member that found itself fenced
COORDINATOR_LOST_EXIT = 71  # a member whose store went away: its coordinator is gone
# where the main thread marks progress at least every step or poll; starting (building, compiling) it may not for long
STILL_PHASES = (Phase.SPARE, Phase.JOINING, Phase.SERVING, Phase.PREPARING, Phase.RECOVERING)


class KeepAliveThread:
    """This member's keep-alive. The main thread calls ``mark`` where it moves on and enters
    ``waiting`` around what waits on its peers; the thread publishes both every ``beat_s``."""

    def __init__(self, board: Board, member: int, beat_s: float,
                 collectives: Callable[[], tuple[int | None, int]]) -> None:
        """``collectives()``: (the generation its EP group serves, the collectives entered in it)."""
        self.board, self.member, self.beat_s, self.collectives = board.clone(), member, beat_s, collectives
        self.progress, self.beats, self._waiting = 0, 0, 0
        self.phase = Phase.STARTING
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"keep-alive-{member}", daemon=True)

    def start(self) -> KeepAliveThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(max(1.0, 4 * self.beat_s))

    def mark(self) -> None:
        self.progress += 1

    def set_phase(self, phase: Phase) -> None:
        if phase != self.phase:
            log.debug("member %d: %s -> %s", self.member, self.phase.value, phase.value)
        self.phase = phase
        self.mark()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Within: the main thread waits on its peers (standing still there is not its own fault)."""
        self._waiting += 1
        try:
            yield
        finally:
            self._waiting -= 1
            self.progress += 1

    def snapshot(self) -> KeepAlive:
        generation, collectives = self.collectives()
        return KeepAlive(self.beats, self.progress, collectives, self._waiting > 0, self.phase, generation)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.beats += 1
            try:
                self.board.beat(self.member, self.snapshot())
                fenced = self.board.fenced(self.member)
            except Exception:  # the store is gone with its coordinator: no member outlives it
                os._exit(COORDINATOR_LOST_EXIT)
            if fenced is not None:  # the group went on without this member: it must not act again
                log.error("member %d fenced (%s): exiting", self.member, fenced)
                os._exit(FENCED_EXIT)
            self._stop.wait(self.beat_s)


@dataclass
class Seen:
    """What the coordinator last saw of one member, and when it last changed (coordinator clock)."""

    since_s: float  # watched from (its process started, or it offered itself)
    alive: KeepAlive | None = None
    beat_s: float | None = None  # when the beat count last changed
    moved_s: float | None = None  # when progress or collectives last changed
    phase_s: float | None = None  # when its phase (or generation) last changed


def observe(seen: Seen, alive: KeepAlive | None, now: float) -> None:
    if alive is None:
        return
    last = seen.alive
    if last is None or alive.beat != last.beat:
        seen.beat_s = now
    if last is None or (alive.progress, alive.collectives) != (last.progress, last.collectives):
        seen.moved_s = now
    if last is None or (alive.phase, alive.generation) != (last.phase, last.generation):
        seen.phase_s = now
    seen.alive = alive


# "behind" and "stuck" wait this many hang bounds: a waiter is slower to judge than a silent member
BEHIND_HANG_BOUNDS = 2


def waiting_still(s: Seen, now: float, hang_s: float) -> bool:
    """Waiting on its peers and not moving for ``hang_s``."""
    return s.alive.waiting and now - s.moved_s > hang_s


def hung_members(seen: dict[int, Seen], serving: tuple[int, ...], now: float, hang_s: float,
                 startup_s: float) -> dict[int, str]:
    """member -> why it is hung, by the three rules of this module's docstring (and a start-up bound)."""
    hung = {}
    for member, s in seen.items():
        if s.alive is None:
            if now - s.since_s > startup_s:
                hung[member] = f"no keep-alive within {startup_s:g} s of its start"
        elif now - s.beat_s > hang_s:
            hung[member] = f"silent for {now - s.beat_s:.1f} s (stopped or hung)"
        elif s.alive.phase in STILL_PHASES and not s.alive.waiting and now - s.moved_s > hang_s:
            hung[member] = f"main thread still for {now - s.moved_s:.1f} s while {s.alive.phase.value}"
        elif s.alive.phase is Phase.STARTING and now - s.moved_s > startup_s:
            hung[member] = f"still starting after {now - s.moved_s:.0f} s (bound {startup_s:g} s)"
    peers = {m: seen[m] for m in serving if m in seen and m not in hung and seen[m].alive is not None}
    for member, s in peers.items():
        if not (waiting_still(s, now, BEHIND_HANG_BOUNDS * hang_s) and now - s.beat_s < hang_s / 2):
            continue
        same = [p for m, p in peers.items() if m != member and p.alive.generation == s.alive.generation]
        most = max((p.alive.collectives for p in same), default=0)  # collectives count from the generation's start
        if most > s.alive.collectives:
            hung[member] = (f"behind its peers: entered {s.alive.collectives} collectives of generation "
                            f"{s.alive.generation}, a peer {most}")
        elif same and all(p.alive.phase is Phase.RECOVERING and now - p.phase_s > hang_s for p in same):
            # the last one left, ``hang_s`` after all the others failed (not the one about to fail next)
            hung[member] = f"still waiting in a collective of generation {s.alive.generation} its peers gave up"
    return hung


class FailureDetector:
    """The coordinator's view of every member it watches (founders, joiners, spares)."""

    def __init__(self, board: Board, hang_s: float, startup_s: float) -> None:
        self.board, self.hang_s, self.startup_s = board, hang_s, startup_s
        self.seen: dict[int, Seen] = {}
        self._stuck_logged: float | None = None

    def watch(self, member: int, now: float) -> None:
        self.seen.setdefault(member, Seen(since_s=now))

    def forget(self, member: int) -> None:
        self.seen.pop(member, None)

    def look(self, serving: tuple[int, ...], now: float) -> dict[int, str]:
        """Reads every watched member's keep-alive; returns those hung, with why."""
        for member, s in self.seen.items():
            observe(s, self.board.keep_alive(member), now)
        hung = hung_members(self.seen, serving, now, self.hang_s, self.startup_s)
        group = [self.seen[m] for m in serving if m in self.seen and self.seen[m].alive is not None]
        stuck = len(group) == len(serving) > 1 and not hung and all(
            waiting_still(s, now, BEHIND_HANG_BOUNDS * self.hang_s) for s in group)
        if stuck and self._stuck_logged is None:
            self._stuck_logged = now
            log.error("members %s all wait in one collective, none behind: left to its timeout", list(serving))
        elif not stuck:
            self._stuck_logged = None
        return hung
