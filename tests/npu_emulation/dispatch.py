"""The boxed PrivateUse1 fallback: every aten op on ``npu`` tensors runs on their host views.

An op's ``npu`` arguments become CPU views over the same bytes (``HostBackedStorage.host_view``),
``device=npu`` becomes ``device=cpu``, the CPU kernel runs, and each result comes back by the
op's schema: a result the schema says is an argument written in place or ``out=`` is that very
argument object (re-strided if the op resized it); a view result is a new ``npu`` tensor over
its base's storage; a fresh result is adopted as ``npu`` memory without a copy. Cross-device
copies (``_copy_from``), which no CPU kernel implements, are written here.

While a graph is capturing (``runtime.GraphCapture``) every op that ran is appended to its
tape, so a replay runs the very tensors the capture saw.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_map

from tests.npu_emulation.storage import HostBackedStorage

aten = torch.ops.aten


def _is_npu(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "npu"


class NpuFallback:
    """The fallback kernel and the two copy kernels, over one ``HostBackedStorage``."""

    def __init__(self, storage: HostBackedStorage, on_op: Callable[[object, tuple, dict, object], None]) -> None:
        self.storage = storage
        self.on_op = on_op  # (op, args, kwargs, result): the capture's tape, when one is recording
        self.ops_seen: set[str] = set()
        self.cross_device_copies = 0  # host <-> device copies (_copy_from with one side on the host)

    # -- the boxed fallback ------------------------------------------------------------

    def __call__(self, op, keyset, *args, **kwargs):  # torch passes (op, keyset) or (keyset, op)
        if isinstance(op, torch._C.DispatchKeySet):
            op, keyset = keyset, op
        self.ops_seen.add(op.name())
        result = self.run(op, args, kwargs)
        self.on_op(op, args, kwargs, result)
        return result

    def run(self, op, args: tuple, kwargs: dict):
        bases: dict[int, torch.Tensor] = {}  # host address -> the npu tensor it backs

        def to_host(value):
            if _is_npu(value):
                host = self.storage.host_view(value)
                bases.setdefault(host.untyped_storage().data_ptr(), value)
                return host
            if isinstance(value, torch.device) and value.type == "npu":
                return torch.device("cpu")
            return value

        args, kwargs = _numbers_as_tensors(op, args, kwargs)
        host_args, host_kwargs = tree_map(to_host, args), tree_map(to_host, kwargs)
        host_result = op(*host_args, **host_kwargs)
        written = self._written_arguments(op, args, kwargs)

        def back(index: int, host):
            if not isinstance(host, torch.Tensor):
                return host
            target = written.get(index)
            if target is not None:  # in place / out=: the argument itself
                if tuple(target.shape) != tuple(host.shape) or target.stride() != host.stride() or (
                    target.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()
                ):
                    self.storage.restride(target, host)
                return target
            base = bases.get(host.untyped_storage().data_ptr())
            if base is not None:  # a view of an npu argument
                return self.storage.view_of(base, host)
            return self.storage.adopt(host)

        if isinstance(host_result, tuple):
            return tuple(self._back_each(back, i, r) for i, r in enumerate(host_result))
        return self._back_each(back, 0, host_result)

    @staticmethod
    def _back_each(back, index: int, value):
        if isinstance(value, list):
            return [back(index, item) for item in value]
        return back(index, value)

    @staticmethod
    def _written_arguments(op, args: tuple, kwargs: dict) -> dict[int, torch.Tensor]:
        """Result index -> the argument the schema says that result is (``Tensor(a!)``)."""
        schema = op._schema
        values = {}
        for position, argument in enumerate(schema.arguments):
            if argument.kwarg_only or position >= len(args):
                values[argument.name] = kwargs.get(argument.name, argument.default_value)
            else:
                values[argument.name] = args[position]
        written = {}
        for index, ret in enumerate(schema.returns):
            if ret.alias_info is None or not ret.alias_info.is_write:
                continue
            for argument in schema.arguments:
                info = argument.alias_info
                if info is not None and info.is_write and info.before_set == ret.alias_info.before_set:
                    if isinstance(values[argument.name], torch.Tensor):
                        written[index] = values[argument.name]
        return written

    # -- copies between devices ------------------------------------------------------------

    def copy_from(self, src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        """``aten::_copy_from``: ``dst.copy_(src)`` where one side is ``npu`` (H2D, D2H or D2D)."""
        self.ops_seen.add("aten::_copy_from")
        host_src = self.storage.host_view(src) if _is_npu(src) else src
        host_dst = self.storage.host_view(dst) if _is_npu(dst) else dst
        host_dst.copy_(host_src)
        self.cross_device_copies += int(src.device.type != dst.device.type)
        self.on_op(aten._copy_from.default, (src, dst, non_blocking), {}, dst)
        return dst

    def copy_from_and_resize(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        if tuple(dst.shape) != tuple(src.shape):
            dst.resize_(src.shape)
        return self.copy_from(src, dst)


def _numbers_as_tensors(op, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A boxed call hands a wrapped number (``x & 0xFFFFFFFF``) to Python as an int; the op's
    Tensor argument needs it back as a 0-dim host tensor, as the dispatcher had it."""
    arguments = op._schema.arguments

    def fixed(argument, value):
        if isinstance(argument.type, torch._C.TensorType) and isinstance(value, (bool, int, float, complex)):
            return torch.tensor(value)
        return value

    positional = tuple(fixed(arguments[i], value) if i < len(arguments) else value for i, value in enumerate(args))
    by_name = {a.name: a for a in arguments}
    named = {name: fixed(by_name[name], value) if name in by_name else value for name, value in kwargs.items()}
    return positional, named


def register(lib: torch.library.Library, fallback: NpuFallback) -> None:
    """Installs ``fallback`` for every op on PrivateUse1, and the copies no CPU kernel covers."""
    lib.fallback(fallback, dispatch_key="PrivateUse1", with_keyset=True)


def register_copies(lib: torch.library.Library, fallback: NpuFallback) -> None:
    lib.impl("_copy_from", fallback.copy_from, "PrivateUse1")
    lib.impl("_copy_from_and_resize", fallback.copy_from_and_resize, "PrivateUse1")
