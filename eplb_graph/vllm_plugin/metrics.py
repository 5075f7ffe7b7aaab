"""What EPLB balances, moves and costs in one vLLM worker, as Prometheus metrics.

``METRICS`` spells every name, type, label and meaning once (``docs/metrics.md`` is written from
it). ``WorkerMetrics`` keeps one worker's values on the host and updates them after each of
upstream's EPLB steps, from what that step already left on the host: the binding's counters,
the movers' byte counts, the watchdog's stalls, the compile watch. Nothing runs on the routing
hot path. Balancedness is computed twice per rearrangement, on EP rank 0: when it starts (the load
window upstream just all-reduced, ``last_expert_load``, under the placement in force) and when its
last layer commits (the same load under the committed placement); both gauges are set then, so
they always describe the same window. A snapshot that cannot be written is logged once, never
raised into a step. Snapshots are published only into a directory this user owns and no other
user can write (``metrics_dir_problem``; else logged and not published), through a new temporary
file and a rename that never follows a link (``core/private_files.py``).

The values reach vLLM's ``/metrics`` through ``metrics_export.py``; without a server they are
read with ``worker_metrics(llm)``.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from eplb_graph.core.placement import layer_balancedness, rank_loads
from eplb_graph.core.private_files import replace_file

PREFIX = "eplb_graph:"
BASE_LABELS = ("model_name", "engine", "ep_rank")  # vLLM's model_name and engine (DP rank), and the worker's EP rank
REARRANGEMENT_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, float("inf"))
PAUSE_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, float("inf"))
# the local work counters change every step; alone they publish a snapshot (a file write) at most this often
WORK_PUBLISH_S = 1.0
WORK_COUNTERS = ("local_pairs_computed", "local_expert_seconds")


@dataclass(frozen=True)
class Metric:
    name: str  # without the prefix; counters are exposed with ``_total``
    kind: str  # counter, gauge or histogram
    help: str
    watches: str  # the invariant or failure an operator alerts on with it
    layered: bool = False  # one series per MoE layer, and ``layer="all"`` for the model


METRICS = (
    Metric("balancedness_window", "gauge", "Mean / max per-rank load of the load window the last finished "
           "rearrangement was computed from, under the placement in force while it was recorded (EP rank 0 only: "
           "the window is global)",
           "a hot expert making one rank the straggler", layered=True),
    Metric("balancedness_committed", "gauge", "Mean / max per-rank load of that window under the placement committed "
           "by the rearrangement it started (EP rank 0 only)", "a policy that does not relieve the straggler",
           layered=True),
    Metric("rearrangements_started", "counter", "Rearrangements upstream's EPLB started on this worker",
           "how often experts move"),
    Metric("rearrangements_finished", "counter", "Rearrangements whose last MoE layer committed on this worker",
           "started minus finished: one in flight, or stuck"),
    Metric("layers_committed", "counter", "Layer placements committed, each refreshing our lookup before upstream's "
           "ack (invariants 3, 6)", "progress of a rearrangement"),
    Metric("expert_bytes_sent", "counter", "Expert weight bytes this worker's mover sent to other EP ranks",
           "the network cost of a rearrangement"),
    Metric("expert_bytes_received", "counter", "Expert weight bytes this worker's mover received from other EP ranks",
           "the network cost of a rearrangement"),
    Metric("rearrangement_duration_seconds", "histogram", "From a load window closing to the rearrangement's last "
           "layer committed", "a slow move, a slow policy"),
    Metric("commit_pause_seconds", "histogram", "Time of upstream's EPLB step in the steps that committed a layer: the "
           "serving pause a commit adds", "a commit stalling serving between graph replays"),
    Metric("stalls", "counter", "Rearrangements in flight with no layer committed past the stall bound "
           "(EPLB_GRAPH_STALL_STEPS / _SECONDS)", "a stuck async worker or transfer"),
    Metric("async_worker_alive", "gauge", "1 while upstream's async EPLB worker thread lives, 0 once it died "
           "(the last committed placement keeps serving)", "EPLB silently off"),
    Metric("local_pairs_computed", "counter", "(token, k) pairs this worker's expert kernels computed: under expert "
           "parallel on CPU, its own slots' only (eplb_graph::local_expert_pairs; published at most once a "
           "second when nothing else changed)", "the straggler: the rank with the most pairs"),
    Metric("local_expert_seconds", "counter", "Seconds this worker's expert kernels took over those pairs (the same "
           "cadence)", "the straggler: the rank whose experts take the longest"),
    Metric("graphs_compiled_while_serving", "counter", "MoE layer mappings our pass made in graphs compiled after "
           "warm-up (0 when graph mode holds)", "invariant 9: a shape or value frozen into a graph"),
)
BY_NAME = {metric.name: metric for metric in METRICS}
logger = logging.getLogger("vllm.eplb_graph")


def metrics_dir_problem(directory: str | os.PathLike) -> str | None:
    """Why ``directory`` cannot hold the snapshots (None: it can): it must exist and be this user's,
    writable by no other user, since whatever lies there is served on ``/metrics`` (a sticky
    directory does not help: another user could add a worker's file of their own)."""
    try:
        info = os.stat(directory)
    except OSError as error:
        return f"the metrics directory {directory} cannot be used: {error.strerror}"
    if not stat.S_ISDIR(info.st_mode):
        return f"the metrics directory {directory} is not a directory"
    if info.st_uid != os.geteuid():
        return f"the metrics directory {directory} is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"the metrics directory {directory} can be written by other users (mode {stat.filemode(info.st_mode)}): "
                f"chmod go-w it, or leave EPLB_GRAPH_METRICS_DIR unset")
    return None


class WorkerMetrics:
    """One worker's EPLB metrics (see the module docstring); ``after_step`` once per EPLB step."""

    def __init__(self, labels: dict[str, str], *, ep_size: int | Callable[[], int], publish_dir: str | None) -> None:
        self.labels = labels
        # the EP size now: under vLLM's elastic EP a resize changes it (and the slot count) while serving, so the
        # worker hands a callable that asks its live group; a fixed int where the group never changes
        self._ep_size = ep_size
        self.publish_to = Path(publish_dir) / f"worker-{os.getpid()}.json" if publish_dir else None
        problem = metrics_dir_problem(publish_dir) if publish_dir else None
        if problem:  # the API server's gate refuses it first; a worker started some other way never uses it
            logger.warning("eplb-graph: EPLB metrics not published: %s", problem)
            self.publish_to = None
        self.counters = {m.name: 0 for m in METRICS if m.kind == "counter"}
        self.gauges: dict[str, dict[str, float]] = {m.name: {} for m in METRICS if m.kind == "gauge"}
        self.histograms = {name: Histogram(buckets) for name, buckets in
                           (("rearrangement_duration_seconds", REARRANGEMENT_BUCKETS),
                            ("commit_pause_seconds", PAUSE_BUCKETS))}
        self.gauges["async_worker_alive"][""] = 1.0
        self._started_at: float | None = None
        self._window_load: torch.Tensor | None = None  # [L, num_logical], of the rearrangement in flight (EP rank 0)
        self._window_balancedness: dict[str, float] = {}  # its window under the placement then in force
        self._publish_failed = False
        self._published_at = time.monotonic()
        self.publish()

    @property
    def ep_size(self) -> int:
        return self._ep_size() if callable(self._ep_size) else self._ep_size

    def after_step(self, *, step_seconds: float, in_flight: bool, layers_committed: int, finished: int, stalls: int,
                   bytes_moved: tuple[int, int], worker_alive: bool, graphs_compiled: int | None,
                   model_state, local_work: tuple[int, float] = (0, 0.0)) -> None:
        """After upstream's EPLB step (``step_seconds`` long) on the serving thread; ``local_work``:
        the pairs this worker's expert kernels computed so far and their seconds."""
        before = dict(self.counters)
        if layers_committed > self.counters["layers_committed"]:
            self.histograms["commit_pause_seconds"].observe(step_seconds)
        # a finish first: one step can commit a rearrangement's last layer and start the next one
        if finished > self.counters["rearrangements_finished"]:
            if self._started_at is not None:
                self.histograms["rearrangement_duration_seconds"].observe(time.monotonic() - self._started_at)
                self._set_balancedness(model_state.physical_to_logical_map)
            self._started_at = None
        if in_flight and self._started_at is None:  # a window closed and a rearrangement started
            self._started_at = time.monotonic()
            self.counters["rearrangements_started"] += 1
            if self.labels["ep_rank"] == "0":  # the window is global: one rank reports it (one copy a rearrangement)
                self._window_load = model_state.last_expert_load.detach().cpu()
                self._window_balancedness = self._balancedness(model_state.physical_to_logical_map)
        self.counters.update(layers_committed=layers_committed, rearrangements_finished=finished, stalls=stalls,
                             expert_bytes_sent=bytes_moved[0], expert_bytes_received=bytes_moved[1],
                             graphs_compiled_while_serving=graphs_compiled or 0)
        self.counters.update(zip(WORK_COUNTERS, local_work))
        alive = 1.0 if worker_alive else 0.0
        changed = [name for name in self.counters if self.counters[name] != before[name]]
        work_due = time.monotonic() - self._published_at >= WORK_PUBLISH_S
        if (any(name not in WORK_COUNTERS for name in changed) or (changed and work_due)
                or self.gauges["async_worker_alive"][""] != alive):
            self.gauges["async_worker_alive"][""] = alive
            self.publish()

    def _balancedness(self, placement: torch.Tensor) -> dict[str, float]:
        """Per layer and over the model ("all"), of the rearrangement's window under ``placement``
        [L, ep_size x num_local], split over the EP size now (a resize changes both)."""
        per_layer = layer_balancedness(rank_loads(self._window_load, placement.detach().cpu(), self.ep_size))  # [L]
        return {**{str(layer): float(value) for layer, value in enumerate(per_layer)}, "all": float(per_layer.mean())}

    def _set_balancedness(self, committed: torch.Tensor) -> None:
        """Both gauges at once, when the rearrangement finished: they describe the same window."""
        if self._window_load is None:
            return
        self.gauges["balancedness_window"] = self._window_balancedness
        self.gauges["balancedness_committed"] = self._balancedness(committed)
        self._window_load = None

    def snapshot(self) -> dict:
        return {"labels": self.labels, "counters": dict(self.counters), "gauges": {k: dict(v) for k, v in self.gauges.items()},
                "histograms": {name: hist.snapshot() for name, hist in self.histograms.items()}}

    def publish(self) -> None:
        """Writes the snapshot for the API server's collector, atomically (a reader never sees half)."""
        if self.publish_to is None:
            return
        self._published_at = time.monotonic()
        try:  # a new temporary file (O_EXCL | O_NOFOLLOW), renamed over the snapshot: a link there is replaced
            replace_file(self.publish_to, json.dumps(self.snapshot()).encode(), sync=False)
        except OSError as error:  # a full disk, or the server removing its directory at exit: never fail a step
            if not self._publish_failed:
                self._publish_failed = True
                logger.warning("eplb-graph: cannot publish EPLB metrics to %s: %s", self.publish_to, error)


class Histogram:
    """Cumulative-free bucket counts, a count and a sum: what a Prometheus histogram exposes."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[next(i for i, bound in enumerate(self.bounds) if value <= bound)] += 1
        self.sum += value

    def snapshot(self) -> dict:
        return {"bounds": [str(b) for b in self.bounds], "counts": list(self.counts), "sum": self.sum}


def metrics_markdown() -> str:
    """The reference table of docs/metrics.md, from ``METRICS``."""
    lines = ["| name | type | labels | meaning | watches |", "| --- | --- | --- | --- | --- |"]
    for m in METRICS:
        name = PREFIX + m.name + ("_total" if m.kind == "counter" else "")
        labels = "model_name, layer" if m.layered else ", ".join(BASE_LABELS)
        lines.append(f"| `{name}` | {m.kind} | {labels} | {m.help} | {m.watches} |")
    return "\n".join(lines) + "\n"


def worker_snapshot(worker) -> dict:
    """One worker's metrics (``collective_rpc`` target); empty where EPLB is off."""
    eplb = getattr(getattr(worker, "model_runner", worker), "eplb_graph", None)
    return {} if eplb is None else eplb.metrics.snapshot()


def worker_metrics(llm) -> list[dict]:
    """Every worker's EPLB metrics of an offline ``vllm.LLM``, the values ``/metrics`` serves."""
    return [snapshot for snapshot in llm.collective_rpc(worker_snapshot) if snapshot]
