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


class GroupSlot:
    """A fixed slot over a real process group."""

    def __init__(self, pg, rank: int, size: int) -> None:
        self.pg, self.rank, self.max_size = pg, rank, size

    def current(self):
        return self.pg, self.rank, self.max_size


def variable_size_rank(rank, world_size, init_method):
    """One gloo launch for every multi-process check: the gather of three dtypes, the reduce-scatter."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    slot = GroupSlot(dist.group.WORLD, rank, world_size)
    EP_GROUPS.register("test-ep-v", slot)
    try:
        gathered = torch.ops.eplb_graph.ep_all_gatherv(rank_tensors(rank), SIZES, "test-ep-v")
        own = torch.ops.eplb_graph.ep_reduce_scatterv(rank_parts(rank), SIZES, "test-ep-v")
        return ([(str(t.dtype), tuple(t.shape), t.float().tolist()) for t in gathered],
                (str(own.dtype), tuple(own.shape), own.tolist()))
    finally:
        EP_GROUPS.unregister("test-ep-v")
        dist.destroy_process_group()


@pytest.mark.launches
def test_the_variable_size_ops_over_two_gloo_ranks_with_unequal_token_counts():
    results = run_ranks(variable_size_rank, 2, timeout_s=120)
    # every tensor, of every dtype, gathered to the one length sum(sizes): each rank's rows in rank order
    expected = [torch.cat(parts) for parts in zip(*(rank_tensors(rank) for rank in range(2)))]
    total = sum(rank_parts(rank) for rank in range(2))  # [8, 3]
    for rank, (gathered, own) in enumerate(results):
        assert [(dtype, shape) for dtype, shape, _ in gathered] == [
            (str(t.dtype), (sum(SIZES), *t.shape[1:])) for t in expected]
        assert [values for _, _, values in gathered] == [t.float().tolist() for t in expected]
        start = sum(SIZES[:rank])  # the reduce-scatter: this rank's own rows of the ranks' sum
        assert own == ("torch.float32", (SIZES[rank], 3), total[start : start + SIZES[rank]].tolist())


def test_the_variable_size_ops_are_the_identity_for_a_group_of_one(slot):
    hidden, weights, ids = rank_tensors(0)
    gathered = torch.ops.eplb_graph.ep_all_gatherv([hidden, weights, ids], [3], "test-ep")
    assert [t.dtype for t in gathered] == [torch.float32, torch.bfloat16, torch.int32]
    assert all(torch.equal(out, x) and out.data_ptr() != x.data_ptr()  # a copy, never the input itself
               for out, x in zip(gathered, (hidden, weights, ids)))
    own = torch.ops.eplb_graph.ep_reduce_scatterv(hidden, [3], "test-ep")
    assert torch.equal(own, hidden) and own.data_ptr() != hidden.data_ptr()


def test_sizes_that_do_not_name_every_rank_are_refused(slot):
    x = torch.ones(3, 2)
    with pytest.raises(RuntimeError, match=r"sizes \[3, 3\] must name each of the group's 1 ranks"):
        torch.ops.eplb_graph.ep_all_gatherv([x], [3, 3], "test-ep")
    with pytest.raises(RuntimeError, match=r"sizes \[1, 2\] must name each of the group's 1 ranks"):
        torch.ops.eplb_graph.ep_reduce_scatterv(x, [1, 2], "test-ep")


def test_sizes_that_miscount_this_ranks_rows_are_refused(slot):
    slot.rank, slot.size = 1, 2  # checked before any collective: the slot needs no process group
    with pytest.raises(RuntimeError, match=r"rank 1 holds 3 rows, but sizes \[3, 4\] say 4"):
        torch.ops.eplb_graph.ep_all_gatherv([torch.ones(3, 2)], [3, 4], "test-ep")
    with pytest.raises(RuntimeError, match=r"rank 1 holds 2 rows, but sizes \[5, 3\] say 3"):
        # every tensor is checked, not the first only
        torch.ops.eplb_graph.ep_all_gatherv([torch.ones(3, 2), torch.ones(2, 2)], [5, 3], "test-ep")
    with pytest.raises(RuntimeError, match=r"reduce_scatterv of 7 rows, but sizes \[3, 5\] sum to 8"):
        torch.ops.eplb_graph.ep_reduce_scatterv(torch.ones(7, 2), [3, 5], "test-ep")


def test_a_compiled_gather_gives_hidden_states_and_ids_one_row_count(slot, monkeypatch):
    """Token counts read from a tensor are data-dependent: one op gathering both tensors gives them
    the same length sum(sizes), so the graph proves they match without a guard on the data."""
    monkeypatch.setattr(torch._dynamo.config, "capture_scalar_outputs", True)

    def dispatch(hidden, ids, counts):
        sizes = counts.tolist()
        for size in sizes:
            torch._check(size >= 1)  # as dp_dispatch says of vLLM's DP ranks
        gathered_hidden, gathered_ids = torch.ops.eplb_graph.ep_all_gatherv([hidden, ids], sizes, "test-ep")
        assert gathered_hidden.shape[0] == gathered_ids.shape[0]  # decided at trace time
        return gathered_hidden * 2, gathered_ids

    compiled = torch.compile(dispatch, backend="aot_eager", fullgraph=True)
    hidden, _, ids = rank_tensors(0)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    gathered_hidden, gathered_ids = compiled(hidden, ids, torch.tensor([3]))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1
    assert torch.equal(gathered_hidden, hidden * 2) and torch.equal(gathered_ids, ids)
