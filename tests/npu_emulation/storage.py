"""Host memory behind the emulated ``npu`` tensors.

Every ``npu`` tensor is a real PrivateUse1 TensorImpl whose storage points at the bytes of a
host (CPU) tensor that this registry keeps alive. Its sizes, strides and storage offset are
real, so views made anywhere (in C++ composites too) share storage exactly as on a device,
``data_ptr()`` is a real, stable address, and a CPU view over the same bytes (``host_view``)
is what the fallback computes on.

The registry is keyed by the storage's base address: a backing is dropped only after every
``npu`` storage over it has died, so its address cannot be handed out again while an entry
names it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


@dataclass
class _Backing:
    host: torch.UntypedStorage  # owns the bytes
    device_storage: StorageWeakRef  # the npu storage over them; expired: the backing may go


class HostBackedStorage:
    """Registry of the host bytes behind every live ``npu`` storage (one per process)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._by_address: dict[int, _Backing] = {}
        self._prune_at = 1024
        self._lock = threading.Lock()  # the EPLB worker thread allocates on the device too

    def __len__(self) -> int:
        return len(self._by_address)

    def adopt(self, host: torch.Tensor) -> torch.Tensor:
        """An ``npu`` tensor over ``host``'s own bytes (no copy), with its sizes, strides, offset.
        ``host`` must own its storage alone from here on: the fallback only adopts fresh results."""
        storage = host.untyped_storage()
        if storage.nbytes() == 0:  # give an empty tensor an address of its own
            storage = torch.UntypedStorage(1)
        device_storage = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), self.device, storage.nbytes())
        self._remember(storage, device_storage)
        return self._tensor_on(device_storage, host)

    def view_of(self, base: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """A new ``npu`` tensor over ``npu`` ``base``'s storage, shaped as ``host`` (a view of its host view)."""
        return self._tensor_on(base.untyped_storage(), host)

    def knows(self, host: torch.Tensor) -> bool:
        backing = self._by_address.get(host.untyped_storage().data_ptr())
        return backing is not None and not backing.device_storage.expired()

    def host_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """A CPU tensor over the same bytes as ``npu`` ``tensor``: writes to it are writes to ``tensor``."""
        address = tensor.untyped_storage().data_ptr()
        backing = self._by_address.get(address)
        if backing is None or backing.device_storage.expired():
            raise RuntimeError(
                f"npu emulation: tensor {tuple(tensor.shape)} {tensor.dtype} has storage the emulation did not "
                f"allocate (address {address:#x}); an op made it without dispatching to the npu backend"
            )
        view = torch.empty(0, dtype=tensor.dtype)
        return view.set_(backing.host, tensor.storage_offset(), tensor.size(), tensor.stride())

    def restride(self, tensor: torch.Tensor, like: torch.Tensor) -> None:
        """Makes ``npu`` ``tensor`` match its host view ``like`` after an op resized or re-pointed it
        (``out=`` and ``resize_``), keeping the Python object, as a device's resize would."""
        if like.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr():
            storage = self.adopt(like).untyped_storage()
        else:
            storage = tensor.untyped_storage()
        torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
            _CPU_KEYS, tensor, storage, like.storage_offset(), like.size(), like.stride()
        )

    def _tensor_on(self, device_storage: torch.UntypedStorage, host: torch.Tensor) -> torch.Tensor:
        tensor = torch._C._acc.create_empty_tensor([0], host.dtype)
        return torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
            _CPU_KEYS, tensor, device_storage, host.storage_offset(), host.size(), host.stride()
        )

    def _remember(self, host: torch.UntypedStorage, device_storage: torch.UntypedStorage) -> None:
        with self._lock:
            if len(self._by_address) >= self._prune_at:
                self._by_address = {a: b for a, b in self._by_address.items() if not b.device_storage.expired()}
                self._prune_at = max(1024, 2 * len(self._by_address))
            self._by_address[host.data_ptr()] = _Backing(host, StorageWeakRef(device_storage))
