import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_graph.upstream.transfer_peers import ranks_with_experts


def test_senders_hold_the_expert_now_and_receivers_gain_it():
    # 3 ranks x 2 slots; expert 1 is on ranks 0 and 2 now, on 1 and 2 after; expert 3 is new
    old = np.array([1, 0, 0, 2, 1, 2])
    new = np.array([0, 3, 1, 2, 1, 3])
    send, recv = ranks_with_experts(np.array([3, 1, 1, 7]), 2, old, new)
    assert send == {1: [0, 2], 3: [], 7: []}
    assert recv == {1: [1], 3: [0, 2], 7: []}  # rank 2 keeps its copy of 1: it receives nothing
    assert all(type(rank) is int for ranks in (*send.values(), *recv.values()) for rank in ranks)
    assert all(type(expert) is int for expert in (*send, *recv))
    assert ranks_with_experts(np.array([], dtype=np.int64), 2, old, new) == ({}, {})


@st.composite
def transfers(draw):
    """A layer's transfer as move_to_buffer asks about it: two placements over ranks x slots
    (-1 for empty slots), and a query that may repeat ids or name one held nowhere."""
    num_logical = draw(st.integers(1, 10))
    num_ranks = draw(st.integers(1, 5))
    num_local = draw(st.integers(1, 5))
    slot_ids = st.integers(-1, num_logical - 1)
    placement = st.lists(slot_ids, min_size=num_ranks * num_local, max_size=num_ranks * num_local)
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    old, new = (np.array(draw(placement), dtype=dtype) for _ in range(2))
    query = np.array(draw(st.lists(st.integers(-1, num_logical), max_size=8)), dtype=np.int64)
    return query, num_local, old, new


@settings(max_examples=200, deadline=None)
@given(transfers())
def test_equals_upstream_get_ep_ranks_with_experts_batch(case):
    """What lets the capability adaptations put ranks_with_experts in upstream's place."""
    rebalance_execute = pytest.importorskip("vllm.distributed.eplb.rebalance_execute")
    upstream = rebalance_execute.get_ep_ranks_with_experts_batch
    assert upstream.__module__ == "vllm.distributed.eplb.rebalance_execute"  # upstream's own, not our patch
    assert ranks_with_experts(*case) == upstream(*case)
