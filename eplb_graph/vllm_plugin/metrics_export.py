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

A preset ``METRICS_DIR`` must be this user's and writable by no other user (the gate refuses it
by name, before any engine starts); a snapshot that is not one (unreadable, a link, too large,
a field of the wrong type or shape) is skipped, logged once and counted (``snapshots_skipped``):
one bad file never breaks the scrape.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from eplb_graph.upstream import patches
from eplb_graph.upstream.adaptations import PLUGIN, adaptation

from .import_hooks import call_after_import
from .metrics import BASE_LABELS, METRICS, PREFIX, Metric, metrics_dir_problem

METRICS_DIR = "EPLB_GRAPH_METRICS_DIR"  # set by the API server's gate; read by its workers
REGISTRY_ADAPTATION = "metrics.registry"
SNAPSHOT_KEYS = ("labels", "counters", "gauges", "histograms")
SECTION = {"counter": "counters", "gauge": "gauges", "histogram": "histograms"}
MAX_SNAPSHOT_BYTES = 1 << 20  # a worker's snapshot is a few KiB (one gauge per MoE layer): anything larger is not one
logger = logging.getLogger("vllm.eplb_graph")


def _writer_alive(path: Path) -> bool:
    """Whether the worker process that wrote ``worker-<pid>[...].json`` still runs (on this host)."""
    try:
        os.kill(int(path.stem.split("-")[1]), 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bound(value: object) -> bool:
    """A histogram bucket's upper bound as a snapshot spells it: a float's ``str``, or ``inf``."""
    try:
        return isinstance(value, str) and not math.isnan(float(value))
    except ValueError:
        return False


def snapshot_problem(snapshot: object) -> str | None:
    """What makes ``snapshot`` unusable by ``_family`` (None: nothing): each section a dict, every
    label a string, every metric there with values of its type, each histogram's bounds and counts
    of one length."""
    if not isinstance(snapshot, dict) or not all(isinstance(snapshot.get(key), dict) for key in SNAPSHOT_KEYS):
        return f"not an object with {', '.join(SNAPSHOT_KEYS)}"
    for label in BASE_LABELS:
        if not isinstance(snapshot["labels"].get(label), str):
            return f"label {label} is not a string"
    for metric in METRICS:
        value = snapshot[SECTION[metric.kind]].get(metric.name)
        if metric.kind == "counter" and not _number(value):
            return f"counter {metric.name} is not a number"
        if metric.kind == "gauge" and not (isinstance(value, dict) and all(
                isinstance(key, str) and _number(item) for key, item in value.items())):
            return f"gauge {metric.name} is not an object of numbers"
        if metric.kind == "histogram":
            if not (isinstance(value, dict) and isinstance(value.get("bounds"), list)
                    and isinstance(value.get("counts"), list) and _number(value.get("sum"))):
                return f"histogram {metric.name} lacks bounds, counts or sum"
            if len(value["bounds"]) != len(value["counts"]) or not all(map(_bound, value["bounds"])) \
                    or not all(_number(count) for count in value["counts"]):
                return f"histogram {metric.name}: bounds and counts differ in length or type"
    return None


def _read(path: Path) -> object:
    """The JSON in ``path``, read without following a link, at most ``MAX_SNAPSHOT_BYTES``."""
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as snapshot:
        data = snapshot.read(MAX_SNAPSHOT_BYTES + 1)
    if len(data) > MAX_SNAPSHOT_BYTES:
        raise ValueError(f"larger than {MAX_SNAPSHOT_BYTES} bytes")
    return json.loads(data)


def read_snapshots(directory: Path, skipped: Callable[[Path, str], None] | None = None) -> list[dict]:
    """Every live worker's last published snapshot (a file being replaced is read whole, or not at
    all); a dead worker's file is left out, and one that is not a snapshot is left out and handed
    to ``skipped`` with why: one never breaks a scrape."""
    snapshots = []
    for path in sorted(directory.glob("worker-*.json")):
        try:
            snapshot = _read(path)
        except FileNotFoundError:  # removed since the glob: its worker ended
            continue
        except (OSError, ValueError, RecursionError) as error:  # a link (ELOOP), unreadable, too large, not JSON
            if skipped is not None:
                skipped(path, f"cannot be read: {error}")
            continue
        if not _writer_alive(path):
            continue
        problem = snapshot_problem(snapshot)
        if problem is None:
            snapshots.append(snapshot)
        elif skipped is not None:
            skipped(path, problem)
    return snapshots


class EplbCollector:
    """A Prometheus collector over the workers' snapshots in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.snapshots_skipped = 0  # files left out of a scrape for not being a snapshot, over every scrape
        self._reported: set[str] = set()  # each such file is logged once (named by pid: a few per worker)

    def describe(self) -> list:
        return []  # values come from other processes: nothing to check at registration

    def collect(self) -> Iterator:
        snapshots = read_snapshots(self.directory, self._skipped)
        for metric in METRICS:
            yield _family(metric, snapshots)

    def _skipped(self, path: Path, why: str) -> None:
        self.snapshots_skipped += 1
        if path.name not in self._reported and len(self._reported) < 1024:
            self._reported.add(path.name)
            logger.warning("eplb-graph: EPLB metrics snapshot %s skipped: %s", path, why)

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


class MetricsDirError(ValueError):
    """The metrics directory preset in the environment cannot be trusted."""


def export_to_server() -> Path:
    """In the API server's process, before its engines start: the directory its workers publish
    into (made here, removed at exit) and the collector on the registry ``/metrics`` serves. A
    preset directory another user owns or can write is refused by name (MetricsDirError; the
    config gate reports it as its own refusal)."""
    directory = os.environ.get(METRICS_DIR)
    if directory is not None:
        problem = metrics_dir_problem(directory)
        if problem:
            raise MetricsDirError(f"{METRICS_DIR}: {problem}")
    else:
        directory = tempfile.mkdtemp(prefix="eplb_graph_metrics_")
        os.environ[METRICS_DIR] = directory  # the engine and worker processes started from here inherit it
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
    collector = EplbCollector(Path(directory))
    call_after_import(adaptation(REGISTRY_ADAPTATION).module, "eplb-graph metrics", collector.serve_on)
    return Path(directory)
