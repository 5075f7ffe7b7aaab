"""bench_movement end to end, where a run has no steady step to compare with."""

import json
import subprocess
import sys

import pytest

from tests.benchmarks.scripts import BENCHMARKS


pytestmark = pytest.mark.launches  # rank processes or an engine: left out by make test-fast


def test_back_to_back_rearrangements_report_no_ratio_and_no_verdict(tmp_path):
    """--interval 1: every step is inside a rearrangement; the ratio has no denominator, so the
    report says null, never a ratio or a target met."""
    out = tmp_path / "movement.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_movement.py"), "--steps", "12", "--interval", "1",
                           "--window", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    for rank in report["ranks"]:
        assert rank["steady_p50_ms"] is None and rank["rearranging_p50_ms"] > 0
        assert rank["rearranging_p99_over_steady_p50"] is None and rank["rearrangements_finished"] >= 2
    assert report["rearranging_p99_over_steady_p50_worst_rank"] is None and report["meets_target"] is None
