"""`eplb-graph bench --data-plane`: EPLB's data plane alone on one device, without vLLM.

What the routing op costs inside an eager, a compiled and a captured forward, measured where
upstream vLLM (EPLB's control plane) is absent -- such as a GPU image that has torch and no
vLLM. One process, EP size 1 (no collective), three models stepping side by side, rotating:

    off       no EPLB: the router's logical ids index the experts directly
    on_idle   the EPLB model at identity placement (25 % redundant replicas by default): the
              routing op maps each id to a replica and records the load into the layer's
              buffer; before each step the batch flags are filled, as the controller does
    off_twin  a second EPLB-off model: the A/A yardstick of the ratio

Left out, and measured by `eplb-graph bench` where vLLM runs: upstream's per-step host work
(its window step, ``on_idle_eplb_host_p50_ms`` there) and every rearrangement.

A bench of an op that did nothing would read as a met target, so each mode checks what it
timed: every on_idle step's output equals off's (identity placement routes each id to a
copy of its own expert; exact in eager on the host, the format's tolerance compiled), and
the load recorded over the timed steps is exactly tokens x top-k per layer.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from eplb_reference.bench.capture_vs_eager import graph_mode_note, graph_speedup, result_entry
from eplb_reference.bench.harness import paired_models, paired_times, prepare_models, rotating_steps
from eplb_reference.bench.stats import check_bench_steps, idle_ratios
from eplb_graph.custom_ops import CPU_LAYER_KERNEL
from eplb_graph.core.layer_lookup import BatchFlags
from eplb_reference.runtime.compile import unique_graphs
from eplb_reference.runtime.config import RunConfig
from eplb_reference.runtime.report import cuda_kernel
from eplb_reference.runtime.stack import build_rank_models
from eplb_reference.runtime.step import check_output, intra_op_threads, rank_device, rank_threads


class FlagsOnly:
    """A step's host side without a control plane: ``begin_batch`` fills the batch flags
    (recording on, the batch's unpadded token count) as ``EplbController.begin_batch`` does;
    nothing runs after the forward."""

    def __init__(self, flags: BatchFlags) -> None:
        self.flags = flags

    def begin_batch(self, *, num_unpadded_tokens: int, is_prefill: bool) -> bool:
        self.flags.set_(record=True, num_unpadded_tokens=num_unpadded_tokens)
        return True

    def end_batch(self) -> None:
        pass


@dataclasses.dataclass
class OutputAgreement:
    """on_idle's output against off's, step by step."""

    tolerance: float
    steps: int = 0
    mismatches: int = 0
    max_abs_diff: float = 0.0

    def __call__(self, outputs: dict[str, torch.Tensor]) -> None:
        check = check_output(outputs["on_idle"], outputs["off"], self.tolerance)
        self.steps += 1
        self.mismatches += not check.ok
        self.max_abs_diff = max(self.max_abs_diff, check.max_abs_diff)


def _without_reference(cfg: RunConfig) -> tuple:
    """``build_rank_models``' tuple with its no-EPLB reference model dropped at once: off is the
    yardstick here, and at a large shape a reference per model is gigabytes of device memory."""
    model, _, rank_layers, flags = build_rank_models(cfg, 0, 1, None)
    return model, None, rank_layers, flags


def data_plane_steps(cfg: RunConfig) -> dict:
    """One mode (``cfg.mode``): the three models compiled or captured in this process, then
    ``cfg.steps`` decode steps each, rotating. Returns times, compile times, counts, checks."""
    on_cfg = dataclasses.replace(cfg, eplb=True, ranks=1)
    off_cfg = dataclasses.replace(cfg, eplb=False, ranks=1)
    with torch.no_grad():
        on, off = _without_reference(on_cfg), _without_reference(off_cfg)
        twin = _without_reference(off_cfg)  # same seed, same weights
        try:
            return _time_paired(cfg, on, off, twin, on_cfg, off_cfg)
        finally:
            # The next mode in this process builds the same layer keys and compiles the same
            # frame: Dynamo's cache would keep these layers alive and its recompile limit
            # would count this mode's graphs against the next one's.
            for layer in on[2]:
                layer.close()
            torch._dynamo.reset()


def _time_paired(cfg: RunConfig, on: tuple, off: tuple, twin: tuple, on_cfg: RunConfig, off_cfg: RunConfig) -> dict:
    """``data_plane_steps`` once its three models are built."""
    device = rank_device(cfg)
    rank_layers, flags = on[2], on[3]
    controllers = {"on_idle": FlagsOnly(flags)}
    prepared = prepare_models(paired_models(on, off, twin, on_cfg, off_cfg), controllers, cfg, 0, device)
    graphs = unique_graphs()
    load_before = torch.stack([layer.tables.load.to("cpu", torch.int64) for layer in rank_layers])  # [L, P]
    agreement = OutputAgreement(cfg.output_tolerance)
    timed = rotating_steps(prepared.forwards, controllers, prepared.decode, cfg.steps, device,
                           after_step=agreement, address_checks=prepared.address_checks)
    load_after = torch.stack([layer.tables.load.to("cpu", torch.int64) for layer in rank_layers])
    recompiles = unique_graphs() - graphs
    decode_tokens = [batch.num_tokens for batch in prepared.decode]
    expected_load = sum(decode_tokens[step % len(decode_tokens)] for step in range(cfg.steps)) * cfg.top_k
    return {
        "times": paired_times(timed),
        "compile_s": prepared.compile_s,
        "recompiles": recompiles,
        "recaptures": prepared.recaptures,
        "checks": {
            "output_tolerance": agreement.tolerance,
            "on_idle_vs_off_steps_checked": agreement.steps,
            "on_idle_vs_off_mismatches": agreement.mismatches,
            "on_idle_vs_off_max_abs_diff": agreement.max_abs_diff,
            "load_recorded_per_layer": (load_after - load_before).sum(-1).tolist(),  # [L]
            "load_expected_per_layer": expected_load,  # every unpadded token's top-k, each timed step
        },
    }


def failed_checks(mode: str, checks: dict) -> list[str]:
    """What a mode's checks say is wrong with its timings, in words; empty when nothing is."""
    problems = []
    if checks["on_idle_vs_off_mismatches"]:
        problems.append(
            f"{mode}: {checks['on_idle_vs_off_mismatches']} on_idle step(s) differ from off beyond "
            f"{checks['output_tolerance']} (max |diff| {checks['on_idle_vs_off_max_abs_diff']:.2e})"
        )
    expected = checks["load_expected_per_layer"]
    if any(recorded != expected for recorded in checks["load_recorded_per_layer"]):
        problems.append(f"{mode}: the routing op recorded {checks['load_recorded_per_layer']} tokens per layer, "
                        f"expected {expected} each")
    return problems


def check_data_plane_config(cfg: RunConfig) -> None:
    """What the data-plane bench cannot run, refused before anything is built or written."""
    check_bench_steps(cfg.steps)
    if cfg.ranks != 1:
        raise ValueError(f"the data-plane bench (--data-plane) runs one process (EP size 1, no collective), "
                         f"got {cfg.ranks} ranks")
    if cfg.policy_process:
        raise ValueError("the data-plane bench (--data-plane) runs no control plane: --policy-process does not apply")


def run_data_plane_bench(base: RunConfig, modes: tuple[str, ...], *,
                         log: Callable[[str], None] | None = None) -> dict:
    """``bench.run_bench``'s report for off and on_idle, from this one process; no on_rearranging
    (rearranging is upstream's). ``failed_checks`` in the report names what makes its timings
    untrustworthy (empty when nothing does)."""
    log = log or (lambda line: None)
    check_data_plane_config(base)
    results, ratios, checks = [], {}, {}
    with intra_op_threads(rank_threads(base, 1)):  # this process is the one rank
        threads = torch.get_num_threads()
        for mode in modes:
            start = time.monotonic()
            log(f"bench {mode} (data plane): off, on_idle and the A/A twin, {base.steps} steps each, rotating ...")
            measured = data_plane_steps(dataclasses.replace(base, mode=mode, check_outputs=False, progress=False,
                                                            collect_load_stats=False))
            log(f"bench {mode} (data plane): done in {time.monotonic() - start:.0f} s")
            times = measured["times"]
            for setting in ("off", "on_idle"):
                results.append(result_entry(mode, setting, times[setting], base, compile_s=measured["compile_s"][setting],
                                            recompiles=measured["recompiles"], recaptures=measured["recaptures"][setting]))
            ratios[mode] = idle_ratios(times["on_idle"], times["off"], times["off_twin"], times["on_idle_eplb_host"])
            checks[mode] = measured["checks"]
    speedup = graph_speedup(results, base.device)
    if speedup is not None:
        ratios["graph_speedup_over_eager_decode"] = speedup
    return {
        "device": base.device,
        "data_plane_only": True,  # no upstream EPLB step, no rearrangement
        "expert_kernel": base.expert_kernel,
        "cpp_wrapper": base.cpp_wrapper,  # compiled mode: Inductor's wrapper in C++
        "cpu_layer_kernel": CPU_LAYER_KERNEL,  # what serves the routing op on the host: native (C++) or composite
        "cuda_kernel": cuda_kernel(base.device),  # "triton" where the ops ran on CUDA through it
        "intra_op_threads": [threads],  # torch's, in this process
        "ranks": 1,
        "steps_per_run": base.steps,
        "decode_tokens_per_rank": base.decode_tokens,
        "capture_sizes": list(base.capture_sizes),
        "note": "data plane only (one process, EP size 1, no vLLM): the routing op at identity placement with "
                "load recording, without upstream's per-step host work or any rearrangement; "
                + graph_mode_note(base.device),
        "results": results,
        "ratios": ratios,
        "checks": checks,
        "failed_checks": [problem for mode, mode_checks in checks.items() for problem in failed_checks(mode, mode_checks)],
        "targets": {"on_idle_over_off": 1.05},
    }
