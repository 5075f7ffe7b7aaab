"""The movement benchmark's argument checks: bad input stops before any rank process starts."""

import subprocess
import sys
from pathlib import Path

import pytest

from eplb_graph.ep_runtime import StackSpec

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_movement.py"


@pytest.mark.parametrize(
    "spec, ranks, message",
    [
        (StackSpec(num_logical=16, num_redundant=3), 2, "19 physical experts do not divide over 2 ranks"),
        (StackSpec(), 0, "ranks must be >= 1, got 0"),
        (StackSpec(num_redundant=-1), 1, "num_redundant must be >= 0, got -1"),
        (StackSpec(num_logical=0), 1, "num_logical must be >= 1, got 0"),
        (StackSpec(top_k=9), 1, "top_k must be in [1, 8], got 9"),
        (StackSpec(weight_format="gptq"), 1, "quantization format 'gptq' is not supported"),
    ],
)
def test_stack_spec_refuses_what_cannot_run(spec, ranks, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        spec.validate(ranks)


def test_bench_movement_stops_before_launching(tmp_path):
    out = tmp_path / "movement.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--steps", "0", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "bench_movement: --steps must be >= 1, got 0" in done.stderr
    assert not out.exists()
