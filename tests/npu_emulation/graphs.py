"""``NPUGraph``: capture records every op the emulated device ran; replay re-runs that tape.

A replay runs the very tensors the capture saw (tables, weights, buffers by address), not
whatever Python names point at by then: a table replaced instead of updated in place is read
stale, as from a real ACL graph. During capture, what a graph cannot hold fails at once, the
way ``aclmdlRICaptureBegin`` refuses it: a host sync (``item()``, a device-to-host or
host-to-device copy of more than a scalar), an op whose output shape depends on data
(``nonzero``, boolean indexing, ``unique``), and replaying another graph inside a capture.
Memory allocated during capture is the graph's private pool: the tape keeps it, and every
replay writes the same outputs.

The emulation runs the captured work once during capture (a real capture only records it), so
a capture's side effects happen once here; ``CapturedForward`` turns load recording off for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

aten = torch.ops.aten

_DATA_DEPENDENT_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


class GraphCaptureError(RuntimeError):
    """Work a captured NPU graph cannot hold, attempted during capture."""


@dataclass
class _Entry:
    op: object
    args: tuple
    kwargs: dict
    result: object


@dataclass
class _Call:
    """Work that is not an op on the device (a collective): replayed by calling it again."""

    run: Callable[[], object]


@dataclass
class CaptureState:
    """The one capture in progress in this process, if any (ACL captures one stream at a time)."""

    tape: list[_Entry | _Call] | None = None
    graphs_captured: int = 0
    replays: int = 0
    violations: list[str] = field(default_factory=list)

    @property
    def capturing(self) -> bool:
        return self.tape is not None

    def check(self, op, args: tuple, kwargs: dict, result) -> None:
        """Refuses, during capture, an op a graph cannot hold; appends the rest to the tape."""
        if self.tape is None:
            return
        why = capture_violation(op, args, kwargs, result)
        if why is not None:
            message = f"{op.name()} inside NPU graph capture: {why}"
            self.violations.append(message)
            raise GraphCaptureError(message)
        self.tape.append(_Entry(op, args, kwargs, result))

    def record_call(self, run: Callable[[], object]) -> None:
        if self.tape is not None:
            self.tape.append(_Call(run))


def _host_tensor_of_data(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() > 0


def capture_violation(op, args: tuple, kwargs: dict, result) -> str | None:
    if any(tag in op.tags for tag in _DATA_DEPENDENT_TAGS):
        return "its output shape or value is data-dependent (a host sync)"
    if op is aten._copy_from.default:
        src, dst = args[0], args[1]
        if _host_tensor_of_data(src) or _host_tensor_of_data(dst) or dst.device.type == "cpu":
            return "a copy between host and device (a host sync)"
    return None


class NPUGraph:
    """``torch.npu.NPUGraph``: ``capture_begin`` / ``capture_end`` / ``replay``."""

    def __init__(self, state: CaptureState, rerun: Callable[[object, tuple, dict], object], host_view) -> None:
        self._state = state
        self._rerun = rerun  # the fallback's op runner, outside any tape
        self._host_view = host_view
        self._tape: list[_Entry] | None = None
        self.recorded: Callable | None = None  # the callable captured by ``torch.npu.graph``, if any

    def capture_begin(self) -> None:
        if self._state.capturing:
            raise GraphCaptureError("another NPU graph is capturing")
        self._state.tape = []

    def capture_end(self) -> None:
        self._tape, self._state.tape = self._state.tape, None
        self._state.graphs_captured += 1

    def replay(self) -> None:
        if self._state.capturing:
            raise GraphCaptureError("NPUGraph.replay() inside a capture")
        if self._tape is None:
            raise RuntimeError("NPUGraph.replay() before a capture")
        for entry in self._tape:
            self._replay(entry)
        self._state.replays += 1

    def _replay(self, entry: _Entry | _Call) -> None:
        if isinstance(entry, _Call):
            entry.run()
            return
        if entry.op in _ALLOCATIONS:
            return  # the graph's pool holds what the capture allocated; an out= op may have resized it since
        fresh = self._rerun(entry.op, entry.args, entry.kwargs)
        for captured, now in zip(_tensors(entry.result), _tensors(fresh)):
            if now is captured or now.untyped_storage().data_ptr() == captured.untyped_storage().data_ptr():
                continue  # written in place, or a view of what was
            self._host_view(captured).copy_(self._host_view(now))  # into the graph's pool


_ALLOCATIONS = (aten.empty.memory_format, aten.empty_strided.default)


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [item for item in value if isinstance(item, torch.Tensor) and item.device.type == "npu"]
    return []


@contextlib.contextmanager
def graph(npu_graph: NPUGraph, pool=None, stream=None) -> Iterator[NPUGraph]:
    """``torch.npu.graph(g)``: captures what the block runs into ``g``."""
    npu_graph.capture_begin()
    try:
        yield npu_graph
    except BaseException:
        npu_graph._state.tape = None  # an aborted capture holds nothing
        raise
    npu_graph.capture_end()
