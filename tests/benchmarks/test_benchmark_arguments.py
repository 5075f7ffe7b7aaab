"""The CPU benchmarks' argument checks: bad input stops with the flag's name before anything runs.

Each script's ``main`` runs in this process with its command line: a refusal is ``SystemExit``
with the message, which Python prints to stderr with exit status 1 (what a shell sees)."""

import sys

import pytest

from tests.benchmarks.scripts import load_benchmark


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("bench_movement.py", ["--steps", "0"], "bench_movement: --steps must be >= 1, got 0"),
        ("bench_movement.py", ["--redundant", "3"], "bench_movement: 19 physical experts do not divide over 2 ranks"),
        ("bench_routing_ops.py", ["--rounds", "0"], "bench_routing_ops: --rounds must be >= 1, got 0"),
        ("bench_routing_ops.py", ["--device", "tpu"], "bench_routing_ops: --device must be cpu or cuda, got 'tpu'"),
        ("bench_commit.py", ["--rounds", "0"], "bench_commit: --rounds must be >= 1, got 0"),
        ("bench_commit.py", ["--shapes", "16x4"], "bench_commit: --shapes takes LOGICAL+REDUNDANT, got '16x4'"),
        ("bench_commit.py", ["--shapes", "0+4"], "bench_commit: --shapes 0+4: experts must be >= 1, got 0"),
        ("bench_policy_stall.py", ["--steps", "0"], "bench_policy_stall: --steps must be >= 1, got 0"),
        ("bench_transfer_planning.py", ["--rounds", "0"], "bench_transfer_planning: --rounds must be >= 1, got 0"),
        ("bench_transfer_planning.py", ["--shapes", "16+4/2"],
         "bench_transfer_planning: --shapes takes LOGICAL+REDUNDANTxRANKS, got '16+4/2'"),
        ("bench_transfer_planning.py", ["--shapes", "16+3x2"],
         "bench_transfer_planning: --shapes 16+3x2: 19 physical experts do not divide over 2 ranks"),
        ("bench_policy_stall.py", ["--shapes", "llama"], "bench_policy_stall: --shapes: unknown ['llama']"),
        ("bench_injected_work.py", ["--work-us", "-1"], "bench_injected_work: --work-us must be >= 0, got -1.0"),
        ("bench_injected_work.py", ["--steps", "5"], "bench_injected_work: --steps must be >= 20, got 5"),
        ("bench_op_in_step.py", ["--rounds", "0"], "bench_op_in_step: --rounds must be >= 1, got 0"),
    ],
)
def test_a_benchmark_stops_before_running(script, args, message, tmp_path, monkeypatch):
    out = tmp_path / "report.json"
    benchmark = load_benchmark(script.removesuffix(".py"))
    monkeypatch.setattr(sys, "argv", [script, *args, "--out", str(out)])
    with pytest.raises(SystemExit) as stopped:
        benchmark.main()
    assert isinstance(stopped.value.code, str)  # a message: exit status 1, the message on stderr
    assert message in stopped.value.code
    assert not out.exists()
