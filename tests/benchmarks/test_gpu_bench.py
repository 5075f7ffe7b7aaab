"""benchmarks/gpu_bench.py on a machine without CUDA: it says why it cannot run, before any stage."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_bench.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run")
def test_without_cuda_it_exits_2_naming_the_reason(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "cannot run here: torch.cuda.is_available() is False" in done.stderr
    assert list(tmp_path.iterdir()) == []  # no stage started


def test_the_summary_names_every_stage_with_its_figures():
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    gpu_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_bench)
    rows = gpu_bench.summary_rows({
        "cuda_tests": {"status": "ok", "tail": "...\n12 passed in 30.1s\n"},
        "bench": {"status": "skipped", "why": "20 s of the budget left"},
        "run": {"status": "ok", "json": {
            "rearrangements": 110, "recaptures": 0, "recompiles": 0, "output_mismatches": 0,
            "balancedness_without_eplb": 0.89, "balancedness_after": 0.96, "step_p50_ms": 2.5}},
    })
    assert rows[1].split() == ["cuda_tests", "ok", "12", "passed", "in", "30.1s"]
    assert rows[2].split() == ["bench", "skipped"]
    assert "rearrangements 110, recaptures 0" in rows[3] and "0.89 -> 0.96" in rows[3]
