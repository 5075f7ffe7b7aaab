"""bench_policy_stall's parts: the three modes are measured and the two policy paths agree."""

import pytest

from tests.benchmarks.scripts import load_benchmark

bench_policy_stall = load_benchmark("bench_policy_stall")


def test_a_small_run_measures_every_mode_and_compares_placements():
    pytest.importorskip("vllm.distributed.eplb.policy.default")
    result = bench_policy_stall.bench_shape("default", rounds=2, steps=3, ops=100)  # ~0.3 ms steps: rounding stays small
    assert set(result["step_p50_ms"]) == set(bench_policy_stall.MODES)
    assert all(result["policy_calls"][mode] >= 2 for mode in ("in_thread", "helper_process"))  # one per block at least
    assert result["placements_equal"] is True
    for mode in bench_policy_stall.MODES:  # each mode's p99 is read against the alone p50, the baseline
        # the ratio is reported to 2 decimals (abs. error up to 0.005, which a small ratio on a loaded
        # machine makes more than 2 %), the times to 3
        assert result["step_p99_over_alone_p50"][mode] == pytest.approx(
            result["step_p99_ms"][mode] / result["step_p50_ms"]["alone"], rel=0.02, abs=0.0051)


def test_policy_loop_reports_an_error_from_its_thread():
    def broken():
        raise RuntimeError("policy exploded")

    with pytest.raises(RuntimeError, match="policy exploded"):
        with bench_policy_stall.PolicyLoop(broken):
            pass
