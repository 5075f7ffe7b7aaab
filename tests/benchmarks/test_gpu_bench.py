"""benchmarks/gpu_bench.py on a machine without CUDA: it says why it cannot run, before any stage."""

import subprocess
import sys

import pytest
import torch

from tests.benchmarks.scripts import BENCHMARKS, load_benchmark

SCRIPT = BENCHMARKS / "gpu_bench.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run")
def test_without_cuda_it_exits_2_naming_the_reason(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "cannot run here: torch.cuda.is_available() is False" in done.stderr
    assert list(tmp_path.iterdir()) == []  # no stage started


def test_without_vllm_the_vllm_free_stages_still_run(tmp_path):
    gpu_bench = load_benchmark("gpu_bench")
    full = {stage.name: stage for stage in gpu_bench.plan(tmp_path, 2, None)}
    assert [name for name, stage in full.items() if stage.skip_why] == []
    assert "tests/eplb_graph/test_runtime.py" in full["cuda_tests"].command
    assert full["run"].command[-6:] == ["--steps", "1100", "--interval", "10", "--out", str(tmp_path / "run")]

    partial = {stage.name: stage for stage in gpu_bench.plan(tmp_path, 1, "no module named vllm")}
    assert {name for name, stage in partial.items() if stage.skip_why} == {"bench", "bench_large", "run"}
    assert partial["bench"].skip_why == "needs vLLM: no module named vllm"
    # the ops, the lookup under graph replay and CapturedForward need no vLLM: their CUDA tests run
    assert "tests/eplb_graph/test_runtime.py" not in partial["cuda_tests"].command
    assert "tests/eplb_graph/test_graph_capture.py" in partial["cuda_tests"].command
    assert "tests/eplb_graph/test_bench_data_plane.py" in partial["cuda_tests"].command
    assert partial["routing_op"].skip_why is None
    # the data plane's cost in eager / compiled / graph mode is measured either way
    for name in ("bench_data_plane", "bench_data_plane_large"):
        assert partial[name].skip_why is None and "--data-plane" in partial[name].command
    assert list(partial)[-2:] == ["bench_data_plane", "bench_data_plane_large"]  # after the stages that need vLLM


def test_the_summary_names_every_stage_with_its_figures():
    gpu_bench = load_benchmark("gpu_bench")
    rows = gpu_bench.summary_rows({
        "cuda_tests": {"status": "ok", "tail": "...\n12 passed in 30.1s\n"},
        "bench": {"status": "skipped", "why": "20 s of the budget left"},
        "run": {"status": "ok", "json": {
            "rearrangements": 110, "recaptures": 0, "recompiles": 0, "output_mismatches": 0,
            "balancedness_without_eplb": 0.89, "balancedness_after": 0.96, "step_p50_ms": 2.5}},
    })
    assert rows[1].split() == ["cuda_tests", "ok", "12", "passed", "in", "30.1s"]
    assert rows[2].split() == ["bench", "skipped", "20", "s", "of", "the", "budget", "left"]
    assert "rearrangements 110, recaptures 0" in rows[3] and "0.89 -> 0.96" in rows[3]


def test_the_summary_reads_a_bench_in_one_line():
    gpu_bench = load_benchmark("gpu_bench")
    data_plane = {"ratios": {"eager": {"on_idle_over_off": 1.02, "off_twin_over_off": 0.99},
                             "graph": {"on_idle_over_off": 1.04, "off_twin_over_off": 1.01},
                             "graph_speedup_over_eager_decode": 3.1},
                  "failed_checks": ["graph: the routing op recorded [0, 0] tokens per layer, expected 1280 each"]}
    assert gpu_bench.bench_figures(data_plane) == (
        "eager on_idle/off 1.02 (A/A 0.99); graph on_idle/off 1.04 (A/A 1.01); graph speedup over eager 3.1x; "
        "FAILED graph: the routing op recorded [0, 0] tokens per layer, expected 1280 each")
    full = {"ratios": {"graph": {"on_idle_over_off": 1.01, "off_twin_over_off": 1.0,
                                 "rearranging_p99_over_steady_p50": 1.12}}}
    assert gpu_bench.bench_figures(full) == "graph on_idle/off 1.01 (A/A 1.0), rearranging p99/steady p50 1.12"
    [_, row] = gpu_bench.summary_rows({"bench_data_plane": {"status": "ok", "json": data_plane}})
    assert row.split()[:2] == ["bench_data_plane", "ok"] and "graph speedup over eager 3.1x" in row


def test_a_stage_runs_reads_its_json_and_a_skipped_stage_never_runs(tmp_path):
    gpu_bench = load_benchmark("gpu_bench")
    stages = gpu_bench.Stages(budget_s=120)
    report_file = tmp_path / "stage.json"
    write = f"import json; json.dump({{'ok': 1}}, open({str(report_file)!r}, 'w')); print('done')"
    ran = stages.run(gpu_bench.Stage("writes", [sys.executable, "-c", write], 60, report_file))
    assert ran["status"] == "ok" and ran["json"] == {"ok": 1} and "done" in ran["tail"]
    never = tmp_path / "never.json"
    skipped = stages.run(gpu_bench.Stage("needs_vllm", [sys.executable, "-c", f"open({str(never)!r}, 'w')"], 60,
                                         never, skip_why="needs vLLM"))
    assert skipped["status"] == "skipped" and skipped["why"] == "needs vLLM" and not never.exists()
    failed = stages.run(gpu_bench.Stage("fails", [sys.executable, "-c", "raise SystemExit(3)"], 60))
    assert failed["status"] == "exit 3"
    assert list(stages.report) == ["writes", "needs_vllm", "fails"]


def test_only_names_known_stages_before_anything_runs(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--only", "bench,benchh", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--only: unknown stage ['benchh']" in done.stderr and "'bench_large'" in done.stderr
    assert not (tmp_path / "out").exists()


def test_only_runs_the_stages_it_names_and_the_exit_code_reads_those():
    gpu_bench = load_benchmark("gpu_bench")
    stages = gpu_bench.select(gpu_bench.plan(BENCHMARKS, 1, None), ["bench", "run"])
    assert [stage.name for stage in stages if stage.skip_why is None] == ["bench", "run"]
    assert {stage.skip_why for stage in stages if stage.name not in ("bench", "run")} == {"not asked for (--only)"}
    report = {"cuda_tests": {"status": "skipped"}, "bench": {"status": "ok"}, "run": {"status": "ok"}}
    assert gpu_bench.exit_code(report, ["bench", "run"]) == 0
    assert gpu_bench.exit_code(report, None) == 1  # without --only, a skipped stage is a missing figure
    assert gpu_bench.exit_code({**report, "run": {"status": "timeout after 150 s"}}, ["bench", "run"]) == 1
