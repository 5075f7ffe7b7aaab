"""``Board``: one client of the run's store, the only code that spells a key (the table: ``__init__``).

Every value goes through ``SealedValues`` (``sealed.py``): sealed with the run's secret when
written, opened and checked against its schema when read; a value without the seal or malformed is
counted in ``Board.skipped`` and dropped. Two counters (``next_member``, ``rearrangements``) are the
store's own integers and carry no seal: one hands out ids, the other is a reported figure.
"""

from __future__ import annotations

import json

import torch.distributed as dist

from eplb_reference.elastic.protocol.values import (
    Abandoned, Generation, KeepAlive, Outcome, Release, Switched, decode_index, decode_members,
    decode_offer, decode_outcome, decode_release, decode_report, decode_request, decode_result, decode_rids,
    encode_outcome,
)
from eplb_reference.elastic.protocol.proof import RunSecret
from eplb_reference.elastic.protocol.sealed import ProtocolTimeout, SealedValues



__all__ = ["STOP", "Board", "ProtocolTimeout"]

STOP = "stop"  # a spare's assignment at the end of a run
SETTLE_TRIES = 4  # compare-and-sets of an outcome whose key an unproven value took first


class Board(SealedValues):
    """One client of the run's store, reading and writing the protocol's keys (not thread-safe:
    ``clone`` gives another thread its own)."""

    def __init__(self, store: dist.Store, run: str, secret: RunSecret) -> None:
        super().__init__(store, secret)
        self.run = run

    def clone(self) -> Board:
        return Board(self.store.clone(), self.run, self.secret)

    def key(self, scope: str, ident: object = None, field: str | None = None, *more: object) -> str:
        parts = [self.run, scope] + ([str(ident)] if ident is not None else []) + ([field] if field else [])
        return "/".join(parts + [str(p) for p in more])

    def _gen(self, index: int, field: str, *more: object) -> str:
        return self.key("gen", index, field, *more)

    def _member(self, member: int, field: str) -> str:
        return self.key("member", member, field)

    def _run(self, field: str) -> str:
        return self.key("run", None, field)

    def delete(self, *keys: str) -> None:
        for key in keys:
            self.store.delete_key(key)

    def size(self) -> int:
        """How many keys the store holds (queues not counted: they are empty once consumed)."""
        return self.store.num_keys()

    # -- generations ------------------------------------------------------------------------

    def announce(self, generation: Generation) -> None:
        if len(set(generation.members)) != generation.size or generation.size < 1:
            raise ValueError(f"a generation needs distinct members, got {list(generation.members)}")
        self._set(self._gen(generation.index, "members"), json.dumps(list(generation.members)))

    def announced(self, index: int) -> bool:
        return self._get(self._gen(index, "members"), "generation") is not None

    def generation(self, index: int, timeout_s: float) -> Generation:
        what = f"generation {index}'s members"
        text = self._wait(self._gen(index, "members"), timeout_s, what)
        return Generation(index, self._decoded_or_timeout(text, decode_members, "generation", what))

    def gloo_store(self, index: int, kind: str) -> dist.PrefixStore:
        return dist.PrefixStore(self._gen(index, "gloo", kind), self.store)

    def hold(self, index: int) -> None:
        self._set(self._gen(index, "hold"), "1")

    def held(self, index: int) -> bool:
        return self._get(self._gen(index, "hold"), "hold") is not None

    def release(self, index: int, release: Release) -> None:
        self._set(self._gen(index, "release"), release.value)

    def release_of(self, index: int) -> Release | None:
        return self._decoded(self._get(self._gen(index, "release"), "release"), decode_release, "release")

    def say_ready(self, index: int, member: int) -> None:
        self._set(self._gen(index, "ready", member), "1")

    def not_ready(self, index: int, members: list[int]) -> list[int]:
        return [m for m in members if self._get(self._gen(index, "ready", m), "ready") is None]

    def commit(self, index: int, switched: Switched) -> Outcome:
        """Rank 0's switch, unless someone gave the resize up first; returns the outcome that won."""
        return self._settle(index, switched)

    def abandon(self, index: int, why: str, *, broken: bool = False) -> Outcome:
        """Gives the resize to generation ``index`` up, unless it switched first; returns the winner."""
        return self._settle(index, Abandoned(why, broken))

    def _settle(self, index: int, outcome: Outcome) -> Outcome:
        key, expected = self._gen(index, "outcome"), ""
        ours = self.secret.seal(key, encode_outcome(outcome))
        for _ in range(SETTLE_TRIES):
            won = self.store.compare_set(key, expected, ours)
            outcome = self._decoded(self._open(key, won, "outcome"), decode_outcome, "outcome")
            if outcome is not None:
                return outcome
            expected = won  # an unproven or malformed value took the key: ours replaces it (its bytes, as stored)
        raise ProtocolTimeout(f"the outcome of generation {index}: unproven values keep taking {key}")

    def outcome(self, index: int) -> Outcome | None:
        return self._decoded(self._get(self._gen(index, "outcome"), "outcome"), decode_outcome, "outcome")

    def wait_outcome(self, index: int, timeout_s: float) -> Outcome:
        what = f"the outcome of generation {index}"
        return self._decoded_or_timeout(self._wait(self._gen(index, "outcome"), timeout_s, what), decode_outcome,
                                        "outcome", what)

    def announce_recovery(self, broken: int, index: int) -> None:
        self._set(self._gen(broken, "recovery"), str(index))

    def recovery_of(self, broken: int) -> int | None:
        return self._decoded(self._get(self._gen(broken, "recovery"), "recovery"), decode_index, "recovery")

    def forget_generation(self, index: int) -> None:
        """A generation older than the one serving: every key under it, gloo's own among them."""
        prefix = self.key("gen", index) + "/"
        self.delete(*(key for key in self.store.list_keys() if key.startswith(prefix)))

    # -- members ----------------------------------------------------------------------------

    def new_member_id(self) -> int:
        return self.store.add(self._run("next_member"), 1) - 1

    def reserve_member_ids(self, below: int) -> None:
        """Ids below ``below`` are taken (the coordinator numbers its founders itself)."""
        taken = self.store.add(self._run("next_member"), 0)
        if taken < below:
            self.store.add(self._run("next_member"), below - taken)

    def assign(self, member: int, index: int | str) -> None:
        self._set(self._member(member, "assign"), str(index))

    def assignment(self, member: int) -> int | str | None:
        """The generation a spare joins, ``STOP``, or None while it has none."""
        value = self._get(self._member(member, "assign"), "assignment")
        return value if value in (None, STOP) else self._decoded(value, decode_index, "assignment")

    def beat(self, member: int, alive: KeepAlive) -> None:
        self._set(self._member(member, "alive"), alive.encode())

    def keep_alive(self, member: int) -> KeepAlive | None:
        """The member's last beat; a malformed one reads as none (counted), as if it never beat."""
        value = self._get(self._member(member, "alive"), "keep-alive")
        if value is None:
            return None
        try:
            return KeepAlive.decode(value)
        except (ValueError, TypeError, KeyError) as error:
            self._drop("keep-alive", f"member {member}: {error}", value)
            return None

    def fence(self, member: int, why: str) -> None:
        self._set(self._member(member, "fence"), why)

    def fenced(self, member: int) -> str | None:
        return self._get(self._member(member, "fence"), "fence")

    def report(self, member: int, result: dict) -> None:
        self._set(self._member(member, "report"), json.dumps(result))

    def take_report(self, member: int) -> dict | None:
        """A member's report; a malformed one is dropped (counted) and reads as none."""
        return self._take_checked(self._member(member, "report"), decode_report, "report")

    def forget_member(self, member: int) -> None:
        """A member gone for good: its keys, and what its inbox still held (its fence stays, for a
        member stopped elsewhere that runs again; what it handed back is the server's to take)."""
        self.delete(self._member(member, "assign"), self._member(member, "alive"))
        self.pop_requests(member)

    def offer(self, member: int, host: str, pid: int) -> None:
        """A member started from outside the coordinator's process tree offers itself as a spare
        (where it runs: a coordinator on the same host can still kill it)."""
        self._push(self._run("offers"), json.dumps({"member": member, "host": host, "pid": pid}))

    def offers(self) -> list[dict]:
        return self._pop_checked(self._run("offers"), decode_offer, "offer")

    # -- work ---------------------------------------------------------------------------------

    def served(self, member: int, step: int, rank: int, size: int) -> None:
        key = self._member(member, "served")
        self.store.append(key, self.secret.seal(key, f"{step}:{rank}:{size}") + ";")  # each entry sealed

    def served_log(self, member: int) -> list[list[int]]:
        """[step, rank, group size] per batch the member completed, in order."""
        key = self._member(member, "served")
        raw = self.store.get(key).decode(errors="replace") if self.store.check([key]) else ""
        entries = (self._open(key, entry.encode(), "served entry") for entry in raw.split(";") if entry)
        return [[int(part) for part in entry.split(":")] for entry in entries if entry is not None]

    def push_request(self, member: int, request: dict) -> None:
        self._push(self._member(member, "inbox"), json.dumps(request))

    def pop_requests(self, member: int) -> list[dict]:
        return self._pop_checked(self._member(member, "inbox"), decode_request, "request")

    def hand_back(self, member: int, rids: list[int]) -> None:
        self._set(self._member(member, "returned"), json.dumps(rids))

    def take_handed_back(self, member: int) -> list[int] | None:
        return self._take_checked(self._member(member, "returned"), decode_rids, "hand-back")

    def push_result(self, result: dict) -> None:
        self._push(self._run("results"), json.dumps(result))

    def pop_results(self) -> list[dict]:
        return self._pop_checked(self._run("results"), decode_result, "result")

    # -- what rank 0 publishes, and the run's life --------------------------------------------

    def publish_step(self, step: int, step_ms: float | None = None) -> None:
        self._set(self._run("step"), str(step))
        if step_ms is not None:
            self._set(self._run("step_ms"), f"{step_ms:.3f}")

    def _number(self, field: str, kind: type, default: float) -> float:
        """A published figure; a malformed one reads as ``default`` (counted), never an error."""
        text = self._get(self._run(field), field)
        try:
            return kind(text) if text is not None else default
        except ValueError as error:
            self._drop(field, error, text)
            return default

    def step(self) -> int:
        return self._number("step", int, 0)

    def step_ms(self) -> float:
        return self._number("step_ms", float, float("nan"))

    def count_rearrangement(self, balancedness: float) -> None:
        self.store.add(self._run("rearrangements"), 1)
        self._set(self._run("balancedness"), f"{balancedness:.4f}")

    def rearrangements(self) -> int:
        return self.store.add(self._run("rearrangements"), 0)

    def balancedness(self) -> float:
        return self._number("balancedness", float, float("nan"))

    def stop(self) -> None:
        self._set(self._run("stop"), "1")

    def stopped(self) -> bool:
        return self._get(self._run("stop"), "stop") is not None

    def publish_spec(self, text: str) -> None:
        self._set(self._run("spec"), text)

    def spec_text(self, timeout_s: float) -> str:
        """The run's spec; ``Unproven`` at once where the one there is not sealed with this client's
        secret (a joiner given the wrong one)."""
        return self._wait_first(self._run("spec"), timeout_s, "the run's spec")
