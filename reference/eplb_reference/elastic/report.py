"""An elastic run's ``report.json`` and timeline plot, from the members' step records.

The group's timeline is every step's last end over the members that served it (all members
step together; a member that dies or leaves takes its records with it, the survivors have
the rest): per resize, the time from the coordinator's request to the first step completed
at the new size
(``reconfiguration_seconds``), the longest gap with no step completing in that window
(``serving_pause_seconds``), and the steps in it that took more than three times the
run's median step (``steps_paused``).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

SLOW_STEP_FACTOR = 3.0  # a step this many times the median counts as paused


def _served(members: list[dict]) -> list[dict]:
    return [m for m in members if "steps" in m]


def group_timeline(members: list[dict]) -> list[tuple[float, int, int]]:
    """(end time, step, group size) per step the group completed, in step order: a step ends when
    its last member ends it."""
    steps: dict[int, tuple[float, int]] = {}
    for m in members:
        for end, step, size in zip(m["step_end_s"], m["steps"], m["step_size"]):
            steps[step] = max((end, size), steps.get(step, (end, size)))
    return [(end, step, size) for step, (end, size) in sorted(steps.items())]


def resize_entry(request: dict, timeline: list[tuple[float, int, int]], median_gap: float,
                 members: list[dict]) -> dict:
    """One resize, from the group's (end time, step, size) timeline after the request."""
    entry = {key: request[key] for key in ("kind", "generation", "old_size", "new_size", "at_step", "outcome")}
    origin = request["died_s"] if request["kind"] == "recovery" else request["requested_s"]  # a recovery: from the death
    after = [(t, step, size) for t, step, size in timeline if t >= origin]
    first_new = next(((t, step) for t, step, size in after if size == request["new_size"]), None)
    entry["reconfiguration_seconds"] = None if first_new is None else round(first_new[0] - origin, 4)
    entry["first_step_at_new_size"] = None if first_new is None else first_new[1]
    window = [t for t, _, _ in after if first_new is None or t <= first_new[0]]
    ends = [origin, *window]
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    entry["serving_pause_seconds"] = round(max(gaps, default=0.0), 4)
    entry["steps_paused"] = sum(gap > SLOW_STEP_FACTOR * median_gap for gap in gaps[1:])
    moves = [r for m in members for r in m.get("resizes", []) if r["generation"] == request["generation"]]
    entry["bytes_moved"] = sum(r["bytes_moved"] for r in moves)
    entry["switch_seconds_max"] = round(max((r["switch_s"] for r in moves), default=0.0), 4)
    if request["kind"] == "recovery":  # lost -> known to the coordinator -> serving again without it
        entry["detection_seconds"] = round(request["detected_s"] - origin, 4)
        entry["detection_to_serving_seconds"] = None if first_new is None else round(
            first_new[0] - request["detected_s"], 4)
    if request.get("why_abandoned"):
        entry["why_abandoned"] = request["why_abandoned"]
    return entry


def request_accounting(logs: list[list[list[int]]]) -> dict:
    """Every batch a step owed (step, rank for each rank of the group that served the step)
    against the batches completed, from every member's served log (the dead ones' included):
    none may be lost nor completed twice."""
    served = [(step, rank) for log in logs for step, rank, _ in log]
    sizes: dict[int, int] = {}
    for log in logs:
        for step, _, size in log:
            sizes[step] = max(size, sizes.get(step, 0))
    expected = {(step, rank) for step, size in sizes.items() for rank in range(size)}
    completed = set(served)
    return {"requests_completed": len(completed & expected), "requests_lost": len(expected - completed),
            "requests_duplicated": len(served) - len(completed)}


def eplb_between_resizes(members: list[dict]) -> dict:
    """Upstream's EPLB in every generation: each generation's count is its members' (they step in
    lockstep; a member that died before the end reports fewer), summed over generations."""
    totals = {}
    for name in ("rearrangements_finished", "layers_committed", "rearrangement_stalls"):
        per_generation: dict[str, int] = {}
        for member in members:
            for generation, count in member.get("eplb", {}).get(name, {}).items():
                per_generation[generation] = max(per_generation.get(generation, 0), count)
        totals[f"eplb_{name}"] = sum(per_generation.values())
    return totals


def summarize_elastic(cfg, plan: tuple[int, ...], max_ranks: int, raw: dict) -> dict:
    members = _served(raw["members"])
    timeline = group_timeline(members)
    ends = [end for end, _, _ in timeline]
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    median_gap = statistics.median(gaps) if gaps else 0.0
    resizes = [resize_entry(request, timeline, median_gap, members) for request in raw["requests"]]
    joiners = [m["join_prepare_s"] for m in members if m.get("join_prepare_s") is not None]
    requests = request_accounting(list(raw["served"].values()))
    recoveries = {r["generation"] for m in members for r in m["recoveries"]}
    return {
        **requests,
        "recoveries": len(recoveries),
        "experts_reloaded": sum(r["experts_reloaded"] for m in members for r in m["recoveries"]),
        "members_lost": sorted(int(m) for m in raw.get("dead", {})),
        "members_recovered_from": sorted({lost for m in members for r in m["recoveries"] for lost in r["lost_members"]}),
        "mode": cfg.mode, "steps": cfg.steps, "scale_plan": list(plan), "max_ranks": max_ranks,
        "reconfigurations": sum(r["outcome"] == "switched" for r in resizes),  # resizes and recoveries
        "resizes_abandoned": sum(r["outcome"] == "abandoned" for r in resizes),
        "resizes": resizes,
        "steps_served": {str(m["member"]): len(m["steps"]) for m in members},
        "batches_served": sum(len(m["steps"]) for m in members),
        "tokens": sum(m["tokens"] for m in members),
        "output_mismatches": sum(m["output_mismatches"] for m in members),
        "max_abs_diff": max(m["max_abs_diff"] for m in members),
        "recompiles": sum(m["recompiles"] for m in members),  # after each member's warm-up: the serving path
        "recaptures": None,  # nothing is captured on the host
        **eplb_between_resizes(members),
        "state_bytes_sent": sum(m["state_bytes_sent"] for m in members),
        "join_prepare_seconds_max": round(max(joiners), 4) if joiners else None,
        "step_p50_ms": round(median_gap * 1e3, 3),
        "spares_unused": sum("steps" not in m for m in raw["members"]),
        "faults": [{key: fault[key] for key in ("member", "kind", "role", "why", "recovery")}
                   for fault in raw.get("faults", [])],
    }


def failed_elastic_invariants(report: dict) -> list[str]:
    problems = []
    if report["output_mismatches"]:
        problems.append(f"{report['output_mismatches']} steps' outputs differ from the one-process reference")
    if report["recompiles"]:
        problems.append(f"{report['recompiles']} recompiles on the serving path")
    planned = [r for r in report["resizes"] if r["kind"] == "resize"]
    if sum(r["outcome"] == "switched" for r in planned) < len(report["scale_plan"]) - 1:
        problems.append(f"{sum(r['outcome'] == 'switched' for r in planned)} of {len(report['scale_plan']) - 1} "
                        f"planned resizes switched")
    for name in ("requests_lost", "requests_duplicated"):
        if report[name]:
            problems.append(f"{report[name]} {name.replace('_', ' ')}")
    if report.get("eplb_rearrangement_stalls"):
        problems.append(f"{report['eplb_rearrangement_stalls']} stalled EPLB rearrangements")
    unrecovered = sorted(set(report["members_lost"]) - set(report["members_recovered_from"]))
    if unrecovered:  # members that died together share one recovery
        problems.append(f"members {unrecovered} lost and not recovered from")
    return problems


def write_elastic_plot(out: Path, raw: dict) -> Path:
    """Step latency and group size over time, the group's timeline, resize requests marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = group_timeline(_served(raw["members"]))
    start = timeline[0][0]
    times = [end - start for end, _, _ in timeline]
    latency = [1e3 * (b - a) for a, b in zip(times, times[1:])]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(times[1:], latency, lw=0.8, label="step (ms)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("step latency (ms)")
    sizes = ax.twinx()
    sizes.step(times, [size for _, _, size in timeline], where="post", color="tab:green", label="EP ranks")
    sizes.set_ylabel("EP ranks")
    for request in raw["requests"]:
        ax.axvline(request["requested_s"] - start, color="tab:red", ls="--", lw=0.8)
    ax.set_title("elastic EP: step latency and group size (dashed: resize requested)")
    fig.tight_layout()
    path = out / "elastic_timeline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_elastic_report(out: Path, cfg, plan: tuple[int, ...], max_ranks: int, raw: dict, *, as_json: bool) -> int:
    """report.json and the timeline in ``out``, a summary on stdout; the exit code (1: an invariant failed)."""
    report = summarize_elastic(cfg, plan, max_ranks, raw)
    report["failed_invariants"] = problems = failed_elastic_invariants(report)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    plot = write_elastic_plot(out, raw)
    if as_json:
        print(json.dumps(report, indent=2))
        return 1 if problems else 0
    for resize in report["resizes"]:
        if resize["outcome"] != "switched":
            print(f"{resize['old_size']} -> {resize['new_size']} ranks at step {resize['at_step']}: {resize['outcome']}"
                  f" ({resize.get('why_abandoned', 'no reason given')}), longest pause "
                  f"{resize['serving_pause_seconds']} s")
            continue
        print(f"{resize['old_size']} -> {resize['new_size']} ranks at step {resize['at_step']}: switched, "
              f"serving at the new size after {resize['reconfiguration_seconds']} s, longest pause "
              f"{resize['serving_pause_seconds']} s, {resize['bytes_moved']} bytes moved")
    print(f"{report['batches_served']} batches, output mismatches {report['output_mismatches']}, "
          f"recompiles {report['recompiles']}, {report['eplb_rearrangements_finished']} EPLB rearrangements "
          f"between resizes; wrote {out / 'report.json'}, {plot}")
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0
