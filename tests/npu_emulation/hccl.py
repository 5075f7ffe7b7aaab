"""An ``hccl`` process-group backend for the emulated device: gloo over the ``npu`` tensors' host bytes.

What torch_npu's ``ProcessGroupHCCL`` does for the runtime's activation group, done by gloo on
each tensor's host view (no copy: gloo reads and writes the very bytes of the ``npu`` tensor).
Proves that the collectives are called with ``npu`` tensors of the right shapes, in the same
order on every rank, and that a captured graph replays them; it is not HCCL (no HCCS links, no
device-side reduction, no asynchrony). A collective issued while a graph captures is recorded
on the graph's tape like any op, since ACL graphs capture HCCL work too.

Functional collectives (``funcol``, what a compiled graph calls) resolve their group by name and
run on the PrivateUse1 kernels registered here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions

from tests.npu_emulation.graphs import CaptureState

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}


class EmulatedHccl(dist.ProcessGroup):
    """A Python process group (``extended_api`` creator) over one gloo group of the same ranks."""

    def __init__(self, options, pg_options, host_view: Callable[[torch.Tensor], torch.Tensor],
                 capture: CaptureState) -> None:
        super().__init__(options.group_rank, options.group_size)
        self._name = options.group_id
        self._gloo = dist.ProcessGroupGloo(options.store, options.group_rank, options.group_size, options.timeout)
        self._host_view = host_view
        self._capture = capture

    @property
    def group_name(self) -> str:
        return self._name

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "hccl"

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._host_view(tensor) if tensor.device.type == "npu" else tensor

    def _run(self, collective: Callable[[], dist.Work]) -> dist.Work:
        """Runs now (and waits: work here is synchronous); during capture, also onto the tape."""
        work = collective()
        work.wait()
        self._capture.record_call(lambda: collective().wait())
        return work

    def allreduce(self, tensors, opts=None):
        host = [self._host(t) for t in tensors]
        return self._run(lambda: self._gloo.allreduce(host, opts) if opts is not None else self._gloo.allreduce(host))

    def allgather(self, output_lists, inputs, opts=None):
        outputs = [[self._host(t) for t in row] for row in output_lists]
        host = [self._host(t) for t in inputs]
        return self._run(lambda: self._gloo.allgather(outputs, host))

    def _allgather_base(self, output, input, opts=None):
        out, inp = self._host(output), self._host(input)
        return self._run(lambda: self._gloo._allgather_base(out, inp))

    def broadcast(self, tensors, opts=None):
        host = [self._host(t) for t in tensors]
        return self._run(lambda: self._gloo.broadcast(host, opts) if opts is not None else self._gloo.broadcast(host))

    def barrier(self, opts=None):
        return self._gloo.barrier()


def register(host_view, capture: CaptureState) -> None:
    """Makes ``hccl`` a process-group backend for ``npu`` in this process."""
    if "HCCL" in dist.Backend._plugins:
        return

    def create(options, pg_options):
        return EmulatedHccl(options, pg_options, host_view, capture)

    dist.Backend.register_backend("hccl", create, extended_api=True, devices=["npu"])


def register_functional(lib: torch.library.Library) -> None:
    """``_c10d_functional`` on PrivateUse1: the compiled graph's collectives, by group name."""

    def group(name: str) -> dist.ProcessGroup:
        return torch._C._distributed_c10d._resolve_process_group(name)

    def all_gather_into_tensor(input: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
        output = input.new_empty((input.shape[0] * group_size, *input.shape[1:]))
        group(group_name)._allgather_base(output, input.contiguous())
        return output

    def all_reduce(input: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
        output = input.clone()
        options = AllreduceOptions()
        options.reduceOp = _REDUCE_OPS[reduce_op.lower()]
        group(group_name).allreduce([output], options)
        return output

    def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
        return tensor  # every collective here has finished when it returns

    lib.impl("all_gather_into_tensor", all_gather_into_tensor, "PrivateUse1")
    lib.impl("all_reduce", all_reduce, "PrivateUse1")
    lib.impl("wait_tensor", wait_tensor, "PrivateUse1")
