"""``eplb-graph run --scale-plan 2,4,2``: an elastic run, resized at fixed steps by a coordinator.

The coordinator (this process) hosts the TCP store every member joins through, starts the
first generation's member processes, and at each planned step -- read from the step
counter rank 0 keeps in the store -- asks for the next size: it starts the joining members
(new processes, new member ids) or names the survivors, and announces the generation.
The members do the rest between two of their steps (``elastic_member``). The report says
per resize how long the group took from the request to serving at the new size, and the
longest gap with no step completing.
"""

from __future__ import annotations

import queue
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from eplb_graph.runtime.elastic_group import Generation, announce_generation
from eplb_graph.runtime.elastic_member import run_member
from eplb_graph.runtime.elastic_spec import ABANDONED, ElasticSpec
from eplb_graph.runtime.elastic_recovery import save_expert_source, served_log
from eplb_graph.runtime.elastic_reshuffle import check_new_size
from eplb_graph.runtime.launch import Heartbeat, RankFailure, _entry, free_port


def parse_scale_plan(text: str) -> tuple[int, ...]:
    """'2,4,2' -> (2, 4, 2): the first generation's size, then each resize's."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--scale-plan takes sizes separated by commas, e.g. 2,4,2; got {text!r}") from None
    if len(sizes) < 2:
        raise ValueError(f"--scale-plan needs a first size and at least one resize, got {text!r}")
    return sizes


def check_scale_plan(plan: tuple[int, ...], num_logical: int, num_local: int, max_ranks: int) -> None:
    for size in plan:
        check_new_size(size, num_logical, num_local, max_ranks)


@dataclass
class ResizeRequest:
    generation: int
    old_size: int
    new_size: int
    requested_s: float  # monotonic
    at_step: int
    members: tuple[int, ...]
    outcome: str = "pending"  # "switched" | "abandoned"
    kind: str = "resize"  # or "recovery": the survivors of a member that died
    died_s: float | None = None  # a recovery: when the member died (killed, or found dead)
    why_abandoned: str | None = None  # as rank 0 gave it up


@dataclass
class ElasticRun:
    spec: ElasticSpec
    plan: tuple[int, ...]
    kill_plan: tuple[tuple[int, int], ...] = ()  # (member, step): fault injection
    member_fn: Callable = run_member  # a member process's body, and what it takes after its first generation
    member_args: tuple = ()
    ctx: object = field(default_factory=lambda: mp.get_context("spawn"))

    def __post_init__(self) -> None:
        self.store = dist.TCPStore(self.spec.store_host, self.spec.store_port, is_master=True,
                                   wait_for_workers=False, timeout=timedelta(seconds=self.spec.timeout_s))
        self.results = self.ctx.Queue()
        self.processes: dict[int, object] = {}
        self.done: dict[int, dict] = {}
        self.failures: dict[int, str] = {}
        self.requests: list[ResizeRequest] = []
        self.spares: list[int] = []
        self.kills: dict[int, int] = dict(self.kill_plan)  # member -> the step it is killed at
        self.killed_s: dict[int, float] = {}
        self.dead: dict[int, float] = {}  # member -> when it died (monotonic)
        self.current, self.next_index = 0, 1  # the generation serving now, the next one to announce
        self.num_local = self.spec.cfg.num_physical // self.spec.cfg.ranks

    def start(self, member: int, first_generation: int | None) -> None:
        address = f"{self.spec.store_host}:{self.spec.store_port}"
        args = (self.spec, first_generation, *self.member_args)
        process = self.ctx.Process(target=_entry, daemon=True, args=(
            self.member_fn, member, self.spec.max_ranks, address, args, self.results, Heartbeat(self.ctx), False))
        process.start()
        self.processes[member] = process

    def progress(self) -> int:
        key = self.spec.key("step")
        return int(self.store.get(key)) if self.store.check([key]) else 0

    def new_member(self) -> int:
        return max(self.processes) + 1

    def top_up_spares(self, count: int) -> None:
        """Warm spares: member processes that build and compile now and wait in the store."""
        while len(self.spares) < count:
            member = self.new_member()
            self.start(member, None)
            self.spares.append(member)

    def request(self, generation: int, members: tuple[int, ...], new_size: int, *, hold: bool = False) -> tuple[int, ...]:
        """Assigns spares (or starts new processes) to join, announces the generation; returns its members.
        ``hold``: the members prepare but do not switch before ``release``."""
        if hold:  # before the announcement: every member reads it when it starts preparing
            self.store.set(self.spec.key("gen", generation, "hold"), "1")
        new_members = members[:new_size]
        for _ in range(new_size - len(members)):
            if self.spares:
                member = self.spares.pop(0)
                self.store.set(self.spec.key("spare", member), str(generation))
            else:
                member = self.new_member()
                self.start(member, generation)
            new_members += (member,)
        self.requests.append(ResizeRequest(generation, len(members), new_size, time.monotonic(), self.progress(),
                                           new_members))
        announce_generation(self.store, self.spec.name, Generation(generation, new_members))
        return new_members

    def release(self, generation: int, *, go: bool) -> None:
        """A held resize may switch (``go``), or is given up: its joiners leave, its groups are dropped."""
        self.store.set(self.spec.key("gen", generation, "release"), "go" if go else "abandon")

    def outcome(self, request: ResizeRequest) -> str:
        """"pending", "switched" or "abandoned" (then ``request.why_abandoned`` says why, where rank 0 said)."""
        key = self.spec.key("gen", request.generation, "switch")
        if not self.store.check([key]):
            return "pending"
        if self.store.get(key).decode() != ABANDONED:
            return "switched"
        why = self.spec.key("gen", request.generation, "why_abandoned")
        request.why_abandoned = self.store.get(why).decode() if self.store.check([why]) else None
        return "abandoned"

    def start_first_generation(self, spares: int) -> None:
        """Members 0..plan[0]-1 as generation 0, and ``spares`` warm spares beside them."""
        self.members = tuple(range(self.plan[0]))
        announce_generation(self.store, self.spec.name, Generation(0, self.members))
        for member in self.members:
            self.start(member, 0)
        self.top_up_spares(spares)

    def run(self, spares: int, timeout_s: float = 600.0) -> dict:
        cfg = self.spec.cfg
        self.start_first_generation(spares)
        resize_steps = [cfg.steps * index // len(self.plan) for index in range(1, len(self.plan))]
        sizes = list(self.plan[1:])
        started = time.monotonic()
        try:
            while len(self.done) + len(self.failures) + len(self.dead) < len(self.processes):
                self.recover_without(self._collect())
                if self.failures or time.monotonic() - started > timeout_s:
                    break
                self._kill_planned()
                pending = self.requests and self.requests[-1].outcome == "pending"
                if pending:
                    self.requests[-1].outcome = self.outcome(self.requests[-1])
                    if self.requests[-1].outcome == "switched":
                        self.members, self.current = self.requests[-1].members, self.requests[-1].generation
                        self.recover_without(self.dead_members(self.requests[-1]))
                        if resize_steps:
                            self.top_up_spares(spares)
                elif not resize_steps and self.spares:
                    self.release_spares()
                elif resize_steps and self.progress() >= resize_steps[0]:
                    resize_steps.pop(0)
                    self.request(self.next_index, self.members, sizes.pop(0))
                    self.next_index += 1
        finally:
            for process in self.processes.values():
                if process.is_alive():
                    process.kill()
                process.join(5)
        if self.failures:
            raise RankFailure(self.failures, self.done)
        missing = set(self.processes) - set(self.done) - set(self.dead)
        if missing:
            raise RankFailure({m: f"still running after {timeout_s:.0f} s" for m in sorted(missing)}, self.done)
        served = {str(m): served_log(self.store, self.spec.key("served_log", m)) for m in sorted(self.processes)}
        return {"requests": [vars(r) for r in self.requests], "members": [self.done[m] for m in sorted(self.done)],
                "dead": {str(m): when for m, when in self.dead.items()}, "served": served}

    def _kill_planned(self) -> None:
        """Fault injection: SIGKILL, no goodbye, once the group has served the planned step."""
        for member, step in list(self.kills.items()):
            if self.progress() >= step and member in self.processes:
                self.processes[member].kill()
                self.killed_s[member] = time.monotonic()
                del self.kills[member]

    def recover_without(self, members: list[int]) -> int:
        """Members died (every death seen at once: one recovery leaves them all out): the survivors
        get a recovery generation. A pending resize they broke the serving group of is given up
        here; one they were to join, rank 0 gives up. A switch written first wins, and the members
        that died are recovered from once it is seen (``dead_members``). Returns how many members
        were recovered from: 0 where there was nothing to recover (spares, joiners that never
        served) or nothing to recover with (then ``failures`` says why)."""
        for member in members:
            self.dead.setdefault(member, self.killed_s.get(member, time.monotonic()))
        request = self.requests[-1] if self.requests and self.requests[-1].outcome == "pending" else None
        joiners = [m for m in members if request is not None and m in request.members and m not in self.members]
        if joiners:  # the serving group is intact, and rank 0 settles the resize at its next step
            # (given up; or switched already, and then ``dead_members`` names them to recover from)
            self.store.set(self.spec.key("gen", request.generation, "cancel"), ",".join(map(str, joiners)))
        serving = [m for m in members if m in self.members]
        if request is not None and serving:  # the serving group broke: nobody else settles the resize
            key = self.spec.key("gen", request.generation, "switch")
            if self.store.compare_set(key, "", ABANDONED).decode() != ABANDONED:
                return 0  # rank 0 switched first: once that is seen, its dead are recovered from
            request.outcome, request.why_abandoned = "abandoned", f"member {', '.join(map(str, serving))} died"
            self.store.set(self.spec.key("gen", request.generation, "why_abandoned"), request.why_abandoned)
        if not serving:
            return 0
        # the first survivor is the new rank 0; a member that died before (its recovery given up) is no survivor
        survivors = tuple(m for m in self.members if m not in self.dead)
        if len(survivors) * self.num_local < self.spec.cfg.num_experts:
            for member in serving:
                self.failures[member] = (f"died and cannot be recovered from: {len(survivors)} survivors x "
                                         f"{self.num_local} slots cannot host {self.spec.cfg.num_experts} experts")
            return 0
        index, self.next_index = self.next_index, self.next_index + 1
        self.requests.append(ResizeRequest(index, len(self.members), len(survivors), time.monotonic(),
                                           self.progress(), survivors, kind="recovery",
                                           died_s=min(self.dead[m] for m in serving)))
        announce_generation(self.store, self.spec.name, Generation(index, survivors))
        self.store.set(self.spec.key("recovery", self.current), str(index))
        return len(serving)

    def dead_members(self, request: ResizeRequest) -> list[int]:
        """Members of a resize that switched who died before the switch was seen (joiners, or serving
        members that died as it switched): recovered from now, as members of the generation serving."""
        return [member for member in request.members if member in self.dead] if request.outcome == "switched" else []

    def release_spares(self) -> None:
        """No resize is left: the spares end without serving."""
        for member in self.spares:
            self.store.set(self.spec.key("spare", member), "stop")
        self.spares = []

    def _collect(self) -> list[int]:
        """Reports in; returns the members that died without one (recovered from where the run
        has a weight source, failures otherwise)."""
        died = []
        try:
            member, ok, value = self.results.get(timeout=0.05)
            (self.done if ok else self.failures)[member] = value
        except queue.Empty:
            for member, process in self.processes.items():
                if member in self.done or member in self.failures or member in self.dead or process.is_alive():
                    continue
                try:  # a process killed by a signal left no last message to wait for
                    m, ok, value = self.results.get(timeout=0.0 if process.exitcode < 0 else 1.0)
                    (self.done if ok else self.failures)[m] = value
                except queue.Empty:
                    if self.spec.expert_source is None:
                        self.failures[member] = f"process died with exit code {process.exitcode}"
                    else:
                        died.append(member)
        return died


def parse_kills(texts: list[str]) -> tuple[tuple[int, int], ...]:
    """['3@150'] -> ((3, 150),): member 3 is killed (SIGKILL) once the group served step 150."""
    kills = []
    for text in texts:
        try:
            member, step = (int(part) for part in text.split("@"))
        except ValueError:
            raise ValueError(f"--kill takes MEMBER@STEP, e.g. 3@150; got {text!r}") from None
        if member < 0 or step < 1:
            raise ValueError(f"--kill {text}: the member must be >= 0 and the step >= 1")
        kills.append((member, step))
    return tuple(kills)


def run_elastic(cfg, plan: tuple[int, ...], max_ranks: int, *, spares: int | None = None, deadline_s: float = 30.0,
                timeout_s: float = 600.0, kills: tuple[tuple[int, int], ...] = (), out: Path | None = None) -> dict:
    """The whole scripted run; the raw per-member results and requests (``elastic_report`` reads them)."""
    cfg.validate()
    check_scale_plan(plan, cfg.num_experts, cfg.num_physical // cfg.ranks, max_ranks)
    if plan[0] != cfg.ranks:
        raise ValueError(f"--scale-plan starts at {plan[0]} ranks but --ranks is {cfg.ranks}")
    if not deadline_s > 0:
        raise ValueError(f"--resize-deadline must be > 0 seconds, got {deadline_s}")
    if not cfg.eplb:
        raise ValueError("--scale-plan moves experts with EPLB: it needs EPLB on")
    with tempfile.TemporaryDirectory(prefix="eplb-graph-elastic-") as scratch:
        # the model's weight source on disk, where a dead member's experts are reloaded from
        source = save_expert_source(cfg, Path(out or scratch) / "expert_source.pt")
        spec = ElasticSpec(cfg, max_ranks, "127.0.0.1", free_port(), deadline_s=deadline_s,
                           expert_source=str(source))
        if spares is None:  # enough warm spares for the largest step up the plan takes, and a replacement per kill
            spares = max(max(0, after - before) for before, after in zip(plan, plan[1:])) + len(kills)
        return ElasticRun(spec, plan, kills).run(spares, timeout_s)
