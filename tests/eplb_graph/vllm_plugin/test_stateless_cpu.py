"""``stateless_cpu``: vLLM's stateless (elastic) groups on CPU with a device communicator, and the
EPLB communicator chosen for them.

In one process: the adaptations install, install again as a no-op, refuse a second installer,
come back out leaving upstream's objects as they were, and ``eplb-graph doctor`` lists them; the
EPLB communicator is ours for host experts over gloo and upstream's choice otherwise. Over three
gloo processes (``launches``): vLLM's own ``StatelessGroupCoordinator``s for ranks 0 and 1, then
standby groups of all three beside them, as a scale-up from DP 2 to 3 builds them: collectives,
vLLM's all-gather / reduce-scatter token dispatch through ``dp_dispatch`` compared with the same
sums by hand, and one expert moved by ``GlooStagedCommunicator`` between two ranks of each group.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from eplb_graph.movement.mover import GlooStagedCommunicator  # noqa: E402
from eplb_graph.upstream import patches  # noqa: E402
from eplb_graph.vllm_plugin.stateless_cpu import (  # noqa: E402
    COMMUNICATOR, EPLB_COMMUNICATOR, INIT, USES_COMMUNICATOR, StatelessCpuAdaptations, StatelessCpuCommunicator)

KEYS = (INIT, COMMUNICATOR, USES_COMMUNICATOR, EPLB_COMMUNICATOR)
HIDDEN, TOP_K, LOCAL_EXPERTS = 4, 2, 2


@pytest.fixture(autouse=True)
def without_the_plugins():
    """The plugin installs the two in every vLLM process on CPU that imports their modules (an
    earlier test in this process may have): taken out for each test here, put back after."""
    from eplb_graph.vllm_plugin.stateless_cpu import INSTALLED, install_for_plugin

    taken = [key for key in INSTALLED if patches.installed(key)]
    for key in reversed(taken):
        patches.uninstall(key)
    yield
    for key in taken:
        install_for_plugin(key)


@pytest.fixture
def installed():
    adaptations = StatelessCpuAdaptations()
    adaptations.install()
    yield adaptations
    adaptations.uninstall()


def test_the_adaptations_install_once_and_come_back_out_cleanly():
    from vllm.distributed.eplb import eplb_state
    from vllm.distributed.stateless_coordinator import StatelessGroupCoordinator

    init, create = vars(StatelessGroupCoordinator)["__init__"], eplb_state.create_eplb_communicator
    adaptations = StatelessCpuAdaptations()
    adaptations.install()
    adaptations.install()  # by the same installer: nothing more
    try:
        assert patches.installed(INIT) and patches.installed(EPLB_COMMUNICATOR)
        assert StatelessGroupCoordinator.__init__.__wrapped__ is init
        assert eplb_state.create_eplb_communicator.__wrapped__ is create
        other = StatelessCpuAdaptations()
        with pytest.raises(patches.AdaptationError, match="already carries stateless_cpu.coordinator_init"):
            other.install()  # a second installer would wrap our wrapper
        other.uninstall()  # it installed nothing, so it takes nothing back
        assert StatelessGroupCoordinator.__init__.__wrapped__ is init
    finally:
        adaptations.uninstall()
    assert vars(StatelessGroupCoordinator)["__init__"] is init and eplb_state.create_eplb_communicator is create
    assert not patches.installed(INIT) and not patches.installed(EPLB_COMMUNICATOR)
    assert patches.LEDGER not in vars(StatelessGroupCoordinator) and patches.LEDGER not in vars(eplb_state)
    adaptations.uninstall()  # again: nothing to take back


def test_doctor_lists_each_adaptation_as_holding_for_the_plugin_on_cpu():
    from eplb_graph.tools.doctor import adaptation_rows, adaptations_markdown
    from eplb_graph.upstream.adaptations import PLUGIN, applicable

    rows = {row["key"]: row for row in adaptation_rows("cpu")}
    for key in KEYS:
        assert rows[key]["applies"] and rows[key]["status"] == "ok", rows[key]
        assert rows[key]["component"] == [PLUGIN] and f"`{key}`" in adaptations_markdown()
    assert {a.key for a in applicable("cpu", PLUGIN)} >= set(KEYS)  # the gate checks them at engine start
    assert not {a.key for a in applicable("cuda", PLUGIN)} & set(KEYS)  # CPU only


def bare_stateless(cpu_group):
    """A stateless coordinator as the EPLB communicator's choice reads it (no groups built)."""
    from vllm.distributed.stateless_coordinator import StatelessGroupCoordinator

    class Bare(StatelessGroupCoordinator):
        def __init__(self) -> None:
            self.cpu_group = self.device_group = cpu_group
            self.device_communicator = None

    return Bare()


def test_host_experts_over_gloo_move_through_ours_on_a_stateless_group_else_upstream_decides():
    from vllm.distributed.eplb import eplb_state

    group, experts = bare_stateless(cpu_group=object()), [[torch.zeros(LOCAL_EXPERTS, HIDDEN)]]
    with pytest.raises(ValueError, match="Elastic EP requires 'torch_nccl', 'pynccl', or 'nixl'"):
        eplb_state.create_eplb_communicator(group, "torch_gloo", experts, [torch.zeros(LOCAL_EXPERTS, HIDDEN)])
    adaptations = StatelessCpuAdaptations()
    adaptations.install()
    try:
        ours = eplb_state.create_eplb_communicator(group, "torch_gloo", experts, [torch.zeros(2, HIDDEN)])
        assert isinstance(ours, GlooStagedCommunicator) and ours._cpu_group is group.cpu_group
        with pytest.raises(RuntimeError, match="'pynccl' supports only cuda-like devices"):  # upstream's answer
            eplb_state.create_eplb_communicator(group, "pynccl", experts, [torch.zeros(2, HIDDEN)])
    finally:
        adaptations.uninstall()


# -- three gloo processes (module level: the ranks import it)

def _group(ranks, name, rank, store, **kwargs):
    from vllm.distributed.stateless_coordinator import StatelessGroupCoordinator

    return StatelessGroupCoordinator(group_ranks=ranks, local_rank=rank, torch_distributed_backend="gloo",
                                     use_device_communicator=True, coord_store=store, group_name=name,
                                     host="127.0.0.1", global_rank=rank, global_world_size=3, **kwargs)


def _collectives(group, rank) -> None:
    members = group.ranks
    assert type(group.device_communicator) is StatelessCpuCommunicator and group.use_device_communicator
    assert group.device_communicator.ranks == members and group.device_communicator.global_rank == rank
    total = group.all_reduce(torch.tensor([float(rank + 1)]))
    assert total.item() == sum(r + 1 for r in members), total
    gathered = group.all_gather(torch.tensor([[rank, 10 * rank]]), dim=0)
    assert torch.equal(gathered, torch.tensor([[r, 10 * r] for r in members])), gathered
    last = len(members) - 1
    for broadcast in (group.broadcast, group.device_communicator.broadcast):
        value = broadcast(torch.tensor([rank]), src=last)
        assert value.item() == members[last], value
    at_root = group.gather(torch.tensor([rank]), dst=0, dim=0)  # through our send / recv
    assert (at_root is None) == (group.rank_in_group != 0)
    assert at_root is None or at_root.tolist() == members, at_root
    group.barrier()


def _rows(seed: int, *shape, ids: bool = False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if ids:
        return torch.randint(0, 8, shape, generator=generator, dtype=torch.int32)
    return torch.randn(*shape, generator=generator)


def _dispatch_and_combine(ep_group, dp_group, sizes: list[int]) -> None:
    """vLLM's AgRs token dispatch (all_gatherv) and combine (reduce_scatterv) over the DP group
    upstream looks up, each rank with its own token count, against the same sums by hand."""
    from vllm.forward_context import DPMetadata, ForwardContext, override_forward_context

    from eplb_graph.vllm_plugin.dp_dispatch import VariableSizeCollectives

    me, ranks = dp_group.rank_in_group, range(len(sizes))
    sent = [(_rows(100 + r, sizes[r], HIDDEN), _rows(200 + r, sizes[r], TOP_K),
             _rows(300 + r, sizes[r], TOP_K, ids=True)) for r in ranks]
    outputs = [_rows(400 + r, sum(sizes), HIDDEN) for r in ranks]  # every rank's experts' rows, every token
    bound = VariableSizeCollectives(dp_group, f"vllm:{dp_group.unique_name}")
    context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={},
                             dp_metadata=DPMetadata(torch.tensor(sizes), local_sizes=list(sizes)))
    try:
        with override_forward_context(context):
            gathered = ep_group.device_communicator.dispatch(*sent[me])
            combined = ep_group.device_communicator.combine(outputs[me])
    finally:
        bound.unbind()
    for got, expected in zip(gathered, (torch.cat(parts) for parts in zip(*sent))):
        assert torch.equal(got, expected), (got, expected)
    start = sum(sizes[:me])
    assert torch.allclose(combined, sum(outputs)[start:start + sizes[me]]), combined


def _move(eplb_group, rank, moves: list[tuple[int, int]]) -> dict:
    """Through eplb_state's name, as EplbState reaches it: ``(src, dst)`` in group ranks, each
    src sending its expert 1 into dst's expert 0 slot."""
    from vllm.distributed.eplb import eplb_state

    me = eplb_group.rank_in_group
    experts = (torch.arange(LOCAL_EXPERTS * HIDDEN, dtype=torch.float32).view(LOCAL_EXPERTS, HIDDEN)
               + 100 * eplb_group.ranks[me])
    communicator = eplb_state.create_eplb_communicator(eplb_group, "torch_gloo", [[experts]],
                                                       [torch.empty_like(experts)])
    assert isinstance(communicator, GlooStagedCommunicator) and communicator._cpu_group is eplb_group.cpu_group
    with pytest.raises(RuntimeError, match="'pynccl' supports only cuda-like devices"):  # upstream's choice
        eplb_state.create_eplb_communicator(eplb_group, "pynccl", [[experts]], [torch.empty_like(experts)])
    expected = experts.clone()
    for src, dst in moves:
        if me == src:
            communicator.add_send([experts[1]], dst, expert_id=1)
        if me == dst:
            communicator.add_recv([experts[0]], src, expert_id=1)
            expected[0] = torch.arange(HIDDEN, 2 * HIDDEN, dtype=torch.float32) + 100 * eplb_group.ranks[src]
    communicator.set_transfer_context(None, 0)
    communicator.execute()
    assert torch.equal(experts, expected), (experts, expected)
    return {"sent": communicator.bytes_sent, "received": communicator.bytes_received}


def stateless_groups_case(rank: int, world_size: int, init_method: str) -> dict:
    from torch.distributed import FileStore, PrefixStore
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    store = FileStore(init_method.removeprefix("file://"), world_size)  # the launcher's rendezvous
    config = VllmConfig(parallel_config=ParallelConfig(enable_expert_parallel=True))
    adaptations, moved = StatelessCpuAdaptations(), {}
    adaptations.install()
    with set_current_vllm_config(config):
        # vLLM's TP and PCP groups as an engine at TP=1 has them: one rank each (no communicator)
        single = _group([[r] for r in range(world_size)], "tp", rank, store)
        assert single.device_communicator is None
        parallel_state._TP = parallel_state._PCP = single  # the all2all manager reads them at its construction
        founders = None
        if rank < 2:  # DP 2: ranks 0 and 1; the dispatch reads the DP group from upstream's getter
            dp = parallel_state._DP = _group([[0, 1]], "dp", rank, store)
            ep = parallel_state._EP = _group([[0, 1]], "ep", rank, store, use_all2all=True)
            eplb = _group([[0, 1]], "eplb", rank, store)
            founders = (dp, ep, eplb)
            for group in founders:
                _collectives(group, rank)
            assert ep.device_communicator.all2all_manager is not None and dp.device_communicator.all2all_manager is None
            _dispatch_and_combine(ep, dp, [3, 1])
            moved[2] = _move(eplb, rank, [(0, 1)])
        # the standby groups of DP 3 beside them (a scale-up's, on their own store keys); the new rank's only
        standby = PrefixStore("standby", store)
        dp3 = _group([[0, 1, 2]], "dp", rank, standby)
        if founders is None:
            parallel_state._DP = dp3
        ep3 = _group([[0, 1, 2]], "ep", rank, standby, use_all2all=True)
        eplb3 = _group([[0, 1, 2]], "eplb", rank, standby)
        if founders is not None:  # the founding groups serve on beside the standby ones
            _collectives(founders[0], rank)
        parallel_state._DP, parallel_state._EP = dp3, ep3  # the switch
        for group in (dp3, ep3, eplb3):
            _collectives(group, rank)
        manager = type(ep3.device_communicator.all2all_manager).__name__
        _dispatch_and_combine(ep3, dp3, [2, 1, 3])
        moved[3] = _move(eplb3, rank, [(0, 2), (2, 1)])  # to and from the new rank
        for group in (*(founders or ()), dp3, ep3, eplb3, single):
            group.destroy()
    adaptations.uninstall()
    return {"manager": manager, "moved": moved}


@pytest.mark.launches  # three rank processes: left out by make test-fast
def test_vllms_stateless_groups_serve_on_cpu_before_and_beside_a_scale_up():
    from eplb_reference.runtime.launch import run_ranks

    results = run_ranks(stateless_groups_case, 3, timeout_s=60)
    assert [r["manager"] for r in results] == ["AgRsAll2AllManager"] * 3
    expert = HIDDEN * 4  # bytes of one float32 expert
    assert [r["moved"].get(2) for r in results] == [{"sent": expert, "received": 0},
                                                    {"sent": 0, "received": expert}, None]
    assert [r["moved"][3] for r in results] == [{"sent": expert, "received": 0}, {"sent": 0, "received": expert},
                                                {"sent": expert, "received": expert}]
