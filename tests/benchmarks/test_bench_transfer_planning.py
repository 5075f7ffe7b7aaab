"""bench_transfer_planning's parts: both plans are upstream's move_to_buffer, compared call by call."""

import numpy as np
import pytest

from tests.benchmarks.scripts import load_benchmark

bench_transfer_planning = load_benchmark("bench_transfer_planning")


def test_placement_pairs_chain_valid_placements():
    pairs = bench_transfer_planning.placement_pairs(6, 3, count=4, seed=1)
    assert len(pairs) == 4
    for (_, new), (old, _) in zip(pairs, pairs[1:]):
        assert np.array_equal(new, old)  # a rearrangement starts where the last one ended
    for old, new in pairs:
        assert old.shape == new.shape == (9,) and set(old.tolist()) == set(range(6)) == set(new.tolist())


def test_both_plans_post_the_same_transfers_and_are_timed():
    rebalance_execute = pytest.importorskip("vllm.distributed.eplb.rebalance_execute")
    result = bench_transfer_planning.bench_shape(6, 2, ranks=2, rounds=5)
    # one warm-up plan plus five timed ones, each compared call by call (it raises otherwise)
    assert result["plans_compared_identical"] == 6
    assert result["posted_per_layer_p50"] > 0  # rank 0 really sends to and receives from rank 1
    assert result["plan_upstream_p50_ms"] > 0 and result["plan_adapter_p50_ms"] > 0
    assert rebalance_execute.get_ep_ranks_with_experts_batch.__module__ == rebalance_execute.__name__  # uninstalled


def test_a_different_plan_is_caught(monkeypatch):
    pytest.importorskip("vllm.distributed.eplb.rebalance_execute")
    from eplb_graph.upstream import capability as upstream_compat
    from eplb_graph.upstream.transfer_peers import ranks_with_experts

    def no_receivers(expert_ids, num_local_experts, old_indices, new_indices):
        send, recv = ranks_with_experts(expert_ids, num_local_experts, old_indices, new_indices)
        return send, {expert: [] for expert in recv}

    monkeypatch.setattr(upstream_compat, "ranks_with_experts", no_receivers)
    with pytest.raises(AssertionError, match="the adapter planned a different transfer"):
        bench_transfer_planning.bench_shape(6, 2, ranks=2, rounds=2)
