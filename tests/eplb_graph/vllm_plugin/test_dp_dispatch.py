"""``VariableSizeCollectives``: the DP group's CPU communicator given ``all_gatherv`` / ``reduce_scatterv``.

In one process: a coordinator of one DP rank (no process group) stands in for vLLM's DP group,
with a communicator named as vLLM's CPU one; the ops over two gloo ranks are tested in
``tests/custom_ops/test_ep_collectives.py``, vLLM's own DP=2 engine in ``test_engine.py``.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from eplb_graph.custom_ops import EP_GROUPS
from eplb_graph.upstream import patches
from eplb_graph.vllm_plugin.dp_dispatch import (CONTEXT_HOOK, SIZES_HOOK, DpDispatchError, VariableSizeCollectives,
                                                bind_dp_dispatch, forward_token_counts)


class CpuCommunicator:
    """vLLM's CPU communicator by name: a device group, and the variable-size collectives it
    inherits from vLLM's base communicator, which raise."""

    def __init__(self) -> None:
        self.device_group = None

    def all_gatherv(self, input_, dim: int = 0, sizes=None):
        raise NotImplementedError

    def reduce_scatterv(self, input_, dim: int = -1, sizes=None):
        raise NotImplementedError


class CudaCommunicator(CpuCommunicator):
    """Any other communicator: refused whatever it holds."""


def coordinator(communicator=None, name: str = "dp-test"):
    """vLLM's ``GroupCoordinator`` as the binding reads it: one rank, so no process group."""
    return SimpleNamespace(device_communicator=communicator or CpuCommunicator(), unique_name=name,
                           rank_in_group=0, world_size=1)


class Counts:
    """The ranks' token counts in the step under way (vLLM's forward context in a worker)."""

    def __init__(self, counts: list[int]) -> None:
        self.counts = counts

    def __call__(self) -> list[int]:
        return self.counts


@pytest.fixture
def bound():
    group = coordinator()
    collectives = VariableSizeCollectives(group, "vllm:dp-test", token_counts=Counts([3]))
    yield group.device_communicator, collectives
    collectives.unbind()


def test_a_list_gathers_to_a_list_and_a_tensor_to_a_tensor(bound):
    communicator, _ = bound
    hidden, ids = torch.randn(3, 4), torch.arange(6, dtype=torch.int32).view(3, 2)
    gathered = communicator.all_gatherv([hidden, ids], dim=0, sizes=[3])
    assert isinstance(gathered, list) and len(gathered) == 2
    assert torch.equal(gathered[0], hidden) and torch.equal(gathered[1], ids)
    one = communicator.all_gatherv(hidden, 0, [3])
    assert isinstance(one, torch.Tensor) and torch.equal(one, hidden)
    assert torch.equal(communicator.all_gatherv(hidden), hidden)  # no sizes: every rank holds as many rows
    own = communicator.reduce_scatterv(hidden, dim=0, sizes=[3])
    assert isinstance(own, torch.Tensor) and torch.equal(own, hidden)
    assert torch.equal(communicator.reduce_scatterv(hidden, 0), hidden)


def test_a_dim_other_than_the_token_rows_is_refused_by_name(bound):
    communicator, _ = bound
    x = torch.ones(3, 4)
    with pytest.raises(DpDispatchError, match="all_gatherv along dim 1"):
        communicator.all_gatherv([x], dim=1, sizes=[3])
    with pytest.raises(DpDispatchError, match="reduce_scatterv along dim -1"):
        communicator.reduce_scatterv(x, sizes=[3])  # upstream's default dim: the last
    with pytest.raises(DpDispatchError, match="reduce_scatterv along dim 1"):
        communicator.reduce_scatterv(x, dim=1, sizes=[3])


def test_counts_the_op_refuses_reach_the_caller(bound):
    communicator, collectives = bound
    collectives.slot.token_counts.counts = [3, 3]
    with pytest.raises(RuntimeError, match="must name each of its 1 members"):
        communicator.all_gatherv([torch.ones(3, 4)], dim=0, sizes=[3])


def test_a_combine_returns_the_rows_dispatched_before_it_and_never_reads_upstreams_sizes(bound):
    communicator, collectives = bound
    hidden = torch.randn(3, 4)
    with pytest.raises(DpDispatchError, match="a combine before any dispatch"):
        communicator.reduce_scatterv(hidden, 0, [3])
    communicator.all_gatherv(hidden, 0, sizes=[99])  # upstream's list, not read
    assert collectives.dispatched_rows == 3
    assert torch.equal(communicator.reduce_scatterv(hidden, 0, sizes=[99]), hidden)


def test_outside_a_vllm_forward_there_are_no_counts_and_dispatch_says_so():
    pytest.importorskip("vllm")
    with pytest.raises(DpDispatchError, match="outside a vLLM forward with DP metadata"):
        forward_token_counts()


class Manager:
    """vLLM's all-gather / reduce-scatter manager as the binding reads it: its own sizes."""

    def _get_sizes(self, num_local_tokens, comm_group):
        return [num_local_tokens, 7]


class Runner:
    """A MoE runner: upstream reads the counts into the graph through this context."""

    def _sequence_parallel_context(self):
        raise AssertionError("upstream's context ran")


def test_the_manager_and_the_runners_read_no_counts_while_bound_and_their_own_after():
    group, manager, runners = coordinator(name="dp-counts"), Manager(), [Runner(), Runner()]
    collectives = VariableSizeCollectives(group, "vllm:dp-counts", token_counts=Counts([3]), manager=manager,
                                          moe_runners=runners)
    other = coordinator(name="ep")
    assert manager._get_sizes(3, group) == [3]  # one per member, the rank's own rows: upstream's check holds
    assert manager._get_sizes(3, other) == [3, 7]  # another group: upstream's
    for runner in runners:
        with runner._sequence_parallel_context():  # entered without reading a count
            pass
    collectives.unbind()
    assert not patches.installed(SIZES_HOOK, on=manager) and manager._get_sizes(3, group) == [3, 7]
    assert not any(patches.installed(CONTEXT_HOOK, on=runner) for runner in runners)
    with pytest.raises(AssertionError, match="upstream's context ran"):
        runners[0]._sequence_parallel_context()


def test_a_communicator_other_than_the_cpu_one_is_refused_by_name():
    group = coordinator(CudaCommunicator(), name="dp-cuda")
    with pytest.raises(DpDispatchError, match="group dp-cuda: .*CpuCommunicator, this group has CudaCommunicator"):
        VariableSizeCollectives(group, "vllm:dp-cuda")
    assert "all_gatherv" not in vars(group.device_communicator)
    with pytest.raises(KeyError):
        EP_GROUPS.resolve("vllm:dp-cuda")


def test_binding_twice_is_refused(bound):
    communicator, collectives = bound
    again = SimpleNamespace(device_communicator=communicator, unique_name="dp-test", rank_in_group=0, world_size=1)
    with pytest.raises(DpDispatchError, match="group dp-test: its variable-size collectives are already bound"):
        VariableSizeCollectives(again, "vllm:dp-test-again")
    with pytest.raises(KeyError):
        EP_GROUPS.resolve("vllm:dp-test-again")  # nothing registered by the refused binding
    assert communicator.all_gatherv.__self__ is collectives  # the first binding serves on


def test_unbinding_restores_the_communicator_and_frees_the_name():
    group = coordinator()
    communicator = group.device_communicator
    collectives = VariableSizeCollectives(group, "vllm:dp-unbind", token_counts=Counts([1]))
    assert EP_GROUPS.resolve("vllm:dp-unbind") is collectives.slot
    assert {"all_gatherv", "reduce_scatterv"} <= set(vars(communicator))
    collectives.unbind()
    assert "all_gatherv" not in vars(communicator) and "reduce_scatterv" not in vars(communicator)
    with pytest.raises(NotImplementedError):  # the class's own is what is left
        communicator.all_gatherv(torch.zeros(1))
    with pytest.raises(KeyError, match="no live EP group named 'vllm:dp-unbind'"):
        EP_GROUPS.resolve("vllm:dp-unbind")
    VariableSizeCollectives(group, "vllm:dp-unbind", token_counts=Counts([1])).unbind()  # and it can be bound again


def test_a_compiled_dispatch_holds_no_count_and_serves_others_without_recompiling(bound):
    """As vLLM's layer calls it: the traced code hands the hooks a list, which no graph keeps."""
    communicator, collectives = bound

    def dispatch(hidden, ids):
        gathered_hidden, gathered_ids = communicator.all_gatherv([hidden, ids], dim=0, sizes=[hidden.shape[0]])
        assert gathered_hidden.shape[0] == gathered_ids.shape[0]
        return communicator.reduce_scatterv(gathered_hidden * 2, dim=0, sizes=[hidden.shape[0]]), gathered_ids

    compiled = torch.compile(dispatch, backend="aot_eager", dynamic=True, fullgraph=True)
    hidden, ids = torch.randn(3, 4), torch.arange(6, dtype=torch.int32).view(3, 2)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    combined, gathered_ids = compiled(hidden, ids)
    assert torch.equal(combined, hidden * 2) and torch.equal(gathered_ids, ids)
    collectives.slot.token_counts.counts = [2]
    combined, gathered_ids = compiled(hidden[:2], ids[:2])
    assert torch.equal(combined, hidden[:2] * 2) and torch.equal(gathered_ids, ids[:2])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1


def test_alone_the_slot_keeps_its_rank_and_size_and_names_no_group():
    """vLLM's new engine compiling before it joins (``elastic_follow.warm_alone``)."""
    group = coordinator(name="dp-alone")
    group.device_communicator.device_group = pg = object()
    group.rank_in_group, group.world_size = 2, 3
    collectives = VariableSizeCollectives(group, "vllm:dp-alone", token_counts=Counts([1, 1, 1]))
    try:
        slot = collectives.slot
        assert slot.current() == (pg, 2, 3)
        with pytest.raises(ValueError, match="boom"), slot.alone():
            assert slot.current() == (None, 2, 3)
            with pytest.raises(DpDispatchError, match="already runs alone"), slot.alone():
                pass
            raise ValueError("boom")
        assert slot.current() == (pg, 2, 3)  # together again, whatever the warm-up raised
    finally:
        collectives.unbind()


def test_one_dp_rank_binds_nothing_and_never_reads_vllms_distributed_state(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", None)  # importing it would raise
    assert bind_dp_dispatch(SimpleNamespace(data_parallel_size=1)) is None
