"""bench_vllm_eplb.py's pieces that need no engine: upstream's balancedness lines, the summary and its
predicted gain, the configurations, the argument checks (the engine arms run in `make bench`; the
checkpoints are test_skewed_router.py's)."""

from __future__ import annotations

import argparse

import pytest

from tests.benchmarks.scripts import load_benchmark

pytest.importorskip("transformers")
bench = load_benchmark("bench_vllm_eplb")


def test_balancedness_is_read_from_upstreams_lines_in_the_timed_phase_only():
    line = ("(Worker_TP0_EP0 pid=1) INFO [eplb_state.py:634] EPLB step: 7 for model m: avg_tokens={}, "
            "max_tokens={}, balancedness=0.1, steps until the next rearrangement: 5")
    output = "\n".join([line.format("1.00", 10), bench.MEASURE_START, line.format("30.00", 40),
                        line.format("6.00", 12), bench.MEASURE_END, line.format("1.00", 100)])
    assert bench.arm_balancedness(output) == round(36 / 52, 4)  # a step weighs as its load does
    assert bench.arm_balancedness("no such line") is None
    idle = "\n".join([bench.MEASURE_START, line.format("0.00", 0), line.format("6.00", 12), bench.MEASURE_END])
    assert bench.timed_loads(idle) == [(6.0, 12.0)]  # a DP wave's idle step is no load


def arm(name: str, tokens_per_s: float, balancedness: float, share: float) -> dict:
    return {"arm": name, "tokens_per_s": tokens_per_s, "balancedness": balancedness, "expert_share": share,
            "logical_load": [10, 10, 0, 0, 30, 30, 10, 10]}


def arguments() -> argparse.Namespace:
    return argparse.Namespace(layout="tp2", experts=8, redundant=4, hot=[4, 5], bias=1.5)


def worst(placement: str = "rank0") -> argparse.Namespace:
    return bench.configured(arguments(), "worst", placement, "bfloat16")


def test_the_summary_predicts_the_gain_and_reads_the_rounds_ratios_not_a_ratio_of_medians():
    runs = [arm("static", 100.0, 0.6, 0.8), arm("rebalanced", 130.0, 0.95, 0.6),
            arm("rebalanced", 128.0, 0.94, 0.6), arm("static", 102.0, 0.61, 0.7),
            arm("static", 90.0, 0.62, 0.9), arm("rebalanced", 100.0, 0.96, 0.6)]
    summary = bench.summarize(runs, worst())
    predicted = 1 / (1 - 0.8 + 0.8 * 0.61 / 0.95)  # the slower rank's expert time scaled by the balancedness
    ratios = [130 / 100, 128 / 102, 100 / 90]  # each round's two arms, whichever ran first
    assert summary["predicted_gain"] == round(predicted, 3)
    assert summary["per_round_ratios"] == [round(r, 3) for r in ratios]
    assert summary["rebalanced_over_static"] == round(128 / 102, 3)  # the median ratio; medians' ratio is 1.28
    assert summary["aa_ratio"] == round(102 / 100, 3) and summary["rebalanced_aa_ratio"] == round(128 / 130, 3)
    share = (128 / 102 - 1) / (predicted - 1)
    assert summary["share_of_predicted_gain"] == round(share, 3)
    assert summary["target_met"] is (share >= 0.8 and (predicted < 1.25 or 128 / 102 >= 1.15))
    assert (summary["config"], summary["placement"], summary["layout"], summary["dtype"]) == ("worst", "rank0", "tp2",
                                                                                             "float32")
    assert summary["hot_experts"] == [4, 5] and summary["hot_share_of_pairs"] == 0.6
    assert summary["load_max_over_mean"] == 2.4 and summary["arms"] == runs


def test_the_mirrored_worst_case_names_the_other_ranks_unreplicated_experts_hot():
    runs = [arm("static", 100.0, 0.6, 0.8), arm("rebalanced", 120.0, 0.9, 0.6)] * 2
    assert bench.summarize(runs, worst("rank1"))["hot_experts"] == [6, 7]


def test_a_gain_below_80_percent_of_the_predicted_one_misses_the_target():
    runs = [arm("static", 100.0, 0.6, 0.9), arm("rebalanced", 105.0, 0.95, 0.6)] * 2
    summary = bench.summarize(runs, worst())
    assert summary["predicted_gain"] > 1.25 and summary["target_met"] is False


def test_the_natural_configuration_takes_its_shape_and_load_and_the_hosts_dtype():
    chosen = bench.configured(arguments(), "natural", "rank1", "bfloat16")
    assert (chosen.hidden, chosen.intermediate, chosen.experts, chosen.top_k) == (2048, 768, 32, 8)
    assert chosen.requests == bench.NATURAL_LOAD["requests"] and chosen.dtype == "bfloat16"
    assert chosen.placement == "rank1" and worst().dtype == "float32"


def test_a_dp2_run_has_no_logical_load_and_reports_none_of_its_figures():
    runs = [{**arm("static", 100.0, 0.6, 0.8), "logical_load": None},
            {**arm("rebalanced", 120.0, 0.9, 0.6), "logical_load": None}] * 2
    summary = bench.summarize(runs, bench.configured(arguments(), "worst", "rank0", "float32", "dp2"))
    assert summary["layout"] == "dp2" and summary["rebalanced_over_static"] == 1.2
    assert (summary["hot_share_of_pairs"], summary["load_max_over_mean"], summary["zipf_exponent"]) == (None,) * 3


def test_one_round_is_refused_it_has_no_aa_pair(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path / "r.json"), "--rounds", "1"])
    assert "--rounds must be >= 2 (the A/A pair), got 1" in capsys.readouterr().err


def test_hot_experts_outside_rank_0s_unreplicated_slots_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--out", str(tmp_path / "r.json"), "--hot", "1", "5"])
    assert stopped.value.code == 2
    assert "--hot [1, 5]: hot experts must sit in rank 0's slots, unreplicated (4..5)" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_where_no_gain_is_predicted_a_loss_misses_the_target():
    """Balanced already: rearranging can only cost (its moves), and the target says so."""
    runs = [arm("static", 100.0, 0.92, 0.9), arm("rebalanced", 90.0, 0.91, 0.9)] * 2
    summary = bench.summarize(runs, worst())
    assert summary["predicted_gain"] < 1 and summary["share_of_predicted_gain"] is None
    assert summary["rebalanced_over_static"] == 0.9 and summary["target_met"] is False
