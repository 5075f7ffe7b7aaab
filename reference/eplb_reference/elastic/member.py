"""A member's decisions: pure functions of what it read, so every transition is tested in-process.

The member process (``member_process.py``) reads a view, asks one of these functions what to
do, and does it; nothing here touches a store, a group or a tensor.

    STARTING --founder--> SERVING <------------- switched, in it ------------+
        |                  |  ^                                              |
        |  spare: SPARE    |  | given up (GIVE_UP), or abandoned unbroken   |
        |     | assigned   v  |                                              |
        +-> JOINING      PREPARING --all ready, released (SWITCH)--> commit point
             |  | switched          |                                 |   |
             |  +-> SERVING         | a step fails                    |   +-- switched, not in it --> LEFT
             | abandoned / gave up  v                                 |
             +-> LEFT          RECOVERING --built, settled--> SERVING <+-- abandoned, broken (a member died)
                                  | the coordinator announces none within the bound: the member fails

Between two steps every member of the serving generation votes (``vote``) and one MAX
all-reduce of the votes (``Control``) gives all of them the same decision (``decide``) at
the same step: a member not ready holds the switch for a step, never the group. Only rank 0
reads the coordinator's keys; a give-up is always written first (``Board.abandon``), so the
joiners, which are not in the all-reduce, learn it from the same key.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from eplb_reference.elastic.protocol import Abandoned, Outcome, Release, Switched


class Act(str, Enum):
    SERVE = "serve"  # no change
    PREPARE = "prepare"  # the next generation is announced: build its group beside
    GIVE_UP = "give_up"  # the pending resize is given up: serve on at this size
    SWITCH = "switch"  # every member ready: move weights, meet at the commit point
    STOP = "stop"  # the run ends
    SWITCHED = "switched"  # past the commit point, in the new generation
    LEAVE = "leave"  # past the commit point, not in it; or a joiner whose resize was given up
    RESUME = "resume"  # the commit point found the resize given up, the group whole: serve on
    RECOVER = "recover"  # the serving group lost a member
    WAIT = "wait"
    SAY_READY = "say_ready"
    FAIL = "fail"


@dataclass(frozen=True)
class View:
    """What a member of the serving generation read before its step (rank 0 reads the store)."""

    rank: int
    pending: int | None = None  # the generation being prepared
    announced: bool = False  # rank 0: the next generation is announced
    in_pending: bool = True  # this member is in the pending generation
    standby_built: bool = False
    standby_error: str | None = None
    outcome: Outcome | None = None  # rank 0: the pending generation's outcome, where one was written
    held: bool = False  # rank 0: a drain holds the resize
    release: Release | None = None  # rank 0: what the coordinator answered a held resize
    not_ready: tuple[int, ...] = ()  # rank 0: joiners that did not say ready
    released_for_s: float = 0.0  # rank 0: since the resize may switch (announced, or released)
    deadline_s: float = float("inf")
    stop: bool = False
    work: bool = True  # rows to serve this step


@dataclass(frozen=True)
class Control:
    """The votes, MAX over the members: what the serving generation agrees on at one step."""

    announced: bool = False
    unready: bool = False
    give_up: bool = False
    stop: bool = False
    work: bool = False

    def as_list(self) -> list[float]:
        return [float(self.announced), float(self.unready), float(self.give_up), float(self.stop), float(self.work)]

    @staticmethod
    def from_list(values: list[float]) -> Control:
        return Control(*(bool(v) for v in values))


def why_give_up(view: View) -> str | None:
    """Why this member gives its pending resize up; None: it may go on."""
    if view.standby_error is not None:
        return f"a member could not build the new group: {view.standby_error}"
    if view.rank != 0:
        return None
    if isinstance(view.outcome, Abandoned):  # a joiner, the coordinator or the server gave it up first
        return view.outcome.why
    if view.release is Release.ABANDON:
        return "the drain of requests timed out"
    if view.released_for_s > view.deadline_s:
        late = f" (members {', '.join(map(str, view.not_ready))} not ready)" if view.not_ready else ""
        return f"not ready within the {view.deadline_s:g} s resize deadline{late}"
    return None


def vote(view: View) -> tuple[Control, str | None]:
    """This member's vote, and why it gives the pending resize up (rank 0 writes that reason)."""
    if view.pending is None:
        return Control(announced=view.rank == 0 and view.announced, stop=view.stop, work=view.work), None
    why = why_give_up(view)
    unready = (view.in_pending and not view.standby_built) or (
        view.rank == 0 and (bool(view.not_ready) or (view.held and view.release is None)))
    return Control(unready=unready, give_up=why is not None, stop=view.stop, work=view.work), why


def decide(pending: bool, agreed: Control) -> Act:
    """What the serving generation does after this step, the same on every member."""
    if agreed.stop:
        return Act.STOP
    if not pending:
        return Act.PREPARE if agreed.announced else Act.SERVE
    if agreed.give_up:
        return Act.GIVE_UP
    return Act.SERVE if agreed.unready else Act.SWITCH


def after_commit(outcome: Outcome, in_new: bool) -> Act:
    """A member of the serving generation past the commit point."""
    if isinstance(outcome, Switched):
        return Act.SWITCHED if in_new else Act.LEAVE
    return Act.RECOVER if outcome.broken else Act.RESUME


@dataclass(frozen=True)
class JoinView:
    """What a joining member read while its generation is prepared."""

    built: bool
    build_error: str | None
    said_ready: bool
    outcome: Outcome | None
    waited_s: float  # since it was assigned
    bound_s: float  # deadline + collective timeout: past it, the joiner gives up itself


def decide_join(view: JoinView) -> Act:
    if isinstance(view.outcome, Switched):
        return Act.SWITCHED  # rank 0 commits only once every joiner said ready
    if isinstance(view.outcome, Abandoned):
        return Act.LEAVE
    if view.build_error is not None or view.waited_s > view.bound_s:
        return Act.GIVE_UP  # a compare-and-set: where the switch won first, the joiner serves
    if view.built and not view.said_ready:
        return Act.SAY_READY
    return Act.WAIT


@dataclass(frozen=True)
class RecoveryView:
    """What a member whose step failed read of the coordinator's verdict."""

    announced: int | None  # the recovery generation announced for the broken one
    tried: int | None  # the one it last tried, given up under it
    waited_s: float
    bound_s: float


def decide_recovery(view: RecoveryView) -> Act:
    """RECOVER into ``view.announced``; WAIT for the coordinator; FAIL: no peer was lost (the
    failure was this member's own) or the coordinator never answered."""
    if view.announced is not None and view.announced != view.tried:
        return Act.RECOVER
    return Act.FAIL if view.waited_s > view.bound_s else Act.WAIT
