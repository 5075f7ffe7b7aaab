"""The workers' EPLB snapshots as Prometheus metric families, on the registry vLLM serves."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from eplb_graph.upstream import patches  # noqa: E402
from eplb_graph.vllm_plugin import metrics_export  # noqa: E402
from eplb_graph.vllm_plugin.metrics import WorkerMetrics  # noqa: E402


def published(directory, ep_rank: str, pause_s: float) -> WorkerMetrics:
    metrics = WorkerMetrics({"model_name": "tiny", "engine": "0", "ep_rank": ep_rank}, ep_size=2, publish_dir=None)
    metrics.publish_to = directory / f"worker-{os.getpid()}-{ep_rank}.json"  # two workers' files, one live process
    metrics.counters.update(rearrangements_started=2, layers_committed=4, expert_bytes_sent=10 * int(ep_rank) + 5)
    metrics.histograms["commit_pause_seconds"].observe(pause_s)
    if ep_rank == "0":
        metrics.gauges["balancedness_window"] = {"0": 0.5, "all": 0.5}
    metrics.publish()
    return metrics


def scrape(collector) -> dict:
    registry = CollectorRegistry()
    registry.register(collector)
    return {family.name: family for family in text_string_to_metric_families(generate_latest(registry).decode())}


def test_the_collector_exposes_every_workers_snapshot_with_vllms_labels(tmp_path):
    published(tmp_path, "0", 0.002), published(tmp_path, "1", 0.2)
    (tmp_path / "worker-9.partial").write_text("{not json")  # a publish in progress is not read
    families = scrape(metrics_export.EplbCollector(tmp_path))
    started = families["eplb_graph:rearrangements_started"]
    assert started.type == "counter" and [s.name for s in started.samples] == ["eplb_graph:rearrangements_started_total"] * 2
    assert {s.labels["ep_rank"]: s.value for s in started.samples} == {"0": 2.0, "1": 2.0}
    assert {s.labels["ep_rank"]: s.value for s in families["eplb_graph:expert_bytes_sent"].samples} == {"0": 5.0, "1": 15.0}
    assert all(s.labels["model_name"] == "tiny" and s.labels["engine"] == "0" for s in started.samples)
    window = families["eplb_graph:balancedness_window"]
    assert {(s.labels["layer"], s.value) for s in window.samples} == {("0", 0.5), ("all", 0.5)}
    pause = families["eplb_graph:commit_pause_seconds"]
    buckets = {(s.labels["ep_rank"], s.labels["le"]): s.value for s in pause.samples if s.name.endswith("_bucket")}
    assert buckets[("0", "0.005")] == 1 and buckets[("1", "0.005")] == 0 and buckets[("1", "0.25")] == 1
    assert buckets[("0", "+Inf")] == buckets[("1", "+Inf")] == 1  # cumulative
    assert families["eplb_graph:async_worker_alive"].samples[0].value == 1.0


def test_a_corrupt_a_foreign_or_a_dead_workers_snapshot_is_skipped(tmp_path):
    published(tmp_path, "0", 0.001)
    (tmp_path / f"worker-{os.getpid()}-1.json").write_text("{half")
    (tmp_path / f"worker-{os.getpid()}-2.json").write_text(json.dumps({"labels": {}}))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / f"worker-{int(dead.stdout)}.json").write_text((tmp_path / f"worker-{os.getpid()}-0.json").read_text())
    assert [snap["labels"]["ep_rank"] for snap in metrics_export.read_snapshots(tmp_path)] == ["0"]


def test_the_server_registry_gets_the_collector_once(monkeypatch):
    from vllm.entrypoints.serve.instrumentator import metrics as served

    monkeypatch.delenv(metrics_export.METRICS_DIR, raising=False)
    directory = metrics_export.export_to_server()
    registry = None
    try:
        assert os.environ[metrics_export.METRICS_DIR] == str(directory) and directory.is_dir()
        assert patches.installed("metrics.registry")
        registry = served.get_prometheus_registry()
        assert served.get_prometheus_registry() is registry
        ours = [c for c in registry._collector_to_names if isinstance(c, metrics_export.EplbCollector)]
        assert len(ours) == 1 and ours[0].directory == directory
        published(directory, "0", 0.01)
        assert "eplb_graph:layers_committed_total" in generate_latest(registry).decode()
    finally:
        for collector in [c for c in getattr(registry, "_collector_to_names", {})
                          if isinstance(c, metrics_export.EplbCollector)]:
            registry.unregister(collector)
        patches.uninstall("metrics.registry")
        os.environ.pop(metrics_export.METRICS_DIR, None)


OTHER_UID = 65534  # nobody: "another user" of this machine


def good_snapshot(directory) -> dict:
    published(directory, "0", 0.001)
    return json.loads((directory / f"worker-{os.getpid()}-0.json").read_text())


def wrong(snapshot: dict, section: str, name: str, value) -> dict:
    broken = json.loads(json.dumps(snapshot))
    broken[section][name] = value
    return broken


def test_a_snapshot_of_the_wrong_types_is_skipped_logged_and_counted_and_the_scrape_goes_on(tmp_path):
    snapshot = good_snapshot(tmp_path)
    histogram = snapshot["histograms"]["commit_pause_seconds"]
    bad = [
        wrong(snapshot, "counters", "stalls", "five"),
        wrong(snapshot, "counters", "stalls", True),
        wrong(snapshot, "labels", "ep_rank", 1),
        wrong(snapshot, "gauges", "async_worker_alive", {"": "alive"}),
        wrong(snapshot, "gauges", "balancedness_window", [0.5]),
        wrong(snapshot, "histograms", "commit_pause_seconds", {**histogram, "counts": histogram["counts"][:-1]}),
        wrong(snapshot, "histograms", "commit_pause_seconds", {**histogram, "bounds": [1] * len(histogram["bounds"])}),
        wrong(snapshot, "histograms", "commit_pause_seconds", {**histogram, "sum": None}),
        [snapshot],
    ]
    for index, document in enumerate(bad, start=1):
        (tmp_path / f"worker-{os.getpid()}-{index}.json").write_text(json.dumps(document))
    (tmp_path / f"worker-{os.getpid()}-90.json").write_text("[" * 100_000 + "]" * 100_000)  # too deep for json
    (tmp_path / f"worker-{os.getpid()}-91.json").write_bytes(b"\xff\xfe{")
    (tmp_path / f"worker-{os.getpid()}-92.json").write_text(" " * (metrics_export.MAX_SNAPSHOT_BYTES + 1))
    (tmp_path / f"worker-{os.getpid()}-93.json").symlink_to(tmp_path / f"worker-{os.getpid()}-0.json")  # never followed
    collector = metrics_export.EplbCollector(tmp_path)
    records = []
    handler = logging.Handler()
    handler.emit = records.append  # vLLM's loggers do not propagate to pytest's capture
    logging.getLogger("vllm.eplb_graph").addHandler(handler)
    try:
        families = scrape(collector)
        scrape(collector)
    finally:
        logging.getLogger("vllm.eplb_graph").removeHandler(handler)
    started = families["eplb_graph:rearrangements_started"]
    assert [s.labels["ep_rank"] for s in started.samples] == ["0"]  # the good one, served
    skipped = len(bad) + 4
    assert collector.snapshots_skipped == 2 * skipped and len(records) == skipped  # counted each scrape, logged once
    messages = "\n".join(r.getMessage() for r in records)
    assert "counter stalls is not a number" in messages and "label ep_rank is not a string" in messages
    assert "histogram commit_pause_seconds" in messages and "cannot be read" in messages


def test_a_preset_directory_another_user_can_write_or_owns_is_refused_by_name(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    monkeypatch.setenv(metrics_export.METRICS_DIR, str(shared))
    for mode, message in [(0o777, "can be written by other users"), (0o1777, "can be written by other users"),
                          (0o770, "can be written by other users")]:
        shared.chmod(mode)
        with pytest.raises(metrics_export.MetricsDirError, match=rf"EPLB_GRAPH_METRICS_DIR: the metrics directory {shared} {message}"):
            metrics_export.export_to_server()
    monkeypatch.setenv(metrics_export.METRICS_DIR, str(tmp_path / "missing"))
    with pytest.raises(metrics_export.MetricsDirError, match="missing cannot be used: No such file or directory"):
        metrics_export.export_to_server()
    assert not patches.installed("metrics.registry")
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    shared.chmod(0o700)
    os.chown(shared, OTHER_UID, OTHER_UID)
    monkeypatch.setenv(metrics_export.METRICS_DIR, str(shared))
    with pytest.raises(metrics_export.MetricsDirError, match=rf"{shared} is owned by uid {OTHER_UID}"):
        metrics_export.export_to_server()


def test_a_worker_publishes_nothing_into_a_directory_other_users_can_write(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    shared.chmod(0o777)
    metrics = WorkerMetrics({"model_name": "tiny", "engine": "0", "ep_rank": "0"}, ep_size=1, publish_dir=str(shared))
    metrics.publish()
    assert metrics.publish_to is None and list(shared.iterdir()) == []


def test_a_snapshot_is_written_through_a_new_file_and_never_through_a_link(tmp_path, monkeypatch):
    from eplb_graph.core import private_files

    victim = tmp_path / "victim"
    victim.write_text("untouched")
    target = tmp_path / f"worker-{os.getpid()}-0.json"
    target.symlink_to(victim)  # planted where the worker's snapshot goes
    flags = []
    real_open = os.open
    monkeypatch.setattr(private_files.os, "open", lambda file, flag, mode=0o777: flags.append(flag) or
                        real_open(file, flag, mode))
    published(tmp_path, "0", 0.001)
    wanted = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    assert flags and all(flag & wanted == wanted for flag in flags)  # the temporary file: new, never a link
    assert victim.read_text() == "untouched" and not target.is_symlink()
    assert json.loads(target.read_text())["labels"]["ep_rank"] == "0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim", target.name]  # no temporary file left
