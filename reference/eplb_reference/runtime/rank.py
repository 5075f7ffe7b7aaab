"""The main job: a reference MoE decoder over real EP ranks with live EPLB, step by step.

One process per EP rank (``eplb_reference.runtime.launch``; the per-rank body ``run_rank`` also runs
under torchrun). Each rank builds the same seeded model, keeps its slice of the physical
experts, and runs server-shaped batches (``eplb_reference.runtime.workload``) in one of three modes:

    eager     the EP model as written (the block calls map_and_record_layer itself)
    compiled  torch.compile(fullgraph=True) with the EPLB pass inserting the routing op
    graph     CUDA graph capture/replay per capture size on CUDA; on CPU, compiled mode
              *is* the graph mode (there is no capture on the host)

EPLB steps and layer commits happen only between forwards/replays (``begin_batch`` /
``end_batch``). Every step checks the output against the no-EPLB model (logical experts,
one process, the same expert kernels) and records balancedness from the global load.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from eplb_reference.runtime.compile import prepare_step, unique_graphs
from eplb_reference.runtime.config import RunConfig
from eplb_reference.runtime.groups import rank_session, shutdown_expert_parallel
from eplb_reference.runtime.launch import Heartbeat
from eplb_reference.runtime.report import balancedness
from eplb_reference.runtime.stack import RankStack, build_rank_stack
from eplb_reference.runtime.step import TimedStep, check_output, rank_device, timed_step
from eplb_reference.runtime.step_probes import StepProbes
from eplb_reference.runtime.workload import Batch, make_batch


@dataclass
class RankResult:
    rank: int
    step_ms: list[float] = field(default_factory=list)
    step_end_s: list[float] = field(default_factory=list)  # every step's end, monotonic (its gaps: the whole step)
    eplb_host_ms: list[float] = field(default_factory=list)  # of step_ms: begin_batch + end_batch (commits)
    kinds: list[str] = field(default_factory=list)
    rebalancing: list[bool] = field(default_factory=list)
    rank_load: list[list[list[int]]] = field(default_factory=list)  # per step: [layers][ranks], all ranks' tokens
    logical_load: list[list[list[int]]] = field(default_factory=list)  # per step: [layers][logical experts]
    rearrangement_finished_steps: list[int] = field(default_factory=list)
    breakdown: list[dict] = field(default_factory=list)  # cfg.step_breakdown: StepProbes' record per timed step
    layers_committed: int = 0
    rearrangements_started: int = 0
    rearrangements_finished: int = 0
    placement_restored: bool = False  # the experts started from cfg.placement_file
    rearrangement_stalls: int = 0  # rearrangements in flight past the watchdog's bound with no layer committed
    output_mismatches: int = 0
    first_mismatch_step: int | None = None
    first_mismatch_during_rearrangement: bool | None = None  # a rearrangement in flight at that step
    nonfinite_output_steps: int = 0  # steps with NaN/Inf outputs where the reference is finite
    max_abs_diff: float = 0.0  # over the entries finite in both
    recompiles: int = 0
    recaptures: int | None = None  # None: this mode captures no graphs (every mode on CPU)
    compile_or_capture_s: float = 0.0
    intra_op_threads: int = 0  # torch's, in this rank's process
    verifier_ok: bool = True
    routers_mapped: int = 0
    tokens: int = 0


def _global_loads(rank_layers, ep_size: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's load over all ranks' batches: per rank [L, ranks] and per logical expert [L, E]."""
    import torch.distributed as dist

    load = torch.stack([layer.tables.load.to("cpu", torch.int64) for layer in rank_layers])  # [L, P]
    if ep_size > 1:
        dist.all_reduce(load, group=group)
    num_logical = rank_layers[0].tables.num_logical_experts
    logical = torch.stack([
        torch.zeros(num_logical, dtype=torch.int64).index_add_(0, layer.tables.physical_to_logical, row)
        for layer, row in zip(rank_layers, load)
    ])
    return load.view(load.shape[0], ep_size, -1).sum(-1), logical


class RankRun:
    """One rank's run, step by step: the timed step, its bookkeeping, the output check."""

    def __init__(self, stack: RankStack, world_size: int, cpu_group, heartbeat: Heartbeat | None) -> None:
        self.stack, self.cfg, self.world_size, self.cpu_group = stack, stack.cfg, world_size, cpu_group
        self.heartbeat = heartbeat
        self.result = RankResult(stack.rank, intra_op_threads=torch.get_num_threads())
        self.records: list = []  # what the EPLB backend compiled: routers mapped, verifier reports
        models = stack.models
        self.forward, self.captured = prepare_step(models.model, self.cfg, models.rank_layers, models.flags, self.records)
        if self.captured is not None:
            self.result.compile_or_capture_s += self.captured.stats.capture_s
        self.workload = self.cfg.workload()
        self.device = rank_device(self.cfg)
        self.seen_sizes: set[int] = set()
        self.graphs_after_warmup: int | None = None
        # after the controller started upstream's worker; the first (compiling) step is not recorded
        self.probes = StepProbes(stack.controller) if self.cfg.step_breakdown and stack.controller is not None else None
        self.progress = None
        if self.cfg.progress and stack.rank == 0:
            from tqdm import tqdm

            self.progress = tqdm(total=self.cfg.steps, desc=f"{self.cfg.mode} x{world_size} ranks", unit="step")

    def run(self) -> RankResult:
        for step in range(self.cfg.steps):
            self.step(step)
        return self.finish()

    def step(self, step: int) -> None:
        batch = make_batch(self.workload, step, self.stack.rank).to(self.device)
        controller = self.stack.controller
        busy = controller is not None and controller.rebalancing
        finished_before = controller.stats.rearrangements_finished if controller is not None else 0
        record = self._record_loads if self.cfg.eplb and self.cfg.collect_load_stats else None
        if self.probes is not None:
            self.probes.begin_step()
        timed = timed_step(self.forward, batch, self.device, controller, record,
                           self.captured.check_addresses if self.captured is not None else None)
        probed = self.probes.end_step(step, timed.seconds, timed.eplb_host_s) if self.probes is not None else None
        if controller is not None:
            busy = busy or controller.rebalancing  # the step that starts a rearrangement pays for it
            if controller.stats.rearrangements_finished > finished_before:
                self.result.rearrangement_finished_steps.append(step)
        self._account(batch, timed, busy, probed)
        if self.heartbeat is not None:
            self.heartbeat.beat()
        if self.progress is not None:
            self._show_progress(step)
        if self.cfg.check_outputs:
            self._check(step, batch, timed.out, busy)
        self.result.step_end_s.append(time.monotonic())

    def _account(self, batch: Batch, timed: TimedStep, busy: bool, probed: dict | None = None) -> None:
        result, size = self.result, batch.tokens.shape[1]
        if size not in self.seen_sizes:  # first forward of a capture size: compile, not a step
            self.seen_sizes.add(size)
            result.compile_or_capture_s += timed.seconds
            if self.seen_sizes == self.workload.capture_sizes_used():
                self.graphs_after_warmup = unique_graphs()
        else:  # timed steps only, aligned lists
            result.step_ms.append(timed.seconds * 1e3)
            result.eplb_host_ms.append(timed.eplb_host_s * 1e3)
            result.kinds.append(batch.kind)
            result.rebalancing.append(busy)
            if probed is not None:
                result.breakdown.append(probed)
        result.tokens += batch.num_tokens

    def _record_loads(self) -> None:
        """This step's global load, for balancedness (before end_batch folds it into upstream's window)."""
        per_rank, logical_load = _global_loads(self.stack.rank_layers, self.world_size, self.cpu_group)
        self.result.rank_load.append(per_rank.tolist())
        self.result.logical_load.append(logical_load.tolist())

    def _show_progress(self, step: int) -> None:
        self.progress.update(1)
        interval = self.cfg.step_interval
        if self.result.rank_load and (step + 1) % interval == 0:
            balance = balancedness(torch.tensor(self.result.rank_load[-interval:]).sum(0))  # [L, ranks]
            stats = self.stack.controller.stats
            self.progress.write(
                f"steps {step + 2 - interval:>4}-{step + 1:<4} balancedness {balance:.3f}  "
                f"rearrangements started {stats.rearrangements_started} finished "
                f"{stats.rearrangements_finished}  layers committed {stats.layers_committed}"
            )

    def _check(self, step: int, batch: Batch, out: torch.Tensor, busy: bool) -> None:
        real = slice(0, batch.num_tokens)
        check = check_output(out[:, real], self.stack.models.reference(batch.tokens)[:, real], self.cfg.output_tolerance)
        result = self.result
        result.max_abs_diff = max(result.max_abs_diff, check.max_abs_diff)
        result.nonfinite_output_steps += check.nonfinite
        if not check.ok:
            result.output_mismatches += 1
            if result.first_mismatch_step is None:  # where to look: the step, and whether a move was in flight
                result.first_mismatch_step, result.first_mismatch_during_rearrangement = step, busy

    def finish(self) -> RankResult:
        result = self.result
        if self.graphs_after_warmup is not None:
            result.recompiles = unique_graphs() - self.graphs_after_warmup
        if self.captured is not None:
            result.recaptures = self.captured.stats.recaptures
        if self.progress is not None:
            self.progress.close()
        if self.probes is not None:
            self.probes.close()  # before the stack closes: its wrappers sit on the controller's upstream state
        result.verifier_ok = all(r.report is None or r.report.ok for r in self.records)
        result.routers_mapped = min((r.result.routers_mapped for r in self.records), default=0)
        controller = self.stack.controller
        if controller is not None:
            result.layers_committed = controller.stats.layers_committed
            result.rearrangements_started = controller.stats.rearrangements_started
            result.rearrangements_finished = controller.stats.rearrangements_finished
            result.rearrangement_stalls = controller.binding.rearrangement_stalls
            result.placement_restored = controller.stats.placements_restored > 0
        self.stack.close()
        return result


def run_rank(rank: int, world_size: int, init_method: str, cfg: RunConfig, heartbeat: Heartbeat | None = None) -> dict:
    """One rank's whole run. ``heartbeat`` (from ``run_ranks``) beats after every step, so the
    launcher's timeout bounds a stuck step, not the run's length."""
    with rank_session(rank, world_size, init_method, cfg) as (group, cpu_group):
        stack = build_rank_stack(cfg, rank, world_size, group)  # binds the load buffers: before capture
        return asdict(RankRun(stack, world_size, cpu_group, heartbeat).run())


def run_rank_and_shut_down(rank: int, world_size: int, init_method: str, cfg: RunConfig,
                           heartbeat: Heartbeat | None = None) -> dict:
    """``run_rank`` for a process that ends with it: the groups are torn down afterwards."""
    try:
        return run_rank(rank, world_size, init_method, cfg, heartbeat)
    finally:
        shutdown_expert_parallel()
