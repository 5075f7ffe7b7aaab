"""bench_policy_stall's parts: the three modes are measured and the two policy paths agree."""

import pytest

from tests.benchmarks.scripts import load_benchmark

bench_policy_stall = load_benchmark("bench_policy_stall")


def test_a_small_run_measures_every_mode_and_compares_placements():
    pytest.importorskip("vllm.distributed.eplb.policy.default")
    result = bench_policy_stall.bench_shape("default", rounds=2, steps=3, ops=2)
    assert set(result["step_p50_ms"]) == set(bench_policy_stall.MODES)
    assert all(result["policy_calls"][mode] >= 2 for mode in ("in_thread", "helper_process"))  # one per block at least
    assert result["placements_equal"] is True
    assert result["step_p99_over_alone_p50"]["alone"] >= 1.0  # p99 of a set over its own median


def test_policy_loop_reports_an_error_from_its_thread():
    def broken():
        raise RuntimeError("policy exploded")

    with pytest.raises(RuntimeError, match="policy exploded"):
        with bench_policy_stall.PolicyLoop(broken):
            pass
