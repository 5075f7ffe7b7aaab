"""bench_kept_placement.py's pieces that need no engine: windows of upstream's balancedness lines,
the summary, the argument checks (the engine arms run in `make bench`)."""

from __future__ import annotations

import pytest

from tests.benchmarks.scripts import load_benchmark

bench = load_benchmark("bench_kept_placement")

LINE = ("(Worker_TP0_EP0 pid=1) INFO [eplb_state.py:634] EPLB step: 7 for model m: avg_tokens={}, max_tokens={}, "
        "balancedness=0.1, steps until the next rearrangement: 5")


def test_windows_are_consecutive_loaded_steps_after_the_marker():
    steps = [("1.00", 10), ("30.00", 40), ("0.00", 0), ("6.00", 12), ("10.00", 10), ("3.00", 4), ("5.00", 9)]
    output = "\n".join([LINE.format("9.00", 10), bench.MEASURE_START, *(LINE.format(*step) for step in steps)])
    # a step that carried no load (vLLM's dummy steps) is no step of a window; a partial window is dropped
    assert bench.window_balancedness(output, 2) == [round(31 / 50, 4), round(16 / 22, 4), round(8 / 13, 4)]


def run(arm: str, round_: int, windows: list[float]) -> dict:
    return {"arm": arm, "round": round_, "windows": windows, "first_windows": windows[:2]}


def test_the_summary_compares_first_windows_with_the_cold_runs_converged_balance():
    runs = [run("cold", 0, [0.6, 0.8, 0.9, 0.96, 0.98]), run("restored", 0, [0.97, 0.97, 0.96]),
            run("cold", 1, [0.62, 0.85, 0.95, 0.95, 0.97]), run("restored", 1, [0.95, 0.98, 0.97])]
    summary = bench.summarize(runs, 2)
    assert summary["first_window_cold"] == 0.61 and summary["first_window_restored"] == 0.96
    assert summary["converged_cold"] == round((0.97 + 0.96) / 2, 4)  # the median of each cold run's last two
    assert summary["restored_first_over_converged"] == round(0.96 / 0.965, 3)
    assert summary["first_window_spread"] == {"cold": 0.02, "restored": 0.02}
    assert summary["mean_first_windows"] == {"cold": round((0.7 + 0.735) / 2, 4), "restored": round((0.97 + 0.965) / 2, 4)}


def test_one_round_is_refused_it_has_no_spread(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path / "r.json"), "--rounds", "1"])
    assert "--rounds must be >= 2 (the spread of the first windows), got 1" in capsys.readouterr().err
