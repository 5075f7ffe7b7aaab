"""A bench report as people read it: the text table (with each ratio beside its target) and the chart."""

from __future__ import annotations

from pathlib import Path

from eplb_reference.bench.breakdown import format_breakdown


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
    breakdown = format_breakdown(report["ratios"])
    if breakdown:
        lines.extend(["", breakdown])
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
