"""vLLM's data-parallel MoE dispatch on CPU, through eplb_graph's variable-size EP collectives.

With DP > 1 and expert parallel, vLLM 0.32's CPU communicator dispatches tokens with its
all-gather / reduce-scatter manager (``AgRsAll2AllManager``), which gathers each DP rank's
hidden states, top-k weights and ids with ``all_gatherv`` and sums the experts' outputs back
with ``reduce_scatterv`` over the DP group. ``CpuCommunicator`` implements neither (the base
class raises ``NotImplementedError``). ``bind_dp_dispatch`` gives the DP group's
communicator *instance* both, as ``eplb_graph::ep_all_gatherv`` / ``ep_reduce_scatterv`` over its
gloo group: one opaque op gathers every tensor to one length, so the compiled graph can prove
that the experts see as many id rows as hidden rows (``moe_problem_size``).

The ops read each rank's token count from vLLM's forward context when they run, never from the
graph: upstream's traced code would otherwise turn ``num_tokens_across_dp_cpu`` into a list as
long as the DP group, and a resize of the group (vLLM's elastic EP) would meet a graph that
gathers from the old number of ranks. So the binding also takes the counts out of the traced
code: the manager's ``_get_sizes`` and each MoE runner's ``_sequence_parallel_context`` (which
read them there) are bound on those instances, and a graph holds no value of the DP size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from eplb_graph.custom_ops import EP_GROUPS
from eplb_graph.upstream import patches

HOOKS = {"all_gatherv": "dp_dispatch.all_gatherv", "reduce_scatterv": "dp_dispatch.reduce_scatterv"}  # -> adaptation
SIZES_HOOK = "dp_dispatch.get_sizes"  # on the EP group's all-gather / reduce-scatter manager
CONTEXT_HOOK = "dp_dispatch.sequence_parallel_context"  # on each MoE runner
# vLLM's CPU communicator, and ours on its stateless (elastic) groups (stateless_cpu.py), a subclass
SERVED = ("CpuCommunicator", "StatelessCpuCommunicator")
# The slot name the compiled graph reads (an op argument): one DP group per worker process, and
# vLLM's elastic EP replaces the group (a new name) at each resize while the graph stays.
SLOT = "vllm:dp"


class DpDispatchError(RuntimeError):
    """vLLM's DP dispatch on this communicator cannot be served."""


def forward_token_counts() -> list[int]:
    """Each DP rank's token rows in the forward under way, as vLLM agreed them before the step."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    metadata = get_forward_context().dp_metadata if is_forward_context_available() else None
    if metadata is None:
        raise DpDispatchError("DP dispatch outside a vLLM forward with DP metadata: no token counts to gather by")
    return metadata.num_tokens_across_dp_cpu.tolist()


class VllmGroupSlot:
    """A vLLM group as the variable-size collectives' slot (``TokenCountSlot``)."""

    def __init__(self, device_group: dist.ProcessGroup, rank: int, size: int,
                 token_counts: Callable[[], list[int]]) -> None:
        self.device_group, self.rank, self.max_size = device_group, rank, size
        self.token_counts = token_counts
        self.running_alone = False  # see alone()

    def current(self) -> tuple[dist.ProcessGroup | None, int, int]:
        together = self.max_size > 1 and not self.running_alone
        return (self.device_group if together else None), self.rank, self.max_size

    @contextmanager
    def alone(self) -> Iterator[None]:
        """This rank's forwards communicate nothing, the other members' rows taken as zeros, while the
        group keeps its size: a graph traced here is the one the group runs together (a new engine
        of vLLM's elastic EP compiles so before it joins, while the others serve)."""
        if self.running_alone:
            raise DpDispatchError("the DP dispatch already runs alone")
        self.running_alone = True
        try:
            yield
        finally:
            self.running_alone = False


class VariableSizeCollectives:
    """``all_gatherv`` / ``reduce_scatterv`` on one vLLM group coordinator's CPU communicator, and the
    counts taken out of the traced code of the manager and the MoE runners that dispatch over it."""

    def __init__(self, coordinator, name: str, token_counts: Callable[[], list[int]] = forward_token_counts,
                 manager: object | None = None, moe_runners: Iterable[object] = ()) -> None:
        communicator = coordinator.device_communicator
        if type(communicator).__name__ not in SERVED:
            raise DpDispatchError(f"group {coordinator.unique_name}: eplb-graph serves DP dispatch on vLLM's "
                                  f"CpuCommunicator, this group has {type(communicator).__name__}")
        if any(patches.installed(key, on=communicator) for key in HOOKS.values()):
            raise DpDispatchError(f"group {coordinator.unique_name}: its variable-size collectives are already bound")
        self.name = name
        self.coordinator, self.communicator = coordinator, communicator
        self.manager, self.moe_runners = manager, list(moe_runners)
        self.slot = VllmGroupSlot(communicator.device_group, coordinator.rank_in_group, coordinator.world_size,
                                  token_counts)
        self.dispatched_rows: int | torch.SymInt | None = None  # this rank's rows at the last dispatch
        EP_GROUPS.register(name, self.slot)
        for hook, key in HOOKS.items():
            patches.install(key, getattr(self, hook), by=self, on=communicator)
        if manager is not None:
            upstream_sizes = manager._get_sizes
            patches.install(SIZES_HOOK, self._sizes_hook(upstream_sizes), by=self, on=manager)
        for moe_runner in self.moe_runners:
            patches.install(CONTEXT_HOOK, nullcontext, by=self, on=moe_runner)  # no counts read while tracing

    def unbind(self) -> None:
        for moe_runner in self.moe_runners:
            patches.uninstall(CONTEXT_HOOK, on=moe_runner)
        if self.manager is not None:
            patches.uninstall(SIZES_HOOK, on=self.manager)
        for key in reversed(HOOKS.values()):
            patches.uninstall(key, on=self.communicator)
        EP_GROUPS.unregister(self.name)

    def _sizes_hook(self, upstream_sizes):
        def _get_sizes(num_local_tokens, comm_group) -> list:
            """On this group, upstream's own check (``sizes[rank]`` = its rows) and nothing else reads
            the list: the ops read the counts when they run."""
            if comm_group is not self.coordinator:
                return upstream_sizes(num_local_tokens, comm_group)
            return [num_local_tokens] * comm_group.world_size

        return _get_sizes

    def all_gatherv(self, input_: torch.Tensor | list[torch.Tensor], dim: int = 0,
                    sizes: list[int] | None = None) -> torch.Tensor | list[torch.Tensor]:
        """``sizes`` are upstream's and not read (see the module docstring)."""
        tensors = input_ if isinstance(input_, list) else [input_]
        if dim != 0:
            raise DpDispatchError(f"all_gatherv along dim {dim}: vLLM's DP dispatch gathers token rows (dim 0)")
        self.dispatched_rows = tensors[0].shape[0]  # what the combine after it returns
        gathered = torch.ops.eplb_graph.ep_all_gatherv(tensors, self.name)
        return list(gathered) if isinstance(input_, list) else gathered[0]

    def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
        """This rank's rows of the ranks' sum: as many as it dispatched (upstream's MoE layer
        dispatches, runs its experts, then combines)."""
        if dim not in (0, -input_.dim()):
            raise DpDispatchError(f"reduce_scatterv along dim {dim}: vLLM's DP combine scatters token rows (dim 0)")
        if self.dispatched_rows is None:
            raise DpDispatchError(f"group {self.coordinator.unique_name}: a combine before any dispatch")
        return torch.ops.eplb_graph.ep_reduce_scatterv(input_, self.dispatched_rows, self.name)


def bind_dp_dispatch(parallel_config, moe_runners: Iterable[object] = ()) -> VariableSizeCollectives | None:
    """Binds the DP group's communicator where vLLM dispatches MoE tokens over it (DP > 1), with
    the EP group's manager and ``moe_runners`` (every MoE layer's runner) reading no counts."""
    if parallel_config.data_parallel_size <= 1:
        return None
    from vllm.distributed.parallel_state import get_dp_group, get_ep_group

    manager = getattr(get_ep_group().device_communicator, "all2all_manager", None)
    if type(manager).__name__ != "AgRsAll2AllManager":
        raise DpDispatchError(f"DP={parallel_config.data_parallel_size} on CPU: eplb-graph serves vLLM's "
                              f"all-gather / reduce-scatter dispatch, the EP group has {type(manager).__name__}")
    return VariableSizeCollectives(get_dp_group(), SLOT, manager=manager, moe_runners=moe_runners)
