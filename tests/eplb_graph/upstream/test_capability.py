"""The capability adaptations: each patch named where upstream imports it, asserted, idempotent, reversible.

What runs upstream's async EPLB on these patches end to end is tests/eplb_reference/runtime/test_controller.py;
here each contract alone.
"""

import threading
import time

import pytest

from eplb_graph.upstream.capability import (
    AsyncWorkerStopped, HostEvent, HostTimingEvent, CapabilityAdaptations, WorkerHealth,
)

eplb_state = pytest.importorskip("vllm.distributed.eplb.eplb_state")
async_worker = pytest.importorskip("vllm.distributed.eplb.async_worker")


def test_host_event_hands_over_once_per_record():
    event = HostEvent()
    assert event.wait(timeout=0.01) is False  # nothing recorded yet
    threading.Thread(target=event.record).start()
    assert event.wait(timeout=10) is True
    assert event.wait(timeout=0.01) is False  # consumed
    event.record()
    with pytest.raises(RuntimeError, match="before the previous event was consumed"):
        event.record()


def test_a_closed_host_event_ends_its_waiter_now_and_later():
    event, ended = HostEvent(), []

    def waiter():
        try:
            event.wait()  # upstream's worker loop: no timeout
        except AsyncWorkerStopped:
            ended.append(True)

    thread = threading.Thread(target=waiter)
    thread.start()
    event.close()
    thread.join(10)
    assert ended == [True] and not thread.is_alive()
    with pytest.raises(AsyncWorkerStopped):
        event.wait(timeout=0.01)


def test_host_timing_event_measures_between_two_records():
    start, end = HostTimingEvent(enable_timing=True), HostTimingEvent(enable_timing=True)
    with pytest.raises(RuntimeError, match="needs both events recorded"):
        start.elapsed_time(end)
    start.record()
    began = time.perf_counter()
    while time.perf_counter() - began < 0.002:  # 2 ms of host work between the records
        pass
    end.record()
    assert start.elapsed_time(end) >= 2.0  # milliseconds, as torch.cuda.Event reports them


def test_on_the_host_the_patches_go_where_upstream_imports_each_name_and_come_back():
    before = {name: getattr(eplb_state, name) for name in ("CpuGpuEvent", "start_async_worker", "compute_logical_maps")}
    worker_event = async_worker.CpuGpuEvent
    adapter = CapabilityAdaptations("cpu", commit_hook=lambda state, layer: None).install()
    try:
        assert eplb_state.CpuGpuEvent is HostEvent and async_worker.CpuGpuEvent is HostEvent
        assert "eplb_state.compute_logical_maps" in adapter.installed
        assert "async_worker.run_rebalance_experts" not in adapter.installed  # no placement check asked for
        count = len(adapter.installed)
        adapter.install()  # idempotent: nothing patched twice
        assert len(adapter.installed) == count
    finally:
        adapter.uninstall()
    assert all(getattr(eplb_state, name) is original for name, original in before.items())
    assert async_worker.CpuGpuEvent is worker_event and adapter.installed == []


def test_a_device_with_events_keeps_upstreams_events():
    adapter = CapabilityAdaptations("cuda", commit_hook=lambda state, layer: None)
    assert not adapter.host_device
    adapter.install()
    try:
        assert eplb_state.CpuGpuEvent is not HostEvent
        assert "eplb_state.start_async_worker" in adapter.installed  # the worker start is ours on every device
    finally:
        adapter.uninstall()


def test_a_name_upstream_no_longer_defines_fails_loudly_and_nothing_stays_installed(monkeypatch):
    monkeypatch.delattr(eplb_state, "compute_logical_maps")
    upstream_event = eplb_state.CpuGpuEvent
    adapter = CapabilityAdaptations("cpu", commit_hook=lambda state, layer: None)
    with pytest.raises(RuntimeError, match="eplb_state.compute_logical_maps: target missing"):
        adapter.install()
    assert adapter.installed == [] and eplb_state.CpuGpuEvent is upstream_event  # all or nothing


def test_a_second_adapter_cannot_chain_onto_the_first():
    first = CapabilityAdaptations("cpu", commit_hook=lambda state, layer: None).install()
    try:
        with pytest.raises(RuntimeError, match="already carries capability.state_event"):
            CapabilityAdaptations("cpu", commit_hook=lambda state, layer: None).install()
        assert eplb_state.CpuGpuEvent is HostEvent
    finally:
        first.uninstall()


def test_worker_health_names_where_the_worker_died():
    health = WorkerHealth()
    health.raise_if_dead("on EP rank 0")
    health.error, health.traceback = OSError("gloo closed"), "Traceback ..."
    with pytest.raises(Exception, match="async EPLB worker on EP rank 0 died: OSError.*last committed placement"):
        health.raise_if_dead("on EP rank 0")
