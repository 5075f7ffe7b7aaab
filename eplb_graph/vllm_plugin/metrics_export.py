"""Every worker's EPLB metrics on the ``/metrics`` of vLLM's OpenAI server.

vLLM serves ``/metrics`` from its API server process, while EPLB runs in the workers (the engine
core's process, or one process per TP / DP rank). With EPLB on, the config gate of an OpenAI
server (``usage_context`` ``OPENAI_API_SERVER``) calls ``export_to_server``: it makes a directory
for this server, named to every engine and worker process it starts (``METRICS_DIR``, inherited
like the rest of the environment), where each worker publishes its snapshot
(``WorkerMetrics.publish``, an atomic rename). ``EplbCollector`` reads them at each scrape; it is
registered into the registry vLLM's own metrics are served from, whichever that is (one API
server or many: ``get_prometheus_registry``, wrapped as the ``metrics.registry`` adaptation).
With EPLB off nothing is made or registered (invariant 8); an offline ``LLM`` reads the same
values with ``metrics.worker_metrics``.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from eplb_graph.upstream import patches
from eplb_graph.upstream.adaptations import PLUGIN, adaptation

from .import_hooks import call_after_import
from .metrics import BASE_LABELS, METRICS, PREFIX, Metric

METRICS_DIR = "EPLB_GRAPH_METRICS_DIR"  # set by the API server's gate; read by its workers
REGISTRY_ADAPTATION = "metrics.registry"
SNAPSHOT_KEYS = ("labels", "counters", "gauges", "histograms")
SECTION = {"counter": "counters", "gauge": "gauges", "histogram": "histograms"}


def _writer_alive(path: Path) -> bool:
    """Whether the worker process that wrote ``worker-<pid>[...].json`` still runs (on this host)."""
    try:
        os.kill(int(path.stem.split("-")[1]), 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _well_formed(snapshot: object) -> bool:
    return (isinstance(snapshot, dict) and all(isinstance(snapshot.get(k), dict) for k in SNAPSHOT_KEYS)
            and all(label in snapshot["labels"] for label in BASE_LABELS)
            and all(m.name in snapshot[SECTION[m.kind]] for m in METRICS))


def read_snapshots(directory: Path) -> list[dict]:
    """Every live worker's last published snapshot (a file being replaced is read whole, or not at
    all); a dead worker's file, or one that is not a snapshot, is skipped: one never breaks a scrape."""
    snapshots = []
    for path in sorted(directory.glob("worker-*.json")):
        try:
            snapshot = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):  # removed since the glob, or not ours
            continue
        if _writer_alive(path) and _well_formed(snapshot):
            snapshots.append(snapshot)
    return snapshots


class EplbCollector:
    """A Prometheus collector over the workers' snapshots in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def describe(self) -> list:
        return []  # values come from other processes: nothing to check at registration

    def collect(self) -> Iterator:
        snapshots = read_snapshots(self.directory)
        for metric in METRICS:
            yield _family(metric, snapshots)

    def serve_on(self, module) -> None:
        """``call_after_import`` target: wraps the registry getter of vLLM's metrics ``module`` so
        the registry it returns carries this collector (once)."""
        if patches.installed(REGISTRY_ADAPTATION):
            return
        upstream = patches.current(REGISTRY_ADAPTATION)

        def get_prometheus_registry():
            registry = upstream()
            if self not in getattr(registry, "_collector_to_names", {}):
                registry.register(self)
            return registry

        patches.install(REGISTRY_ADAPTATION, get_prometheus_registry, by=PLUGIN)


def _family(metric: Metric, snapshots: list[dict]):
    """One metric over every worker's snapshot, as a Prometheus metric family."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    name = PREFIX + metric.name
    if metric.kind == "histogram":
        family = HistogramMetricFamily(name, metric.help, labels=BASE_LABELS)
        for snap in snapshots:
            hist = snap["histograms"][metric.name]
            cumulative = itertools.accumulate(hist["counts"])  # Prometheus buckets count every value up to them
            buckets = [("+Inf" if bound == "inf" else bound, count) for bound, count in zip(hist["bounds"], cumulative)]
            family.add_metric(_worker(snap), buckets, hist["sum"])
    elif metric.kind == "counter":
        family = CounterMetricFamily(name, metric.help, labels=BASE_LABELS)
        for snap in snapshots:
            family.add_metric(_worker(snap), snap["counters"][metric.name])
    elif metric.layered:
        family = GaugeMetricFamily(name, metric.help, labels=("model_name", "layer"))
        for snap in snapshots:
            for layer, value in snap["gauges"][metric.name].items():
                family.add_metric([snap["labels"]["model_name"], layer], value)
    else:
        family = GaugeMetricFamily(name, metric.help, labels=BASE_LABELS)
        for snap in snapshots:
            for value in snap["gauges"][metric.name].values():
                family.add_metric(_worker(snap), value)
    return family


def _worker(snapshot: dict) -> list[str]:
    return [snapshot["labels"][label] for label in BASE_LABELS]


def export_to_server() -> Path:
    """In the API server's process, before its engines start: the directory its workers publish
    into (made here, removed at exit) and the collector on the registry ``/metrics`` serves."""
    directory = os.environ.get(METRICS_DIR)
    if directory is None:
        directory = tempfile.mkdtemp(prefix="eplb_graph_metrics_")
        os.environ[METRICS_DIR] = directory  # the engine and worker processes started from here inherit it
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
    collector = EplbCollector(Path(directory))
    call_after_import(adaptation(REGISTRY_ADAPTATION).module, "eplb-graph metrics", collector.serve_on)
    return Path(directory)
