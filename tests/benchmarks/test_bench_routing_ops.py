"""bench_routing_ops: the registered op against the inline composite, naming the kernel it timed."""

import json
import os
import subprocess
import sys

import pytest

from eplb_graph.custom_ops import CPU_LAYER_KERNEL, native_routing
from tests.benchmarks.scripts import BENCHMARKS


pytestmark = pytest.mark.launches  # rank processes or an engine: left out by make test-fast


def _run(tmp_path, **env: str) -> tuple[dict, str]:
    out = tmp_path / "routing.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_routing_ops.py"), "--tokens", "1", "16",
                           "--rounds", "3", "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == f"wrote {out}"
    return json.loads(out.read_text()), done.stdout


def test_the_report_names_the_cpu_kernel_it_timed_and_judges_t16_by_its_target(tmp_path):
    report, stdout = _run(tmp_path)
    assert report["device"] == "cpu" and report["cpu_kernel"] == CPU_LAYER_KERNEL and report["cuda_kernel"] is None
    assert f"the registered op runs the {CPU_LAYER_KERNEL} cpu kernel" in stdout
    assert [r["num_tokens"] for r in report["results"]] == [1, 16]
    assert all(r["registered_us"] > 0 and r["inline_us"] > 0 for r in report["results"])
    t16 = report["results"][1]
    assert t16["target_ratio"] == 1.5 and t16["meets_target"] == (t16["ratio"] <= 1.5)
    assert report["all_targets_met"] == t16["meets_target"]


def test_switched_off_the_report_says_the_composite_was_timed(tmp_path):
    report, stdout = _run(tmp_path, **{native_routing.SWITCH: "0"})
    assert report["cpu_kernel"] == "composite"
    assert "the registered op runs the composite cpu kernel" in stdout
