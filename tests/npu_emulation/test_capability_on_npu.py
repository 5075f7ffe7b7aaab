"""The capability adaptations' device branches on ``npu``: no host events swapped in, the async
worker started on its rank's NPU with a device stream, upstream's own events and streams."""

import pytest
import torch

pytest.importorskip("vllm")

from eplb_graph.upstream.capability import HostEvent, CapabilityAdaptations  # noqa: E402


def test_on_npu_upstream_keeps_its_device_events_and_streams(npu_emulation):
    from vllm.distributed.eplb import async_worker, eplb_state

    adapter = CapabilityAdaptations(torch.device("npu", 1), commit_hook=lambda state, layer: None).install()
    try:
        assert not adapter.host_device
        assert eplb_state.CpuGpuEvent is not HostEvent and async_worker.CpuGpuEvent is not HostEvent
        assert "eplb_state.start_async_worker" in adapter.installed
        event = async_worker.CpuGpuEvent()  # upstream's: a torch.Event on the device plus a host flag
        event.record()
        event.wait(torch.npu.current_stream())
    finally:
        adapter.uninstall()


def test_the_async_worker_starts_on_its_ranks_npu_with_a_device_stream(npu_emulation, monkeypatch):
    from vllm.distributed.eplb import async_worker

    started, indices = [], []
    monkeypatch.setattr(async_worker, "transfer_run_periodically",
                        lambda state, stream, is_profile: started.append((state, stream, is_profile)))
    monkeypatch.setattr(torch.accelerator, "set_device_index", indices.append)
    adapter = CapabilityAdaptations(torch.device("npu", 1), commit_hook=lambda state, layer: None)
    adapter._start_async_worker("state", is_profile=True).join(timeout=30)

    assert adapter.health.alive, adapter.health.traceback
    assert indices == [1]  # the worker thread's device is its rank's, not device 0
    (state, stream, is_profile), = started
    assert state == "state" and is_profile
    assert isinstance(stream, torch.Stream) and stream.device.type == "npu"
