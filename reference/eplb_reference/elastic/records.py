"""What the coordinator records of each resize, recovery and fault, and what one look at the run found.

The scripted run's report (``report.py``) and the chaos run read these (as dicts, once the run
is over); the server acts on ``Events`` as the coordinator returns them. The coordinator keeps the
last ``HISTORY`` of each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# resizes, recoveries and faults a coordinator keeps, and members it remembers as lost or reported:
# a server that runs for months keeps the recent ones (older ones are only counted)
HISTORY = 1024


def trim_oldest(records: dict, keep: int) -> None:
    """Drops ``records``' oldest entries (in insertion order) past ``keep``."""
    while len(records) > keep:
        del records[next(iter(records))]


@dataclass
class ResizeRequest:
    generation: int
    old_size: int
    new_size: int
    requested_s: float  # monotonic
    at_step: int
    members: tuple[int, ...]
    outcome: str = "pending"  # "switched" | "abandoned"
    kind: str = "resize"  # or "recovery": the survivors of members lost
    died_s: float | None = None  # a recovery: when the first member was lost (killed, or found dead or hung)
    detected_s: float | None = None  # a recovery: when the coordinator knew
    why_abandoned: str | None = None
    settled_s: float | None = None  # when the coordinator saw the outcome


@dataclass
class Fault:
    """A member lost: how, and when (monotonic, the coordinator's clock)."""

    member: int
    kind: str  # "died" (exited, no report), "hung" (fenced), "failed" (reported an error)
    why: str
    role: str  # "serving", "joining", "spare"
    detected_s: float
    happened_s: float | None = None  # where a driver knows (it killed or stopped the member itself)
    recovery: int | None = None  # the recovery generation that left it out


@dataclass
class Events:
    switched: list[tuple[ResizeRequest, tuple[int, ...]]] = field(default_factory=list)  # request, members gone
    abandoned: list[ResizeRequest] = field(default_factory=list)
    lost: list[Fault] = field(default_factory=list)
