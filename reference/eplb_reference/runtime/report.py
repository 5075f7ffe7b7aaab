"""Turns per-rank step records of a run into ``report.json`` and PNG plots.

Balancedness = mean / max of per-rank executed load, summed over a window of
``window`` steps (one step of 16 tokens is too few to say anything), averaged over
layers. Three numbers, all from the same run:

    balancedness_without_eplb  the logical load of every step placed as EP without EPLB
                               would place it (experts split contiguously over ranks)
    balancedness_before        what EPLB executed before its first rebalance finished
    balancedness_after         what EPLB executed after its first rebalance finished
"""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import torch

from eplb_graph.core.placement import layer_balancedness


def balancedness(per_rank: torch.Tensor) -> float:
    """mean / max of the load over ranks (the last dim), averaged over any leading dims (layers)."""
    return float(layer_balancedness(per_rank).mean())


def windowed_balancedness(per_rank_steps: torch.Tensor, window: int) -> list[float]:
    """per_rank_steps: [steps, layers, ranks] -> one balancedness per full, non-overlapping window."""
    starts = range(0, per_rank_steps.shape[0] - window + 1, window)
    return [balancedness(per_rank_steps[start : start + window].sum(0)) for start in starts]


def trailing_balancedness(per_rank_steps: torch.Tensor, window: int) -> list[float]:
    """The same measure over the `window` steps ending at each step (shorter at the start), for plots."""
    return [
        balancedness(per_rank_steps[max(0, step - window + 1) : step + 1].sum(0))
        for step in range(per_rank_steps.shape[0])
    ]


def without_eplb_rank_load(logical_steps: torch.Tensor, ranks: int) -> torch.Tensor:
    """[steps, L, E] logical load -> [steps, L, ranks] under a contiguous split of logical experts."""
    steps, layers, experts = logical_steps.shape
    owner = torch.arange(experts) * ranks // experts  # expert -> rank
    out = torch.zeros(steps, layers, ranks, dtype=logical_steps.dtype)
    return out.index_add_(2, owner, logical_steps)


def cuda_kernel(device: str) -> str | None:
    """What served the routing ops on ``device`` if it is CUDA ("triton", or the composite and
    why), else None: a composite serving on a GPU would be another figure."""
    from eplb_graph.custom_ops import CUDA_KERNEL

    return CUDA_KERNEL if device == "cuda" else None


def first_mismatch(results: list[dict]) -> dict:
    """The earliest mismatching step over ranks, and whether a rearrangement was in flight there
    (a move or commit bug shows first right after a commit); None for both without a mismatch."""
    keys = ("first_mismatch_step", "first_mismatch_during_rearrangement")  # RankResult's fields, same names
    firsts = [r for r in results if r["first_mismatch_step"] is not None]
    earliest = min(firsts, key=lambda r: r["first_mismatch_step"]) if firsts else dict.fromkeys(keys)
    return {key: earliest[key] for key in keys}


def summarize(cfg, results: list[dict]) -> dict:
    first = results[0]  # loads are global (all-reduced), identical on every rank
    step_ms = [ms for r in results for ms in r["step_ms"]]
    tolerance = cfg.output_tolerance
    report = {
        "mode": cfg.mode,
        "device": cfg.device,
        "ranks": cfg.ranks,
        "policy_process": cfg.policy_process,
        "steps": cfg.steps,
        "weight_format": cfg.weight_format,
        "expert_kernel": cfg.expert_kernel,
        "cpp_wrapper": cfg.cpp_wrapper,
        "cuda_kernel": cuda_kernel(cfg.device),
        "intra_op_threads": [r["intra_op_threads"] for r in results],  # torch's, per rank
        "eplb": cfg.eplb,
        "num_layers": cfg.num_layers,
        "num_logical_experts": cfg.num_experts,
        "num_physical_experts": cfg.num_physical,
        "capture_sizes": list(cfg.capture_sizes),
        "batch_tokens_per_rank": cfg.workload().batch_tokens(),  # decode / prefill / mixed, before padding
        "rearrangements": min(r["rearrangements_finished"] for r in results),
        "rearrangements_started": min(r["rearrangements_started"] for r in results),
        "layers_committed": min(r["layers_committed"] for r in results),
        "rearrangement_stalls": max(r["rearrangement_stalls"] for r in results),
        "output_mismatches": sum(r["output_mismatches"] for r in results),
        **first_mismatch(results),
        "nonfinite_output_steps": sum(r["nonfinite_output_steps"] for r in results),
        "max_abs_diff": max(r["max_abs_diff"] for r in results),
        "tolerance": tolerance,
        "output_check": "exact" if tolerance == 0 else f"allclose(rtol=atol={tolerance:g})",
        "recompiles": max(r["recompiles"] for r in results),
        "recaptures": None if any(r["recaptures"] is None for r in results) else max(r["recaptures"] for r in results),
        "verifier_ok": all(r["verifier_ok"] for r in results),
        "routers_mapped": min(r["routers_mapped"] for r in results),
        "compile_or_capture_s": round(max(r["compile_or_capture_s"] for r in results), 2),
        "step_p50_ms": round(statistics.median(step_ms), 3) if step_ms else None,
        "tokens_per_s": round(sum(r["tokens"] for r in results) / (sum(step_ms) / 1e3 / len(results)), 1) if step_ms else None,
        "rearrangement_finished_steps": first["rearrangement_finished_steps"],
        "placement_file": cfg.placement_file,
        "placement_restored": all(r["placement_restored"] for r in results),
    }
    # On one rank every load is that rank's: mean / max is 1.0 whatever EPLB does, a figure
    # that measures nothing, so it is not reported.
    if first["rank_load"] and cfg.ranks > 1:
        window = cfg.step_interval
        executed = torch.tensor(first["rank_load"])  # [steps, L, ranks]
        logical = torch.tensor(first["logical_load"])  # [steps, L, E]
        finished = first["rearrangement_finished_steps"]
        split = finished[0] + 1 if finished else executed.shape[0]
        before = windowed_balancedness(executed[:split], min(window, split))
        after = windowed_balancedness(executed[split:], window) if split < executed.shape[0] else []
        # a run shorter than one window is measured over its length, like `before`
        without = windowed_balancedness(without_eplb_rank_load(logical, cfg.ranks), min(window, logical.shape[0]))
        report["balancedness_without_eplb"] = round(statistics.mean(without), 4)
        report["balancedness_before"] = round(statistics.mean(before), 4) if before else None
        report["balancedness_after"] = round(statistics.mean(after), 4) if after else None
        report["balancedness_window_steps"] = window
        report["balancedness_windows"] = [round(b, 4) for b in windowed_balancedness(executed, window)]  # each window's
    else:
        report["balancedness_without_eplb"] = report["balancedness_before"] = report["balancedness_after"] = None
        report["balancedness_windows"] = []
    return report


def failed_invariants(report: dict) -> list[str]:
    problems = []
    if report["output_mismatches"]:
        where = "during a rearrangement" if report["first_mismatch_during_rearrangement"] else "no rearrangement in flight"
        nonfinite = report["nonfinite_output_steps"]
        problems.append(
            f"{report['output_mismatches']} step(s) whose output differs from the no-EPLB reference "
            f"(first at step {report['first_mismatch_step']}, {where})"
            + (f"; {nonfinite} of them with NaN/Inf where the reference is finite" if nonfinite else "")
        )
    if report["rearrangement_stalls"]:
        problems.append(f"{report['rearrangement_stalls']} rearrangement(s) stalled: in flight past the watchdog's "
                        f"bound with no layer committed")
    if report["recompiles"]:
        problems.append(f"{report['recompiles']} recompile(s) after warm-up")
    if report["recaptures"]:
        problems.append(f"{report['recaptures']} recapture(s) after warm-up")
    if not report["verifier_ok"]:
        problems.append("the EPLB graph verifier failed")
    compiled_with_pass = report["mode"] in ("compiled", "graph") and report["eplb"]
    if compiled_with_pass and report["routers_mapped"] != report["num_layers"]:
        problems.append(f"the EPLB pass mapped {report['routers_mapped']} of {report['num_layers']} routers")
    return problems


def write_plots(out: Path, cfg, results: list[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = results[0]
    if not first["rank_load"] or cfg.ranks < 2:  # one rank: balancedness is 1.0 by definition
        return []
    executed = torch.tensor(first["rank_load"]).double()  # [steps, L, ranks]
    window = cfg.step_interval
    without = without_eplb_rank_load(torch.tensor(first["logical_load"]), cfg.ranks)

    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(trailing_balancedness(executed, window), label=f"with EPLB (load of the last {window} steps)")
    ax.plot(trailing_balancedness(without, window), label="same load without EPLB", alpha=0.7)
    for step in first["rearrangement_finished_steps"]:
        ax.axvline(step, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("step (dotted: rearrangement finished)")
    ax.set_ylabel("balancedness (mean / max rank load)")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="lower right")
    ax.set_title(f"{cfg.mode}, {cfg.ranks} ranks, {cfg.num_experts}+{cfg.num_physical - cfg.num_experts} experts")
    balance_png = out / "balancedness.png"
    fig.tight_layout()
    fig.savefig(balance_png, dpi=110)
    plt.close(fig)

    finished = first["rearrangement_finished_steps"]
    split = finished[0] + 1 if finished else executed.shape[0]
    before, after = executed[:split].sum(0), executed[split:].sum(0)  # [L, ranks]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, data, title in ((axes[0], before, "before first rebalance"), (axes[1], after, "after first rebalance")):
        share = data / data.sum(-1, keepdim=True).clamp_min(1)
        image = ax.imshow(share.numpy(), cmap="viridis", vmin=0, vmax=max(0.5, float(share.max())), aspect="auto")
        ax.set_title(title)
        ax.set_xlabel("rank")
        ax.set_ylabel("MoE layer")
        ax.set_xticks(range(cfg.ranks))
        ax.set_yticks(range(data.shape[0]))
        for (layer, rank), value in ((idx, float(share[idx])) for idx in itertools.product(*map(range, share.shape))):
            ax.text(rank, layer, f"{value:.2f}", ha="center", va="center", color="black", fontsize=9)
    fig.colorbar(image, ax=axes, label="share of layer load")
    heatmap_png = out / "rank_load_heatmap.png"
    fig.savefig(heatmap_png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [balance_png, heatmap_png]
