"""``GlooStagedCommunicator``: upstream's ``EplbCommunicator`` contract over gloo, CPU-staged.

The async worker moves expert tensors with this communicator. Device tensors are copied
into reusable host staging buffers (pinned where the device has pinned memory, keyed by dtype
and shape, so a steady rearrangement allocates nothing), exchanged with the gloo
group's own send / recv on the EPLB CPU group, and copied back into the destination. The
worker thread therefore never issues a device collective: foreground MoE communication
keeps the device group to itself. Host (CPU) tensors are sent and received in place.

Every wait is bounded: a peer that dies mid-transfer raises ``EplbTransferError`` naming
the peers involved instead of hanging the worker.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist


class EplbTransferError(RuntimeError):
    pass


def _make_communicator_base():
    from vllm.distributed.eplb.eplb_communicator import EplbCommunicator

    return EplbCommunicator


def pinned_host_memory() -> tuple[bool, str | None]:
    """(whether this process's accelerator gives pinned host memory, why not). CUDA and torch_npu
    do; a device backend without a pinned allocator raises at the first pinned allocation, so
    one is tried here rather than failing inside the worker's first transfer."""
    if not torch.accelerator.is_available():
        return False, "no accelerator in this process"
    try:
        torch.empty(1, pin_memory=True)
    except (RuntimeError, NotImplementedError) as error:
        return False, f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return True, None


class StagingPool:
    """Host buffers reused across transfers, keyed by (dtype, shape)."""

    def __init__(self, pin_memory: bool, unpinned_because: str | None = None) -> None:
        self.pin_memory = pin_memory
        self.unpinned_because = None if pin_memory else unpinned_because or "pinning not asked for"
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)

    def take(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.dtype, tuple(like.shape))
        if self._free[key]:
            return self._free[key].pop()
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.pin_memory)

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        for buffer in buffers:
            self._free[(buffer.dtype, tuple(buffer.shape))].append(buffer)


class GlooStagedCommunicator(_make_communicator_base()):
    """EplbCommunicator (add_send / add_recv / execute / set_transfer_context / set_stream)."""

    def __init__(self, cpu_group: dist.ProcessGroup, *, timeout_s: float = 60.0, pin_memory: bool | None = None,
                 on_execute: Callable[[], object] | None = None) -> None:
        """``on_execute``: called as each layer's exchange starts (every rank executes every layer,
        with or without transfers: an elastic member counts them for its keep-alive)."""
        self._cpu_group = cpu_group
        self.on_execute = on_execute
        self._stream = None
        self._ops: list[tuple[str, torch.Tensor, int]] = []
        self.timeout = timedelta(seconds=timeout_s)
        unpinned_because = None
        if pin_memory is None:  # pinned where the device has it (CUDA, NPU): D2H and H2D copies at full speed
            pin_memory, unpinned_because = pinned_host_memory()
        self.staging = StagingPool(pin_memory, unpinned_because)
        self.bytes_sent = 0
        self.bytes_received = 0

    @property
    def needs_profile_buffer_reservation(self) -> bool:
        return False  # staging is allocated on demand, on the host

    def add_send(self, tensors: list[torch.Tensor], dst_rank: int, expert_id: int) -> None:
        self._ops.extend(("send", tensor, dst_rank) for tensor in tensors)

    def add_recv(self, tensors: list[torch.Tensor], src_rank: int, expert_id: int) -> None:
        self._ops.extend(("recv", tensor, src_rank) for tensor in tensors)

    def set_transfer_context(self, old_indices, layer_idx: int) -> None:
        self._layer_idx = layer_idx

    def execute(self) -> None:
        if self.on_execute is not None:
            self.on_execute()
        ops, self._ops = self._ops, []
        if not ops:
            return
        p2p, staged_recvs, staging = [], [], []
        for kind, tensor, peer in ops:
            on_host = tensor.device.type == "cpu" and tensor.is_contiguous()
            if kind == "send":
                if on_host:
                    buffer = tensor
                else:
                    buffer = self.staging.take(tensor)
                    buffer.copy_(tensor)  # D2H; a blocking copy, so the data is ready for gloo
                    staging.append(buffer)
                p2p.append(("send", buffer, peer))
                self.bytes_sent += tensor.numel() * tensor.element_size()
            else:
                buffer = tensor if on_host else self.staging.take(tensor)
                if not on_host:
                    staged_recvs.append((tensor, buffer))
                    staging.append(buffer)
                p2p.append(("recv", buffer, peer))
                self.bytes_received += tensor.numel() * tensor.element_size()
        peers = sorted({peer for _, _, peer in ops})
        try:
            # the group's own send/recv take ranks in the group, so a stateless group (an
            # elastic generation's, never registered with c10d) serves as well as vLLM's
            requests = [getattr(self._cpu_group, kind)([buffer], peer, 0) for kind, buffer, peer in p2p]
            for request in requests:
                request.wait(self.timeout)
        except Exception as error:  # gloo raises RuntimeError / DistBackendError on a dead peer
            raise EplbTransferError(
                f"EPLB expert transfer with EP peer(s) {peers} failed (layer {getattr(self, '_layer_idx', '?')}, "
                f"timeout {self.timeout.total_seconds():.0f} s): {error}"
            ) from error
        for destination, buffer in staged_recvs:
            destination.copy_(buffer)  # H2D into the exact storage the buffer view names
        self.staging.give_back(staging)
