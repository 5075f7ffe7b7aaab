"""``ElasticServer``: the reference MoE decoder served over an elastic EP group, as a Python API.

It drives the ``Coordinator`` from one watch thread and keeps the requests: each is assigned to
a member of the serving generation, round robin, and stays assigned until its result comes
back through the run's result queue, where it is taken once (a second result for it is
counted as a duplicate and dropped). A member lost has its unfinished requests re-queued to
the survivors once their recovery switched (they restart from their prompt: generation is
deterministic, so the tokens are the same); a member scaled away hands its unfinished
requests back and they are re-queued the same way. ``scale`` follows vLLM's
``/scale_elastic_ep`` contract; the HTTP layer (``http.py``) only maps it onto status codes.
Nothing here waits on the store while holding the server's lock.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from eplb_reference.runtime.config import RunConfig
from eplb_reference.elastic.coordinator import Coordinator
from eplb_reference.elastic.records import Events, ResizeRequest
from eplb_reference.elastic.protocol import Release, RunSecret
from eplb_reference.elastic.recovery import save_expert_source
from eplb_reference.elastic.reshuffle import check_new_size
from eplb_reference.elastic.spec import ElasticSpec, ServeShape

log = logging.getLogger("eplb_graph.elastic.server")
TICK_S = 0.02


class ScaleError(Exception):
    """A refused or failed scale request, with the HTTP status vLLM's endpoint answers it with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ServerStats:
    requests_submitted: int = 0
    requests_completed: int = 0
    requests_requeued: int = 0
    requests_duplicated: int = 0  # results for a request already answered (dropped)
    output_mismatches: int = 0
    reconfigurations: int = 0  # resizes and recoveries switched
    recoveries: int = 0  # members recovered from
    member_failures: int = 0  # members that ended with an error (recovered from like a death)
    members_fenced: int = 0  # members found hung
    store_values_dropped: int = 0  # unproven or malformed store values the coordinator dropped (Board.skipped)


class ElasticServer:
    def __init__(self, cfg: RunConfig, max_ranks: int, *, shape: ServeShape = ServeShape(), spares: int | None = None,
                 deadline_s: float = 30.0, hang_s: float = 10.0, host: str = "127.0.0.1", store_port: int = 0,
                 chaos: bool = False, secret: RunSecret | None = None) -> None:
        cfg.validate()
        check_new_size(cfg.ranks, cfg.num_experts, cfg.num_physical // cfg.ranks, max_ranks)
        self.cfg, self.max_ranks, self.shape = cfg, max_ranks, shape
        self.scratch = tempfile.TemporaryDirectory(prefix="eplb-graph-serve-")
        source = save_expert_source(cfg, Path(self.scratch.name) / "expert_source.pt")
        spec = ElasticSpec(cfg, max_ranks, host, store_port, deadline_s=deadline_s, hang_s=hang_s,
                           expert_source=str(source), serve=shape, chaos=chaos)
        self.coordinator = Coordinator(spec, spares=max_ranks - cfg.ranks if spares is None else spares,
                                       recover_failures=True, secret=secret)
        self.lock = threading.Lock()  # the bookkeeping below, and the coordinator (its store client among it)
        self.answered = threading.Condition(self.lock)
        self.requests: dict[int, dict] = {}  # rid -> the request, until answered
        self.assigned: dict[int, int] = {}  # rid -> member, until answered
        self.results: dict[int, dict] = {}  # answered, not fetched yet
        self.unclaimed: set[int] = set()  # their caller stopped waiting: dropped when answered
        self.leaving: set[int] = set()  # scaled away: what they hand back is awaited
        self.held: list[int] | None = None  # while a drain runs: requests submitted since, not assigned yet
        self.next_rid, self.turn = 0, 0
        self.stats = ServerStats()
        self.scaling = False
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._watch_thread: threading.Thread | None = None

    @property
    def spec(self) -> ElasticSpec:
        return self.coordinator.spec

    @property
    def ranks(self) -> int:
        return len(self.coordinator.members)

    # -- life --------------------------------------------------------------------------

    def start(self, timeout_s: float = 300.0) -> ElasticServer:
        """Starts the members and returns once the group has served its first step."""
        self.coordinator.start_first_generation(self.cfg.ranks)
        self._watch_thread = threading.Thread(target=self._watch, name="elastic-server", daemon=True)
        self._watch_thread.start()
        deadline = time.monotonic() + timeout_s
        while self.progress() == 0:
            if self.error or time.monotonic() > deadline:
                raise RuntimeError(f"the EP group did not start serving: {self.error or 'timed out'}")
            time.sleep(TICK_S)
        return self

    def shutdown(self) -> None:
        self._stop.set()
        if self._watch_thread is not None:
            self._watch_thread.join(30)
        self.coordinator.shutdown()
        self.scratch.cleanup()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the elastic server's coordinator stopped: {self.error!r}") from self.error

    def progress(self) -> int:
        with self.lock:
            return self.coordinator.progress()

    # -- requests ----------------------------------------------------------------------

    def submit(self, prompt_token_ids: list[int], max_new_tokens: int) -> int:
        """Queues a request on a member of the serving generation; returns its id."""
        self.check()
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.cfg.vocab_size
                   for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.cfg.vocab_size})")
        self.shape.check(len(prompt_token_ids), max_new_tokens)
        with self.lock:
            rid, self.next_rid = self.next_rid, self.next_rid + 1
            self.requests[rid] = {"rid": rid, "prompt_token_ids": prompt_token_ids, "max_new_tokens": max_new_tokens}
            self.stats.requests_submitted += 1
            if self.held is None:
                self._assign(rid)
            else:  # a drain runs: it goes to the group the resize leaves behind
                self.held.append(rid)
        return rid

    def _assign(self, rid: int) -> None:
        coordinator = self.coordinator
        members = [m for m in coordinator.members if m not in coordinator.dead] or list(coordinator.members)
        member = members[self.turn % len(members)]
        self.turn += 1
        self.assigned[rid] = member
        coordinator.board.push_request(member, self.requests[rid])

    def result(self, rid: int, timeout_s: float = 120.0) -> dict:
        """Blocks until request ``rid`` is answered; its result, taken once."""
        deadline = time.monotonic() + timeout_s
        with self.answered:
            while rid not in self.results:
                self.check()
                if not self.answered.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
                    if time.monotonic() >= deadline:
                        self.unclaimed.add(rid)
                        raise TimeoutError(f"request {rid} did not finish within {timeout_s:.0f} s")
            return self.results.pop(rid)

    def generate(self, prompt_token_ids: list[int], max_new_tokens: int, timeout_s: float = 120.0) -> dict:
        return self.result(self.submit(prompt_token_ids, max_new_tokens), timeout_s)

    def in_flight(self) -> int:
        with self.lock:
            return len(self.assigned)

    def waiting(self) -> int:
        """Requests held while a drain runs (assigned to the group the resize leaves behind)."""
        with self.lock:
            return len(self.held or ())

    def in_flight_on(self, member: int) -> int:
        with self.lock:
            return sum(m == member for m in self.assigned.values())

    # -- what rank 0 publishes (``/metrics``) ------------------------------------------------

    def last_step_ms(self) -> float:
        with self.lock:
            return self.coordinator.board.step_ms()

    def eplb_rearrangements(self) -> int:
        with self.lock:
            return self.coordinator.board.rearrangements()

    def balancedness(self) -> float:
        with self.lock:
            return self.coordinator.board.balancedness()

    # -- scaling -----------------------------------------------------------------------

    def scale(self, new_size: int, drain_timeout: float | None = None) -> str:
        """Resizes the group to ``new_size`` ranks while it serves; ScaleError otherwise (400 bad
        size, 409 another resize in progress, 408 drain timed out, 500 the resize failed)."""
        try:
            check_new_size(new_size, self.cfg.num_experts, self.coordinator.num_local, self.max_ranks)
        except ValueError as error:
            raise ScaleError(400, str(error)) from None
        with self.lock:
            if self.scaling or self.coordinator.pending() is not None:
                raise ScaleError(409, "a resize of the EP group is already in progress")
            self.scaling = True
        try:
            if new_size == self.ranks:
                return f"Scaled to {new_size} data parallel engines"
            with self.lock:
                request = self.coordinator.request(new_size, hold=drain_timeout is not None)
                if drain_timeout is not None:
                    self.held = []
            if drain_timeout is not None:  # the new generation prepares while the old one drains
                self._drain(request, drain_timeout)
            if not self._settled(request, self.spec.deadline_s + self.spec.timeout_s):
                with self.lock:  # a compare-and-set: where the switch won meanwhile, it stands
                    self.coordinator.give_up(request, f"not switched within the server's {self.spec.deadline_s:g} s "
                                                      f"deadline")
                self._settled(request, self.spec.timeout_s)
            if request.outcome != "switched":
                raise ScaleError(500, f"Scale failed: the resize to {new_size} ranks was {request.outcome}: "
                                      f"{request.why_abandoned or 'no reason recorded'}")
            return f"Scaled to {new_size} data parallel engines"
        finally:
            with self.lock:  # after the switch (or not): the held requests go to the group serving now
                held, self.held = self.held or [], None
                for rid in held:
                    self._assign(rid)
                self.scaling = False

    def _settled(self, request: ResizeRequest, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while request.outcome == "pending" and time.monotonic() < deadline:
            self.check()
            time.sleep(TICK_S)
        return request.outcome != "pending"

    def _drain(self, request: ResizeRequest, timeout_s: float) -> None:
        """Waits for the requests assigned before the resize to finish, then lets it switch; past
        ``timeout_s`` gives it up (its joiners leave, its standby groups are dropped) and answers 408."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight() and request.outcome == "pending":
            if time.monotonic() > deadline:
                with self.lock:
                    self.coordinator.release(request, Release.ABANDON)
                self._settled(request, self.spec.timeout_s)
                raise ScaleError(408, f"Scale failed due to request drain timeout after {timeout_s} seconds; "
                                      f"the resize to {request.new_size} ranks was {request.outcome}")
            time.sleep(TICK_S)
        with self.lock:
            self.coordinator.release(request, Release.GO)

    # -- the watch thread --------------------------------------------------------------

    def _watch(self) -> None:
        try:
            while not self._stop.is_set():
                with self.answered:
                    self._apply(self.coordinator.tick())
                    self._take_results()
                    self._take_handed_back()
                    self.stats.store_values_dropped = sum(self.coordinator.board.skipped.values())
                    if self.coordinator.failures:  # a loss the group cannot recover from
                        raise RuntimeError(f"the EP group cannot keep serving: {self.coordinator.failures}")
                time.sleep(TICK_S)
        except BaseException as error:  # the server can no longer keep its requests: every call says so
            self.error = error
            with self.answered:
                self.answered.notify_all()
            raise

    def _apply(self, events: Events) -> None:
        for fault in events.lost:
            self.stats.member_failures += fault.kind == "failed"
            self.stats.members_fenced += fault.kind == "hung"
        for request, gone in events.switched:
            self.stats.reconfigurations += 1
            self._take_results()  # what the members finished before the switch, before anything is re-queued
            for member in gone:
                if member in self.coordinator.dead:
                    self.stats.recoveries += 1
                    self._requeue([rid for rid, m in self.assigned.items() if m == member])
                else:
                    self.leaving.add(member)

    def _take_results(self) -> None:
        for result in self.coordinator.board.pop_results():
            rid = result.pop("rid")
            if rid not in self.requests:
                self.stats.requests_duplicated += 1
                log.error("request %d answered twice (the second by member %s): dropped", rid, result["member"])
                continue
            del self.requests[rid]
            self.assigned.pop(rid, None)
            if rid in self.unclaimed:
                self.unclaimed.discard(rid)
            else:
                self.results[rid] = result
            self.stats.requests_completed += 1
            self.stats.output_mismatches += not result["matches_reference"]
        self.answered.notify_all()

    def _take_handed_back(self) -> None:
        """A member scaled away hands its unfinished requests back after its last results; one that
        dies first hands nothing back, and everything still assigned to it is re-queued."""
        for member in list(self.leaving):
            handed_back = self.coordinator.board.take_handed_back(member)
            if handed_back is None and member not in self.coordinator.dead:
                continue
            self._take_results()
            self.leaving.discard(member)
            self._requeue([rid for rid, m in self.assigned.items() if m == member])

    def _requeue(self, rids: list[int]) -> None:
        for rid in rids:
            if rid in self.requests:
                self._assign(rid)
                self.stats.requests_requeued += 1
