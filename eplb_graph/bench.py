"""`eplb-graph bench`: capture vs eager, EPLB off / on-idle / on-while-rearranging, one run.

For each available mode and EPLB setting it launches the multi-rank runtime and times
decode steps (16 tokens per rank by default, the batch size the targets name):

    off             no EPLB: logical ids index experts directly, no routing op
    on_idle         EPLB on, identity placement, no rearrangement (interval > steps);
                    off and on_idle run in the same processes, steps rotating, beside a
                    second EPLB-off model (off_twin: the harness's A/A yardstick)
    on_rearranging  EPLB on, rearranging every --interval steps (10): steps while an async
                    rearrangement runs (the step that starts one included), next to the
                    same run's steady steps

Ratios are taken inside this one invocation, side by side, so the machine's noise hits
every setting alike. On CPU the graph mode is the compiled mode and is not run twice; on
CUDA it is the compiled forward captured in CUDA graphs (``eplb_graph.graph_capture``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from eplb_graph.custom_ops import CPU_LAYER_KERNEL
from eplb_graph.launch import Heartbeat, run_ranks
from eplb_graph.run_report import cuda_kernel, over_median, percentile
from eplb_graph.runner import (
    MODES,
    RunConfig,
    TimedStep,
    build_rank_models,
    prepare_step,
    rank_device,
    rank_session,
    run_rank_and_shut_down,
    timed_step,
)
from eplb_graph.workload import Batch, make_batch

if TYPE_CHECKING:
    from eplb_graph.controller import EplbController


def bench_modes(requested: str, device: str) -> tuple[str, ...]:
    """The modes a bench runs: every mode the device has for "all", else the one asked for.
    On the host the compiled mode is the graph mode, so "graph" there is refused, not run twice."""
    available = ("eager", "compiled") if device == "cpu" else MODES
    if requested == "all":
        return available
    if requested not in MODES:
        raise ValueError(f"unknown mode {requested!r}; expected all or one of {', '.join(MODES)}")
    if requested not in available:
        raise ValueError(f"bench --mode {requested} on {device}: on the host the compiled mode is the graph mode; "
                         f"use --mode compiled")
    return (requested,)


def _decode_steps(result: dict, rebalancing: bool | None, times: str = "step_ms") -> list[float]:
    """Decode step times (or their EPLB host part, times="eplb_host_ms"); rebalancing=None: all,
    True/False: only steps in / out of a rearrangement."""
    return [
        ms for ms, kind, busy in zip(result[times], result["kinds"], result["rebalancing"])
        if kind == "decode" and (rebalancing is None or busy == rebalancing)
    ]


PAIRED_SETTINGS = ("off", "on_idle", "off_twin")
BLOCK_STEPS = 10  # the bootstrap's block: consecutive paired steps drawn together
MIN_BENCH_STEPS = 2 * BLOCK_STEPS


def decode_batches(cfg: RunConfig, rank: int, device: torch.device) -> list[Batch]:
    """This rank's decode batches of the workload (its steps 1..7), on the device."""
    workload = cfg.workload()
    return [make_batch(workload, step, rank).to(device) for step in range(1, 8)]


def rotating_steps(forwards: dict[str, Callable], controllers: dict[str, EplbController | StepHooks | None],
                   batches: list[Batch], steps: int, device: torch.device,
                   heartbeat: Heartbeat | None = None,
                   after_step: Callable[[dict[str, torch.Tensor]], None] | None = None,
                   address_checks: dict[str, Callable[[], object]] | None = None) -> dict[str, list[TimedStep]]:
    """Every forward once per step on the same batch, the order rotating so each leads a step as
    often as the others: side by side in one process, the machine's noise hits all alike.
    ``heartbeat`` beats after each step (see ``eplb_graph.launch``); ``after_step`` gets the
    step's outputs by name, untimed, before the next step (a replayed graph overwrites its
    output buffer). ``address_checks``: name -> its captured forward's ``check_addresses``,
    run untimed after each of its steps."""
    names = list(forwards)
    address_checks = address_checks or {}
    timed: dict[str, list[TimedStep]] = {name: [] for name in names}
    for step in range(steps):
        batch = batches[step % len(batches)]
        first = step % len(names)
        for name in names[first:] + names[:first]:
            timed[name].append(timed_step(forwards[name], batch, device, controllers.get(name),
                                          after=address_checks.get(name)))
        if after_step is not None:
            after_step({name: timed[name][-1].out for name in names})
        if heartbeat is not None:
            heartbeat.beat()
    return timed


class StepHooks(Protocol):
    """What a timed step calls around a forward: ``EplbController``, or a stand-in without a control plane."""

    def begin_batch(self, *, num_unpadded_tokens: int, is_prefill: bool) -> object: ...

    def end_batch(self) -> None: ...


@dataclasses.dataclass
class PreparedModels:
    forwards: dict[str, Callable]  # name -> the step's callable (model, compiled, or captured)
    captured: dict[str, object | None]  # name -> its CapturedForward, None where nothing is captured
    compile_s: dict[str, float]  # name -> compile or capture time, its first (compiling) step included
    decode: list[Batch]  # the decode batches every model steps through

    @property
    def address_checks(self) -> dict[str, Callable[[], int]]:
        """name -> its CapturedForward's check between steps (where a graph was captured)."""
        return {name: c.check_addresses for name, c in self.captured.items() if c is not None}

    @property
    def recaptures(self) -> dict[str, int | None]:
        return {name: None if c is None else c.stats.recaptures for name, c in self.captured.items()}


def prepare_models(models: dict[str, tuple], controllers: dict[str, StepHooks], cfg: RunConfig, rank: int,
                   device: torch.device) -> PreparedModels:
    """Compiles (graph mode: captures) each model in order and runs its first step, untimed.
    ``models``: name -> (model, its RunConfig, its RankLayers, its flags)."""
    compile_s, captured, forwards = {}, {}, {}
    for name, (model, run_cfg, rank_layers, flags) in models.items():
        start = time.perf_counter()
        forwards[name], captured[name] = prepare_step(model, run_cfg, rank_layers, flags, [])
        compile_s[name] = time.perf_counter() - start
    decode = decode_batches(cfg, rank, device)
    for name, forward in forwards.items():  # first call: compiles (graph mode captured already)
        compile_s[name] += timed_step(forward, decode[0], device, controllers.get(name)).seconds
    return PreparedModels(forwards, captured, compile_s, decode)


def unique_graphs() -> int:
    """Dynamo's count of graphs compiled in this process: a recompile adds one."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def idle_vs_off_rank(rank: int, world_size: int, init_method: str, cfg: RunConfig,
                     heartbeat: Heartbeat | None = None) -> dict:
    """EPLB off and EPLB on (identity placement, never rearranging) in the same processes,
    decode steps rotating between the models, so all see the same machine. ``off_twin`` is
    a second, identical EPLB-off model: off_twin / off is what this harness measures when
    nothing differs (an A/A test), the yardstick for on_idle / off."""
    from eplb_graph.controller import EplbController
    from eplb_graph.expert_parallel import shutdown_expert_parallel

    on_cfg = dataclasses.replace(cfg, eplb=True, step_interval=cfg.steps * 10, window_size=cfg.steps * 10)
    off_cfg = dataclasses.replace(cfg, eplb=False)
    with rank_session(rank, world_size, init_method, on_cfg) as (group, _):
        device = rank_device(cfg)
        on = build_rank_models(on_cfg, rank, world_size, group)
        off = build_rank_models(off_cfg, rank, world_size, group)
        twin = build_rank_models(off_cfg, rank, world_size, group)  # same seed, same weights
        controller = EplbController(on[2], device=device)
        controllers = {"on_idle": controller}
        # the backend's verifier is strict: a graph that fails it does not compile
        prepared = prepare_models(paired_models(on, off, twin, on_cfg, off_cfg), controllers, cfg, rank, device)
        graphs = unique_graphs()
        timed = rotating_steps(prepared.forwards, controllers, prepared.decode, cfg.steps, device, heartbeat,
                               address_checks=prepared.address_checks)
        recompiles = unique_graphs() - graphs
        controller.close()
    shutdown_expert_parallel()
    return {"times": paired_times(timed), "compile_s": prepared.compile_s, "recompiles": recompiles,
            "recaptures": prepared.recaptures}


def paired_models(on: tuple, off: tuple, twin: tuple, on_cfg: RunConfig, off_cfg: RunConfig) -> dict[str, tuple]:
    """The three models of a paired run, each ``build_rank_models``' (model, reference,
    RankLayers, flags), as ``prepare_models`` takes them, in compile order: the twin compiles
    first, since the process's first compile pays the cold caches (~2-5 s here), which would
    otherwise make "off" look several times costlier to compile than "on_idle"."""
    on_model, _, on_layers, on_flags = on
    off_model, _, _, off_flags = off
    twin_model, _, _, twin_flags = twin
    return {"off_twin": (twin_model, off_cfg, [], twin_flags), "off": (off_model, off_cfg, [], off_flags),
            "on_idle": (on_model, on_cfg, on_layers, on_flags)}


def paired_times(timed: dict[str, list[TimedStep]]) -> dict[str, list[float]]:
    """Step times in ms by model, and on_idle's EPLB host part (begin_batch + end_batch)."""
    times = {name: [t.seconds * 1e3 for t in steps] for name, steps in timed.items()}
    times["on_idle_eplb_host"] = [t.eplb_host_s * 1e3 for t in timed["on_idle"]]
    return times


def paired_ratio_interval(numerator: list[float], denominator: list[float], *, block: int = BLOCK_STEPS,
                          resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % interval of median(numerator) / median(denominator) for paired step times
    (numerator[i] and denominator[i] timed back to back), by a moving-block bootstrap:
    blocks of consecutive pairs are drawn together, keeping the steps' correlation in time
    (the workload's batches cycle, the machine's load drifts). Says how far the measured
    ratio can be trusted on a noisy machine; seeded, so a report reproduces from its steps."""
    if len(numerator) != len(denominator) or len(numerator) < block:
        raise ValueError(f"need two paired series of at least {block} steps, got {len(numerator)} and {len(denominator)}")
    pairs = torch.tensor([numerator, denominator], dtype=torch.float64)  # [2, N]
    n = pairs.shape[1]
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, n - block + 1, (resamples, -(-n // block)), generator=generator)  # [R, ceil(N / block)]
    picks = (starts.unsqueeze(-1) + torch.arange(block)).flatten(1)[:, :n]  # [R, N]
    medians = pairs[:, picks].quantile(0.5, dim=-1)  # [2, R]
    ratios = medians[0] / medians[1]  # [R]
    low, high = ratios.quantile(torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return low, high


def check_bench_steps(steps: int) -> None:
    if steps < MIN_BENCH_STEPS:
        raise ValueError(f"bench needs --steps >= {MIN_BENCH_STEPS} (p99 and the 95 % intervals need at least two "
                         f"{BLOCK_STEPS}-step blocks per rank), got {steps}")


def idle_ratios(idle: list[float], off: list[float], twin: list[float], idle_host: list[float]) -> dict:
    """on_idle / off beside the A/A off_twin / off, with their paired 95 % intervals (the three
    models rotate step by step in the same processes), and on_idle's EPLB host time."""
    return {
        "on_idle_over_off": over_median(idle, off),
        "on_idle_over_off_ci95": [round(x, 3) for x in paired_ratio_interval(idle, off)],
        # the A/A yardstick: two identical EPLB-off models, what the harness reads when nothing differs
        "off_twin_over_off": over_median(twin, off),
        "off_twin_over_off_ci95": [round(x, 3) for x in paired_ratio_interval(twin, off)],
        "on_idle_eplb_host_p50_ms": round(statistics.median(idle_host), 3),  # begin_batch + end_batch
    }


def graph_mode_note(device: str) -> str:
    """What a report's "graph" mode means on ``device``."""
    if device == "cpu":
        return "on CPU the graph mode is the compiled mode (no capture exists on the host)"
    return "graph: the compiled forward captured as one device graph per capture size"


def graph_speedup(results: list[dict], device: str) -> float | None:
    """Eager p50 over graph-mode p50 of the EPLB-on (idle) decode step; on CPU the compiled mode
    is the graph mode. None unless both ran."""
    by_key = {(r["mode"], r["eplb"]): r for r in results}
    graph_mode = "graph" if device != "cpu" else "compiled"
    if ("eager", "on_idle") not in by_key or (graph_mode, "on_idle") not in by_key:
        return None
    return round(by_key[("eager", "on_idle")]["p50_ms"] / by_key[(graph_mode, "on_idle")]["p50_ms"], 3)


def _worst(counts: list[int | None]) -> int | None:
    """The largest count over ranks; None where a mode captures nothing."""
    return None if any(c is None for c in counts) else max(counts)


def result_entry(mode: str, eplb: str, steps: list[float], cfg: RunConfig, *, compile_s: float, recompiles: int,
                 recaptures: int | None, rearrangements: int = 0) -> dict:
    tokens = cfg.decode_tokens * cfg.ranks
    return {
        "mode": mode,
        "eplb": eplb,
        "p50_ms": round(statistics.median(steps), 3),
        "p99_ms": round(percentile(steps, 99), 3),
        "tokens_per_s": round(tokens / (statistics.median(steps) / 1e3), 1),
        "decode_steps": len(steps),
        "compile_or_capture_s": round(compile_s, 2),
        "recompiles": recompiles,
        "recaptures": recaptures,  # None: nothing is captured in this mode (every mode on CPU)
        "rearrangements": rearrangements,
    }


def run_bench(base: RunConfig, modes: tuple[str, ...], *, timeout_s: float = 900,
              log: Callable[[str], None] | None = None) -> dict:
    """``base.steps`` per run and setting; ``base.step_interval``: how often the on_rearranging
    run rearranges (on_idle never does). ``log`` gets one line as each run starts and ends."""
    log = log or (lambda line: None)
    check_bench_steps(base.steps)  # before any process starts
    results, ratios = [], {}
    for mode in modes:
        common = dict(mode=mode, check_outputs=False, progress=False, collect_load_stats=False)
        start = time.monotonic()
        log(f"bench {mode}: off, on_idle and the A/A twin, {base.steps} steps each, rotating ...")
        paired = run_ranks(idle_vs_off_rank, base.ranks, dataclasses.replace(base, **common), timeout_s=timeout_s)
        log(f"bench {mode}: on_rearranging, a rearrangement every {base.step_interval} steps ... "
            f"({time.monotonic() - start:.0f} s so far)")
        busy_cfg = dataclasses.replace(base, eplb=True, **common)
        busy = run_ranks(run_rank_and_shut_down, base.ranks, busy_cfg, timeout_s=timeout_s)
        intra_op_threads = [r["intra_op_threads"] for r in busy]  # every run's ranks follow the same rule
        log(f"bench {mode}: done in {time.monotonic() - start:.0f} s")
        off_steps = [ms for r in paired for ms in r["times"]["off"]]
        idle_steps = [ms for r in paired for ms in r["times"]["on_idle"]]
        twin_steps = [ms for r in paired for ms in r["times"]["off_twin"]]
        rearranging = [ms for r in busy for ms in _decode_steps(r, True)]
        steady = [ms for r in busy for ms in _decode_steps(r, False)]
        # the main thread's EPLB work inside those steps: upstream's rearrange() and layer commits
        rearranging_host = [ms for r in busy for ms in _decode_steps(r, True, "eplb_host_ms")]
        recompiles = max(r["recompiles"] for r in paired)
        entries = [
            result_entry(mode, "off", off_steps, base, compile_s=max(r["compile_s"]["off"] for r in paired),
                         recompiles=recompiles, recaptures=_worst([r["recaptures"]["off"] for r in paired])),
            result_entry(mode, "on_idle", idle_steps, base, compile_s=max(r["compile_s"]["on_idle"] for r in paired),
                         recompiles=recompiles, recaptures=_worst([r["recaptures"]["on_idle"] for r in paired])),
            result_entry(mode, "on_rearranging", rearranging or steady, busy_cfg,
                         compile_s=max(r["compile_or_capture_s"] for r in busy),
                         recompiles=max(r["recompiles"] for r in busy), recaptures=_worst([r["recaptures"] for r in busy]),
                         rearrangements=min(r["rearrangements_finished"] for r in busy)),
        ]
        results.extend(entries)
        idle_host = [ms for r in paired for ms in r["times"]["on_idle_eplb_host"]]
        ratios[mode] = {
            **idle_ratios(idle_steps, off_steps, twin_steps, idle_host),
            # null where the run had none of either: no rearrangement (--interval past --steps), or
            # no steady step (rearrangements back to back: --interval within a rearrangement's length)
            "rearranging_p99_over_steady_p50": over_median(rearranging, steady, 99),
            # the same run's steady steps against themselves: what the ratio above would read if a
            # rearrangement cost nothing (this machine's own tail), and the typical rearranging step
            "steady_p99_over_steady_p50": over_median(steady, steady, 99),
            "rearranging_p50_over_steady_p50": over_median(rearranging, steady),
            "rearranging_decode_steps": len(rearranging),
            "steady_decode_steps": len(steady),
            "steady_p50_ms": round(statistics.median(steady), 3) if steady else None,
            "rearranging_eplb_host_p50_ms": round(statistics.median(rearranging_host), 3) if rearranging_host else None,
            "rearranging_eplb_host_p99_ms": round(percentile(rearranging_host, 99), 3) if rearranging_host else None,
        }
    speedup = graph_speedup(results, base.device)
    if speedup is not None:
        ratios["graph_speedup_over_eager_decode"] = speedup
    return {
        "device": base.device,
        "expert_kernel": base.expert_kernel,
        "cpp_wrapper": base.cpp_wrapper,  # compiled mode: Inductor's wrapper in C++
        "cpu_layer_kernel": CPU_LAYER_KERNEL,  # what serves the routing op on the host: native (C++) or numba
        "cuda_kernel": cuda_kernel(base.device),  # "triton" where the ops ran on CUDA through it
        "intra_op_threads": intra_op_threads,  # torch's, per rank (the same in every run of this bench)
        "ranks": base.ranks,
        "steps_per_run": base.steps,
        "decode_tokens_per_rank": base.decode_tokens,
        "capture_sizes": list(base.capture_sizes),
        "policy_process": base.policy_process,  # on_rearranging: upstream's policy in a helper process
        "note": graph_mode_note(base.device),
        "results": results,
        "ratios": ratios,
        "targets": {"on_idle_over_off": 1.05, "rearranging_p99_over_steady_p50": 1.15},
    }


def format_table(report: dict) -> str:
    lines = [f"{'mode':<9} {'eplb':<15} {'p50 ms':>8} {'p99 ms':>8} {'tok/s':>9} {'compile s':>9} {'recomp':>6} {'recapt':>6}"]
    for r in report["results"]:
        lines.append(
            f"{r['mode']:<9} {r['eplb']:<15} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['tokens_per_s']:>9.0f} "
            f"{r['compile_or_capture_s']:>9.1f} {r['recompiles']:>6} {'-' if r['recaptures'] is None else r['recaptures']:>6}"
        )
    modes = [mode for mode, ratios in report["ratios"].items() if isinstance(ratios, dict)]
    if modes:
        lines.append("")
        lines.append(f"{'ratio':<42}" + "".join(f"{mode:>24}" for mode in modes) + "  target")
        targets = report.get("targets", {})
        for label, key, interval in _RATIO_ROWS:
            if not any(key in report["ratios"][mode] for mode in modes):
                continue  # not measured by this bench (the data-plane bench has no rearrangement)
            values = [report["ratios"][mode].get(key) for mode in modes]
            cells = []
            for mode, value in zip(modes, values):
                bounds = report["ratios"][mode].get(interval) if interval else None
                cell = "n/a" if value is None else f"{value:.3f}"
                cells.append(cell + (f" [{bounds[0]:.3f}, {bounds[1]:.3f}]" if bounds else ""))
            line = f"{label:<42}" + "".join(f"{cell:>24}" for cell in cells)
            target = targets.get(key)
            if target is not None:
                verdicts = ("n/a" if value is None else "met" if value <= target else "missed" for value in values)
                line += f"  <= {target} ({', '.join(verdicts)})"
            lines.append(line)
    speedup = report["ratios"].get("graph_speedup_over_eager_decode")
    if speedup is not None:
        lines.append(f"{'graph speedup over eager at decode (p50)':<42}{speedup:>24.3f}")
    if report.get("cpp_wrapper"):
        lines.append("compiled with Inductor's C++ wrapper (--cpp-wrapper)")
    if report.get("intra_op_threads"):
        lines.append(f"torch intra-op threads per rank: {', '.join(map(str, report['intra_op_threads']))}")
    return "\n".join(lines)


# (label, key in a mode's ratios, key of its 95 % interval or None)
_RATIO_ROWS = (
    ("on_idle / off (p50) [95 %]", "on_idle_over_off", "on_idle_over_off_ci95"),
    ("off_twin / off (A/A: nothing differs)", "off_twin_over_off", "off_twin_over_off_ci95"),
    ("rearranging p99 / steady p50", "rearranging_p99_over_steady_p50", None),
    ("steady p99 / steady p50 (its floor here)", "steady_p99_over_steady_p50", None),
    ("rearranging p50 / steady p50", "rearranging_p50_over_steady_p50", None),
)


def write_chart(out: Path, report: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['mode']}\n{r['eplb']}" for r in report["results"]]
    fig, ax = plt.subplots(figsize=(9, 4))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], [r["p50_ms"] for r in report["results"]], width=0.4, label="p50")
    ax.bar([x + 0.2 for x in xs], [r["p99_ms"] for r in report["results"]], width=0.4, label="p99")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("decode step, ms")
    scope = ", data plane only" if report.get("data_plane_only") else ""
    ax.set_title(f"eplb-graph bench: {report['ranks']} rank(s) on {report['device']}{scope}")
    ax.legend()
    path = out / "bench.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
