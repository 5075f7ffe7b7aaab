"""vLLM's data-parallel MoE dispatch on CPU, through eplb_graph's variable-size EP collectives.

With DP > 1 and expert parallel, vLLM 0.32's CPU communicator dispatches tokens with its
all-gather / reduce-scatter manager (``AgRsAll2AllManager``), which gathers each DP rank's
hidden states, top-k weights and ids with ``all_gatherv`` and sums the experts' outputs back
with ``reduce_scatterv`` over the DP group. ``CpuCommunicator`` implements neither (the base
class raises ``NotImplementedError``). ``bind_dp_dispatch`` gives the DP group's
communicator *instance* both, as ``eplb_graph::ep_all_gatherv`` / ``ep_reduce_scatterv`` over its
gloo group: one opaque op gathers every tensor to the one length ``sum(sizes)``, so the compiled
graph can prove that the experts see as many id rows as hidden rows (``moe_problem_size``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from eplb_graph.custom_ops import EP_GROUPS
from eplb_graph.upstream import patches

HOOKS = {"all_gatherv": "dp_dispatch.all_gatherv", "reduce_scatterv": "dp_dispatch.reduce_scatterv"}  # -> adaptation
# vLLM's CPU communicator, and ours on its stateless (elastic) groups (stateless_cpu.py), a subclass
SERVED = ("CpuCommunicator", "StatelessCpuCommunicator")
# The slot name the compiled graph reads (an op argument): one DP group per worker process, and
# vLLM's elastic EP replaces the group (a new name) at each resize while the graph stays.
SLOT = "vllm:dp"


class DpDispatchError(RuntimeError):
    """vLLM's DP dispatch on this communicator cannot be served."""


class VllmGroupSlot:
    """A fixed vLLM group as the EP collectives' slot (``EpGroupSlot``)."""

    def __init__(self, device_group: dist.ProcessGroup, rank: int, size: int) -> None:
        self.device_group, self.rank, self.max_size = device_group, rank, size

    def current(self) -> tuple[dist.ProcessGroup | None, int, int]:
        return (self.device_group if self.max_size > 1 else None), self.rank, self.max_size


class VariableSizeCollectives:
    """``all_gatherv`` / ``reduce_scatterv`` on one vLLM group coordinator's CPU communicator."""

    def __init__(self, coordinator, name: str) -> None:
        communicator = coordinator.device_communicator
        if type(communicator).__name__ not in SERVED:
            raise DpDispatchError(f"group {coordinator.unique_name}: eplb-graph serves DP dispatch on vLLM's "
                                  f"CpuCommunicator, this group has {type(communicator).__name__}")
        if any(patches.installed(key, on=communicator) for key in HOOKS.values()):
            raise DpDispatchError(f"group {coordinator.unique_name}: its variable-size collectives are already bound")
        self.name = name
        self.communicator = communicator
        self.slot = VllmGroupSlot(communicator.device_group, coordinator.rank_in_group, coordinator.world_size)
        EP_GROUPS.register(name, self.slot)
        for hook, key in HOOKS.items():
            patches.install(key, getattr(self, hook), by=self, on=communicator)

    def unbind(self) -> None:
        for key in reversed(HOOKS.values()):
            patches.uninstall(key, on=self.communicator)
        EP_GROUPS.unregister(self.name)

    def _sizes(self, rows, sizes: list[int] | None) -> list:
        """Token counts per rank. Read from vLLM's forward context, they are data-dependent in a
        traced graph; every DP rank runs each forward with at least one token (an idle one a dummy
        batch of one), and saying so lets the graph decide upstream's shape checks on the gathered
        batch (checked again when it runs)."""
        sizes = [rows] * self.slot.max_size if sizes is None else list(sizes)
        for size in sizes:
            torch._check(size >= 1)
        return sizes

    def all_gatherv(self, input_: torch.Tensor | list[torch.Tensor], dim: int = 0,
                    sizes: list[int] | None = None) -> torch.Tensor | list[torch.Tensor]:
        tensors = input_ if isinstance(input_, list) else [input_]
        if dim != 0:
            raise DpDispatchError(f"all_gatherv along dim {dim}: vLLM's DP dispatch gathers token rows (dim 0)")
        gathered = torch.ops.eplb_graph.ep_all_gatherv(tensors, self._sizes(tensors[0].shape[0], sizes), self.name)
        return list(gathered) if isinstance(input_, list) else gathered[0]

    def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
        if dim not in (0, -input_.dim()):
            raise DpDispatchError(f"reduce_scatterv along dim {dim}: vLLM's DP combine scatters token rows (dim 0)")
        rows = input_.shape[0] // self.slot.max_size
        return torch.ops.eplb_graph.ep_reduce_scatterv(input_, self._sizes(rows, sizes), self.name)


def bind_dp_dispatch(parallel_config) -> VariableSizeCollectives | None:
    """Binds the DP group's communicator where vLLM dispatches MoE tokens over it (DP > 1)."""
    if parallel_config.data_parallel_size <= 1:
        return None
    from vllm.distributed.parallel_state import get_dp_group, get_ep_group

    manager = getattr(get_ep_group().device_communicator, "all2all_manager", None)
    if type(manager).__name__ != "AgRsAll2AllManager":
        raise DpDispatchError(f"DP={parallel_config.data_parallel_size} on CPU: eplb-graph serves vLLM's "
                              f"all-gather / reduce-scatter dispatch, the EP group has {type(manager).__name__}")
    return VariableSizeCollectives(get_dp_group(), SLOT)
