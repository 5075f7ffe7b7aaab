"""The bench's step breakdown: each rank's probed steps combined, rearranging vs steady.

Each rank's ``RankResult.breakdown`` (``eplb_reference.runtime.step_probes``) holds, per timed
step, its time, its EPLB host work split ours / upstream, the async worker's CPU time, the
GIL probe's samples and the CLOCK_MONOTONIC instant the rank was ready to enter the step.
Here the ranks meet: the wait at a step's first collective is the last rank's ready instant
less this rank's, and what is left of the step is the forward itself (with whatever the
GIL and the cores took from it), so that per step

    step_ms = eplb_ours_ms + eplb_upstream_ms + collective_wait_ms + forward_rest_ms

The wait at upstream's ready all-reduce (in ``end_batch``, while a rearrangement is in
flight) is found the same way from each rank's entry instant; it is a part of upstream's
EPLB host work, not a fifth part. Medians of the parts do not add up to the step's median; their means add up to its mean.
"""

from __future__ import annotations

import statistics

from eplb_reference.bench.stats import percentile

# the parts that add up to a step, then what is read beside them (not parts of the sum)
PARTS = ("eplb_ours_ms", "eplb_upstream_ms", "collective_wait_ms", "forward_rest_ms")
BESIDE = ("upstream_ready_sync_ms", "upstream_ready_sync_wait_ms", "upstream_install_ms", "upstream_commit_ms", "upstream_rearrange_ms",
          "worker_cpu_ms", "gil_wait_ms", "gil_wait_worker_bound_ms", "gil_wait_main_bound_ms")
PHASES = ("step_ms", *PARTS, *BESIDE)


def collective_waits(ready_ns: list[dict[int, int]]) -> list[dict[int, float]]:
    """Per rank, step -> ms it waited for the last rank to be ready: max over ranks of the
    ready instants less its own. ``ready_ns``: per rank, step -> CLOCK_MONOTONIC ns; steps
    that not every rank has are left out."""
    common = set.intersection(*(set(r) for r in ready_ns)) if ready_ns else set()
    last = {step: max(r[step] for r in ready_ns) for step in common}
    return [{step: (last[step] - r[step]) / 1e6 for step in sorted(common)} for r in ready_ns]


def completed_records(ranks: list[list[dict]]) -> list[list[dict]]:
    """Each rank's step records with the waits and the forward's remainder filled in."""
    waits = collective_waits([{r["step"]: r["ready_ns"] for r in records} for records in ranks])
    # the same at upstream's ready all-reduce, in the steps where every rank entered one
    sync_waits = collective_waits([{r["step"]: r["ready_sync_entry_ns"] for r in records
                                    if r.get("ready_sync_entry_ns") is not None} for records in ranks])
    completed = []
    for records, wait, sync_wait in zip(ranks, waits, sync_waits):
        rows = []
        for record in records:
            if record["step"] not in wait:
                continue
            row = dict(record, collective_wait_ms=wait[record["step"]],
                       upstream_ready_sync_wait_ms=sync_wait.get(record["step"], 0.0))
            row["forward_rest_ms"] = (row["step_ms"] - row["eplb_ours_ms"] - row["eplb_upstream_ms"]
                                      - row["collective_wait_ms"])
            rows.append(row)
        completed.append(rows)
    return completed


def summarize(rows: list[dict]) -> dict | None:
    """p50, p99 and mean of every phase over ``rows`` (None where there are none)."""
    if not rows:
        return None
    summary = {"steps": len(rows)}
    for phase in PHASES:
        values = [row[phase] for row in rows]
        summary[phase] = {"p50": round(statistics.median(values), 3), "p99": round(percentile(values, 99), 3),
                          "mean": round(statistics.fmean(values), 3)}
    return summary


def step_breakdown(busy: list[dict]) -> dict:
    """The breakdown of a rearranging run (``run_rank``'s results, one per rank, decode steps):
    every phase's p50 / p99 / mean over all ranks' rearranging and steady steps, and each rank's."""
    # a rank's breakdown is aligned with its timed steps' kinds and rearranging flags
    ranks = [[dict(record, kind=kind, rearranging=busy_step)
              for record, kind, busy_step in zip(result["breakdown"], result["kinds"], result["rebalancing"], strict=True)]
             for result in busy]
    completed = [[row for row in rows if row["kind"] == "decode"] for rows in completed_records(ranks)]

    def split(rows: list[dict]) -> dict:
        return {"rearranging": summarize([r for r in rows if r["rearranging"]]),
                "steady": summarize([r for r in rows if not r["rearranging"]])}

    return {**split([row for rows in completed for row in rows]),
            "per_rank": [{"rank": result["rank"], **split(rows)} for result, rows in zip(busy, completed)]}


def breakdown_cells(ratios: dict) -> tuple[list[str], list[list[str]]]:
    """The breakdown as a header and rows of cells: per mode, p50 (p99) ms of each phase in
    rearranging and steady steps, and the difference of their means (what a rearranging step
    adds, part by part). Empty where no mode has a breakdown."""
    modes = [m for m, r in ratios.items() if isinstance(r, dict) and r.get("step_breakdown")]
    if not modes:
        return [], []
    header = ["step breakdown, p50 (p99) ms"] + [f"{m} {col}" for m in modes for col in ("rearranging", "steady", "added (mean)")]
    rows = []
    for label, phase in BREAKDOWN_ROWS:
        cells = [label]
        for mode in modes:
            summaries = [ratios[mode]["step_breakdown"][kind] for kind in ("rearranging", "steady")]
            summaries = [None if s is None or phase not in s else s[phase] for s in summaries]  # a report of fewer phases
            cells += ["n/a" if s is None else f"{s['p50']:.2f} ({s['p99']:.2f})" for s in summaries]
            cells.append("n/a" if None in summaries else f"{summaries[0]['mean'] - summaries[1]['mean']:+.2f}")
        rows.append(cells)
    return header, rows


def format_breakdown(ratios: dict) -> str:
    """The compact text table of ``breakdown_cells``; "added": rearranging mean - steady mean."""
    header, rows = breakdown_cells(ratios)
    if not header:
        return ""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join(f"{row[0]:<{widths[0]}}" + "".join(f"  {cell:>{w}}" for cell, w in zip(row[1:], widths[1:]))
                     for row in [header, *rows])


BREAKDOWN_ROWS = (  # (label, phase)
    ("step", "step_ms"),
    ("EPLB host: ours", "eplb_ours_ms"),
    ("EPLB host: upstream", "eplb_upstream_ms"),
    ("  its ready all-reduce", "upstream_ready_sync_ms"),
    ("    of it, the slower rank", "upstream_ready_sync_wait_ms"),
    ("  its weight install", "upstream_install_ms"),
    ("  its map commit", "upstream_commit_ms"),
    ("  its rearrange()", "upstream_rearrange_ms"),
    ("wait for the slower rank", "collective_wait_ms"),
    ("forward and the rest", "forward_rest_ms"),
    ("worker thread CPU", "worker_cpu_ms"),
    ("GIL wait (probe)", "gil_wait_ms"),
    ("  of it the worker's, at most", "gil_wait_worker_bound_ms"),
    ("  the main thread's, at most", "gil_wait_main_bound_ms"),
)
