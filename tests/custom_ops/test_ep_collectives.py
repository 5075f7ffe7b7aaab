"""``custom_ops/ep_collectives.py``: EP collectives that resolve their group by name, shaped by its maximum.

One process: a slot with no process group (a group of one) shows the shapes, the padding
and the masking; the multi-process behaviour (a graph following a 2 -> 4 -> 2 switch) is in
``tests/eplb_reference/elastic/test_scripted.py``. The variable-size ops (``ep_all_gatherv`` /
``ep_reduce_scatterv``) run once over two gloo processes with unequal token counts.
"""

import pytest
import torch
import torch.distributed as dist

from eplb_graph.custom_ops import EP_GROUPS
from eplb_reference.runtime.launch import run_ranks


class Slot:
    """A group slot as ``ElasticEpGroup`` is one: no process group, this process rank ``rank`` of ``size``."""

    def __init__(self, max_size: int, rank: int = 0, size: int = 1) -> None:
        self.max_size, self.rank, self.size = max_size, rank, size

    def current(self):
        return None, self.rank, self.size


@pytest.fixture
def slot():
    slot = Slot(max_size=4)
    EP_GROUPS.register("test-ep", slot)
    yield slot
    EP_GROUPS.unregister("test-ep")


def test_the_gather_is_shaped_by_the_maximum_with_the_absent_ranks_rows_zero(slot):
    x = torch.arange(6, dtype=torch.float32).view(3, 2) + 1  # [T=3, C=2]
    out = torch.ops.eplb_graph.ep_all_gather(x, "test-ep")
    assert out.shape == (12, 2)
    assert torch.equal(out[:3], x) and not out[3:].any()


def test_local_slots_keep_this_ranks_experts_and_drop_the_padding_rows(slot):
    slot.rank, slot.size = 0, 1
    ids = torch.tensor([[0, 5], [2, 3], [1, 0], [4, 2]])  # [max_size * T = 4, K], T = 1: rows 1-3 are padding
    local = torch.ops.eplb_graph.ep_local_slots(ids, "test-ep", 3)
    assert local.tolist() == [[0, -1], [-1, -1], [-1, -1], [-1, -1]]


def test_local_slots_follow_the_rank_the_slot_holds_now(slot):
    slot.rank, slot.size = 1, 2
    ids = torch.tensor([[0, 5], [2, 3], [1, 4], [4, 2]])  # T = 1: rows 0-1 are the two members'
    assert torch.ops.eplb_graph.ep_local_slots(ids, "test-ep", 3).tolist() == [[-1, 2], [-1, 0], [-1, -1], [-1, -1]]


def test_the_sum_returns_this_ranks_rows(slot):
    parts = torch.arange(8, dtype=torch.float32).view(8, 1)  # [max_size * T = 8, 1], T = 2
    assert torch.ops.eplb_graph.ep_sum_own_rows(parts, "test-ep").flatten().tolist() == [0.0, 1.0]


def test_a_compiled_graph_follows_the_slot_without_recompiling(slot):
    def step(x, ids):
        gathered = torch.ops.eplb_graph.ep_all_gather(x, "test-ep")  # [4T, C]
        local = torch.ops.eplb_graph.ep_local_slots(ids, "test-ep", 2)  # [4T, K]
        return torch.ops.eplb_graph.ep_sum_own_rows(gathered * (local >= 0).any(1, keepdim=True), "test-ep")

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    x, ids = torch.ones(2, 3), torch.tensor([[0], [1], [2], [3], [0], [1], [2], [3]])
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert torch.equal(compiled(x, ids), torch.ones(2, 3))  # rank 0 hosts slots 0-1: rows 0 and 1 are mine
    slot.rank, slot.size = 1, 2  # a resize between two calls: rows 2-3 are this rank's now
    assert torch.equal(compiled(x, ids), torch.zeros(2, 3))  # their rows came from an absent rank: zero
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1  # compiled once


def test_a_graph_naming_no_live_group_fails_when_it_is_built():
    with pytest.raises(Exception, match="no live EP group named 'nobody'"):
        torch.compile(lambda x: torch.ops.eplb_graph.ep_all_gather(x, "nobody"), backend="aot_eager",
                      fullgraph=True)(torch.ones(1, 1))


def test_a_name_is_held_by_one_group(slot):
    with pytest.raises(ValueError, match="already registered to another group"):
        EP_GROUPS.register("test-ep", Slot(max_size=2))


# --- the variable-size ops: vLLM's DP dispatch, ranks holding different token counts -----------

SIZES = [3, 5]  # rows (tokens) per rank: rank 0 is padded to rank 1's 5 on the wire


def rank_tensors(rank: int) -> list[torch.Tensor]:
    """What rank ``rank`` gathers, as vLLM's dispatch does: hidden states, top-k weights, top-k ids."""
    rows = SIZES[rank]
    hidden = torch.arange(rows * 4, dtype=torch.float32).view(rows, 4) + 100 * rank  # [T, C]
    weights = (torch.arange(rows * 2, dtype=torch.float32).view(rows, 2) / 8 + rank).to(torch.bfloat16)  # [T, K]
    ids = torch.arange(rows * 2, dtype=torch.int32).view(rows, 2) + 1000 * rank  # [T, K]
    return [hidden, weights, ids]


def rank_parts(rank: int) -> torch.Tensor:
    """What rank ``rank`` hands the reduce-scatter: [sum(SIZES), C], different on each rank."""
    return torch.arange(sum(SIZES) * 3, dtype=torch.float32).view(sum(SIZES), 3) * (rank + 1)


def dispatch(hidden, ids, group: str):
    """vLLM's DP MoE layer in miniature: gather, compute on every rank's rows, sum back."""
    gathered_hidden, gathered_ids = torch.ops.eplb_graph.ep_all_gatherv([hidden, ids], group)
    assert gathered_hidden.shape[0] == gathered_ids.shape[0]  # decided at trace time
    summed = gathered_hidden * 2 + gathered_ids.sum(1, keepdim=True)
    return torch.ops.eplb_graph.ep_reduce_scatterv(summed, hidden.shape[0], group)


def joining_dispatch(hidden, ids, group: str):
    """``dispatch`` under a code object of its own, so its graphs are compiled apart."""
    return dispatch(hidden, ids, group)


class GroupSlot:
    """A slot over a real process group, whose ranks hold ``counts`` tokens in the step."""

    def __init__(self, pg, rank: int, size: int, counts: list[int]) -> None:
        self.pg, self.rank, self.max_size, self.counts = pg, rank, size, counts

    def current(self):
        return self.pg, self.rank, self.max_size

    def token_counts(self):
        return self.counts


def variable_size_rank(rank, world_size, init_method):
    """One gloo launch for every multi-process check: the gather of three dtypes, the reduce-scatter."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    alone = [dist.new_group([member]) for member in range(world_size)][rank]  # every rank joins each
    slot = GroupSlot(dist.group.WORLD, rank, world_size, SIZES)
    EP_GROUPS.register("test-ep-v", slot)
    try:
        gathered = torch.ops.eplb_graph.ep_all_gatherv(rank_tensors(rank), "test-ep-v")
        own = torch.ops.eplb_graph.ep_reduce_scatterv(rank_parts(rank), SIZES[rank], "test-ep-v")
        # a graph built while the slot holds a group of one serves the group of two (a resize)
        hidden, _, ids = rank_tensors(rank)
        slot.pg, slot.rank, slot.max_size, slot.counts = alone, 0, 1, [SIZES[rank]]
        compiled = torch.compile(dispatch, backend="aot_eager", dynamic=True, fullgraph=True)
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        alone_out = compiled(hidden, ids, "test-ep-v")
        slot.pg, slot.rank, slot.max_size, slot.counts = dist.group.WORLD, rank, world_size, SIZES
        together_out = compiled(hidden, ids, "test-ep-v")
        compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
        # a graph built by a rank alone in the group of two (vLLM's new engine before it joins: no
        # process group, every rank's count its own) serves the group
        slot.pg, slot.counts = None, [SIZES[rank]] * world_size
        joining = torch.compile(joining_dispatch, backend="aot_eager", dynamic=True, fullgraph=True)
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        before_joining_out = joining(hidden, ids, "test-ep-v")
        slot.pg, slot.counts = dist.group.WORLD, SIZES
        joined_out = joining(hidden, ids, "test-ep-v")
        joining_compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
        return ([(str(t.dtype), tuple(t.shape), t.float().tolist()) for t in gathered],
                (str(own.dtype), tuple(own.shape), own.tolist()),
                (alone_out.tolist(), together_out.tolist(), compiles),
                (before_joining_out.tolist(), joined_out.tolist(), joining_compiles))
    finally:
        EP_GROUPS.unregister("test-ep-v")
        dist.destroy_process_group()


@pytest.mark.launches
def test_the_variable_size_ops_over_two_gloo_ranks_with_unequal_token_counts():
    results = run_ranks(variable_size_rank, 2, timeout_s=120)
    # every tensor, of every dtype, gathered to the one length sum(sizes): each rank's rows in rank order
    expected = [torch.cat(parts) for parts in zip(*(rank_tensors(rank) for rank in range(2)))]
    total = sum(rank_parts(rank) for rank in range(2))  # [8, 3]
    everyone = [torch.cat(parts) for parts in zip(*(rank_tensors(rank) for rank in range(2)))]
    gathered_sum = everyone[0] * 2 + everyone[2].sum(1, keepdim=True)  # what dispatch sums on each rank
    for rank, (gathered, own, (alone_out, together_out, compiles), joining) in enumerate(results):
        assert [(dtype, shape) for dtype, shape, _ in gathered] == [
            (str(t.dtype), (sum(SIZES), *t.shape[1:])) for t in expected]
        assert [values for _, _, values in gathered] == [t.float().tolist() for t in expected]
        start = sum(SIZES[:rank])  # the reduce-scatter: this rank's own rows of the ranks' sum
        assert own == ("torch.float32", (SIZES[rank], 3), total[start : start + SIZES[rank]].tolist())
        hidden, _, ids = rank_tensors(rank)
        assert alone_out == (hidden * 2 + ids.sum(1, keepdim=True)).tolist()
        assert together_out == (2 * gathered_sum[start : start + SIZES[rank]]).tolist()  # both ranks' sum
        assert compiles == 1
        assert joining == (alone_out, together_out, 1)


class CountedSlot(Slot):
    """A slot of no process group whose members' token counts the test sets."""

    def __init__(self, counts: list[int], rank: int = 0) -> None:
        super().__init__(max_size=len(counts), rank=rank, size=len(counts))
        self.counts = counts

    def token_counts(self):
        return self.counts


@pytest.fixture
def counted():
    slot = CountedSlot([3])
    EP_GROUPS.register("test-ep-counted", slot)
    yield slot
    EP_GROUPS.unregister("test-ep-counted")


def test_the_variable_size_ops_are_the_identity_for_a_group_of_one(counted):
    hidden, weights, ids = rank_tensors(0)
    gathered = torch.ops.eplb_graph.ep_all_gatherv([hidden, weights, ids], "test-ep-counted")
    assert [t.dtype for t in gathered] == [torch.float32, torch.bfloat16, torch.int32]
    assert all(torch.equal(out, x) and out.data_ptr() != x.data_ptr()  # a copy, never the input itself
               for out, x in zip(gathered, (hidden, weights, ids)))
    own = torch.ops.eplb_graph.ep_reduce_scatterv(hidden, 3, "test-ep-counted")
    assert torch.equal(own, hidden) and own.data_ptr() != hidden.data_ptr()


def test_a_rank_alone_in_a_group_of_several_takes_the_others_rows_as_zeros(counted):
    """No process group while the size stays: vLLM's new engine warming up before it joins."""
    counted.counts, counted.rank, counted.size = [2, 3, 1], 1, 3
    x = torch.arange(6, dtype=torch.float32).view(3, 2) + 1
    (gathered,) = torch.ops.eplb_graph.ep_all_gatherv([x], "test-ep-counted")
    assert torch.equal(gathered, torch.cat([torch.zeros(2, 2), x, torch.zeros(1, 2)]))
    own = torch.ops.eplb_graph.ep_reduce_scatterv(gathered * 2, 3, "test-ep-counted")  # nothing summed in
    assert torch.equal(own, x * 2)


def test_counts_that_do_not_name_every_member_are_refused(counted):
    counted.counts = [3, 3]
    x = torch.ones(3, 2)
    with pytest.raises(RuntimeError, match=r"token counts \[3, 3\] must name each of its 1 members"):
        torch.ops.eplb_graph.ep_all_gatherv([x], "test-ep-counted")
    with pytest.raises(RuntimeError, match=r"token counts \[3, 3\] must name each of its 1 members"):
        torch.ops.eplb_graph.ep_reduce_scatterv(x, 3, "test-ep-counted")


def test_rows_the_counts_do_not_give_this_rank_are_refused(counted):
    counted.counts, counted.rank, counted.size = [3, 4], 1, 2  # checked before any collective
    with pytest.raises(RuntimeError, match=r"rank 1 holds 3 rows, but the step's token counts \[3, 4\] say 4"):
        torch.ops.eplb_graph.ep_all_gatherv([torch.ones(3, 2)], "test-ep-counted")
    counted.counts = [5, 3]
    with pytest.raises(RuntimeError, match=r"rank 1 holds 2 rows, but the step's token counts \[5, 3\] say 3"):
        # every tensor is checked, not the first only
        torch.ops.eplb_graph.ep_all_gatherv([torch.ones(3, 2), torch.ones(2, 2)], "test-ep-counted")
    with pytest.raises(RuntimeError, match=r"reduce_scatterv of 7 rows to 3, but the step's token counts "
                                           r"\[5, 3\] sum to 8 and give rank 1 3"):
        torch.ops.eplb_graph.ep_reduce_scatterv(torch.ones(7, 2), 3, "test-ep-counted")
    with pytest.raises(RuntimeError, match=r"reduce_scatterv of 8 rows to 2, .* give rank 1 3"):
        torch.ops.eplb_graph.ep_reduce_scatterv(torch.ones(8, 2), 2, "test-ep-counted")


def test_a_slot_without_token_counts_is_refused_by_name(slot):
    with pytest.raises(RuntimeError, match="group 'test-ep' keeps no token counts"):
        torch.ops.eplb_graph.ep_all_gatherv([torch.ones(3, 2)], "test-ep")


def test_a_compiled_dispatch_reads_the_counts_when_it_runs(counted):
    """The counts are read when the op runs, never traced: one graph serves other counts, and the
    gathered hidden states and ids share one data-dependent length the graph proved equal when it
    was built. (A graph built for one member serving two: ``variable_size_rank``.)"""
    compiled = torch.compile(dispatch, backend="inductor", dynamic=True, fullgraph=True)
    hidden, _, ids = rank_tensors(0)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert torch.equal(compiled(hidden, ids, "test-ep-counted"), dispatch(hidden, ids, "test-ep-counted"))
    counted.counts = [2]
    assert torch.equal(compiled(hidden[:2], ids[:2], "test-ep-counted"),
                       dispatch(hidden[:2], ids[:2], "test-ep-counted"))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1
