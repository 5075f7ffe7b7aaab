"""bench_local_pairs: the op against the ideal (the same kernel on the pre-compacted local rows), per T."""

import json
import statistics
import subprocess
import sys

import pytest

from eplb_graph.custom_ops import LOCAL_EXPERTS
from tests.benchmarks.scripts import BENCHMARKS

pytestmark = pytest.mark.launches  # vLLM's CPU kernels in a process of their own


def test_the_report_times_both_at_every_t_and_judges_each_by_the_target(tmp_path):
    out = tmp_path / "local_pairs.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_local_pairs.py"), "--tokens", "1", "16",
                           "--rounds", "2", "--hidden", "256", "--intermediate", "128", "--experts", "8",
                           "--top-k", "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["isa"] in ("amx", "vec") and report["dtype"] in ("bfloat16", "float32")
    assert report["dtype"] == "bfloat16" or report["isa"] == "vec"  # AMX kernels run bfloat16 only
    assert report["passes"] == LOCAL_EXPERTS.passes.kind and report["cpu"]
    assert [run["tokens"] for run in report["runs"]] == [1, 16]
    for run in report["runs"]:  # both op arms' results were checked equal to the ideal's sum before timing
        assert run["op_s"] > 0 and run["ideal_s"] > 0 and run["composite_s"] > 0 and len(run["per_round_ratios"]) == 2
        assert 0.5 < run["overhead_ratio"] < 20  # the same kernel on the same rows: neither free nor absurd
        # the median of the rounds' ratios (each rounded to 3 places), not a ratio of medians
        assert abs(run["overhead_ratio"] - statistics.median(run["per_round_ratios"])) <= 0.001
        assert run["local_pairs"] > 0


def test_a_shape_the_kernel_cannot_take_is_refused_before_anything_runs(tmp_path):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_local_pairs.py"), "--experts", "7",
                           "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--experts divisible by 2" in done.stderr
