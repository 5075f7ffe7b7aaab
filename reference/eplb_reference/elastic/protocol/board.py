"""``Board``: one client of the run's store, the only code that spells a key (the table: ``__init__``).

What peers write is checked before anyone acts on it (``values.py``'s decoders): a malformed queued
value, report, hand-back, keep-alive or figure is logged, counted in ``Board.skipped`` and dropped,
never raised into the loop that read it."""

from __future__ import annotations

import json
import logging
from collections import Counter
from datetime import timedelta

import torch.distributed as dist

from eplb_reference.elastic.protocol.values import (
    Abandoned, Generation, KeepAlive, MalformedValue, Outcome, Release, Switched, decode_offer, decode_outcome,
    decode_report, decode_request, decode_result, decode_rids, encode_outcome,
)

log = logging.getLogger("eplb_graph.elastic")


class ProtocolTimeout(RuntimeError):
    """A bounded wait ended with nothing written; the message names what was waited for."""


STOP = "stop"  # a spare's assignment at the end of a run


class Board:
    """One client of the run's store, reading and writing the protocol's keys (not thread-safe:
    ``clone`` gives another thread its own)."""

    def __init__(self, store: dist.Store, run: str) -> None:
        self.store, self.run = store, run
        self.skipped: Counter[str] = Counter()  # malformed queued values dropped, by queue: never acted on

    def clone(self) -> Board:
        return Board(self.store.clone(), self.run)

    def key(self, scope: str, ident: object = None, field: str | None = None, *more: object) -> str:
        parts = [self.run, scope] + ([str(ident)] if ident is not None else []) + ([field] if field else [])
        return "/".join(parts + [str(p) for p in more])

    def _gen(self, index: int, field: str, *more: object) -> str:
        return self.key("gen", index, field, *more)

    def _member(self, member: int, field: str) -> str:
        return self.key("member", member, field)

    def _run(self, field: str) -> str:
        return self.key("run", None, field)

    # -- plain values and queues ------------------------------------------------------------

    def _get(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _take(self, key: str) -> str | None:
        value = self._get(key)
        if value is not None:
            self.store.delete_key(key)
        return value

    def _wait(self, key: str, timeout_s: float, what: str) -> str:
        try:
            self.store.wait([key], timedelta(seconds=max(timeout_s, 1e-3)))
        except dist.DistStoreError:
            raise ProtocolTimeout(f"{what}: nothing written under {key} within {timeout_s:g} s") from None
        return self.store.get(key).decode()

    def _pop_all(self, key: str) -> list[str]:
        """Every entry queued under ``key`` since the last pop: as many store calls as entries (one
        other client popping the same queue, as a fenced member might, takes what it takes)."""
        entries = []
        for _ in range(self.store.queue_len(key)):
            try:
                entries.append(self.store.queue_pop(key, block=False).decode())
            except dist.QueueEmptyError:
                break
        return entries

    def _take_checked(self, key: str, decode, what: str):
        text = self._take(key)
        if text is None:
            return None
        try:
            return decode(text)
        except MalformedValue as error:
            self.skipped[what] += 1
            log.warning("a malformed %s in the store was dropped (%s): %.120r", what, error, text)
            return None

    def _pop_checked(self, key: str, decode, queue: str) -> list[dict]:
        """The entries of a queue that decode; one that does not is logged, counted and dropped."""
        values = []
        for text in self._pop_all(key):
            try:
                values.append(decode(text))
            except MalformedValue as error:
                self.skipped[queue] += 1
                log.warning("a malformed %s in the store was dropped (%s): %.120r", queue, error, text)
        return values

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
        self.store.set(self._gen(generation.index, "members"), json.dumps(list(generation.members)))

    def announced(self, index: int) -> bool:
        return self.store.check([self._gen(index, "members")])

    def generation(self, index: int, timeout_s: float) -> Generation:
        text = self._wait(self._gen(index, "members"), timeout_s, f"generation {index}'s members")
        return Generation(index, tuple(json.loads(text)))

    def gloo_store(self, index: int, kind: str) -> dist.PrefixStore:
        return dist.PrefixStore(self._gen(index, "gloo", kind), self.store)

    def hold(self, index: int) -> None:
        self.store.set(self._gen(index, "hold"), "1")

    def held(self, index: int) -> bool:
        return self.store.check([self._gen(index, "hold")])

    def release(self, index: int, release: Release) -> None:
        self.store.set(self._gen(index, "release"), release.value)

    def release_of(self, index: int) -> Release | None:
        value = self._get(self._gen(index, "release"))
        return None if value is None else Release(value)

    def say_ready(self, index: int, member: int) -> None:
        self.store.set(self._gen(index, "ready", member), "1")

    def not_ready(self, index: int, members: list[int]) -> list[int]:
        return [m for m in members if not self.store.check([self._gen(index, "ready", m)])]

    def commit(self, index: int, switched: Switched) -> Outcome:
        """Rank 0's switch, unless someone gave the resize up first; returns the outcome that won."""
        return self._settle(index, switched)

    def abandon(self, index: int, why: str, *, broken: bool = False) -> Outcome:
        """Gives the resize to generation ``index`` up, unless it switched first; returns the winner."""
        return self._settle(index, Abandoned(why, broken))

    def _settle(self, index: int, outcome: Outcome) -> Outcome:
        won = self.store.compare_set(self._gen(index, "outcome"), "", encode_outcome(outcome)).decode()
        return decode_outcome(won)

    def outcome(self, index: int) -> Outcome | None:
        value = self._get(self._gen(index, "outcome"))
        return None if value is None else decode_outcome(value)

    def wait_outcome(self, index: int, timeout_s: float) -> Outcome:
        return decode_outcome(self._wait(self._gen(index, "outcome"), timeout_s, f"the outcome of generation {index}"))

    def announce_recovery(self, broken: int, index: int) -> None:
        self.store.set(self._gen(broken, "recovery"), str(index))

    def recovery_of(self, broken: int) -> int | None:
        value = self._get(self._gen(broken, "recovery"))
        return None if value is None else int(value)

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
        self.store.set(self._member(member, "assign"), str(index))

    def assignment(self, member: int) -> int | str | None:
        """The generation a spare joins, ``STOP``, or None while it has none."""
        value = self._get(self._member(member, "assign"))
        return value if value in (None, STOP) else int(value)

    def beat(self, member: int, alive: KeepAlive) -> None:
        self.store.set(self._member(member, "alive"), alive.encode())

    def keep_alive(self, member: int) -> KeepAlive | None:
        """The member's last beat; a malformed one reads as none (counted), as if it never beat."""
        value = self._get(self._member(member, "alive"))
        if value is None:
            return None
        try:
            return KeepAlive.decode(value)
        except (ValueError, TypeError, KeyError) as error:
            self.skipped["keep-alive"] += 1
            log.warning("a malformed keep-alive of member %d was ignored (%s)", member, error)
            return None

    def fence(self, member: int, why: str) -> None:
        self.store.set(self._member(member, "fence"), why)

    def fenced(self, member: int) -> str | None:
        return self._get(self._member(member, "fence"))

    def report(self, member: int, result: dict) -> None:
        self.store.set(self._member(member, "report"), json.dumps(result))

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
        self.store.queue_push(self._run("offers"), json.dumps({"member": member, "host": host, "pid": pid}))

    def offers(self) -> list[dict]:
        return self._pop_checked(self._run("offers"), decode_offer, "offer")

    # -- work ---------------------------------------------------------------------------------

    def served(self, member: int, step: int, rank: int, size: int) -> None:
        self.store.append(self._member(member, "served"), f"{step}:{rank}:{size};")

    def served_log(self, member: int) -> list[list[int]]:
        """[step, rank, group size] per batch the member completed, in order."""
        value = self._get(self._member(member, "served")) or ""
        return [[int(part) for part in entry.split(":")] for entry in value.split(";") if entry]

    def push_request(self, member: int, request: dict) -> None:
        self.store.queue_push(self._member(member, "inbox"), json.dumps(request))

    def pop_requests(self, member: int) -> list[dict]:
        return self._pop_checked(self._member(member, "inbox"), decode_request, "request")

    def hand_back(self, member: int, rids: list[int]) -> None:
        self.store.set(self._member(member, "returned"), json.dumps(rids))

    def take_handed_back(self, member: int) -> list[int] | None:
        return self._take_checked(self._member(member, "returned"), decode_rids, "hand-back")

    def push_result(self, result: dict) -> None:
        self.store.queue_push(self._run("results"), json.dumps(result))

    def pop_results(self) -> list[dict]:
        return self._pop_checked(self._run("results"), decode_result, "result")

    # -- what rank 0 publishes, and the run's life --------------------------------------------

    def publish_step(self, step: int, step_ms: float | None = None) -> None:
        self.store.set(self._run("step"), str(step))
        if step_ms is not None:
            self.store.set(self._run("step_ms"), f"{step_ms:.3f}")

    def _number(self, field: str, kind: type, default: float) -> float:
        """A published figure; a malformed one reads as ``default`` (counted), never an error."""
        text = self._get(self._run(field))
        try:
            return kind(text) if text is not None else default
        except ValueError:
            self.skipped[field] += 1
            return default

    def step(self) -> int:
        return self._number("step", int, 0)

    def step_ms(self) -> float:
        return self._number("step_ms", float, float("nan"))

    def count_rearrangement(self, balancedness: float) -> None:
        self.store.add(self._run("rearrangements"), 1)
        self.store.set(self._run("balancedness"), f"{balancedness:.4f}")

    def rearrangements(self) -> int:
        return self.store.add(self._run("rearrangements"), 0)

    def balancedness(self) -> float:
        return self._number("balancedness", float, float("nan"))

    def stop(self) -> None:
        self.store.set(self._run("stop"), "1")

    def stopped(self) -> bool:
        return self.store.check([self._run("stop")])

    def publish_spec(self, text: str) -> None:
        self.store.set(self._run("spec"), text)

    def spec_text(self, timeout_s: float) -> str:
        return self._wait(self._run("spec"), timeout_s, "the run's spec")
