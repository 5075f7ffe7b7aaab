"""The step breakdown: waits from ready instants, parts that add up to the step, rearranging vs steady."""

import pytest

from eplb_reference.bench.breakdown import PARTS, collective_waits, completed_records, format_breakdown, step_breakdown

MS = 1_000_000  # ns


def test_each_rank_waits_for_the_last_rank_ready_at_that_step():
    ready = [{0: 10 * MS, 1: 20 * MS, 2: 31 * MS}, {0: 12 * MS, 1: 20 * MS, 2: 30 * MS, 3: 40 * MS}]
    waits = collective_waits(ready)
    assert waits == [{0: 2.0, 1: 0.0, 2: 0.0}, {0: 0.0, 1: 0.0, 2: 1.0}]  # step 3: not every rank has it
    assert collective_waits([{5: 7 * MS}]) == [{5: 0.0}]  # one rank waits for no one
    assert collective_waits([]) == []


def record(step: int, ready_ms: float, step_ms: float, ours: float, upstream: float, **beside) -> dict:
    sync = beside.get("sync_at")
    return {"step": step, "ready_ns": int(ready_ms * MS), "ready_sync_entry_ns": None if sync is None else int(sync * MS), "step_ms": step_ms, "eplb_ours_ms": ours,
            "eplb_upstream_ms": upstream, "upstream_ready_sync_ms": beside.get("sync", 0.0),
            "upstream_install_ms": beside.get("sync", 0.0) / 2, "upstream_rearrange_ms": 0.0,
            "upstream_commit_ms": 0.1,
            "worker_cpu_ms": beside.get("cpu", 0.0), "gil_wait_ms": beside.get("gil", 0.0),
            "gil_wait_worker_bound_ms": beside.get("gil", 0.0) / 2, "gil_wait_main_bound_ms": beside.get("gil", 0.0),
            "gil_samples": 3}


def test_the_parts_add_up_to_each_step():
    ranks = [[record(0, 0.0, 5.0, 0.5, 1.0, sync_at=4.0), record(1, 10.0, 4.0, 0.1, 0.1, sync_at=13.0)],
             [record(0, 1.5, 4.0, 0.5, 1.0, sync_at=4.5), record(1, 10.0, 4.0, 0.1, 0.1)]]
    completed = completed_records(ranks)
    assert [row["collective_wait_ms"] for row in completed[0]] == [1.5, 0.0]
    # at upstream's ready all-reduce: rank 0 came 0.5 ms early in step 0; step 1 had it on one rank only
    assert [row["upstream_ready_sync_wait_ms"] for row in completed[0]] == [0.5, 0.0]
    assert [row["upstream_ready_sync_wait_ms"] for row in completed[1]] == [0.0, 0.0]
    assert completed[0][0]["forward_rest_ms"] == pytest.approx(5.0 - 0.5 - 1.0 - 1.5)
    for rows in completed:
        for row in rows:
            assert sum(row[part] for part in PARTS) == pytest.approx(row["step_ms"])


def busy_rank(rank: int, offset_ms: float) -> dict:
    # steps 0-3: two rearranging decode steps, a steady one, a prefill one (left out)
    records = [record(0, 0.0 + offset_ms, 8.0, 1.0, 3.0, sync=1.0, cpu=2.0, gil=1.0),
               record(1, 10.0 + offset_ms, 6.0, 0.5, 2.0, sync=0.5, cpu=1.0, gil=0.5),
               record(2, 20.0, 4.0, 0.1, 0.1), record(3, 30.0, 9.0, 0.1, 0.1)]
    return {"rank": rank, "breakdown": records, "kinds": ["decode", "decode", "decode", "prefill"],
            "rebalancing": [True, True, False, False]}


def test_the_breakdown_splits_rearranging_from_steady_steps_per_rank_and_over_all():
    breakdown = step_breakdown([busy_rank(0, 0.0), busy_rank(1, 1.0)])
    rearranging, steady = breakdown["rearranging"], breakdown["steady"]
    assert rearranging["steps"] == 4 and steady["steps"] == 2  # the prefill step is no decode step
    assert rearranging["collective_wait_ms"]["p99"] == 1.0  # rank 0 was ready 1 ms before rank 1
    assert rearranging["worker_cpu_ms"]["p50"] == 1.5 and steady["worker_cpu_ms"]["p50"] == 0.0
    # the parts' means add up to the mean step (their medians need not)
    for summary in (rearranging, steady):
        assert sum(summary[part]["mean"] for part in PARTS) == pytest.approx(summary["step_ms"]["mean"], abs=0.01)
    rank0 = breakdown["per_rank"][0]
    assert rank0["rank"] == 0 and rank0["rearranging"]["collective_wait_ms"]["p50"] == 1.0
    assert breakdown["per_rank"][1]["rearranging"]["collective_wait_ms"]["p50"] == 0.0


def test_the_breakdown_table_shows_each_phase_and_n_a_where_a_kind_had_no_step():
    breakdown = step_breakdown([busy_rank(0, 0.0), busy_rank(1, 1.0)])
    no_steady = dict(breakdown, steady=None)
    text = format_breakdown({"compiled": {"step_breakdown": breakdown}, "eager": {"step_breakdown": no_steady},
                             "graph_speedup_over_eager_decode": 2.0})
    lines = text.splitlines()
    assert "compiled rearranging" in lines[0] and "eager steady" in lines[0]
    rows = {line[:28].strip(): line for line in lines[1:]}
    assert rows["wait for the slower rank"].split()[-1] == "n/a"
    assert rows["worker thread CPU"].split()[3:8] == ["1.50", "(2.00)", "0.00", "(0.00)", "+1.50"]  # compiled: p50 (p99), added
    assert format_breakdown({"compiled": {"on_idle_over_off": 1.0}}) == ""  # a bench without the probes
