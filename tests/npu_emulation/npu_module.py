"""``torch.npu`` as the emulation provides it: the slice of torch_npu's device API our code touches.

Devices, streams and events are bookkeeping over synchronous host work: a kernel "launched" on
the emulated device has finished when the call returns, so ``synchronize`` and event waits
return at once and streams only carry identity. Device indices are checked against
``device_count`` as a driver would and tracked here; torch 2.13's Python device guard has no
index hooks, so ``torch.accelerator``, ``torch.Stream`` and tensors report index 0.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from tests.npu_emulation.graphs import CaptureState, NPUGraph, graph


def _index(device) -> int:
    """The device index of an int, a device or a device string; None: the current device."""
    if device is None:
        return torch.npu.current_device()
    if isinstance(device, int):
        return device
    return torch.device(device).index or 0


class Stream(torch.Stream):
    """``torch.npu.Stream``: a ``torch.Stream`` of device type npu."""

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        return super().__new__(cls, device=torch.device("npu", _index(device)), priority=priority)

    def synchronize(self) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None


class Event(torch.Event):
    """``torch.npu.Event``: recorded work is already done on the emulated device."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        return super().__new__(cls, device="npu", enable_timing=enable_timing)

    def record(self, stream=None) -> None:
        self._recorded_at = time.perf_counter()

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: Event) -> float:
        return (end._recorded_at - self._recorded_at) * 1000.0  # milliseconds, like a device event


class HostGenerator(torch.Generator):
    """``torch.Generator("npu")``, drawn on the host: torch 2.13's Python backend cannot make a
    device generator ("implement `getNewGenerator` ... for PrivateUse1"), and random ops on the
    emulated device run torch's CPU kernels, which take a CPU generator."""

    def __new__(cls, device="cpu"):
        device = torch.device(device)
        return super().__new__(cls, "cpu" if device.type == "npu" else device)

    def __init__(self, device="cpu") -> None:
        pass


class EmulatedNpuModule:
    """Registered as ``torch.npu`` (``torch._register_device_module``); one per process."""

    Stream = Stream
    Event = Event

    def __init__(self, device_count: int, capture: CaptureState, rerun, host_view) -> None:
        self._device_count = device_count
        self._current = 0
        self.capture_state = capture
        self._rerun = rerun
        self._host_view = host_view
        self.synchronize_calls = 0

    # -- devices -----------------------------------------------------------------------------

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return self._device_count

    def current_device(self) -> int:
        return self._current

    def set_device(self, device) -> None:
        index = _index(device)
        if not 0 <= index < self._device_count:
            raise RuntimeError(f"npu emulation: device index {index} out of range ({self._device_count} devices)")
        self._current = index
        torch.accelerator.set_device_index(index)

    def get_device_name(self, device=None) -> str:
        return "emulated Ascend NPU (host-backed)"

    def manual_seed(self, seed: int) -> None:
        return None  # random ops run on the host generator, which torch.manual_seed seeds itself

    manual_seed_all = manual_seed

    def get_rng_state(self, device=None) -> torch.Tensor:  # random ops run on the host generator
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device=None) -> None:
        torch.set_rng_state(state)

    # -- streams and synchronization -----------------------------------------------------------

    def synchronize(self, device=None) -> None:
        if self.capture_state.capturing:
            from tests.npu_emulation.graphs import GraphCaptureError

            raise GraphCaptureError("torch.npu.synchronize() inside NPU graph capture: a host sync")
        self.synchronize_calls += 1

    def current_stream(self, device=None) -> Stream:
        return Stream(device=device)

    def default_stream(self, device=None) -> Stream:
        return Stream(device=device)

    @contextlib.contextmanager
    def stream(self, stream) -> Iterator[None]:
        yield

    # -- graphs ------------------------------------------------------------------------------------

    def NPUGraph(self) -> NPUGraph:  # noqa: N802 (torch_npu's name)
        return NPUGraph(self.capture_state, self._rerun, self._host_view)

    def graph(self, npu_graph: NPUGraph, pool=None, stream=None):
        return graph(npu_graph, pool, stream)

    def is_current_stream_capturing(self) -> bool:
        return self.capture_state.capturing
