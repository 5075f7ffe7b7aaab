"""A bench report as text: each ratio beside its target and its A/A yardstick."""




def test_bench_table_shows_each_ratio_beside_its_target_and_yardstick():
    from eplb_reference.bench.table import format_table

    entry = {"p50_ms": 4.0, "p99_ms": 9.0, "tokens_per_s": 8000.0, "compile_or_capture_s": 2.5, "recompiles": 0,
             "recaptures": None}
    ratios = {"on_idle_over_off": 1.041, "on_idle_over_off_ci95": [0.97, 1.107], "off_twin_over_off": 0.937,
              "off_twin_over_off_ci95": [0.868, 1.018], "rearranging_p99_over_steady_p50": 4.493,
              "steady_p99_over_steady_p50": 3.442, "rearranging_p50_over_steady_p50": None}
    report = {"results": [{"mode": "compiled", "eplb": "off", **entry}],
              "ratios": {"eager": dict(ratios, on_idle_over_off=1.2), "compiled": ratios,
                         "graph_speedup_over_eager_decode": 2.9},
              "targets": {"on_idle_over_off": 1.05, "rearranging_p99_over_steady_p50": 1.15}}
    lines = format_table(report).splitlines()
    row = {line.split("  ")[0]: line for line in lines}
    assert "1.200 [0.970, 1.107]" in row["on_idle / off (p50) [95 %]"]
    assert row["on_idle / off (p50) [95 %]"].endswith("1.041 [0.970, 1.107]  <= 1.05 (missed, met)")
    assert row["off_twin / off (A/A: nothing differs)"].endswith("0.937 [0.868, 1.018]")
    assert row["rearranging p99 / steady p50"].endswith("4.493  <= 1.15 (missed, missed)")
    assert row["rearranging p50 / steady p50"].endswith("n/a")
    assert lines[-1].startswith("graph speedup over eager") and lines[-1].endswith("2.900")


def test_bench_table_ends_with_the_step_breakdown_where_the_bench_probed_its_steps():
    from eplb_reference.bench.breakdown import PHASES
    from eplb_reference.bench.table import format_table

    phase = {"p50": 1.0, "p99": 2.0, "mean": 1.2}
    summary = {"steps": 4, **{name: phase for name in PHASES}}
    report = {"results": [], "ratios": {"compiled": {"step_breakdown": {"rearranging": summary, "steady": summary}}}}
    lines = format_table(report).splitlines()
    assert any(line.startswith("step breakdown, p50 (p99) ms") for line in lines)
    # p50 (p99) in rearranging and steady steps, then what a rearranging step adds (mean - mean)
    assert any(line.startswith("worker thread CPU") and line.split()[-5:] == ["1.00", "(2.00)", "1.00", "(2.00)", "+0.00"]
               for line in lines)
