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
    kind, first, rest = (text.split(":", 2) + ["", ""])[:3]
    if kind == "switched" and first.isdigit() and rest.isdigit():
        return Switched(int(first), int(rest))
    if kind == "abandoned" and first in ("0", "1"):
        return Abandoned(rest, broken=first == "1")
    raise MalformedValue("an outcome is switched:STEP:SIZE or abandoned:0|1:WHY")


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


# -- the queued JSON values: each checked field by field before anyone acts on it ----------------


class MalformedValue(ValueError):
    """A store value that is not what its key holds (a fault, or a peer that is not ours)."""


def _int(value: object, name: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise MalformedValue(f"{name} must be an integer >= {low}, not {value!r}")
    return value


def _token_ids(value: object, name: str) -> list[int]:
    if not isinstance(value, list) or not value and name == "prompt_token_ids":
        raise MalformedValue(f"{name} must be a list of token ids")
    return [_int(token, name) for token in value]


def _fields(text: str, names: tuple[str, ...]) -> dict:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise MalformedValue(f"not JSON: {error}") from None
    if not isinstance(value, dict) or set(value) != set(names):
        raise MalformedValue(f"an object with exactly {', '.join(names)}")
    return value


def decode_offer(text: str) -> dict:
    value = _fields(text, ("member", "host", "pid"))
    if not isinstance(value["host"], str):
        raise MalformedValue("host must be a string")
    return {"member": _int(value["member"], "member"), "host": value["host"], "pid": _int(value["pid"], "pid")}


def decode_result(text: str) -> dict:
    value = _fields(text, ("rid", "token_ids", "matches_reference", "member"))
    if not isinstance(value["matches_reference"], bool):
        raise MalformedValue("matches_reference must be a bool")
    return {"rid": _int(value["rid"], "rid"), "token_ids": _token_ids(value["token_ids"], "token_ids"),
            "matches_reference": value["matches_reference"], "member": _int(value["member"], "member")}


def decode_request(text: str) -> dict:
    value = _fields(text, ("rid", "prompt_token_ids", "max_new_tokens"))
    return {"rid": _int(value["rid"], "rid"), "prompt_token_ids": _token_ids(value["prompt_token_ids"],
                                                                             "prompt_token_ids"),
            "max_new_tokens": _int(value["max_new_tokens"], "max_new_tokens", 1)}


def decode_report(text: str) -> dict:
    """A member's last word: an object whose ``error``, where there is one, is a string (its other
    fields are its ``MemberResult``, read by the report)."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise MalformedValue(f"not JSON: {error}") from None
    if not isinstance(value, dict) or not isinstance(value.get("error", ""), str):
        raise MalformedValue("an object, its error (if any) a string")
    return value


def decode_rids(text: str) -> list[int]:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise MalformedValue(f"not JSON: {error}") from None
    if not isinstance(value, list):
        raise MalformedValue("a list of request ids")
    return [_int(rid, "rid") for rid in value]


# -- what the coordinator writes (sealed like the rest; a malformed one is a fault, never acted on) ----


def decode_members(text: str) -> tuple[int, ...]:
    """A generation's members in rank order: distinct member ids, one at least."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise MalformedValue(f"not JSON: {error}") from None
    if not isinstance(value, list) or not value:
        raise MalformedValue("a generation's members are a non-empty list")
    members = tuple(_int(member, "member") for member in value)
    if len(set(members)) != len(members):
        raise MalformedValue(f"a generation's members are distinct, not {list(members)}")
    return members


def decode_index(text: str) -> int:
    """A generation index or a member's assignment to one, in decimal."""
    if not text.isdigit() or not text.isascii():
        raise MalformedValue(f"a generation index is a decimal integer >= 0, not {text!r}")
    return int(text)


def decode_release(text: str) -> Release:
    try:
        return Release(text)
    except ValueError:
        raise MalformedValue(f"a release is one of {[r.value for r in Release]}, not {text!r}") from None
