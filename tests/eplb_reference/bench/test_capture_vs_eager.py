"""`eplb-graph bench`: eager / compiled / graph x EPLB off / on_idle / on_rearranging, side by side."""

import json

import pytest

from eplb_reference.bench.breakdown import PARTS, PHASES
from eplb_reference.cli import main


pytestmark = pytest.mark.launches  # rank processes or an engine: left out by make test-fast


def test_bench_reports_every_mode_and_setting(capsys, tmp_path):
    assert main(["bench", "--json", "--steps", "40", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # stdout holds the JSON alone; progress goes to stderr
    for mode in ("eager", "compiled"):
        for stage in ("off, on_idle and the A/A twin, 40 steps each", "on_rearranging, a rearrangement every 10 steps",
                      "done in"):
            assert f"bench {mode}: {stage}" in captured.err
    settings = {(r["mode"], r["eplb"]) for r in report["results"]}
    assert settings == {(m, e) for m in ("eager", "compiled") for e in ("off", "on_idle", "on_rearranging")}
    assert len(report["intra_op_threads"]) == 2 and min(report["intra_op_threads"]) >= 1  # what the ranks ran
    for result in report["results"]:
        for key in ("p50_ms", "p99_ms", "tokens_per_s", "recompiles", "recaptures"):
            assert key in result
        assert result["p99_ms"] >= result["p50_ms"] > 0
    for mode in ("eager", "compiled"):
        ratios = report["ratios"][mode]
        assert set(ratios) >= {"on_idle_over_off", "rearranging_p99_over_steady_p50"}
        for interval in ("on_idle_over_off_ci95", "off_twin_over_off_ci95"):  # the A/A yardstick beside it
            low, high = ratios[interval]
            assert 0 < low <= high
        rearranging = next(r for r in report["results"] if r["mode"] == mode and r["eplb"] == "on_rearranging")
        # upstream's main-thread EPLB work (rearrange, commits) is part of a rearranging step, never more
        assert 0 < ratios["rearranging_eplb_host_p50_ms"] <= ratios["rearranging_eplb_host_p99_ms"] <= rearranging["p99_ms"]
        assert rearranging["recaptures"] is None  # nothing is captured on the host
        assert ratios["rearranging_decode_steps"] > 0 and ratios["steady_decode_steps"] > 0
        lengths = ratios["steps_per_rearrangement"]  # every rank's finished rearrangements, one layer per step
        assert lengths["rearrangements"] >= 2 and 1 <= lengths["mean"] <= lengths["max"]
        # the floor the rearranging ratio is read against: the steady steps' own tail
        assert ratios["steady_p99_over_steady_p50"] >= 1 and ratios["rearranging_p50_over_steady_p50"] > 0
        assert ratios["rearranging_p99_over_steady_p50"] >= ratios["rearranging_p50_over_steady_p50"]
        breakdown = ratios["step_breakdown"]  # where the time goes: every rank's probed decode steps
        assert breakdown["rearranging"]["steps"] == ratios["rearranging_decode_steps"]
        assert breakdown["steady"]["steps"] == ratios["steady_decode_steps"]
        for summary in (breakdown["rearranging"], breakdown["steady"], *(r["rearranging"] for r in breakdown["per_rank"])):
            assert set(summary) == {"steps", *PHASES}
            assert sum(summary[part]["mean"] for part in PARTS) == pytest.approx(summary["step_ms"]["mean"], abs=0.01)
            assert 0 <= summary["eplb_ours_ms"]["p50"] and summary["eplb_upstream_ms"]["p50"] <= summary["step_ms"]["p99"]
        assert breakdown["rearranging"]["step_ms"]["p50"] == rearranging["p50_ms"]  # the same steps
        assert breakdown["rearranging"]["worker_cpu_ms"]["p99"] > 0  # the worker moved experts in those steps
        assert [r["rank"] for r in breakdown["per_rank"]] == [0, 1]
    assert "eplb_reference.runtime.step_probes" in report["step_breakdown_note"]
    assert (tmp_path / "bench.json").exists() and (tmp_path / "bench.png").exists()


def test_bench_with_back_to_back_rearrangements_reports_no_steady_ratio(capsys, tmp_path):
    """--interval 1: every step is inside a rearrangement, so there is no steady p50 to divide by."""
    assert main(["bench", "--json", "--mode", "eager", "--ranks", "1", "--steps", "20", "--interval", "1",
                 "--out", str(tmp_path)]) == 0
    ratios = json.loads(capsys.readouterr().out)["ratios"]["eager"]
    assert ratios["steady_decode_steps"] == 0 and ratios["rearranging_decode_steps"] > 0
    assert ratios["rearranging_p99_over_steady_p50"] is None and ratios["steady_p50_ms"] is None
    assert ratios["steady_p99_over_steady_p50"] is None and ratios["rearranging_p50_over_steady_p50"] is None
