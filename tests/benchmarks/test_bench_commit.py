"""bench_commit's parts: the commit it times under the adapter is upstream's, with the same result."""

import pytest
import torch

from tests.benchmarks.scripts import load_benchmark

bench_commit = load_benchmark("bench_commit")


def test_random_placements_are_valid_and_reproducible():
    first = bench_commit.random_placements(6, 3, count=4, seed=1)
    assert [p.tolist() for p in first] == [p.tolist() for p in bench_commit.random_placements(6, 3, count=4, seed=1)]
    for placement in first:
        assert placement.shape == (9,)
        assert set(placement.tolist()) == set(range(6))  # every expert placed at least once


def test_both_commits_leave_the_same_state_and_are_timed():
    pytest.importorskip("vllm.distributed.eplb.eplb_state")
    result = bench_commit.bench_shape(6, 3, rounds=5)
    # one warm-up commit plus five timed ones, each compared field by field (it raises otherwise)
    assert result["commits_compared_identical"] == 6
    assert result["commit_upstream_p50_ms"] > 0 and result["commit_adapter_p50_ms"] > 0
    assert result["commit_upstream_over_adapter"] == pytest.approx(
        result["commit_upstream_p50_ms"] / result["commit_adapter_p50_ms"], rel=0.05)


def test_the_adapter_is_uninstalled_after_timing():
    eplb_state = pytest.importorskip("vllm.distributed.eplb.eplb_state")
    bench_commit.bench_shape(4, 0, rounds=2)
    assert eplb_state.compute_logical_maps.__module__ == "vllm.distributed.eplb.eplb_state"
    assert torch.equal(eplb_state.compute_logical_maps(torch.tensor([1, 0]), 2)[0], torch.tensor([[1], [0]]))
