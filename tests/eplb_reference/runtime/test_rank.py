"""The main job (`eplb-graph run`) and the capture-vs-eager benchmark (`eplb-graph bench`)."""

import json
import os
import time

import pytest

from eplb_reference.cli import main
from eplb_reference.runtime.config import RunConfig
from eplb_reference.runtime.launch import RankFailure, run_ranks
from eplb_reference.runtime.report import failed_invariants, summarize
from eplb_reference.runtime.workload import make_batch
from eplb_graph.movement.weight_views import expert_format
from tests.benchmarks.scripts import load_benchmark
from tests.markers import requires_cuda
from tests.eplb_reference.runtime import multirank_cases

live_processes_in_group = load_benchmark("gpu_stages").live_processes_in_group

pytestmark = pytest.mark.launches  # rank processes or an engine: left out by make test-fast


def _run(capsys, tmp_path, *args):
    code = main(["run", "--json", "--out", str(tmp_path), *args])
    captured = capsys.readouterr()
    assert captured.out, f"no report (exit code {code}); stderr:\n{captured.err[-3000:]}"  # a failed launch says why
    return code, json.loads(captured.out)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_run_rebalances_live_with_outputs_checked_every_step(mode, capsys, tmp_path):
    code, report = _run(capsys, tmp_path, "--mode", mode, "--steps", "70", "--interval", "10")
    assert code == 0, report["failed_invariants"]
    for key in ("balancedness_before", "balancedness_after", "rearrangements", "layers_committed",
                "output_mismatches", "recompiles", "recaptures", "steps", "mode", "ranks"):
        assert key in report
    assert report["mode"] == mode and report["ranks"] == 2 and report["steps"] == 70
    assert len(report["intra_op_threads"]) == 2 and min(report["intra_op_threads"]) >= 1
    assert report["output_mismatches"] == 0 and report["max_abs_diff"] <= report["tolerance"]
    if mode == "eager":  # the reference's own kernels in the same order: nothing may differ
        assert report["tolerance"] == 0 and report["output_check"] == "exact" and report["max_abs_diff"] == 0
    else:  # Inductor's fused kernels round differently from the eager reference
        assert report["tolerance"] == 1e-5 and report["output_check"] == "allclose(rtol=atol=1e-05)"
    assert report["rearrangements"] >= 5
    # 2 layers per rearrangement; the last one may still be in flight when the run ends
    assert 2 * report["rearrangements"] <= report["layers_committed"] <= 2 * report["rearrangements_started"]
    assert report["recompiles"] == 0
    assert report["recaptures"] is None  # no graph is captured on the host: not a count that could be 0
    assert report["balancedness_after"] > report["balancedness_without_eplb"]
    if mode == "compiled":
        assert report["verifier_ok"] and report["routers_mapped"] == 2
    assert json.loads((tmp_path / "report.json").read_text()) == report
    assert (tmp_path / "balancedness.png").stat().st_size > 0
    assert (tmp_path / "rank_load_heatmap.png").stat().st_size > 0


def test_the_dense_expert_kernel_stays_exact_down_to_batches_of_two_tokens(capsys, tmp_path):
    """--expert-kernel dense (every local expert over every gathered token): the EP model's
    GEMMs have more rows than the reference's (4 vs 2 at decode here, under the 4 rows where the
    host's sgemm changes path, so both are padded), and eager stays exact, in a quantized format too."""
    for weight_format in ("unquantized", "w4a8"):
        code, report = _run(capsys, tmp_path, "--mode", "eager", "--expert-kernel", "dense", "--steps", "40",
                            "--interval", "10", "--capture-sizes", "2,64", "--decode-tokens", "2",
                            "--format", weight_format)
        assert code == 0, report["failed_invariants"]
        assert report["expert_kernel"] == "dense" and report["rearrangements"] >= 2
        assert report["output_check"] == "exact" and report["max_abs_diff"] == 0


def test_back_to_back_rearrangements_are_all_counted(capsys, tmp_path):
    """At --interval 1 one upstream step() commits a rearrangement's last layer and starts the
    next, so the rebalancing flag never reads False between steps; each is still counted.
    A quantized format under that churn still equals the one-process model exactly (eager)."""
    code, report = _run(capsys, tmp_path, "--mode", "eager", "--steps", "30", "--interval", "1",
                        "--format", "w8a8_dynamic")
    assert code == 0, report["failed_invariants"]
    assert report["output_check"] == "exact" and report["max_abs_diff"] == 0
    layers = report["num_layers"]
    assert report["rearrangements"] == report["layers_committed"] // layers >= 10
    assert report["rearrangements_started"] - report["rearrangements"] in (0, 1)
    assert report["balancedness_after"] is not None


def test_quantized_format_runs_under_compile(capsys, tmp_path):
    code, report = _run(capsys, tmp_path, "--mode", "compiled", "--format", "w4a8", "--steps", "30", "--interval", "10")
    assert code == 0 and report["weight_format"] == "w4a8" and report["output_mismatches"] == 0
    assert report["tolerance"] == 1e-3  # the format's own: quantization turns reordered sums into rounding flips


@pytest.mark.parametrize("weight_format", ["unquantized", "w4a8"])
def test_the_output_check_catches_a_lost_weight_move(weight_format):
    """The per-step check against the no-EPLB model fails a run whose commits publish
    placements without their weights, by far more than even a compiled run's tolerance,
    and points at the first rearrangement."""
    cfg = RunConfig(mode="eager", steps=30, step_interval=10, window_size=10, weight_format=weight_format)
    results = run_ranks(multirank_cases.run_rank_losing_weight_moves, 2, cfg, timeout_s=300)
    report = summarize(cfg, results)
    assert report["layers_committed"] >= 2 and report["tolerance"] == 0  # eager: exact
    assert report["output_mismatches"] > 0 and report["max_abs_diff"] > 10 * expert_format(weight_format).output_tolerance
    # the first wrong output is the forward after a commit: inside the first rearrangement
    assert report["first_mismatch_during_rearrangement"] is True
    assert 0 < report["first_mismatch_step"] <= report["rearrangement_finished_steps"][0] + 1
    assert report["nonfinite_output_steps"] == 0
    assert any(f"(first at step {report['first_mismatch_step']}, during a rearrangement)" in problem
               for problem in failed_invariants(report))


def test_a_weight_move_that_writes_nan_is_named_as_such():
    """Moved experts that arrive as NaN: every later step mismatches; the report says NaN, where
    the max |diff| over finite entries alone would look small."""
    cfg = RunConfig(mode="eager", steps=30, step_interval=10, window_size=10)
    results = run_ranks(multirank_cases.run_rank_with_nan_weight_moves, 2, cfg, timeout_s=300)
    report = summarize(cfg, results)
    assert report["output_mismatches"] > 0 and report["first_mismatch_during_rearrangement"] is True
    assert report["nonfinite_output_steps"] == report["output_mismatches"]
    assert json.loads(json.dumps(report, allow_nan=False))["max_abs_diff"] == report["max_abs_diff"]  # strict JSON
    assert any("with NaN/Inf where the reference is finite" in problem for problem in failed_invariants(report))


def test_run_with_the_policy_in_helper_processes(capsys, tmp_path):
    code, report = _run(capsys, tmp_path, "--mode", "eager", "--steps", "30", "--interval", "10", "--policy-process")
    assert code == 0, report["failed_invariants"]
    assert report["policy_process"] is True
    assert report["rearrangements"] >= 2 and report["output_mismatches"] == 0


def test_each_rank_runs_the_intra_op_threads_asked_for(capsys, tmp_path):
    """--threads sets torch's thread count in every rank process, and the report says what ran.
    More threads than the default (at most this machine's cores), so the default cannot pass."""
    threads = len(os.sched_getaffinity(0)) + 1
    code, report = _run(capsys, tmp_path, "--mode", "eager", "--steps", "12", "--interval", "10",
                        "--threads", str(threads))
    assert code == 0, report["failed_invariants"]
    assert report["intra_op_threads"] == [threads, threads]


def test_run_pads_batches_to_the_capture_sizes_asked_for(capsys, tmp_path):
    code, report = _run(capsys, tmp_path, "--mode", "eager", "--steps", "24", "--interval", "10",
                        "--capture-sizes", "8,24,64", "--decode-tokens", "8", "--prefill-tokens", "20")
    assert code == 0, report["failed_invariants"]
    assert report["capture_sizes"] == [8, 24, 64]
    assert report["batch_tokens_per_rank"] == {"decode": 8, "prefill": 20, "mixed": 28}
    assert report["output_mismatches"] == 0 and report["rearrangements"] >= 1
    spec = RunConfig(capture_sizes=(8, 24, 64), decode_tokens=8, prefill_tokens=20).workload()
    padded = {make_batch(spec, step, 0).kind: make_batch(spec, step, 0).tokens.shape[1] for step in range(17)}
    assert padded == {"decode": 8, "prefill": 24, "mixed": 64}  # the smallest capture size that holds each


@requires_cuda
def test_graph_mode_on_cuda_replays_with_live_eplb(capsys, tmp_path):
    """CUDA graphs captured once per size; upstream's async EPLB rearranges between replays."""
    code, report = _run(capsys, tmp_path, "--device", "cuda", "--mode", "graph", "--ranks", "1",
                        "--steps", "80", "--interval", "10")
    assert code == 0, report["failed_invariants"]
    assert report["output_mismatches"] == 0 and report["rearrangements"] >= 5
    assert report["recaptures"] == 0 and report["recompiles"] == 0


def test_under_torchrun_each_process_is_one_rank(tmp_path):
    """The same entry point spans machines under torchrun (here: two processes on one)."""
    import subprocess
    import sys

    from eplb_reference.runtime.launch import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
               "-m", "eplb_reference.cli", "run", "--ranks", "2", "--steps", "30", "--interval", "10", "--json",
               "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["ranks"] == 2 and report["rearrangements"] >= 2 and report["output_mismatches"] == 0
    assert report["failed_invariants"] == []


def test_a_dying_rank_stops_the_run_naming_it():
    cfg = RunConfig(mode="eager", steps=200, check_outputs=False)
    with pytest.raises(RankFailure) as failure:
        run_ranks(multirank_cases.run_rank_then_die, 2, cfg, 1, 12, timeout_s=120)
    assert failure.value.failures[1] == "process died with exit code 17"
    # the survivor failed on the lost connection itself, not by the launcher's timeout ("stuck")
    assert "Connection" in failure.value.failures[0] or "peer" in failure.value.failures[0]


def test_ctrl_c_stops_every_rank_and_exits_130(tmp_path):
    """Ctrl-C reaches the launcher and both ranks (one process group): the run stops at once,
    says so without a traceback, writes nothing, and leaves no process behind."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    # a shell's background job may have inherited SIGINT ignored: restore Python's handler
    launcher = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                "sys.argv = ['eplb-graph', *sys.argv[1:]]; runpy.run_module('eplb_reference.cli', run_name='__main__')")
    out = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, "-c", launcher, "run", "--mode", "eager", "--steps", "1000000", "--out", str(out)],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True,
    )
    stderr: list[str] = []
    stepping = threading.Event()

    def read_stderr() -> None:
        for line in iter(lambda: process.stderr.read(256), ""):
            stderr.append(line)
            if "step/s" in "".join(stderr[-2:]):  # the progress bar: both ranks are stepping
                stepping.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        assert stepping.wait(180), "".join(stderr)[-3000:]
        os.killpg(process.pid, signal.SIGINT)
        code = process.wait(60)  # bounded: a launcher that does not stop its ranks fails here
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    reader.join(10)
    text = "".join(stderr)
    assert code == 130, text[-3000:]
    assert "interrupted; every rank process stopped" in text and "Traceback" not in text
    assert not (out / "report.json").exists()
    # no rank, nor anything else of the run, is left (the resource tracker exits once the launcher has)
    deadline = time.monotonic() + 10
    while live_processes_in_group(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_processes_in_group(process.pid) == []


def test_a_second_run_starts_from_the_placement_the_first_kept_already_balanced(capsys, tmp_path):
    """Both runs within the workload's first hot slice (it drifts every 100 steps): the second's
    first window runs on the first run's last committed placement, for a full interval (upstream's
    first rearrangement of a fresh state comes after three quarters of one; a restored one waits)."""
    path = tmp_path / "placement.json"
    args = ("--steps", "40", "--interval", "10", "--placement-file", str(path))
    code, first = _run(capsys, tmp_path / "first", *args)
    assert code == 0 and first["rearrangements"] >= 2 and not first["placement_restored"]
    kept = json.loads(path.read_text())
    assert kept["written_by"] == "runtime" and kept["rearrangements"] == first["rearrangements"]
    code, second = _run(capsys, tmp_path / "second", *args)
    assert code == 0 and second["placement_restored"] and second["output_mismatches"] == 0
    # its first window runs on the first run's last placement: as balanced as the first run's last
    # window, and at least as balanced as the first run was on average after its first rebalance
    assert abs(second["balancedness_windows"][0] - first["balancedness_windows"][-1]) <= 0.02
    assert second["balancedness_before"] >= first["balancedness_after"] - 0.02
    assert second["balancedness_before"] > first["balancedness_before"] + 0.05
    assert json.loads(path.read_text())["rearrangements"] == first["rearrangements"] + second["rearrangements"]
