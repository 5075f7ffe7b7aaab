"""vLLM's elastic EP groups on CPU: a device communicator and an EPLB communicator for stateless groups.

With elastic EP on, vLLM builds its DP, EP and EPLB groups as ``StatelessGroupCoordinator``s
(process groups c10d never registers), at the first start and at every resize. On CPU (vLLM 0.32)
the coordinator asserts its device communicator is ``CudaCommunicator`` (and ``CpuCommunicator``
drops the global ranks a stateless group must hand its base class), and
``create_eplb_communicator`` takes only nixl / pynccl / torch_nccl there (pynccl refuses host tensors).

``StatelessCpuCommunicator`` is ``CpuCommunicator`` on such a group: the global ranks passed on,
plain ``torch.distributed`` (the shared-memory path serves tp/pp groups only), point to point in
group ranks through the group's own process group (c10d cannot translate global ranks for a group
it never registered), and vLLM's ``AgRsAll2AllManager`` over the stateless group on the EP group
(``all_gatherv`` / ``reduce_scatterv`` on the DP group come from ``dp_dispatch``).
``StatelessCpuAdaptations`` installs the two adaptations (``adaptations.py``: ``stateless_cpu.*``)
and takes them back; the plugin installs them in every vLLM process on CPU (``install_for_plugin``).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.distributed as dist
from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
from vllm.logger import init_logger

from eplb_graph.upstream import patches

logger = init_logger(__name__)

INIT, COMMUNICATOR, USES_COMMUNICATOR, EPLB_COMMUNICATOR = (
    "stateless_cpu.coordinator_init", "stateless_cpu.device_communicator",
    "stateless_cpu.uses_device_communicator", "stateless_cpu.eplb_communicator")
INSTALLED = (INIT, EPLB_COMMUNICATOR)  # the two set on upstream's class and module; the others are config


class StatelessCpuCommunicator(CpuCommunicator):
    """``CpuCommunicator`` on a stateless group; takes ``CudaCommunicator``'s arguments, as upstream's
    stateless coordinator passes them."""

    def __init__(self, cpu_group: dist.ProcessGroup, device: torch.device | None = None,
                 device_group: dist.ProcessGroup | None = None, unique_name: str = "",
                 global_ranks: list[int] | None = None, global_world_size: int | None = None,
                 tcp_store_group=None, use_all2all: bool = False) -> None:
        # CpuCommunicator.__init__ is skipped: it calls its base without the global ranks (asserted
        # for a stateless group) and probes the shared-memory path; what else it sets is set here
        DeviceCommunicatorBase.__init__(self, cpu_group, device, device_group, unique_name, global_ranks,
                                        global_world_size, use_all2all=use_all2all)
        self.dist_module = torch.distributed
        self.supports_tensor_dict = False
        self.tcp_store_group = tcp_store_group
        if self.use_all2all:  # the EP group only (the base class decides by its name)
            if self.all2all_backend not in ("naive", "allgather_reducescatter"):
                logger.warning("`%s` all2all manager is not supported on CPU. Falling back to "
                               "`allgather_reducescatter` manager.", self.all2all_backend)
            from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager

            self.all2all_manager = AgRsAll2AllManager(self.cpu_group, tcp_store_group)

    # point to point and rooted collectives take ranks in the group (upstream's stateless
    # coordinator passes them so), sent through the group's own process group

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        dst = (self.rank_in_group + 1) % self.world_size if dst is None else dst
        self.device_group.send([tensor], dst, 0).wait()

    def recv(self, size: torch.Size, dtype: torch.dtype, src: int | None = None) -> torch.Tensor:
        src = (self.rank_in_group - 1) % self.world_size if src is None else src
        tensor = torch.empty(size, dtype=dtype, device=self.device)
        self.device_group.recv([tensor], src, 0).wait()
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size > 1:
            self.device_group.broadcast(tensor, src).wait()
        return tensor

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        gathered = self.all_gather(input_, dim)  # c10d's gather names its root by global rank
        return gathered if self.rank_in_group == dst else None


def _coordinator_init(upstream):
    """Upstream's constructor without a device communicator, then ours where one was asked for."""
    signature = inspect.signature(upstream)

    @functools.wraps(upstream)
    def __init__(self, *args, **kwargs) -> None:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return upstream(self, *args, **kwargs)
        call = signature.bind(self, *args, **kwargs)
        call.apply_defaults()
        wanted = call.arguments["use_device_communicator"]
        call.arguments["use_device_communicator"] = False  # upstream's branch asserts CudaCommunicator
        upstream(*call.args, **call.kwargs)
        if not wanted:
            return
        patches.configure(USES_COMMUNICATOR, True, on=self)
        if self.world_size > 1:
            communicator = StatelessCpuCommunicator(
                cpu_group=self.cpu_group, device=self.device, device_group=self.device_group,
                unique_name=self.unique_name, global_ranks=self.ranks,
                global_world_size=call.arguments["global_world_size"], tcp_store_group=self.tcp_store_group,
                use_all2all=call.arguments["use_all2all"])
            patches.configure(COMMUNICATOR, communicator, on=self)

    return __init__


def _eplb_communicator(upstream):
    """Ours for host expert tensors over gloo (its send / recv take the stateless group's ranks),
    else upstream's choice."""

    @functools.wraps(upstream)
    def create_eplb_communicator(group_coordinator, backend, expert_weights, expert_buffer):
        first_layer = expert_weights[0] if expert_weights else []
        on_host = (first_layer[0].device.type if first_layer else "cpu") == "cpu"  # upstream's rule
        if on_host and backend == "torch_gloo":
            from eplb_graph.movement.mover import GlooStagedCommunicator

            return GlooStagedCommunicator(group_coordinator.cpu_group)
        return upstream(group_coordinator, backend, expert_weights, expert_buffer)

    return create_eplb_communicator


class StatelessCpuAdaptations:
    """Installs both adaptations (the plugin's elastic mode, and tests), and takes them back."""

    def __init__(self, by: object | None = None) -> None:
        self._by = self if by is None else by  # the installer the registry records (the plugin's name)
        self._wrappers: dict[str, object] = {}  # what this one installed: installing again is a no-op

    def install(self, keys: tuple[str, ...] = INSTALLED) -> None:
        for key, make in ((INIT, _coordinator_init), (EPLB_COMMUNICATOR, _eplb_communicator)):
            if key not in keys:
                continue
            wrapper = self._wrappers.get(key) or make(patches.current(key))
            patches.install(key, wrapper, by=self._by)  # refused where another installer's is there
            self._wrappers[key] = wrapper

    def uninstall(self) -> None:
        """Groups built meanwhile keep their communicators."""
        for key in reversed(INSTALLED):
            if self._wrappers.pop(key, None) is not None:
                patches.uninstall(key)


def install_for_plugin(key: str) -> None:
    """The plugin's installation of one of the two, once per process, when vLLM has imported its
    module (``import_hooks``; the two modules import each other): on CPU upstream's own path for
    stateless groups fails, so they serve every elastic EP group and nothing else."""
    from eplb_graph.upstream.adaptations import PLUGIN
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and not patches.installed(key):
        StatelessCpuAdaptations(by=PLUGIN).install((key,))
