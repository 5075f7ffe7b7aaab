"""``ElasticServer``: the reference MoE decoder served over an elastic EP group, as a Python API.

It owns the coordinator (``ElasticRun``: the TCP store, the member processes, the
generations) and the request bookkeeping: every request is assigned to one member of the
current generation, round robin, and stays assigned until its result is in the store. A
member that dies has its unfinished requests re-queued to the survivors (they restart from
their prompt: generation is deterministic, so the tokens are the same); a member scaled
away hands its unfinished requests back and they are re-queued the same way. ``scale``
follows vLLM's ``/scale_elastic_ep`` contract; the HTTP layer (``elastic_http``) only maps
it onto status codes.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from eplb_graph.runtime.config import RunConfig
from eplb_graph.runtime.elastic_spec import ElasticSpec
from eplb_graph.runtime.elastic_recovery import save_expert_source
from eplb_graph.runtime.elastic_reshuffle import check_new_size
from eplb_graph.runtime.elastic_run import ElasticRun
from eplb_graph.runtime.elastic_serving import ServeShape, run_serving_member
from eplb_graph.runtime.launch import free_port


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
    output_mismatches: int = 0
    reconfigurations: int = 0
    recoveries: int = 0
    member_failures: int = 0  # members that ended with an error (recovered from like a death)


class ElasticServer:
    def __init__(self, cfg: RunConfig, max_ranks: int, *, shape: ServeShape = ServeShape(), spares: int | None = None,
                 deadline_s: float = 30.0) -> None:
        cfg.validate()
        check_new_size(cfg.ranks, cfg.num_experts, cfg.num_physical // cfg.ranks, max_ranks)
        self.cfg, self.max_ranks, self.shape = cfg, max_ranks, shape
        self.scratch = tempfile.TemporaryDirectory(prefix="eplb-graph-serve-")
        source = save_expert_source(cfg, Path(self.scratch.name) / "expert_source.pt")
        spec = ElasticSpec(cfg, max_ranks, "127.0.0.1", free_port(), deadline_s=deadline_s, expert_source=str(source))
        self.coordinator = ElasticRun(spec, (cfg.ranks,), member_fn=run_serving_member, member_args=(shape,))
        self.spares = max_ranks - cfg.ranks if spares is None else spares
        self.lock = threading.Lock()  # the assignments and the coordinator's generations
        self.assigned: dict[int, int] = {}  # request id -> member, until its result is in
        self.next_rid, self.turn = 0, 0
        self.stats = ServerStats()
        self.scaling = False
        self.held: list[int] | None = None  # while a drain runs: requests submitted since, not assigned yet
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self.error: BaseException | None = None
        self.failed_members: dict[int, str] = {}  # member -> its error, once it ended with one
        self._clients = threading.local()

    @property
    def spec(self) -> ElasticSpec:
        return self.coordinator.spec

    @property
    def store(self):
        return self.coordinator.store

    @property
    def ranks(self) -> int:
        return len(self.coordinator.members)

    # -- life --------------------------------------------------------------------------

    def start(self, timeout_s: float = 300.0) -> ElasticServer:
        """Starts the members and returns once the group has served its first step."""
        run = self.coordinator
        run.start_first_generation(self.spares)
        self._monitor = threading.Thread(target=self._watch, name="elastic-server", daemon=True)
        self._monitor.start()
        deadline = time.monotonic() + timeout_s
        while run.progress() == 0:
            why = self.error or run.failures or self.failed_members
            if why or time.monotonic() > deadline:
                raise RuntimeError(f"the EP group did not start serving: {why or 'timed out'}")
            time.sleep(0.05)
        return self

    def shutdown(self) -> None:
        self.store.set(self.spec.key("stop"), "1")
        self.coordinator.release_spares()
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(30)
        for process in self.coordinator.processes.values():
            process.join(30)
            if process.is_alive():
                process.kill()
        self.scratch.cleanup()

    # -- requests ----------------------------------------------------------------------

    def submit(self, prompt_token_ids: list[int], max_new_tokens: int) -> int:
        """Queues a request on a member of the current generation; returns its id."""
        self.check()
        if not all(isinstance(t, int) and 0 <= t < self.cfg.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.cfg.vocab_size})")
        self.shape.check(len(prompt_token_ids), max_new_tokens)
        with self.lock:
            rid, self.next_rid = self.next_rid, self.next_rid + 1
            self.store.set(self.spec.key("req", rid), json.dumps(
                {"prompt_token_ids": prompt_token_ids, "max_new_tokens": max_new_tokens}))
            if self.held is None:
                self._assign(rid)
            else:  # a drain runs: it goes to the group the resize leaves behind
                self.held.append(rid)
            self.stats.requests_submitted += 1
        return rid

    def _assign(self, rid: int) -> None:
        members = self.coordinator.members
        member = members[self.turn % len(members)]
        self.turn += 1
        self.assigned[rid] = member
        self.store.append(self.spec.key("inbox", member), f"{rid};")

    def result(self, rid: int, timeout_s: float = 120.0) -> dict:
        """Blocks until request ``rid`` finished: on this thread's own store client, since a client
        blocked in a wait holds up every other call made through it."""
        self.check()
        client = self._client()
        key = self.spec.key("res", rid)
        try:
            client.wait([key], timedelta(seconds=timeout_s))
        except RuntimeError:
            self.check()
            raise TimeoutError(f"request {rid} did not finish within {timeout_s:.0f} s") from None
        return json.loads(client.get(key))

    def _client(self):
        """This thread's own store client: one blocked in a wait holds up every call made through it."""
        client = getattr(self._clients, "store", None)
        if client is None:
            client = self._clients.store = self.spec.connect()
        return client

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
        """Requests assigned to ``member`` and not finished yet."""
        with self.lock:
            return sum(m == member for m in self.assigned.values())

    # -- what the members publish (``/metrics``) ---------------------------------------------

    def _published(self, *parts: str) -> float:
        key, client = self.spec.key(*parts), self._client()
        return float(client.get(key)) if client.check([key]) else float("nan")

    def last_step_ms(self) -> float:
        return self._published("step_ms")

    def eplb_rearrangements(self) -> int:
        return self._client().add(self.spec.key("eplb", "rearrangements"), 0)

    def balancedness(self) -> float:
        return self._published("eplb", "balancedness")

    # -- scaling -----------------------------------------------------------------------

    def scale(self, new_size: int, drain_timeout: float | None = None) -> str:
        """Resizes the group to ``new_size`` ranks while it serves; ScaleError otherwise (400 bad
        size, 409 another resize in progress, 408 drain timed out, 500 the resize failed)."""
        try:
            check_new_size(new_size, self.cfg.num_experts, self.coordinator.num_local, self.max_ranks)
        except ValueError as error:
            raise ScaleError(400, str(error)) from None
        with self.lock:
            run = self.coordinator
            if self.scaling or (run.requests and run.requests[-1].outcome == "pending"):
                raise ScaleError(409, "a resize of the EP group is already in progress")
            self.scaling = True
        try:
            if new_size == self.ranks:
                return f"Scaled to {new_size} data parallel engines"
            with self.lock:
                run = self.coordinator
                run.request(run.next_index, run.members, new_size, hold=drain_timeout is not None)
                run.next_index += 1
                request = run.requests[-1]
                if drain_timeout is not None:
                    self.held = []
            if drain_timeout is not None:  # the new generation prepares while the old one drains
                self._drain(request, drain_timeout)
            deadline = time.monotonic() + self.spec.deadline_s + self.spec.timeout_s
            while request.outcome == "pending" and time.monotonic() < deadline:
                time.sleep(0.02)
            if request.outcome != "switched":
                failed = {m: why for m, why in self.failed_members.items() if m in request.members}
                died = [m for m in request.members if m in run.dead and m not in failed]
                reason = "" if failed or died or request.why_abandoned is None else f": {request.why_abandoned}"
                raise ScaleError(500, f"Scale failed: the resize to {new_size} ranks was {request.outcome}{reason}"
                                      + "".join(f"; member {m} failed: {why}" for m, why in failed.items())
                                      + "".join(f"; member {m} died" for m in died))
            return f"Scaled to {new_size} data parallel engines"
        finally:
            with self.lock:  # after the switch (or not): the held requests go to the group serving now
                held, self.held = self.held or [], None
                for rid in held:
                    self._assign(rid)
            self.scaling = False

    def _drain(self, request, timeout_s: float) -> None:
        """Waits for the requests assigned before the resize to finish, then lets it switch; past
        ``timeout_s`` gives it up (its joiners leave, its standby groups are dropped) and answers 408."""
        run = self.coordinator
        deadline = time.monotonic() + timeout_s
        while self.in_flight() and request.outcome == "pending":
            if time.monotonic() > deadline:
                with self.lock:  # the store's master client is the watch thread's too
                    run.release(request.generation, go=False)
                while request.outcome == "pending" and time.monotonic() < deadline + self.spec.timeout_s:
                    time.sleep(0.02)
                raise ScaleError(408, f"Scale failed due to request drain timeout after {timeout_s} seconds; "
                                      f"the resize to {request.new_size} ranks was {request.outcome}")
            time.sleep(0.02)
        with self.lock:
            run.release(request.generation, go=True)

    # -- the coordinator's loop --------------------------------------------------------

    def _watch(self) -> None:
        try:
            self._watch_loop()
        except BaseException as error:  # the server can no longer keep its requests: every call says so
            self.error = error
            raise

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the elastic server's coordinator stopped: {self.error!r}") from self.error

    def _watch_loop(self) -> None:
        run = self.coordinator
        while not self._stop.is_set():
            lost = run._collect() + self._failed_since()
            with self.lock:
                # their requests are re-queued once the survivors switched
                self.stats.recoveries += run.recover_without(lost)
                if run.failures:  # a loss the group cannot recover from: every call says so from now on
                    raise RuntimeError(f"the EP group cannot keep serving: {run.failures}"
                                       + "".join(f"; member {m} had failed: {why}" for m, why in self.failed_members.items()))
                request = run.requests[-1] if run.requests else None
                if request is not None and request.outcome == "pending":
                    request.outcome = run.outcome(request)
                    if request.outcome == "switched":
                        self._switched(request)
                        self.stats.recoveries += run.recover_without(run.dead_members(request))
                    elif request.outcome == "abandoned":  # its joiners leave: warm up others for the next
                        run.top_up_spares(self.spares)
                self._collect_results()

    def _failed_since(self) -> list[int]:
        """Members that reported an error since the last look: a serving process that fails is lost
        to the group as a killed one is, and is recovered from the same way."""
        run = self.coordinator
        failed = [m for m in run.failures if m in run.processes and m not in run.dead]
        for member in failed:
            self.failed_members[member] = run.failures.pop(member)
            self.stats.member_failures += 1
        return failed

    def _switched(self, request) -> None:
        run = self.coordinator
        gone = [m for m in run.members if m not in request.members]
        run.members, run.current = request.members, request.generation
        self.stats.reconfigurations += 1
        for member in gone:  # scaled away or dead: what it had not finished goes to the new generation
            if member not in run.dead:  # a leaver stops reading its inbox once it handed its requests back
                self.store.wait([self.spec.key("returned", member)], timedelta(seconds=self.spec.timeout_s))
            self._requeue([rid for rid, m in self.assigned.items() if m == member])
        run.top_up_spares(self.spares)

    def _requeue(self, rids: list[int]) -> None:
        for rid in rids:
            if rid in self.assigned and not self.store.check([self.spec.key("res", rid)]):
                self._assign(rid)
                self.stats.requests_requeued += 1

    def _collect_results(self) -> None:
        for rid in list(self.assigned):
            key = self.spec.key("res", rid)
            if self.store.check([key]):
                del self.assigned[rid]
                self.stats.requests_completed += 1
                self.stats.output_mismatches += not json.loads(self.store.get(key))["matches_reference"]
