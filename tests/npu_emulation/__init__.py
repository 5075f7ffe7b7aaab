"""A test-only emulated ``npu`` device: torch's PrivateUse1 Python backend over host memory.

What it proves, on a machine without CANN or torch_npu: that our NPU code paths *run* on a
device whose tensors have device type ``npu`` and dispatch on PrivateUse1 -- the ops'
PrivateUse1 registrations, device placement (``.to("npu")``, ``.cpu()``, tensors made on the
device), views, in-place and ``out=`` aliasing, ``data_ptr`` stability of in-place refreshes,
host staging between processes, the capability adaptations' device branches (device index,
streams, events), and graph capture whose replay reads the captured tensors by address and
whose capture refuses host syncs and data-dependent shapes.

What it cannot prove: any Ascend kernel (every op runs torch's CPU kernel), HCCL (ranks talk
gloo), real ACL graph capture (``aclmdlRI*``: the tape here re-runs host ops), torchair or any
NPU compiler backend, asynchronous streams and their races (work here is synchronous), pinned
host memory (torch 2.13's Python backend cannot provide a pinned allocator: "implement
`getPinnedMemoryAllocator` ... for PrivateUse1"), memory limits, and torch_npu's own API
beyond the slice in ``npu_module.py``.

``install()`` registers it once per process (PrivateUse1 can be renamed only once). Tests
take the ``npu_emulation`` fixture; rank processes import ``tests.npu_emulation.activate``
through ``EPLB_GRAPH_NPU_MODULE``, the product's name for the module that provides the
``npu`` device (torch_npu by default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.npu_emulation import hccl
from tests.npu_emulation.dispatch import NpuFallback, register, register_copies
from tests.npu_emulation.graphs import CaptureState, GraphCaptureError, NPUGraph
from tests.npu_emulation.npu_module import EmulatedNpuModule, HostGenerator
from tests.npu_emulation.storage import HostBackedStorage

MODULE_ENV = "EPLB_GRAPH_NPU_MODULE"
ACTIVATE_MODULE = "tests.npu_emulation.activate"
DEVICE_COUNT = 8  # an Atlas 800 node's NPUs


@dataclass
class NpuEmulation:
    storage: HostBackedStorage
    fallback: NpuFallback
    capture: CaptureState
    module: EmulatedNpuModule
    libraries: tuple  # the torch.library fragments holding the registrations

    def host_view(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.storage.host_view(tensor)


_INSTALLED: list[NpuEmulation] = []  # the process's one device: PrivateUse1 is renamed once


def install(device_count: int = DEVICE_COUNT) -> NpuEmulation:
    """Registers the emulated ``npu`` device in this process (idempotent)."""
    if _INSTALLED:
        return _INSTALLED[0]
    if torch._C._get_privateuse1_backend_name() not in ("privateuseone", "npu"):
        raise RuntimeError(f"PrivateUse1 is already {torch._C._get_privateuse1_backend_name()!r} in this process")
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    storage = HostBackedStorage(None)  # its device exists once PrivateUse1 is renamed
    capture = CaptureState()
    fallback = NpuFallback(storage, capture.check)

    def rerun(op, args, kwargs):
        if op is torch.ops.aten._copy_from.default:
            src, dst = args[0], args[1]
            storage.host_view(dst).copy_(storage.host_view(src) if src.device.type == "npu" else src)
            return dst
        return fallback.run(op, args, kwargs)

    module = EmulatedNpuModule(device_count, capture, rerun, storage.host_view)
    _setup_privateuseone_for_python_backend("npu", backend_module=module)
    storage.device = torch.device("npu", 0)
    torch.Generator = HostGenerator  # for the whole process: see HostGenerator
    fallback_lib = torch.library.Library("_", "IMPL")
    register(fallback_lib, fallback)
    aten_lib = torch.library.Library("aten", "IMPL")
    register_copies(aten_lib, fallback)
    hccl.register(storage.host_view, capture)
    functional_lib = torch.library.Library("_c10d_functional", "IMPL")
    hccl.register_functional(functional_lib)
    emulation = NpuEmulation(storage, fallback, capture, module, (fallback_lib, aten_lib, functional_lib))
    _INSTALLED.append(emulation)
    return emulation


__all__ = ["ACTIVATE_MODULE", "MODULE_ENV", "GraphCaptureError", "NPUGraph", "NpuEmulation", "install"]
