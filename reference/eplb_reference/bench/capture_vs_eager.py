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
CUDA it is the compiled forward captured in CUDA graphs (``eplb_graph.graph.graph_capture``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

from eplb_reference.bench.breakdown import step_breakdown
from eplb_reference.bench.harness import paired_models, paired_times, prepare_models, rotating_steps
from eplb_reference.bench.stats import check_bench_steps, idle_ratios, over_median, percentile, rearrangement_lengths
from eplb_graph.custom_ops import CPU_LAYER_KERNEL
from eplb_reference.runtime.compile import unique_graphs
from eplb_reference.runtime.config import MODES, RunConfig
from eplb_reference.runtime.groups import rank_session, shutdown_expert_parallel
from eplb_reference.runtime.launch import Heartbeat, run_ranks
from eplb_reference.runtime.rank import run_rank_and_shut_down
from eplb_reference.runtime.report import cuda_kernel
from eplb_reference.runtime.stack import build_rank_models, build_rank_stack
from eplb_reference.runtime.step import rank_device


BREAKDOWN_NOTE = ("ratios.<mode>.step_breakdown: the on_rearranging run's decode steps, every rank's, with "
                  "eplb_reference.runtime.step_probes in them (steady and rearranging steps alike; the off / on_idle "
                  "run has no probes); step_ms = eplb_ours_ms + eplb_upstream_ms + collective_wait_ms + "
                  "forward_rest_ms per step (means add up, medians need not)")


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


def idle_vs_off_rank(rank: int, world_size: int, init_method: str, cfg: RunConfig,
                     heartbeat: Heartbeat | None = None) -> dict:
    """EPLB off and EPLB on (identity placement, never rearranging) in the same processes,
    decode steps rotating between the models, so all see the same machine. ``off_twin`` is
    a second, identical EPLB-off model: off_twin / off is what this harness measures when
    nothing differs (an A/A test), the yardstick for on_idle / off."""
    on_cfg = dataclasses.replace(cfg, eplb=True, step_interval=cfg.steps * 10, window_size=cfg.steps * 10,
                                 policy_process=False)
    off_cfg = dataclasses.replace(cfg, eplb=False)
    with rank_session(rank, world_size, init_method, on_cfg) as (group, _):
        device = rank_device(cfg)
        on_stack = build_rank_stack(on_cfg, rank, world_size, group)
        on = on_stack.models
        off = build_rank_models(off_cfg, rank, world_size, group)
        twin = build_rank_models(off_cfg, rank, world_size, group)  # same seed, same weights
        controllers = {"on_idle": on_stack.controller}
        # the backend's verifier is strict: a graph that fails it does not compile
        prepared = prepare_models(paired_models(on, off, twin, on_cfg, off_cfg), controllers, cfg, rank, device)
        graphs = unique_graphs()
        timed = rotating_steps(prepared.forwards, controllers, prepared.decode, cfg.steps, device, heartbeat,
                               address_checks=prepared.address_checks)
        recompiles = unique_graphs() - graphs
        on_stack.close()
    shutdown_expert_parallel()
    return {"times": paired_times(timed), "compile_s": prepared.compile_s, "recompiles": recompiles,
            "recaptures": prepared.recaptures}


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


def mode_entries(mode: str, paired: list[dict], busy: list[dict], base: RunConfig, busy_cfg: RunConfig) -> list[dict]:
    """The three result rows of one mode, from its paired run's and its rearranging run's ranks."""
    recompiles = max(r["recompiles"] for r in paired)

    def paired_entry(setting: str) -> dict:
        steps = [ms for r in paired for ms in r["times"][setting]]
        return result_entry(mode, setting, steps, base, compile_s=max(r["compile_s"][setting] for r in paired),
                            recompiles=recompiles, recaptures=_worst([r["recaptures"][setting] for r in paired]))

    rearranging = [ms for r in busy for ms in _decode_steps(r, True)]
    steady = [ms for r in busy for ms in _decode_steps(r, False)]
    return [paired_entry("off"), paired_entry("on_idle"), result_entry(
        mode, "on_rearranging", rearranging or steady, busy_cfg, compile_s=max(r["compile_or_capture_s"] for r in busy),
        recompiles=max(r["recompiles"] for r in busy), recaptures=_worst([r["recaptures"] for r in busy]),
        rearrangements=min(r["rearrangements_finished"] for r in busy))]


def mode_ratios(paired: list[dict], busy: list[dict]) -> dict:
    """One mode's ratios: on_idle / off beside the A/A, and the rearranging steps against the steady ones."""
    times = {name: [ms for r in paired for ms in r["times"][name]] for name in ("off", "on_idle", "off_twin", "on_idle_eplb_host")}
    rearranging = [ms for r in busy for ms in _decode_steps(r, True)]
    steady = [ms for r in busy for ms in _decode_steps(r, False)]
    # the main thread's EPLB work inside those steps: upstream's rearrange() and layer commits
    rearranging_host = [ms for r in busy for ms in _decode_steps(r, True, "eplb_host_ms")]
    return {
        **idle_ratios(times["on_idle"], times["off"], times["off_twin"], times["on_idle_eplb_host"]),
        # null where the run had none of either: no rearrangement (--interval past --steps), or
        # no steady step (rearrangements back to back: --interval within a rearrangement's length)
        "rearranging_p99_over_steady_p50": over_median(rearranging, steady, 99),
        # the same run's steady steps against themselves: what the ratio above would read if a
        # rearrangement cost nothing (this machine's own tail), and the typical rearranging step
        "steady_p99_over_steady_p50": over_median(steady, steady, 99),
        "rearranging_p50_over_steady_p50": over_median(rearranging, steady),
        "rearranging_decode_steps": len(rearranging),
        # how many steps (prefill and decode) each finished rearrangement took, over every rank
        "steps_per_rearrangement": _length_summary([n for r in busy for n in rearrangement_lengths(r["rebalancing"])]),
        "steady_decode_steps": len(steady),
        "steady_p50_ms": round(statistics.median(steady), 3) if steady else None,
        "rearranging_eplb_host_p50_ms": round(statistics.median(rearranging_host), 3) if rearranging_host else None,
        "rearranging_eplb_host_p99_ms": round(percentile(rearranging_host, 99), 3) if rearranging_host else None,
        # where the time goes, per phase and rank (bench.breakdown); the probes ran in this run only
        "step_breakdown": step_breakdown(busy),
    }


def _length_summary(lengths: list[int]) -> dict | None:
    if not lengths:
        return None
    return {"rearrangements": len(lengths), "mean": round(statistics.mean(lengths), 2), "max": max(lengths)}


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
        busy_cfg = dataclasses.replace(base, eplb=True, step_breakdown=True, **common)
        busy = run_ranks(run_rank_and_shut_down, base.ranks, busy_cfg, timeout_s=timeout_s)
        intra_op_threads = [r["intra_op_threads"] for r in busy]  # every run's ranks follow the same rule
        log(f"bench {mode}: done in {time.monotonic() - start:.0f} s")
        results.extend(mode_entries(mode, paired, busy, base, busy_cfg))
        ratios[mode] = mode_ratios(paired, busy)
    speedup = graph_speedup(results, base.device)
    if speedup is not None:
        ratios["graph_speedup_over_eager_decode"] = speedup
    return {
        "device": base.device,
        "expert_kernel": base.expert_kernel,
        "cpp_wrapper": base.cpp_wrapper,  # compiled mode: Inductor's wrapper in C++
        "cpu_layer_kernel": CPU_LAYER_KERNEL,  # what serves the routing op on the host: native (C++) or composite
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
        "step_breakdown_note": BREAKDOWN_NOTE,
    }
