"""bench_vllm_eplb.py's pieces that need no engine: the skewed checkpoint, upstream's balancedness
lines, the summary and its predicted gain, the argument checks (the engine arms run in `make bench`)."""

from __future__ import annotations

import pytest
import torch

from tests.benchmarks.scripts import load_benchmark

pytest.importorskip("transformers")
bench = load_benchmark("bench_vllm_eplb")


def test_the_skewed_checkpoint_routes_about_half_the_pairs_to_the_hot_experts(tmp_path):
    from safetensors.torch import load_file

    bench.write_skewed_checkpoint(tmp_path, hidden=256, intermediate=64, layers=1, experts=8, hot=[4, 5], bias=0.15)
    tensors = load_file(next(tmp_path.glob("*.safetensors")))
    x = tensors["model.embed_tokens.weight"]  # [V, H]: what layer 0's router sees, up to its norm
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))
    top2 = (x @ tensors["model.layers.0.mlp.gate.weight"].T).topk(2).indices  # [V, 2]
    counts = torch.bincount(top2.flatten(), minlength=8)
    hot_share = float(counts[[4, 5]].sum() / counts.sum())
    assert hot_share > 0.4 and counts[[4, 5]].min() > counts[[0, 1, 2, 3, 6, 7]].max()


def test_balancedness_is_read_from_upstreams_lines_in_the_timed_phase_only():
    line = ("(Worker_TP0_EP0 pid=1) INFO [eplb_state.py:634] EPLB step: 7 for model m: avg_tokens={}, "
            "max_tokens={}, balancedness=0.1, steps until the next rearrangement: 5")
    output = "\n".join([line.format("1.00", 10), bench.MEASURE_START, line.format("30.00", 40),
                        line.format("6.00", 12), bench.MEASURE_END, line.format("1.00", 100)])
    assert bench.arm_balancedness(output) == round(36 / 52, 4)  # a step weighs as its load does
    assert bench.arm_balancedness("no such line") is None


def arm(name: str, tokens_per_s: float, balancedness: float, share: float) -> dict:
    return {"arm": name, "tokens_per_s": tokens_per_s, "balancedness": balancedness, "expert_share": share,
            "logical_load": [10, 10, 0, 0, 30, 30, 10, 10]}


def test_the_summary_predicts_the_gain_from_balancedness_and_the_expert_share():
    runs = [arm("static", 100.0, 0.6, 0.8), arm("rebalanced", 130.0, 0.95, 0.6),
            arm("static", 102.0, 0.61, 0.7), arm("rebalanced", 128.0, 0.94, 0.6),
            arm("static", 90.0, 0.62, 0.9), arm("rebalanced", 140.0, 0.96, 0.6)]
    summary = bench.summarize(runs, [4, 5])  # medians over the rounds
    predicted = 1 / (1 - 0.8 + 0.8 * 0.61 / 0.95)  # the slower rank's expert time scaled by the balancedness
    assert summary["predicted_gain"] == round(predicted, 3)
    assert summary["rebalanced_over_static"] == round(130 / 100, 3)
    assert summary["aa_ratio"] == round(102 / 100, 3) and summary["rebalanced_aa_ratio"] == round(128 / 130, 3)
    assert summary["static_spread"] == round(102 / 90, 3)
    assert summary["share_of_predicted_gain"] == round((130 / 100 - 1) / (predicted - 1), 3)
    assert summary["hot_share_of_pairs"] == 0.6


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
