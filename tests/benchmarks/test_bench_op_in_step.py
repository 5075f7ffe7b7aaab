"""bench_op_in_step: each call is timed right after a step (cold) and again at once (hot)."""

import json
import subprocess
import sys

import pytest

from eplb_graph.custom_ops import CPU_LAYER_KERNEL
from tests.benchmarks.scripts import BENCHMARKS, load_benchmark


bench_op_in_step = load_benchmark("bench_op_in_step")


def test_each_case_is_timed_after_a_step_then_again():
    events = []
    cases = {"a": lambda: events.append("a"), "b": lambda: events.append("b")}
    results = bench_op_in_step.time_cases(cases, lambda index: events.append(f"step{index}"), rounds=2)
    assert events == ["step0", "a", "a", "step0", "b", "b", "step1", "a", "a", "step1", "b", "b"]
    assert set(results) == {"a", "b"} and all(r["cold_us"] > 0 and r["hot_us"] > 0 for r in results.values())


@pytest.mark.launches
def test_the_script_times_the_routing_op_against_its_floors(tmp_path):
    out = tmp_path / "op.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_op_in_step.py"), "--rounds", "30", "--backend",
                           "aot_eager", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    calls = report["calls"]
    assert set(calls) == {"routing_op", "composite_op", "passthrough", "composite", "nothing"}
    assert report["cpu_layer_kernel"] == CPU_LAYER_KERNEL
    assert report["forward_p50_us"] > 0 and report["routing_op_cold_over_hot"] > 0
    assert report["composite_op_cold_over_routing_op_cold"] > 0
    # the op does the kernel's work behind the dispatcher: never cheaper than an empty call
    assert calls["routing_op"]["hot_us"] > calls["nothing"]["hot_us"]
    assert calls["composite_op"]["hot_us"] > calls["nothing"]["hot_us"]
    assert done.stdout.splitlines()[-1] == f"wrote {out}"
