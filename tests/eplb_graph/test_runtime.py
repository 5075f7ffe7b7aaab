"""The main job (`eplb-graph run`) and the capture-vs-eager benchmark (`eplb-graph bench`)."""

import json
import os
import time

import pytest
import torch

from eplb_graph.cli import main
from eplb_graph.launch import RankFailure, run_ranks
from eplb_graph.run_report import failed_invariants, summarize
from eplb_graph.runner import OutputCheck, RunConfig, check_output
from eplb_graph.weight_views import expert_format
from eplb_graph.workload import WorkloadSpec, capture_size_for, make_batch
from tests.eplb_graph import multirank_cases
from tests.markers import requires_cuda


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


@pytest.mark.parametrize(
    "args,message",
    [
        (["--mode", "turbo"], "unknown mode 'turbo'"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--ranks", "3"], "20 physical experts do not divide over 3 ranks"),
        (["--format", "gptq_marlin"], "quantization format 'gptq_marlin' is not supported"),
        (["--expert-kernel", "fused"], "unknown expert kernel 'fused'; expected one of pairs, dense"),
        (["--device", "npu"], "device 'npu'"),
        (["--interval", "0"], "EPLB step_interval must be >= 1 step, got 0"),
        (["--redundant", "-1"], "redundant experts must be >= 0, got -1"),
        (["--experts", "0"], "experts must be >= 1, got 0"),
        (["--hidden", "6"], "hidden_size 6 is not divisible by num_heads 4"),
        (["--timeout", "0"], "--timeout must be > 0 seconds, got 0.0"),
        (["--tolerance", "-1"], "tolerance must be >= 0 (0: exact), got -1.0"),
        (["--capture-sizes", "8"], "decode_tokens=16 exceeds the largest capture size 8"),
        (["--capture-sizes", "0,64"], "capture sizes must be positive token counts, got [0, 64]"),
        (["--prefill-tokens", "100"], "prefill_tokens=100 exceeds the largest capture size 64"),
        (["--format", "w4a8", "--intermediate", "33"], "w4a8 packs two int4 per byte along the input dim; got odd "
                                                       "intermediate size 33"),
        (["--cpp-wrapper", "--ranks", "1", "--mode", "eager"], "--cpp-wrapper applies to what Inductor compiles"),
        (["--threads", "0"], "threads must be >= 1 per rank, got 0"),
    ],
)
def test_bad_input_fails_before_any_process_starts(args, message, capsys, tmp_path):
    start = time.monotonic()
    assert main(["run", "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err
    assert time.monotonic() - start < 5  # no process was launched


def test_each_rank_runs_the_intra_op_threads_asked_for(capsys, tmp_path):
    """--threads sets torch's thread count in every rank process, and the report says what ran.
    More threads than the default (at most this machine's cores), so the default cannot pass."""
    threads = len(os.sched_getaffinity(0)) + 1
    code, report = _run(capsys, tmp_path, "--mode", "eager", "--steps", "12", "--interval", "10",
                        "--threads", str(threads))
    assert code == 0, report["failed_invariants"]
    assert report["intra_op_threads"] == [threads, threads]


def test_rank_threads_follow_the_device_unless_asked():
    from eplb_graph.runner import rank_threads

    cores = torch.get_num_threads()
    assert rank_threads(RunConfig(device="cpu"), 1) == cores  # the host computes: all its cores to one rank
    assert rank_threads(RunConfig(device="cpu"), cores + 1) == 1  # more ranks than cores: one each
    assert rank_threads(RunConfig(device="cuda"), 1) == 1  # the device computes: one, as vLLM's GPU worker
    assert rank_threads(RunConfig(device="cuda", threads=4), 1) == 4


def test_capture_sizes_that_are_not_numbers_are_a_usage_error(capsys, tmp_path):
    with pytest.raises(SystemExit) as usage:
        main(["run", "--out", str(tmp_path), "--capture-sizes", "16,big"])
    assert usage.value.code == 2
    assert "expected comma-separated token counts such as 16,64, got '16,big'" in capsys.readouterr().err


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


@pytest.mark.parametrize("command", ["run", "bench", "inspect"])
def test_an_output_path_that_is_a_file_fails_before_any_process_starts(command, capsys, tmp_path):
    taken = tmp_path / "report"
    taken.write_text("not a directory")
    start = time.monotonic()
    assert main([command, "--out", str(taken)]) == 2
    assert f"--out {taken}: cannot create the output directory" in capsys.readouterr().err
    assert time.monotonic() - start < 5 and taken.read_text() == "not a directory"


def test_cuda_needs_a_gpu_per_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device 'cuda': torch.cuda.is_available\(\) is False"):
        RunConfig(device="cuda").validate()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="2 ranks need 2 GPUs \\(NCCL runs one rank per GPU\\), 1 visible"):
        RunConfig(device="cuda", ranks=2).validate()
    RunConfig(device="cuda", ranks=1).validate()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # torchrun over two machines, one rank on each
    RunConfig(device="cuda", ranks=2).validate()


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

    from eplb_graph.launch import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
               "-m", "eplb_graph.cli", "run", "--ranks", "2", "--steps", "30", "--interval", "10", "--json",
               "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["ranks"] == 2 and report["rearrangements"] >= 2 and report["output_mismatches"] == 0
    assert report["failed_invariants"] == []


def test_a_batch_larger_than_every_capture_size_is_rejected():
    with pytest.raises(ValueError, match="prefill_tokens=100 exceeds the largest capture size 64"):
        RunConfig(prefill_tokens=100).validate()
    with pytest.raises(ValueError, match="exceeds every capture size"):
        capture_size_for(65, (16, 64))


def test_workload_is_seeded_padded_and_drifts():
    spec = WorkloadSpec(vocab_size=256, drift_every=10)
    first, again = make_batch(spec, 3, 1), make_batch(spec, 3, 1)
    assert first.tokens.equal(again.tokens)
    assert first.kind == "decode" and first.tokens.shape == (1, 16)
    prefill = make_batch(spec, 0, 0)
    assert prefill.is_prefill and prefill.tokens.shape == (1, 64) and prefill.num_tokens == 48
    assert (prefill.tokens[0, 48:] == 0).all()
    mixed = make_batch(spec, 8, 0)
    assert mixed.kind == "mixed" and mixed.is_prefill
    early = {int(t) for step in range(1, 8) for t in make_batch(spec, step, 0).tokens[0]}
    late = {int(t) for step in range(21, 28) for t in make_batch(spec, step, 0).tokens[0]}
    assert early != late  # the hot slice moved


def test_a_dying_rank_stops_the_run_naming_it():
    cfg = RunConfig(mode="eager", steps=200, check_outputs=False)
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_ranks(multirank_cases.run_rank_then_die, 2, cfg, 1, 12, timeout_s=120)
    assert failure.value.failures[1] == "process died with exit code 17"
    assert "Connection" in failure.value.failures[0] or "peer" in failure.value.failures[0]
    assert time.monotonic() - start < 90


def _live_processes_in_group(group: int) -> list[str]:
    """Command lines of the processes in a process group, zombies (already exited, waiting
    for a parent that is gone) left out."""
    from pathlib import Path

    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp
            if int(fields[2]) == group and fields[0] != "Z":
                live.append((stat.parent / "cmdline").read_text().replace("\0", " "))
        except (OSError, IndexError, ValueError):  # exited while we looked
            continue
    return live


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
                "sys.argv = ['eplb-graph', *sys.argv[1:]]; runpy.run_module('eplb_graph.cli', run_name='__main__')")
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
        start = time.monotonic()
        code = process.wait(60)
        stopped_s = time.monotonic() - start
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    reader.join(10)
    text = "".join(stderr)
    assert code == 130, text[-3000:]
    assert stopped_s < 15
    assert "interrupted; every rank process stopped" in text and "Traceback" not in text
    assert not (out / "report.json").exists()
    time.sleep(1)  # the resource tracker exits once the launcher has
    assert _live_processes_in_group(process.pid) == []  # no rank, nor anything else of the run, is left


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
        # the floor the rearranging ratio is read against: the steady steps' own tail
        assert ratios["steady_p99_over_steady_p50"] >= 1 and ratios["rearranging_p50_over_steady_p50"] > 0
        assert ratios["rearranging_p99_over_steady_p50"] >= ratios["rearranging_p50_over_steady_p50"]
    assert (tmp_path / "bench.json").exists() and (tmp_path / "bench.png").exists()


def test_bench_with_back_to_back_rearrangements_reports_no_steady_ratio(capsys, tmp_path):
    """--interval 1: every step is inside a rearrangement, so there is no steady p50 to divide by."""
    assert main(["bench", "--json", "--mode", "eager", "--ranks", "1", "--steps", "20", "--interval", "1",
                 "--out", str(tmp_path)]) == 0
    ratios = json.loads(capsys.readouterr().out)["ratios"]["eager"]
    assert ratios["steady_decode_steps"] == 0 and ratios["rearranging_decode_steps"] > 0
    assert ratios["rearranging_p99_over_steady_p50"] is None and ratios["steady_p50_ms"] is None
    assert ratios["steady_p99_over_steady_p50"] is None and ratios["rearranging_p50_over_steady_p50"] is None


def test_bench_runs_the_mode_asked_for(monkeypatch, capsys, tmp_path):
    import eplb_graph.bench as bench

    asked = []

    def fake_run_bench(config, modes, *, timeout_s, log):  # what reaches the bench is the subject
        asked.append((config.mode, modes, config.steps, config.step_interval, timeout_s, config.capture_sizes))
        return {"device": config.device, "ranks": config.ranks, "results": [], "ratios": {}}

    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    monkeypatch.setattr(bench, "write_chart", lambda out, report: out / "bench.png")
    assert main(["bench", "--mode", "compiled", "--out", str(tmp_path), "--interval", "7", "--timeout", "60",
                 "--steps", "30", "--capture-sizes", "16,48"]) == 0
    assert main(["bench", "--out", str(tmp_path)]) == 0
    assert asked == [("compiled", ("compiled",), 30, 7, 60, (16, 48)), ("eager", ("eager", "compiled"), 120, 10, 900, (16, 64))]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mode", "graph"], "on the host the compiled mode is the graph mode"),
        (["--mode", "warp"], "unknown mode 'warp'"),
        (["--steps", "5"], "bench needs --steps >= 20"),
        (["--threads", "-2"], "threads must be >= 1 per rank, got -2"),
        (["--cpp-wrapper", "--mode", "eager", "--data-plane"], "--cpp-wrapper applies to what Inductor compiles"),
    ],
)
def test_bench_refuses_bad_arguments_before_launching(args, message, capsys, tmp_path):
    assert main(["bench", "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err


def test_cpp_wrapper_is_refused_where_it_cannot_serve():
    from eplb_graph.runner import check_cpp_wrapper, collectives_refuse_cpp_wrapper

    with pytest.raises(ValueError, match="cpp_wrapper is a host option"):
        check_cpp_wrapper("cuda", "inductor", 1)
    with pytest.raises(ValueError, match="cpp_wrapper is an Inductor option; the backend is 'aot_eager'"):
        check_cpp_wrapper("cpu", "aot_eager", 1)
    check_cpp_wrapper("cpu", "inductor", 1)
    if collectives_refuse_cpp_wrapper():  # torch 2.13: the collectives' group argument is typed Any
        with pytest.raises(ValueError, match="cpp_wrapper needs ranks 1 with torch"):
            RunConfig(cpp_wrapper=True, ranks=2).validate()


def test_cpp_wrapper_compiles_a_forward_that_calls_the_routing_op_from_cpp():
    from torch._inductor.utils import run_and_get_code

    from eplb_graph.bench import decode_batches
    from eplb_graph.runner import build_rank_models, prepare_forward

    cfg = RunConfig(ranks=1, cpp_wrapper=True)
    cfg.validate()
    with torch.no_grad():
        model, reference, rank_layers, flags = build_rank_models(cfg, 0, 1, None)
        forward = prepare_forward(model, cfg, rank_layers, [])
        batch = decode_batches(cfg, 0, torch.device("cpu"))[0]
        flags.set_(record=True, num_unpadded_tokens=batch.num_tokens)
        out, codes = run_and_get_code(forward, batch.tokens)
        expected = reference(batch.tokens)
    code = "\n".join(codes)
    # the forward is C++: the routing op is reached through the dispatcher, not torch.ops in Python
    assert '"eplb_graph::map_and_record_layer"' in code
    assert "torch.ops.eplb_graph.map_and_record_layer.default(" not in code
    assert check_output(out, expected, cfg.output_tolerance).ok
    assert [int(layer.tables.load.sum()) for layer in rank_layers] == [batch.num_tokens * cfg.top_k] * cfg.num_layers


def test_paired_ratio_interval_brackets_the_true_ratio():
    from eplb_graph.bench import paired_ratio_interval

    generator = torch.Generator().manual_seed(3)
    off = (3 + torch.rand(400, generator=generator)).tolist()  # a drifting machine: 3-4 ms steps
    exact = [1.1 * ms for ms in off]
    assert paired_ratio_interval(exact, off) == pytest.approx((1.1, 1.1))
    noisy = [1.04 * ms + float(torch.randn((), generator=generator)) * 0.3 for ms in off]
    low, high = paired_ratio_interval(noisy, off)
    assert low < 1.04 < high and high - low < 0.1
    short_low, short_high = paired_ratio_interval(noisy[:40], off[:40])
    assert short_high - short_low > high - low  # fewer steps, less certainty
    with pytest.raises(ValueError, match="paired series"):
        paired_ratio_interval(noisy[:39], off[:40])


def test_bench_table_shows_each_ratio_beside_its_target_and_yardstick():
    from eplb_graph.bench import format_table

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


def test_output_check_flags_nan_and_inf_that_a_max_diff_would_hide():
    expected = torch.tensor([[1.0, -2.0, 3.0]])
    assert check_output(expected.clone(), expected, 0.0) == OutputCheck(ok=True, max_abs_diff=0.0, nonfinite=False)
    off = torch.tensor([[1.0, -2.0, 3.5]])
    assert check_output(off, expected, 0.0) == OutputCheck(ok=False, max_abs_diff=0.5, nonfinite=False)
    assert check_output(off, expected, 0.2).ok  # rtol = atol = 0.2: |0.5| <= 0.2 + 0.2 * 3
    nan = torch.tensor([[1.0, float("nan"), 3.25]])
    # NaN compares false, so max() alone would have reported 0.25 and no sign of the NaN
    assert check_output(nan, expected, 0.0) == OutputCheck(ok=False, max_abs_diff=0.25, nonfinite=True)
    inf = torch.tensor([[float("inf"), -2.0, 3.0]])
    assert check_output(inf, expected, 1.0) == OutputCheck(ok=False, max_abs_diff=0.0, nonfinite=True)
    # the reference's own NaN, reproduced, is the model's and equal; -0.0 equals 0.0 exactly
    both_nan = torch.tensor([[float("nan"), 0.0]])
    assert check_output(both_nan.clone(), both_nan, 0.0).ok
    assert check_output(torch.tensor([[-0.0]]), torch.tensor([[0.0]]), 0.0).ok
