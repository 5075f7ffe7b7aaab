"""The workers' EPLB snapshots as Prometheus metric families, on the registry vLLM serves."""

from __future__ import annotations

import json
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
