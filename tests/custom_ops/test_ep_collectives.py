"""``custom_ops/ep_collectives.py``: EP collectives that resolve their group by name, shaped by its maximum.

One process: a slot with no process group (a group of one) shows the shapes, the padding
and the masking; the multi-process behaviour (a graph following a 2 -> 4 -> 2 switch) is in
``tests/runtime/elastic/test_scripted.py``.
"""

import pytest
import torch

from eplb_graph.custom_ops import EP_GROUPS


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
