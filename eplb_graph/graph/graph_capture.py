"""Graph mode: one captured device graph per capture size, replayed with live EPLB tables.

``CapturedForward`` wraps a forward (eager or compiled) the way vLLM's CUDA graph runner
does: for each capture size it warms the forward up, captures it into a device graph
around a static input buffer, and from then on copies a batch into that buffer and
replays. The graph holds every tensor it reads by address -- routing tables, load
buffers, batch flags, expert weights -- so EPLB must change them in place between
replays (invariants 1 and 6). ``CapturedForward`` proves it did: it fingerprints those
tensors' storage at capture and checks the fingerprint before each replay, or, where the
caller says so (``check_addresses_on_replay=False``), whenever it calls ``check_addresses``
between steps: reading every weight's address is host work a timed replay should not
carry. A changed address means the graph would read a stale tensor, so that size is
captured again and counted in ``recaptures`` (``runtime/report.failed_invariants`` fails a run on any).

Warm-up runs execute the routing op for real, so recording is switched off for them (the
flag is restored after): a capture must not add load that no batch produced.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from eplb_graph.core.layer_lookup import BatchFlags


class DeviceGraph(Protocol):
    """One capturable graph of a device: ``capture`` records ``fn``'s work and returns its
    (static) output without executing it for real; ``replay`` runs the recorded work."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


class TorchDeviceGraph:
    """A device's own graph (``torch.cuda.CUDAGraph``, or torch_npu's ACL graph runner
    ``torch.npu.NPUGraph``, the same API) behind ``DeviceGraph``; each graph has its own memory
    pool (sizes are replayed in any order, so pools are not shared)."""

    GRAPH_CLASSES = {"cuda": "CUDAGraph", "npu": "NPUGraph"}

    def __init__(self, device_type: str) -> None:
        self._module = torch.get_device_module(device_type)
        self._graph = getattr(self._module, self.GRAPH_CLASSES[device_type])()

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with self._module.graph(self._graph):
            return fn()

    def replay(self) -> None:
        self._graph.replay()


class CudaGraph(TorchDeviceGraph):
    def __init__(self) -> None:
        super().__init__("cuda")


class NpuGraph(TorchDeviceGraph):
    """torch.npu exists only once the npu device is loaded (``npu_backend.require_npu``)."""

    def __init__(self) -> None:
        super().__init__("npu")


def device_graph_factory(device: torch.device | str) -> Callable[[], DeviceGraph]:
    # "npu" is no device string until the npu device is loaded: read the type without parsing
    device_type = device.split(":")[0] if isinstance(device, str) else device.type
    if device_type == "cuda":
        return CudaGraph
    if device_type == "npu":
        from eplb_graph.graph.npu_backend import require_npu

        require_npu()
        return NpuGraph
    raise ValueError(
        f"no graph capture on device {device_type!r}: graph mode captures CUDA or NPU graphs "
        f"(on CPU the compiled mode is the graph mode)"
    )


def storage_fingerprint(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in tensors)


@dataclass
class _Captured:
    graph: DeviceGraph
    static_input: torch.Tensor
    static_output: torch.Tensor
    fingerprint: tuple[int, ...]


@dataclass
class CaptureStats:
    captures: int = 0  # every capture, the first of each size included
    recaptures: int = 0  # captures of a size that had a graph already (stale tensor addresses)
    capture_s: float = 0.0
    replays: int = 0


class CapturedForward:
    """``forward(tokens [1, S]) -> [1, S, V]`` replayed from one device graph per size S."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor], torch.Tensor],
        capture_sizes: tuple[int, ...],
        *,
        device: torch.device | str,
        graph_tensors: Callable[[], list[torch.Tensor]],  # what the graph reads by address
        flags: BatchFlags | None = None,
        graph_factory: Callable[[], DeviceGraph] | None = None,
        warmup_runs: int = 2,
        check_addresses_on_replay: bool = True,  # False: the caller calls check_addresses between steps
    ) -> None:
        if not capture_sizes or min(capture_sizes) < 1:
            raise ValueError(f"capture sizes must be positive, got {capture_sizes}")
        self.forward = forward
        self.capture_sizes = tuple(sorted(set(capture_sizes), reverse=True))  # largest first, as vLLM
        self.device = torch.device(device)
        self.graph_tensors = graph_tensors
        self.flags = flags
        self.new_graph = graph_factory or device_graph_factory(self.device)
        self.warmup_runs = warmup_runs
        self.check_addresses_on_replay = check_addresses_on_replay
        self.stats = CaptureStats()
        self._graphs: dict[int, _Captured] = {}

    def capture_all(self) -> None:
        """Captures every size (every EP rank must call this at the same point: warm-up
        runs the forward's collectives)."""
        for size in self.capture_sizes:
            self._capture(size)

    def _capture(self, size: int) -> _Captured:
        start = time.perf_counter()
        static_input = torch.zeros(1, size, dtype=torch.long, device=self.device)
        with self._recording_off():
            self._warm_up(static_input)
            graph = self.new_graph()
            static_output = graph.capture(lambda: self.forward(static_input))
        if size in self._graphs:
            self.stats.recaptures += 1
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - start
        entry = _Captured(graph, static_input, static_output, storage_fingerprint(self.graph_tensors()))
        self._graphs[size] = entry
        return entry

    def _warm_up(self, static_input: torch.Tensor) -> None:
        if self.device.type not in ("cuda", "npu"):
            for _ in range(self.warmup_runs):
                self.forward(static_input)
            return
        # On a side stream, as torch.cuda.graphs' make_graphed_callables: lazy initialisation
        # (cuBLAS workspaces, Triton JIT, compilation) must not happen under capture. torch.npu
        # has the same stream API.
        streams = torch.get_device_module(self.device)
        side = streams.Stream()
        side.wait_stream(streams.current_stream())
        with streams.stream(side):
            for _ in range(self.warmup_runs):
                self.forward(static_input)
        streams.current_stream().wait_stream(side)

    @contextlib.contextmanager
    def _recording_off(self) -> Iterator[None]:
        if self.flags is None:
            yield
            return
        saved = self.flags.record_enabled.clone()
        self.flags.record_enabled.fill_(False)
        try:
            yield
        finally:
            self.flags.record_enabled.copy_(saved)

    def check_addresses(self) -> int:
        """Captures again every size whose graph holds a tensor that was replaced, not updated
        in place, since its capture; returns how many. EPLB commits in lockstep on every rank
        (upstream's readiness all-reduce), so every rank sees the change at the same step and
        recaptures together (warm-up runs collectives); the run then fails on the count."""
        fingerprint = storage_fingerprint(self.graph_tensors())
        stale = [size for size, entry in self._graphs.items() if entry.fingerprint != fingerprint]
        for size in stale:
            self._capture(size)
        return len(stale)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:  # [1, S] padded to a capture size
        size = tokens.shape[-1]
        entry = self._graphs.get(size)
        if entry is None:
            raise ValueError(
                f"batch of {size} tokens has no captured graph (capture sizes {self.capture_sizes}); "
                f"pad batches to a capture size"
            )
        if self.check_addresses_on_replay and storage_fingerprint(self.graph_tensors()) != entry.fingerprint:
            entry = self._capture(size)
        entry.static_input.copy_(tokens)
        entry.graph.replay()
        self.stats.replays += 1
        return entry.static_output  # overwritten by the next replay of this size
