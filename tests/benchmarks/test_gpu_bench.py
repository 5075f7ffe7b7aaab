"""benchmarks/gpu_bench.py and gpu_stages.py, proven on the host before any GPU is lent.

Fake stages (small Python commands) stand in for the real ones: the budget, the order, the
report rewritten after every stage, a timed-out stage killed whole with its partial output
kept, stale JSON removed, and the checks that fail a stage which exited 0 without doing what
it claims. ``make gpu-dryrun`` runs the whole call on the host with the CPU equivalents.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.benchmarks.scripts import BENCHMARKS, load_benchmark

SCRIPT = BENCHMARKS / "gpu_bench.py"
gpu_bench = load_benchmark("gpu_bench")
gpu_stages = sys.modules["gpu_stages"]


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper (the test's orphans have none but init)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def runner(tmp_path, names, budget_s=120):
    return gpu_stages.StageRunner(budget_s, tmp_path / "gpu_bench.json", {"device": "test"}, tmp_path / "logs", names)


def python_stage(name, code, timeout_s=60, **options):
    return gpu_stages.Stage(name, [sys.executable, "-c", textwrap.dedent(code)], timeout_s, **options)


@pytest.mark.launches
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run")
def test_without_cuda_it_exits_2_naming_the_reason(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "cannot run here: torch.cuda.is_available() is False" in done.stderr
    assert list(tmp_path.iterdir()) == []  # no stage started


def test_the_first_call_runs_the_vllm_free_stages_first_within_its_budget(tmp_path):
    stages = gpu_bench.select(gpu_bench.plan(tmp_path, 1, None), None)
    first_call = [stage for stage in stages if stage.asked]
    assert [stage.name for stage in first_call] == [
        "cuda_tests", "routing_op", "bench_data_plane", "runtime_tests", "run", "bench"]
    assert sum(stage.timeout_s for stage in first_call) <= gpu_bench.DEFAULT_BUDGET_S
    later = {stage.name: stage.skip_why for stage in stages if not stage.asked}
    assert later == dict.fromkeys(["bench_data_plane_large", "bench_large"],
                                  "second call: --only bench_data_plane_large,bench_large")
    second = [s for s in gpu_bench.select(gpu_bench.plan(tmp_path, 1, None), list(later)) if s.asked]
    assert sum(stage.timeout_s for stage in second) <= gpu_bench.DEFAULT_BUDGET_S
    # the large stages come last in the plan too: after every vLLM stage
    assert [stage.name for stage in stages][-2:] == ["bench_data_plane_large", "bench_large"]
    by_name = {stage.name: stage for stage in stages}
    assert by_name["run"].command[-6:] == ["--steps", "1100", "--interval", "10", "--out", str(tmp_path / "run")]
    assert "--data-plane" in by_name["bench_data_plane"].command and "cuda" in by_name["cuda_tests"].command


def test_without_vllm_the_vllm_free_stages_still_run(tmp_path):
    partial = {stage.name: stage for stage in gpu_bench.plan(tmp_path, 1, "no module named vllm")}
    assert {name for name, stage in partial.items() if stage.skip_why} == {"runtime_tests", "run", "bench", "bench_large"}
    assert partial["bench"].skip_why == "needs vLLM: no module named vllm"
    assert "tests/eplb_graph/graph/test_graph_capture.py" in partial["cuda_tests"].command
    assert "tests/eplb_reference/runtime/test_rank.py" not in partial["cuda_tests"].command


def test_the_dry_run_replaces_every_cuda_stage_and_makes_run_time_out(tmp_path):
    stages = {stage.name: stage for stage in gpu_bench.plan(tmp_path, 2, None, dry_run=True)}
    for stage in stages.values():
        assert "cuda" not in stage.command  # no --device cuda, no `-k cuda`
    assert [name for name, stage in stages.items() if stage.forced_timeout] == ["run"]


@pytest.mark.launches
def test_the_report_is_rewritten_after_every_stage(tmp_path):
    stages = runner(tmp_path, ["first", "second", "third"])
    report = tmp_path / "gpu_bench.json"
    assert json.loads(report.read_text())["pending"] == ["first", "second", "third"]  # before any stage
    stages.run(python_stage("first", "print('one')"))
    # the second stage reads the report as the call would bring it back if killed now
    reads = f"""
        import json, sys
        report = json.load(open({str(report)!r}))
        sys.exit(0 if report["stages"]["first"]["status"] == "ok" and report["pending"] == ["second", "third"] else 5)
    """
    assert stages.run(python_stage("second", reads))["status"] == "ok"
    stages.run(python_stage("third", "raise SystemExit(3)"))
    final = json.loads(report.read_text())
    assert final["device"] == "test" and final["pending"] == []
    assert [entry["status"] for entry in final["stages"].values()] == ["ok", "ok", "exit 3"]


@pytest.mark.launches
def test_a_timed_out_stage_is_killed_whole_and_keeps_its_partial_output(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    spawns = f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print("measured half of it", flush=True)
        time.sleep(600)
    """
    entry = runner(tmp_path, ["hangs"]).run(python_stage("hangs", spawns, timeout_s=3))
    assert entry["status"] == "timeout after 3 s" and "measured half of it" in entry["tail"]
    assert entry["processes_left_alive"] == 0
    assert not alive(int(pid_file.read_text()))  # the rank-like grandchild went with its stage


@pytest.mark.launches
def test_a_stage_that_exits_leaves_no_process_behind(tmp_path):
    pid_file = tmp_path / "orphan.pid"
    orphans = f"""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
    """
    entry = runner(tmp_path, ["orphans"]).run(python_stage("orphans", orphans))
    assert entry["status"] == "ok" and entry["processes_left_alive"] == 0
    assert not alive(int(pid_file.read_text()))


@pytest.mark.launches
def test_a_stale_json_from_an_earlier_call_does_not_pass_for_this_one(tmp_path):
    stale = tmp_path / "bench.json"
    stale.write_text(json.dumps({"cuda_kernel": "triton", "results": []}))
    stage = python_stage("bench", "print('wrote nothing')", json_file=stale, check=gpu_bench.bench_check("cuda"))
    entry = runner(tmp_path, ["bench"]).run(stage)
    assert entry["status"] == "failed" and entry["problems"] == ["wrote no JSON"] and not stale.exists()


@pytest.mark.launches
def test_a_skipped_stage_never_runs_and_a_stage_without_budget_is_skipped(tmp_path):
    never = tmp_path / "never"
    stages = runner(tmp_path, ["needs_vllm", "late"], budget_s=10)
    skipped = stages.run(python_stage("needs_vllm", f"open({str(never)!r}, 'w')", skip_why="needs vLLM"))
    late = stages.run(python_stage("late", f"open({str(never)!r}, 'w')"))
    assert skipped == {"status": "skipped", "why": "needs vLLM", "command": skipped["command"]}
    assert late["status"] == "skipped" and late["why"].endswith("s of the budget left") and not never.exists()


@pytest.mark.parametrize("tail, problems", [
    ("...\n12 passed in 30.1s\n", []),
    ("...\n3 skipped in 1.2s\n", ["no test passed ({'skipped': 3})", "3 test(s) skipped"]),
    ("...\n4 passed, 1 skipped, 2 deselected in 9.0s\n", ["1 test(s) skipped"]),
    ("Traceback ...", ["no test passed (no pytest summary)"]),
])
def test_a_test_stage_passes_only_when_tests_ran_and_none_skipped(tail, problems):
    assert gpu_stages.tests_ran({"tail": tail}) == problems


def test_the_checks_fail_what_did_not_happen():
    run = {"cuda_kernel": "triton", "rearrangements": 0, "recaptures": 0, "failed_invariants": []}
    assert gpu_bench.run_check("cuda", 100)({"json": run}) == ["0 rearrangements, 100 expected"]
    assert gpu_bench.run_check("cuda", 100)({"json": {**run, "rearrangements": 110}}) == []
    composite = {**run, "rearrangements": 110, "cuda_kernel": "composite (Triton is not installed)"}
    assert gpu_bench.run_check("cuda", 100)({"json": composite}) == [
        "the ops ran through 'composite (Triton is not installed)', not the Triton kernel"]
    assert gpu_bench.run_check("cpu", 1)({"json": {**composite, "recaptures": None}}) == []  # the dry run
    bench = {"cuda_kernel": "triton", "results": [
        {"mode": "graph", "eplb": "on_idle", "recaptures": 1, "rearrangements": 0},
        {"mode": "graph", "eplb": "on_rearranging", "recaptures": 0, "rearrangements": 0}]}
    assert gpu_bench.bench_check("cuda")({"json": bench}) == [
        "graph on_idle: recaptures 1 (0 expected)", "graph on_rearranging: no rearrangement happened"]
    plane = {"cuda_kernel": "triton", "results": [], "failed_checks": ["graph: 3 on_idle step(s) differ"]}
    assert gpu_bench.data_plane_check("cuda")({"json": plane}) == ["check failed: graph: 3 on_idle step(s) differ"]


def test_exit_code_reads_the_stages_of_this_call_and_a_forced_timeout_that_held():
    ok, skipped = {"status": "ok"}, {"status": "skipped"}
    forced = {"status": "timeout after 20 s", "forced_timeout": True, "tail": "partial", "processes_left_alive": 0}
    assert gpu_stages.exit_code({"a": ok, "b": skipped}, ["a"]) == 0
    assert gpu_stages.exit_code({"a": ok, "b": skipped}, ["a", "b"]) == 1  # a skip is a missing figure
    assert gpu_stages.exit_code({"a": ok, "run": forced}, ["a", "run"]) == 0
    assert gpu_stages.exit_code({"run": {**forced, "processes_left_alive": 1}}, ["run"]) == 1
    assert gpu_stages.exit_code({"run": {**forced, "status": "ok"}}, ["run"]) == 1  # it was meant to time out


@pytest.mark.launches
def test_vllms_import_leaves_the_compile_threads_as_they_were():
    """vLLM sets TORCHINDUCTOR_COMPILE_THREADS=1 on import; the call's parent puts it back, so
    every stage (and its ranks) compiles in parallel."""
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(BENCHMARKS)!r})
        import torch._inductor.config as config
        import gpu_bench
        assert gpu_bench.vllm_problem() is None
        print(os.environ.get("TORCHINDUCTOR_COMPILE_THREADS"), config.compile_threads == config.decide_compile_threads())
    """)
    env = {key: value for key, value in os.environ.items() if key != "TORCHINDUCTOR_COMPILE_THREADS"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["None", "True"]


def test_the_summary_names_every_stage_with_its_figures():
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


@pytest.mark.launches
def test_only_names_known_stages_before_anything_runs(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--only", "bench,benchh", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--only: unknown stage ['benchh']" in done.stderr and "'bench_large'" in done.stderr
    assert not (tmp_path / "out").exists()


def test_only_runs_the_stages_it_names():
    stages = gpu_bench.select(gpu_bench.plan(BENCHMARKS, 1, None), ["bench", "run"])
    assert [stage.name for stage in stages if stage.asked] == ["run", "bench"]
    assert {stage.skip_why for stage in stages if not stage.asked} == {"not asked for (--only)"}
