"""The protocol's values: the states members publish and what the keys hold, each with its codec."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import Enum


@dataclass(frozen=True)
class Generation:
    index: int
    members: tuple[int, ...]  # member ids in rank order

    @property
    def size(self) -> int:
        return len(self.members)

    def rank_of(self, member: int) -> int:
        return self.members.index(member)


class Release(str, Enum):
    GO = "go"  # the drain finished: the resize may switch
    ABANDON = "abandon"  # the drain timed out: give it up


class Phase(str, Enum):
    """What a member is doing, published with every keep-alive (``member.py`` draws the machine)."""

    STARTING = "starting"  # building and warming up its graphs
    SPARE = "spare"  # warm, waiting for a generation to join
    JOINING = "joining"  # building a generation it joins, receiving rank 0's state
    SERVING = "serving"
    PREPARING = "preparing"  # serving, the next generation being built beside
    RECOVERING = "recovering"  # a peer was lost: building the survivors' generation


@dataclass(frozen=True)
class Switched:
    first_step: int  # the first step served at the new size
    old_size: int


@dataclass(frozen=True)
class Abandoned:
    why: str
    broken: bool = False  # a member of the serving group died: its survivors recover


Outcome = Switched | Abandoned


def encode_outcome(outcome: Outcome) -> str:
    if isinstance(outcome, Switched):
        return f"switched:{outcome.first_step}:{outcome.old_size}"
    return f"abandoned:{int(outcome.broken)}:{outcome.why}"


def decode_outcome(text: str) -> Outcome:
    kind, first, rest = text.split(":", 2)
    if kind == "switched":
        return Switched(int(first), int(rest))
    return Abandoned(rest, broken=first == "1")


@dataclass(frozen=True)
class KeepAlive:
    """One beat: ``beat`` proves the process runs; ``progress`` and ``collectives`` that its main
    thread moves (marks, and collectives entered on the EP group in ``generation``, the one its
    group serves); ``waiting`` that it is inside a wait on its peers (a collective, the commit
    point), where standing still is not its fault."""

    beat: int
    progress: int
    collectives: int
    waiting: bool
    phase: Phase
    generation: int | None = None

    def encode(self) -> str:
        return json.dumps({**asdict(self), "phase": self.phase.value})

    @staticmethod
    def decode(text: str | bytes) -> KeepAlive:
        fields = json.loads(text)
        return KeepAlive(**{**fields, "phase": Phase(fields["phase"])})
