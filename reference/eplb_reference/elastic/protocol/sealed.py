"""``SealedValues``: the run's store read and written through the seal of its secret (``proof.py``).

Every value written carries the seal over its key; every value read is opened before anyone acts on
it, and then decoded against its schema (``values.py``). One without the seal, or malformed, is
logged, counted in ``skipped`` and dropped (a plain value reads as none), never raised into the
loop that read it. ``Board`` spells the keys on top of this.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from datetime import timedelta

import torch.distributed as dist

from eplb_reference.elastic.protocol.proof import RunSecret, Unproven
from eplb_reference.elastic.protocol.values import MalformedValue

log = logging.getLogger("eplb_graph.elastic")
UNPROVEN_POLL_S = 0.05  # a wait that read an unproven value reads again, until the run's own is written
# entries one read takes from a queue: a flood is worked off a bounded step at a time (a store
# queue cannot be emptied at once: torch's TCPStore deletes no queue)
POP_MAX = 1024


class ProtocolTimeout(RuntimeError):
    """A bounded wait ended with nothing written; the message names what was waited for."""


class SealedValues:
    """One client of the run's store whose values carry the run's seal (not thread-safe)."""

    def __init__(self, store: dist.Store, secret: RunSecret) -> None:
        self.store, self.secret = store, secret
        self.skipped: Counter[str] = Counter()  # values dropped, by kind ("unproven ..." or malformed): never acted on

    def _drop(self, what: str, why: object, text: str) -> None:
        self.skipped[what] += 1
        count = self.skipped[what]
        if count & (count - 1) == 0:  # the 1st, 2nd, 4th...: a value read every step cannot flood the log
            log.warning("store value dropped, %s (%d so far; %s): %.80r", what, count, why, text)

    def _open(self, key: str, raw: bytes | None, what: str) -> str | None:
        """The text of a value read under ``key``, or None: absent, or without the run's seal (counted)."""
        if raw is None:
            return None
        sealed = raw.decode(errors="replace")
        try:
            return self.secret.open(key, sealed)
        except Unproven as error:
            self._drop(f"unproven {what}", error, sealed)
            return None

    def _set(self, key: str, text: str) -> None:
        self.store.set(key, self.secret.seal(key, text))

    def _get(self, key: str, what: str) -> str | None:
        return self._open(key, self.store.get(key) if self.store.check([key]) else None, what)

    def _take(self, key: str, what: str) -> str | None:
        present = self.store.check([key])
        raw = self.store.get(key) if present else None
        if present:
            self.store.delete_key(key)
        return self._open(key, raw, what)

    def _wait_written(self, key: str, timeout_s: float, what: str, waited_s: float) -> bytes:
        """What is under ``key`` once something is, within ``timeout_s``."""
        try:
            self.store.wait([key], timedelta(seconds=max(timeout_s, 1e-3)))
        except dist.DistStoreError:
            raise ProtocolTimeout(f"{what}: nothing written under {key} within {waited_s:g} s") from None
        return self.store.get(key)

    def _wait(self, key: str, timeout_s: float, what: str) -> str:
        """The run's value under ``key`` once written; an unproven one there is read past until then."""
        deadline = time.monotonic() + timeout_s
        while True:
            raw = self._wait_written(key, deadline - time.monotonic(), what, timeout_s)
            text = self._open(key, raw, what)
            if text is not None:
                return text
            if time.monotonic() >= deadline:
                raise ProtocolTimeout(f"{what}: no value of the run's under {key} within {timeout_s:g} s")
            time.sleep(UNPROVEN_POLL_S)

    def _wait_first(self, key: str, timeout_s: float, what: str) -> str:
        """The value under ``key`` once written; ``Unproven`` if it is not sealed with this secret."""
        raw = self._wait_written(key, timeout_s, what, timeout_s)
        return self.secret.open(key, raw.decode(errors="replace"))

    def _push(self, key: str, text: str) -> None:
        self.store.queue_push(key, self.secret.seal(key, text))

    def _pop_all(self, key: str, what: str) -> list[str]:
        """The sealed entries queued under ``key`` since the last pop, ``POP_MAX`` at most (the rest
        wait for the next): as many store calls as entries (one other client popping the same queue,
        as a fenced member might, takes what it takes)."""
        entries = []
        for _ in range(min(self.store.queue_len(key), POP_MAX)):
            try:
                entries.append(self._open(key, self.store.queue_pop(key, block=False), what))
            except dist.QueueEmptyError:
                break
        return [entry for entry in entries if entry is not None]

    def _decoded(self, text: str | None, decode, what: str):
        if text is None:
            return None
        try:
            return decode(text)
        except MalformedValue as error:
            self._drop(what, error, text)
            return None

    def _decoded_or_timeout(self, text: str, decode, kind: str, what: str):
        """A waited-for value decoded; a malformed one (a fault) is counted and ends the wait as a timeout."""
        value = self._decoded(text, decode, kind)
        if value is None:
            raise ProtocolTimeout(f"{what}: the value written is malformed ({text[:80]!r})")
        return value

    def _take_checked(self, key: str, decode, what: str):
        return self._decoded(self._take(key, what), decode, what)

    def _pop_checked(self, key: str, decode, queue: str) -> list[dict]:
        """The entries of a queue that carry the seal and decode; any other is logged, counted, dropped."""
        values = (self._decoded(text, decode, queue) for text in self._pop_all(key, queue))
        return [value for value in values if value is not None]

