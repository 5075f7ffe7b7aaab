"""Chaos: random resizes and faults against a serving elastic group under continuous traffic.

``eplb-graph run --chaos SEED`` draws a schedule from the seed -- resizes, SIGKILLs and SIGSTOPs
of serving members, rank 0, spares and joiners, faults during a resize and during a recovery,
and main threads made to hang -- and plays it against an ``ElasticServer`` while client threads
keep sending requests. It passes only if every request was answered exactly once, every
token was the reference decoder's greedy choice, nothing recompiled, and each fault was
detected and served around within its bound.

A member's main thread is made to hang by SIGUSR1 (``member_faults.install_member_faults``, only
in the members of a run with ``chaos`` on): its handler blocks the main thread forever, as a
deadlock would, while the keep-alive thread goes on beating.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import torch

from eplb_reference.elastic.protocol import Phase
from eplb_reference.elastic.server import ElasticServer, ScaleError

log = logging.getLogger("eplb_graph.elastic.chaos")

ACTIONS = ("resize", "kill", "kill_rank0", "stop", "hang", "kill_spare", "stop_spare", "kill_joiner",
           "kill_in_resize", "kill_in_recovery")
FAULTS_PER_ACTION = {"resize": 0, "kill_in_recovery": 2}  # every other action is one fault


def schedule(seed: int, faults: int) -> list[str]:
    """Actions whose faults add up to ``faults``: every action once, then drawn at random."""
    rng = random.Random(seed)
    actions = list(ACTIONS)
    rng.shuffle(actions)
    while sum(FAULTS_PER_ACTION.get(a, 1) for a in actions) < faults:
        actions.append(rng.choice(ACTIONS))
    return actions


@dataclass
class Traffic:
    """Client threads submitting random greedy requests until stopped; every answer kept."""

    server: ElasticServer
    clients: int = 3
    answers: dict[int, dict] = field(default_factory=dict)  # rid -> its answer
    prompts: dict[int, tuple[list[int], int]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def start(self, seed: int) -> Traffic:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(seed * 100 + i,), daemon=True)
                         for i in range(self.clients)]
        for thread in self._threads:
            thread.start()
        return self

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            prompt = [rng.randrange(self.server.cfg.vocab_size) for _ in range(rng.randrange(1, 8))]
            new_tokens = rng.randrange(1, 8)
            try:
                rid = self.server.submit(prompt, new_tokens)
                self.prompts[rid] = (prompt, new_tokens)
                self.answers[rid] = self.server.result(rid, timeout_s=300)
            except Exception as error:  # a request the server failed to answer
                self.errors.append(f"{type(error).__name__}: {error}")
                return

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(360)


def not_greedy(reference: torch.nn.Module, prompts: dict[int, tuple[list[int], int]],
               answers: dict[int, dict], tolerance: float = 1e-4) -> list[int]:
    """Requests whose tokens are not the reference's greedy choice (within float rounding: a token
    whose logit is within ``tolerance`` of the maximum is one), teacher-forced in one forward each."""
    wrong = []
    for rid, answer in answers.items():
        prompt, new_tokens = prompts[rid]
        generated = answer["token_ids"]
        if len(generated) != new_tokens:
            wrong.append(rid)
            continue
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + generated]))[0]  # [S, V]
        for position, token in enumerate(generated, start=len(prompt) - 1):
            if logits[position].max() - logits[position, token] > tolerance:
                wrong.append(rid)
                break
    return wrong


class ChaosRun:
    def __init__(self, server: ElasticServer, seed: int, faults: int, *, detect_bound_s: float,
                 serve_bound_s: float) -> None:
        self.server, self.seed, self.rng = server, seed, random.Random(seed)
        self.actions = schedule(seed, faults)
        self.detect_bound_s, self.serve_bound_s = detect_bound_s, serve_bound_s
        self.records: list[dict] = []

    @property
    def coordinator(self):
        return self.server.coordinator

    def _inject(self, member: int, how: str) -> None:
        with self.server.lock:
            self.coordinator.happened[member] = time.monotonic()
            signum = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "hang": signal.SIGUSR1}[how]
            self.coordinator.processes.signal(member, signum)
        log.info("chaos: %s member %d", how, member)

    def _wait(self, condition, what: str, timeout_s: float):
        """The condition's first truthy value, checking the server while waiting for it."""
        deadline = time.monotonic() + timeout_s
        while not (value := condition()):
            self.server.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"chaos: {what} not within {timeout_s:g} s")
            time.sleep(0.05)
        return value

    def _size_at_least(self, size: int, tries: int = 3) -> None:
        """Grows the group for the next fault; a resize given up (spares not warm by the deadline, a
        fault under it) is the group's to give up: it is asked again."""
        for attempt in range(tries):
            if self.server.ranks >= size:
                return
            try:
                self.server.scale(self.server.max_ranks)
            except ScaleError as error:
                if attempt == tries - 1:
                    raise
                log.info("chaos: growing for the next fault was given up (%s); asking again", error)

    def _spare(self) -> int:
        """A warm spare of ours (one still importing has no keep-alive yet: its bound is the start-up's)."""
        def warm() -> list[int]:
            with self.server.lock:
                seen = self.coordinator.detector.seen
                return [m for m in self.coordinator.spares if m in self.coordinator.processes.children and m in seen
                        and seen[m].alive is not None and seen[m].alive.phase is Phase.SPARE]

        return self._wait(warm, "a warm spare of ours", 300)[0]  # read once: a spare lost since is not returned

    def play(self, action: str) -> None:
        server, coordinator = self.server, self.coordinator
        if action == "resize":
            sizes = [s for s in range(2, server.max_ranks + 1) if s != server.ranks]
            try:
                server.scale(self.rng.choice(sizes), drain_timeout=self.rng.choice([None, 30.0]))
            except ScaleError as error:
                log.info("chaos: resize refused: %s", error)
            return
        if action in ("kill_spare", "stop_spare"):
            self._inject(self._spare(), action.split("_")[0])
            return
        self._size_at_least(3 if action != "kill_in_recovery" else 4)
        members = coordinator.members
        if action in ("kill_joiner", "kill_in_resize"):
            self._during_resize(action)
        elif action == "kill_in_recovery":
            self._inject(self.rng.choice(members[1:]), "kill")
            self._wait(lambda: (coordinator.pending() or coordinator.requests[-1]).kind == "recovery",
                       "the recovery's announcement", 60)
            with self.server.lock:  # one read: the recovery may switch between two
                request = coordinator.pending()
                survivors = list(request.members) if request is not None else []
            if survivors:
                self._inject(self.rng.choice(survivors), "kill")
        else:
            victim = members[0] if action == "kill_rank0" else self.rng.choice(members[1:])
            self._inject(victim, action.replace("_rank0", ""))

    def _during_resize(self, action: str) -> None:
        server, coordinator = self.server, self.coordinator
        if server.ranks == server.max_ranks:
            self._scale_quietly(server.max_ranks - 1)
        outcome: list = []
        thread = threading.Thread(target=lambda: outcome.append(self._scale_quietly(server.max_ranks)))
        thread.start()
        self._wait(lambda: coordinator.pending() is not None or outcome, "the resize's announcement", 60)
        request = coordinator.pending()
        if request is not None:
            joiners = [m for m in request.members if m not in coordinator.members]
            victims = joiners if action == "kill_joiner" else list(coordinator.members[1:])
            self._inject(self.rng.choice(victims), "kill")
        thread.join(600)

    def _scale_quietly(self, size: int) -> str:
        try:
            return self.server.scale(size)
        except ScaleError as error:
            return f"{error.status}: {error}"

    def run(self) -> list[dict]:
        for number, action in enumerate(self.actions):
            before = self.coordinator.fault_count
            started = time.monotonic()
            self.play(action)
            expected = FAULTS_PER_ACTION.get(action, 1)
            self._wait(lambda: self.coordinator.fault_count >= before + expected, f"{action}'s faults detected",
                       self.detect_bound_s + 60)
            records, = self._wait(lambda: self._records_once_serving(number, action, before),
                                  f"{action}: serving again", 300)
            self.records.extend(records)
            log.info("chaos: %d/%d %s done in %.1f s", number + 1, len(self.actions), action,
                     time.monotonic() - started)
        return self.records

    def _records_once_serving(self, number: int, action: str, before: int) -> tuple[list[dict]] | None:
        """The action's faults recorded, once no recovery is pending (a 1-tuple: none may be recorded).
        Under the server's lock: a tick appends a fault and announces its recovery together, and read
        between the two, no recovery is pending yet."""
        with self.server.lock:
            if self.coordinator.pending() is not None:
                return None
            return [self._record(number, action, fault) for fault in self.coordinator.faults_since(before)],

    def _record(self, number: int, action: str, fault) -> dict:
        """One fault: injected (or a member lost that nobody touched), detected after, serving again
        after (the recovery that switched: one given up under a second fault is followed to the next)."""
        recoveries = [r for r in self.coordinator.requests if r.kind == "recovery" and fault.recovery is not None
                      and r.generation >= fault.recovery and r.outcome == "switched"]
        detected = None if fault.happened_s is None else round(fault.detected_s - fault.happened_s, 3)
        serving = round(recoveries[0].settled_s - fault.detected_s, 3) if recoveries else None
        needs_recovery = fault.role == "serving"
        return {"action": number, "kind_injected": action, "member": fault.member, "role": fault.role,
                "injected": fault.happened_s is not None, "detected_as": fault.kind, "why": fault.why,
                "detection_s": detected, "detection_to_serving_s": serving,
                "within_bounds": detected is not None and detected <= self.detect_bound_s
                and (not needs_recovery or (serving is not None and serving <= self.serve_bound_s))}


def run_chaos(server: ElasticServer, seed: int, faults: int, *, clients: int = 3, serve_bound_s: float = 30.0) -> dict:
    """Starts ``server``, plays the seed's schedule under traffic, and checks what must hold."""
    from eplb_reference.models.reference import build_reference_model

    detect_bound_s = server.spec.detection_bound_s
    server.start()
    traffic = Traffic(server, clients).start(seed)
    chaos = ChaosRun(server, seed, faults, detect_bound_s=detect_bound_s, serve_bound_s=serve_bound_s)
    started = time.monotonic()
    try:
        records = chaos.run()
    finally:
        traffic.stop()
        stats = server.stats
        server.shutdown()
    reference = build_reference_model(server.cfg.model_config(), seed=server.cfg.seed).eval()
    reports = server.coordinator.reports.values()
    report = {
        "seed": seed, "actions": chaos.actions, "faults": len(records), "faults_by_kind": {},
        "seconds": round(time.monotonic() - started, 1), "requests_answered": len(traffic.answers),
        "requests_unanswered": len(traffic.errors), "client_errors": traffic.errors[:5],
        "requests_duplicated": stats.requests_duplicated,  # a second result for a request: the server drops it
        "members_lost_not_injected": [r["member"] for r in records if not r["injected"]],
        "requests_requeued": stats.requests_requeued,
        "output_mismatches": stats.output_mismatches + len(not_greedy(reference, traffic.prompts, traffic.answers)),
        "recompiles": sum(r.get("recompiles", 0) for r in reports), "members_reported": len(reports),
        "detect_bound_s": detect_bound_s, "serve_bound_s": serve_bound_s,
        "detection_s_max": max((r["detection_s"] for r in records if r["detection_s"] is not None), default=None),
        "detection_to_serving_s_max": max((r["detection_to_serving_s"] for r in records
                                           if r["detection_to_serving_s"] is not None), default=None),
        "records": records,
    }
    for record in records:
        report["faults_by_kind"][record["kind_injected"]] = report["faults_by_kind"].get(record["kind_injected"], 0) + 1
    report["failed"] = chaos_failures(report)
    return report


def chaos_failures(report: dict) -> list[str]:
    problems = [f"{report[name]} {name.replace('_', ' ')}" for name in (
        "requests_unanswered", "requests_duplicated", "output_mismatches", "recompiles") if report[name]]
    if not report["members_reported"]:  # nothing would say whether anything recompiled
        problems.append("no member reported at the end")
    if report["members_lost_not_injected"]:  # fenced or lost with nothing done to them: a false detection
        problems.append(f"members {report['members_lost_not_injected']} lost that no fault touched")
    late = [r for r in report["records"] if not r["within_bounds"]]
    if late:
        problems.append(f"{len(late)} faults not detected or served around within their bounds: {late[:3]}")
    return problems

