"""The emulated device itself: placement, aliasing and capture behave as a device's do."""

import pytest
import torch

from tests.npu_emulation import GraphCaptureError


def test_to_npu_and_back_keeps_values_dtype_and_shape(npu_emulation):
    host = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    on_device = host.to("npu")
    assert on_device.device.type == "npu" and on_device.dtype == torch.int32
    assert torch.equal(on_device.cpu(), host)
    assert torch.zeros(2, device="npu").device == torch.device("npu", 0)


def test_views_share_storage_and_in_place_writes_are_seen_through_them(npu_emulation):
    x = torch.zeros(3, 4, device="npu")
    transposed, row = x.t(), x[1]
    assert transposed.stride() == (1, 4) and transposed.data_ptr() == x.data_ptr()
    row.fill_(7)
    returned = x.add_(1)
    assert returned is x
    assert transposed.cpu()[:, 1].tolist() == [8.0] * 4
    assert x.cpu()[0].tolist() == [1.0] * 4


def test_out_argument_is_written_and_resized_in_place(npu_emulation):
    x = torch.ones(2, 3, device="npu")
    out = torch.empty(0, device="npu")
    result = torch.add(x, x, out=out)
    assert result is out and out.shape == (2, 3) and out.cpu().tolist() == [[2.0] * 3] * 2


def test_index_put_accumulates_into_the_same_storage(npu_emulation):
    load = torch.zeros(4, dtype=torch.int64, device="npu")
    address = load.data_ptr()
    load.index_put_((torch.tensor([1, 1, 3], device="npu"),), torch.ones(3, dtype=torch.int64, device="npu"),
                    accumulate=True)
    assert load.data_ptr() == address and load.cpu().tolist() == [0, 2, 0, 1]


def test_device_api_slice(npu_emulation):
    assert torch.npu.is_available() and torch.npu.device_count() == 8
    torch.npu.set_device(1)
    assert torch.npu.current_device() == 1  # torch.accelerator keeps 0: the Python guard has no index hooks
    torch.npu.set_device(0)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.npu.set_device(8)
    stream = torch.npu.current_stream()
    assert stream.device.type == "npu"
    assert torch.npu.Stream("npu:1").device.type == torch.npu.Stream(1).device.type == "npu"  # index: see above
    event = torch.npu.Event()
    event.record(stream)
    event.synchronize()


def test_replay_reruns_the_captured_tensors_not_the_names(npu_emulation):
    table = torch.tensor([1, 2, 3], device="npu")
    holder = {"table": table}
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        out = holder["table"] * 10
    table.copy_(torch.tensor([4, 5, 6]))  # in place: the graph sees it
    graph.replay()
    assert out.cpu().tolist() == [40, 50, 60]
    holder["table"] = torch.tensor([7, 8, 9], device="npu")  # replaced: the graph does not
    graph.replay()
    assert out.cpu().tolist() == [40, 50, 60]


@pytest.mark.parametrize("work", [
    lambda x: x.sum().item(),                      # host sync
    lambda x: x.cpu(),                             # device-to-host copy
    lambda x: x.nonzero(),                         # data-dependent shape
    lambda x: x[x > 0],                            # boolean indexing
    lambda x: x + torch.ones(3).to("npu"),         # host-to-device copy
    lambda x: torch.npu.synchronize(),
])
def test_capture_refuses_what_a_graph_cannot_hold(npu_emulation, work):
    x = torch.ones(3, device="npu")
    graph = torch.npu.NPUGraph()
    with pytest.raises(GraphCaptureError, match="inside NPU graph capture"):
        with torch.npu.graph(graph):
            work(x)
    assert not npu_emulation.capture.capturing
    x.cpu()  # outside capture the same work is fine


def test_replay_inside_a_capture_is_refused(npu_emulation):
    x = torch.ones(2, device="npu")
    first = torch.npu.NPUGraph()
    with torch.npu.graph(first):
        x.mul_(2)
    with pytest.raises(GraphCaptureError):
        with torch.npu.graph(torch.npu.NPUGraph()):
            first.replay()


def test_pinned_host_memory_is_refused_by_the_python_backend(npu_emulation):
    """What a staging pool on this emulation meets: torch 2.13's Python backend has no pinned allocator."""
    with pytest.raises(NotImplementedError, match="getPinnedMemoryAllocator"):
        torch.empty(4, pin_memory=True)
