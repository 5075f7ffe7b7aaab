"""Capability adaptations: lets upstream vLLM's async EPLB run where it does not today (CPU, NPU).

Upstream's control plane assumes a device with events and streams: ``CpuGpuEvent``
records a ``torch.Event``, the async worker makes a ``torch.Stream`` on
``torch.accelerator``'s device, and ``device_stream`` switches accelerator streams. On the
CPU platform none of these exist, and ``ParallelConfig`` refuses ``enable_eplb``.
And on every platform, each layer commit inverts the new placement on the main thread with
``compute_logical_maps``, a Python loop over the physical slots: a stall between two graph
replays at every layer commit that grows with the expert count (``bench_commit.py``).

Each gap is one named patch of the name *where upstream imports it*, never a rewrite of
upstream logic, declared in ``adaptations.py`` (``capability.*``) and installed through
``patches.py``: each target is checked against its declared shape first, so an upstream
refactor fails loudly instead of silently bypassing the adaptations. Installing is idempotent and
all or nothing, and ``uninstall`` takes every patch back. Two patches swap an upstream function for a faster one with the
same contract (vectorized; equal outputs are tested against upstream's on every input
class): ``compute_logical_maps`` for ``layer_lookup.logical_maps`` on the main thread, and
the worker's per-layer transfer planning, ``get_ep_ranks_with_experts_batch``, for
``transfer_peers.ranks_with_experts`` (the worker shares the main thread's GIL). Two hooks
are ours rather than gaps:

* ``commit_hook``: called after upstream commits a layer's placement and *before* it
  acknowledges the staging buffer to the worker (invariants 3 and 6), and after a
  synchronous commit of all layers;
* ``placement_check``: called with the model's state and the worker's policy output before
  any byte moves; an invalid placement is replaced by the current one (a no-op move) and
  reported.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from eplb_graph.core.placement import logical_maps
from eplb_graph.upstream import patches
from eplb_graph.upstream.adaptations import adaptation
from eplb_graph.upstream.transfer_peers import ranks_with_experts


class HostEvent:
    """``CpuGpuEvent`` for devices without events: the threading half alone.

    Same contract: one producer calls record(), one consumer wait()s; record() before
    the previous wait() consumed it is an error.
    """

    def __init__(self) -> None:
        self._recorded = threading.Event()
        self._closed = False

    def wait(self, stream=None, timeout: float | None = None) -> bool:
        done = self._recorded.wait(timeout)
        if self._closed:
            raise AsyncWorkerStopped("the EPLB state this worker served was closed")
        if done:
            self._recorded.clear()
        return done

    def close(self) -> None:
        """A waiter blocked now, or later, raises ``AsyncWorkerStopped``: upstream's worker loop
        waits on its state's event forever, and ends only by an exception."""
        self._closed = True
        self._recorded.set()

    def record(self, stream=None) -> None:
        if self._recorded.is_set():
            raise RuntimeError("HostEvent.record() called before the previous event was consumed by wait()")
        self._recorded.set()


class HostStream:
    """The worker's "stream" on a host device: work is synchronous, so synchronize() is free."""

    def synchronize(self) -> None:
        return None


class HostTimingEvent:
    """``torch.Event(enable_timing=True)`` on a host: wall-clock marks, nothing to wait for."""

    def __init__(self, enable_timing: bool = False, **_ignored) -> None:
        self._at: float | None = None

    def record(self, stream=None) -> None:
        self._at = time.perf_counter()

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: HostTimingEvent) -> float:
        if self._at is None or end._at is None:
            raise RuntimeError("elapsed_time() needs both events recorded")
        return (end._at - self._at) * 1000.0  # milliseconds, like a device event


class TorchWithHostEvents:
    """``torch`` as ``eplb_state`` sees it on a host device: torch itself, except ``Event``.

    ``EplbState.rearrange`` times itself with ``torch.Event(enable_timing=True)`` (rank 0,
    synchronous or profile rearrangements); the CPU platform has no such event.
    """

    Event = HostTimingEvent

    def __getattr__(self, name: str):
        return getattr(torch, name)


@contextlib.contextmanager
def host_device_stream(stream):
    """``device_stream`` that tolerates host streams (and None) and defers to upstream otherwise."""
    if stream is None or isinstance(stream, HostStream):
        yield
        return
    prev = torch.accelerator.current_stream()
    torch.accelerator.set_stream(stream)
    try:
        yield
    finally:
        torch.accelerator.set_stream(prev)


class AsyncWorkerStopped(Exception):
    """Ends an idle async worker whose EPLB state was closed (``HostEvent.close``)."""


class EplbWorkerError(RuntimeError):
    """The async EPLB worker died; EPLB would otherwise be silently off from here on."""


@dataclass
class WorkerHealth:
    """What the async worker thread left behind: upstream's worker logs and exits silently."""

    error: BaseException | None = None
    traceback: str = ""
    rejected_placements: list[str] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.error is None

    def raise_if_dead(self, where: str) -> None:
        """Surfaces a dead worker on the main thread; ``where`` names the rank or runner."""
        if self.error is not None:
            raise EplbWorkerError(
                f"async EPLB worker {where} died: {self.error!r}; the last committed placement stays in force\n"
                f"{self.traceback}"
            ) from self.error


def ends_rearrangement(model_state, layer_index: int | None) -> bool:
    """Whether a commit (``commit_hook``'s arguments) ends a rearrangement, by upstream's own
    rule: the async path commits layers in order and ``_move_to_workspace`` ends the
    rearrangement with the last MoE layer; the synchronous path commits all at once (None)."""
    return layer_index is None or layer_index == model_state.model.num_moe_layers - 1


class CapabilityAdaptations:
    """Installs the narrow patches for one process; see the module docstring."""

    def __init__(
        self,
        device: torch.device,
        *,
        commit_hook: Callable[[object, int | None], None],
        placement_check: Callable[[object, torch.Tensor], None] | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.commit_hook = commit_hook
        self.placement_check = placement_check
        self.health = WorkerHealth()
        self._keys: list[str] = []  # installed, in order

    @property
    def host_device(self) -> bool:
        """No device events or streams: CPU (and any backend torch.accelerator does not know)."""
        return self.device.type == "cpu"

    # -- installation ------------------------------------------------------------------

    def _patch(self, key: str, replacement) -> None:
        patches.install(key, replacement, by=self)
        self._keys.append(key)

    def install(self) -> CapabilityAdaptations:
        """Installs every patch this device needs, or none (an error takes back what went in)."""
        if self._keys:
            return self  # idempotent
        try:
            self._install()
        except BaseException:
            self.uninstall()
            raise
        return self

    def _install(self) -> None:
        if self.host_device:
            # Events and streams: the names as each module imported them.
            self._patch("capability.state_event", HostEvent)
            self._patch("capability.state_timing_event", TorchWithHostEvents())
            self._patch("capability.worker_event", HostEvent)
            for key in ("capability.worker_stream", "capability.execute_stream", "capability.communicator_stream"):
                self._patch(key, host_device_stream)
        # Worker start: a device index only cuda/xpu get, a stream on torch.accelerator,
        # and an exception swallowed by a log line. Ours runs upstream's loop unchanged.
        self._patch("capability.start_async_worker", self._start_async_worker)
        # Commit points: refresh our lookups between upstream's commit and its ack.
        self._patch("capability.commit_layer", self._commit_layer(patches.current("capability.commit_layer")))
        self._patch("capability.commit_all", self._commit_all(patches.current("capability.commit_all")))
        if self.placement_check is not None:
            self._patch("capability.checked_policy", self._checked_policy(patches.current("capability.checked_policy")))
        # The placement inversion every commit runs on the main thread: same outputs, no Python loop.
        self._patch("capability.logical_maps", logical_maps)
        # The worker's transfer planning, twice per layer: same outputs, no per-expert loop.
        self._patch("capability.transfer_peers", ranks_with_experts)
        # Read (not patched) by the controller to decide a batch's record flag on the host.
        patches.require("capability.record_flag")

    def uninstall(self) -> None:
        for key in reversed(self._keys):
            patches.uninstall(key)
        self._keys.clear()

    @property
    def installed(self) -> list[str]:
        return [f"{adaptation(key).module.rsplit('.', 1)[-1]}.{adaptation(key).attribute}" for key in self._keys]

    # -- the replacements ----------------------------------------------------------------

    def _commit_layer(self, upstream_commit):
        def commit_eplb_maps_for_layer(model_state, new_physical_to_logical_map, layer):
            upstream_commit(model_state, new_physical_to_logical_map=new_physical_to_logical_map, layer=layer)
            self.commit_hook(model_state, layer)

        return commit_eplb_maps_for_layer

    def _commit_all(self, upstream_commit):
        def commit_eplb_maps(model_state, new_physical_to_logical_map):
            upstream_commit(model_state, new_physical_to_logical_map=new_physical_to_logical_map)
            self.commit_hook(model_state, None)

        return commit_eplb_maps

    def _checked_policy(self, upstream_policy):
        def run_rebalance_experts(model_state, eplb_state, physical_to_logical_map_cpu, stream):
            proposed = upstream_policy(model_state, eplb_state, physical_to_logical_map_cpu, stream)
            try:
                self.placement_check(model_state, proposed)
            except ValueError as error:
                # Rejected before any byte moves: transfer the current placement (a no-op).
                self.health.rejected_placements.append(str(error))
                return physical_to_logical_map_cpu.clone()
            return proposed

        return run_rebalance_experts

    def _start_async_worker(self, state, is_profile: bool = False) -> threading.Thread:
        from vllm.distributed.eplb import async_worker

        health = self.health
        device = self.device

        def run() -> None:
            try:
                if device.type == "cpu":
                    stream = HostStream()
                else:
                    if device.index is not None:
                        torch.accelerator.set_device_index(device.index)
                    stream = torch.Stream(device=torch.accelerator.current_accelerator())
                async_worker.transfer_run_periodically(state=state, stream=stream, is_profile=is_profile)
            except AsyncWorkerStopped:  # its state was closed: a clean end, not a death
                return
            except BaseException as error:  # surfaced on the main thread by check_worker()
                health.error = error
                health.traceback = traceback.format_exc()

        thread = threading.Thread(target=run, name="eplb-async-worker", daemon=True)
        thread.start()
        return thread
