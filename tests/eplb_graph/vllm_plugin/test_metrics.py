"""One worker's EPLB metrics: what each upstream step moves them by, and the snapshot they publish."""

from __future__ import annotations

import json
import logging
import shutil
from types import SimpleNamespace

import pytest
import torch

from eplb_graph.vllm_plugin import metrics as metrics_module
from eplb_graph.vllm_plugin.metrics import METRICS, WorkerMetrics, metrics_markdown

LABELS = {"model_name": "m", "engine": "0", "ep_rank": "0"}


def model_state(load, placement):
    return SimpleNamespace(last_expert_load=torch.tensor(load), physical_to_logical_map=torch.tensor(placement))


def step(metrics, state, *, in_flight, committed, finished, seconds=0.002, stalls=0, moved=(0, 0), alive=True,
         compiled=0):
    metrics.after_step(step_seconds=seconds, in_flight=in_flight, layers_committed=committed, finished=finished,
                       stalls=stalls, bytes_moved=moved, worker_alive=alive, graphs_compiled=compiled,
                       model_state=state)


def test_a_rearrangement_is_counted_timed_and_its_balancedness_taken_before_and_after(tmp_path):
    metrics = WorkerMetrics(LABELS, ep_size=2, publish_dir=str(tmp_path))
    # 2 layers, 3 logical experts, 4 slots over 2 ranks; expert 0 is hot
    load = [[6.0, 1.0, 1.0], [2.0, 2.0, 2.0]]
    state = model_state(load, [[0, 2, 1, 1], [0, 1, 2, 2]])  # in force: expert 0 on rank 0 only
    step(metrics, state, in_flight=False, committed=0, finished=0)
    assert metrics.counters["rearrangements_started"] == 0 and metrics.gauges["balancedness_window"] == {}
    step(metrics, state, in_flight=True, committed=0, finished=0)  # the window closed: upstream started one
    assert metrics.counters["rearrangements_started"] == 1
    step(metrics, state, in_flight=True, committed=1, finished=0, seconds=0.003, moved=(100, 40))
    assert metrics.gauges["balancedness_window"] == {}  # both gauges come with the finish: the same window
    state.physical_to_logical_map = torch.tensor([[0, 1, 0, 2], [0, 1, 2, 0]])  # committed: the hot one replicated
    step(metrics, state, in_flight=False, committed=2, finished=1, seconds=0.004, moved=(200, 80))
    # layer 0: rank 0 holds 0 and 2: 6 + 1 = 7, rank 1 holds 1 twice: 1 -> 4 / 7
    # layer 1: rank 0 holds 0, 1: 4; rank 1 holds 2 twice: 2 -> 3 / 4
    window = metrics.gauges["balancedness_window"]
    assert window["0"] == pytest.approx(4 / 7) and window["1"] == pytest.approx(3 / 4)
    assert window["all"] == pytest.approx((4 / 7 + 3 / 4) / 2)
    committed = metrics.gauges["balancedness_committed"]
    # layer 0: rank 0: 3 + 1 = 4, rank 1: 3 + 1 = 4 -> 1; layer 1: rank 0: 1 + 2, rank 1: 2 + 1 -> 1
    assert committed == {"0": pytest.approx(1.0), "1": pytest.approx(1.0), "all": pytest.approx(1.0)}
    assert metrics.counters["rearrangements_finished"] == 1 and metrics.counters["layers_committed"] == 2
    assert metrics.counters["expert_bytes_sent"] == 200 and metrics.counters["expert_bytes_received"] == 80
    pause = metrics.histograms["commit_pause_seconds"]
    assert sum(pause.counts) == 2 and pause.sum == pytest.approx(0.007)
    assert sum(metrics.histograms["rearrangement_duration_seconds"].counts) == 1
    published = json.loads((tmp_path / next(p.name for p in tmp_path.iterdir())).read_text())
    assert published == json.loads(json.dumps(metrics.snapshot()))
    assert [p.suffix for p in tmp_path.iterdir()] == [".json"]  # no partial file left


def test_a_step_that_finishes_one_rearrangement_and_starts_the_next_counts_both():
    """Upstream commits the last layer and, the interval reached, starts the next in one step."""
    metrics = WorkerMetrics(LABELS, ep_size=1, publish_dir=None)
    state = model_state([[2.0, 1.0]], [[0, 1]])
    step(metrics, state, in_flight=True, committed=0, finished=0)
    first_window = metrics._window_load
    state.last_expert_load = torch.tensor([[1.0, 5.0]])  # the next window, all-reduced in the same step
    step(metrics, state, in_flight=True, committed=1, finished=1)
    assert metrics.counters["rearrangements_started"] == 2 and metrics.counters["rearrangements_finished"] == 1
    assert metrics._window_load.tolist() == [[1.0, 5.0]] and first_window.tolist() == [[2.0, 1.0]]
    step(metrics, state, in_flight=False, committed=2, finished=2)
    assert sum(metrics.histograms["rearrangement_duration_seconds"].counts) == 2


def test_a_snapshot_that_cannot_be_written_is_logged_once_and_never_raised(tmp_path):
    records = []
    handler = logging.Handler()
    handler.emit = records.append  # vLLM's loggers do not propagate to pytest's capture
    logger = logging.getLogger("vllm.eplb_graph")
    logger.addHandler(handler)
    try:
        (tmp_path / "removed").mkdir(mode=0o700)
        metrics = WorkerMetrics(LABELS, ep_size=1, publish_dir=str(tmp_path / "removed"))
        shutil.rmtree(tmp_path / "removed")  # the server's dir is gone (it removes it at exit)
        metrics.publish()
        metrics.publish()
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage().startswith("eplb-graph: cannot publish EPLB metrics") for r in records] == [True]


def test_only_ep_rank_0_reports_the_global_balancedness_and_a_dead_worker_is_published():
    metrics = WorkerMetrics({**LABELS, "ep_rank": "1"}, ep_size=2, publish_dir=None)
    state = model_state([[1.0, 1.0]], [[0, 1]])
    step(metrics, state, in_flight=True, committed=0, finished=0, stalls=1)
    assert metrics.gauges["balancedness_window"] == {} and metrics.counters["stalls"] == 1
    step(metrics, state, in_flight=True, committed=0, finished=0, stalls=1, alive=False, compiled=2)
    assert metrics.gauges["async_worker_alive"] == {"": 0.0}
    assert metrics.counters["graphs_compiled_while_serving"] == 2


def test_every_metric_is_named_by_prometheus_conventions_and_documented():
    for metric in METRICS:
        assert metric.name == metric.name.lower() and not metric.name.endswith("_total"), metric.name
        assert metric.kind in ("counter", "gauge", "histogram") and metric.help and metric.watches
        if metric.kind == "histogram":
            assert metric.name.endswith("_seconds")
    from pathlib import Path

    reference = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"
    assert metrics_markdown() in reference.read_text()


def test_balancedness_splits_a_placement_over_the_live_ep_size_after_a_resize():
    """vLLM's elastic EP grows the group 2 -> 3 at 5 slots a rank (10 -> 15 slots) while a
    rearrangement runs: the EP size fixed at bind reshapes 15 slots as [2, 2, -1] (the operator's
    error); the live one splits them over 3 ranks."""
    load = [[4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [1.0] * 8]
    at_2 = [list(range(8)) + [0, 1]] * 2  # [L=2, 10]
    at_3 = [list(range(8)) + [0, 0, 1, 2, 3, 4, 5]] * 2  # [L=2, 15]: the placement after the scale-up
    stale = WorkerMetrics(LABELS, ep_size=2, publish_dir=None)
    step(stale, model_state(load, at_2), in_flight=True, committed=0, finished=0)
    with pytest.raises(RuntimeError, match=r"shape '\[2, 2, -1\]' is invalid for input of size 30"):
        step(stale, model_state(load, at_3), in_flight=False, committed=2, finished=1)

    group = SimpleNamespace(world_size=2)
    metrics = WorkerMetrics(LABELS, ep_size=lambda: group.world_size, publish_dir=None)
    step(metrics, model_state(load, at_2), in_flight=True, committed=0, finished=0)
    group.world_size = 3  # the switch
    step(metrics, model_state(load, at_3), in_flight=False, committed=2, finished=1)
    assert metrics.ep_size == 3
    committed = metrics.gauges["balancedness_committed"]
    from eplb_graph.core.placement import layer_balancedness, rank_loads

    expected = layer_balancedness(rank_loads(torch.tensor(load), torch.tensor(at_3), 3))
    assert committed["0"] == pytest.approx(float(expected[0])) and committed["1"] == pytest.approx(float(expected[1]))
    assert set(metrics.gauges["balancedness_window"]) == {"0", "1", "all"}  # taken at EP 2, 10 slots


def test_the_local_work_counters_alone_publish_at_most_once_a_second(tmp_path, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    metrics = WorkerMetrics(LABELS, ep_size=2, publish_dir=str(tmp_path))
    state = model_state([[1.0, 1.0]], [[0, 1]])
    published = lambda: json.loads(next(tmp_path.iterdir()).read_text())["counters"]  # noqa: E731

    metrics.after_step(step_seconds=0.01, in_flight=False, layers_committed=0, finished=0, stalls=0, bytes_moved=(0, 0),
                       worker_alive=True, graphs_compiled=0, model_state=state, local_work=(40, 0.25))
    assert metrics.counters["local_pairs_computed"] == 40 and published()["local_pairs_computed"] == 0
    now[0] += metrics_module.WORK_PUBLISH_S
    metrics.after_step(step_seconds=0.01, in_flight=False, layers_committed=0, finished=0, stalls=0, bytes_moved=(0, 0),
                       worker_alive=True, graphs_compiled=0, model_state=state, local_work=(56, 0.5))
    assert (published()["local_pairs_computed"], published()["local_expert_seconds"]) == (56, 0.5)
    # any other change publishes at once, the work counters with it
    metrics.after_step(step_seconds=0.01, in_flight=False, layers_committed=0, finished=0, stalls=1, bytes_moved=(0, 0),
                       worker_alive=True, graphs_compiled=0, model_state=state, local_work=(60, 0.75))
    assert (published()["stalls"], published()["local_pairs_computed"]) == (1, 60)
