"""``eplb-graph run --scale-plan 2,4,2``: the scripted workload, resized at fixed steps.

It drives the ``Coordinator``: at each planned step -- read from the step rank 0 publishes --
it asks for the next size, and it kills the members ``--kill`` names once the group served
their step. The members serve the scripted workload and check every output. The raw result
(``report.py`` reads it) holds every member's report, every resize and recovery, the
faults, and every member's log of the batches it completed.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from eplb_reference.elastic.coordinator import Coordinator
from eplb_reference.elastic.recovery import save_expert_source
from eplb_reference.elastic.reshuffle import check_new_size
from eplb_reference.elastic.spec import ElasticSpec
from eplb_reference.runtime.launch import RankFailure


def parse_scale_plan(text: str) -> tuple[int, ...]:
    """'2,4,2' -> (2, 4, 2): the first generation's size, then each resize's."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--scale-plan takes sizes separated by commas, e.g. 2,4,2; got {text!r}") from None
    if len(sizes) < 2:
        raise ValueError(f"--scale-plan needs a first size and at least one resize, got {text!r}")
    return sizes


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


def spares_needed(sizes: list[int], size: int, kills: int) -> int:
    """Warm spares for the largest step up ``sizes`` take from ``size`` (joiners of one resize at
    most: each resize's spares are replaced after it), and one replacement per kill to come."""
    steps_up = [max(0, after - before) for before, after in zip([size, *sizes], sizes)]
    return max(steps_up, default=0) + kills


class ElasticRun:
    """The scripted run over one coordinator: ``plan`` sizes at evenly spaced steps, ``kill_plan``
    (member, step) faults."""

    def __init__(self, spec: ElasticSpec, plan: tuple[int, ...], kill_plan: tuple[tuple[int, int], ...] = (),
                 *, spares: int = 0) -> None:
        self.spec, self.plan = spec, plan
        self.kills = dict(kill_plan)  # member -> the step it is killed at
        self.coordinator = Coordinator(spec, spares=spares)

    def run(self, timeout_s: float = 600.0) -> dict:
        coordinator, steps = self.coordinator, self.spec.cfg.steps
        coordinator.start_first_generation(self.plan[0])
        resizes = [(steps * index // len(self.plan), size) for index, size in enumerate(self.plan[1:], start=1)]
        started = time.monotonic()
        try:
            while not coordinator.settled():
                if coordinator.failures or time.monotonic() - started > timeout_s:
                    break
                time.sleep(0.02)  # the members step meanwhile; the store is read at this pace
                self.on_tick(coordinator.tick())
                self._kill_planned()
                if coordinator.pending() is not None:
                    continue
                if resizes and coordinator.progress() >= resizes[0][0]:
                    target = resizes.pop(0)[1]
                    coordinator.request(target)
                    coordinator.spares_wanted = spares_needed([size for _, size in resizes], target, len(self.kills))
                elif not resizes and coordinator.spares:
                    coordinator.release_spares()
        finally:
            coordinator.shutdown(grace_s=0 if coordinator.failures else 10)
        if coordinator.failures:
            raise RankFailure(coordinator.failures, coordinator.reports)
        if not coordinator.settled():
            raise RankFailure({m: f"still running after {timeout_s:.0f} s" for m in sorted(coordinator.roles)},
                              coordinator.reports)
        return self.raw()

    def on_tick(self, events) -> None:
        """What a subclass adds to each look (fault injection in the tests)."""

    def _kill_planned(self) -> None:
        """Fault injection: SIGKILL, no goodbye, once the group has served the planned step."""
        coordinator = self.coordinator
        for member, step in list(self.kills.items()):
            if coordinator.progress() >= step and member in coordinator.processes.children:
                coordinator.happened[member] = time.monotonic()
                coordinator.processes.kill(member)
                del self.kills[member]

    def raw(self) -> dict:
        coordinator = self.coordinator
        members = sorted(coordinator.processes.children)
        return {"requests": [vars(r) for r in coordinator.requests],
                "members": [coordinator.reports[m] for m in members if m in coordinator.reports],
                "dead": {str(m): when for m, when in coordinator.dead.items()},
                "faults": [vars(f) for f in coordinator.faults],
                "served": {str(m): coordinator.board.served_log(m) for m in members}}


def run_elastic(cfg, plan: tuple[int, ...], max_ranks: int, *, spares: int | None = None, deadline_s: float = 30.0,
                timeout_s: float = 600.0, hang_s: float = 10.0, kills: tuple[tuple[int, int], ...] = (),
                out: Path | None = None) -> dict:
    """The whole scripted run; the raw per-member results and requests (``report.py`` reads them)."""
    cfg.validate()
    for size in plan:
        check_new_size(size, cfg.num_experts, cfg.num_physical // cfg.ranks, max_ranks)
    if plan[0] != cfg.ranks:
        raise ValueError(f"--scale-plan starts at {plan[0]} ranks but --ranks is {cfg.ranks}")
    if not deadline_s > 0:
        raise ValueError(f"--resize-deadline must be > 0 seconds, got {deadline_s}")
    if not hang_s > 0:
        raise ValueError(f"--hang-timeout must be > 0 seconds, got {hang_s}")
    if not cfg.eplb:
        raise ValueError("--scale-plan moves experts with EPLB: it needs EPLB on")
    with tempfile.TemporaryDirectory(prefix="eplb-graph-elastic-") as scratch:
        # the model's weight source on disk, where a dead member's experts are reloaded from
        source = save_expert_source(cfg, Path(out or scratch) / "expert_source.pt")
        spec = ElasticSpec(cfg, max_ranks, "127.0.0.1", 0, deadline_s=deadline_s, hang_s=hang_s,
                           expert_source=str(source))
        if spares is None:
            spares = spares_needed(list(plan[1:]), plan[0], len(kills))
        return ElasticRun(spec, plan, kills, spares=spares).run(timeout_s)
