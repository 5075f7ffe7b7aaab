"""`eplb-graph`'s command line: flags, usage errors and bad input refused before any process starts."""

import pytest

from eplb_reference.bench import capture_vs_eager
from eplb_reference.runtime import launch
from eplb_reference.elastic import processes
from eplb_graph.tools.cli import main


@pytest.fixture
def no_launch(monkeypatch):
    """Bad input must be refused before any rank process starts: launching is a test failure."""

    def launched(*args, **kwargs):
        raise AssertionError("a rank process was launched")

    monkeypatch.setattr(launch, "run_ranks", launched)
    monkeypatch.setattr(capture_vs_eager, "run_ranks", launched)
    monkeypatch.setattr(processes.MemberProcesses, "start", launched)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--mode", "turbo"], "unknown mode 'turbo'"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--ranks", "3"], "20 physical experts do not divide over 3 ranks"),
        (["--format", "gptq_marlin"], "quantization format 'gptq_marlin' is not supported"),
        (["--expert-kernel", "fused"], "unknown expert kernel 'fused'; expected one of pairs, dense"),
        (["--device", "npu"], "device 'npu': the NPU runtime needs torch_npu and an ACL graph runner: torch_npu is not installed"),
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
        (["--stall-steps", "0"], "--stall-steps must be an int >= 1, got 0"),
        (["--stall-seconds", "0"], "--stall-seconds must be > 0, got 0.0"),
        (["--scale-plan", "2,5", "--max-ranks", "4"], "cannot scale to 5 ranks: the group's maximum (--max-ranks) is 4"),
        (["--scale-plan", "2,1"], "1 x 10 expert slots cannot host 16 logical experts (at least 2 ranks)"),
        (["--scale-plan", "2,x"], "--scale-plan takes sizes separated by commas"),
        (["--scale-plan", "3,4"], "20 physical experts do not divide over 3 ranks"),
        (["--scale-plan", "2,4", "--resize-deadline", "0"], "--resize-deadline must be > 0 seconds, got 0.0"),
        (["--scale-plan", "2,4", "--policy-process"], "--scale-plan runs on the host"),
        (["--scale-plan", "2,4", "--hang-timeout", "0"], "--hang-timeout must be > 0 seconds, got 0.0"),
        (["--chaos", "1", "--scale-plan", "2,4"], "--chaos draws its own resizes and faults"),
        (["--chaos", "1", "--faults", "0"], "--faults must be >= 1, got 0"),
        (["--chaos", "1", "--max-ranks", "3"], "--max-ranks must be >= 4"),
        (["--placement-file", "/nonexistent/p.json"], "placement file /nonexistent/p.json: directory /nonexistent does not exist"),
        (["--scale-plan", "2,4", "--placement-file", "p.json"], "--placement-file keeps a fixed EP size's placement"),
    ],
)
def test_bad_input_fails_before_any_process_starts(args, message, capsys, tmp_path, no_launch):
    assert main(["run", "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err


def test_capture_sizes_that_are_not_numbers_are_a_usage_error(capsys, tmp_path):
    with pytest.raises(SystemExit) as usage:
        main(["run", "--out", str(tmp_path), "--capture-sizes", "16,big"])
    assert usage.value.code == 2
    assert "expected comma-separated token counts such as 16,64, got '16,big'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "bench", "inspect"])
def test_an_output_path_that_is_a_file_fails_before_any_process_starts(command, capsys, tmp_path, no_launch):
    taken = tmp_path / "report"
    taken.write_text("not a directory")
    assert main([command, "--out", str(taken)]) == 2
    assert f"--out {taken}: cannot create the output directory" in capsys.readouterr().err
    assert taken.read_text() == "not a directory"


def test_bench_runs_the_mode_asked_for(monkeypatch, capsys, tmp_path):
    from eplb_reference.bench import capture_vs_eager, table

    asked = []

    def fake_run_bench(config, modes, *, timeout_s, log):  # what reaches the bench is the subject
        asked.append((config.mode, modes, config.steps, config.step_interval, timeout_s, config.capture_sizes))
        return {"device": config.device, "ranks": config.ranks, "results": [], "ratios": {}}

    monkeypatch.setattr(capture_vs_eager, "run_bench", fake_run_bench)
    monkeypatch.setattr(table, "write_chart", lambda out, report: out / "bench.png")
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
def test_bench_refuses_bad_arguments_before_launching(args, message, capsys, tmp_path, no_launch):
    assert main(["bench", "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err
