"""``custom_ops/__init__.py``: which kernel serves each dispatch key, and that reports can say so."""

import importlib.util
import os
import subprocess
import sys

import pytest

import eplb_graph.custom_ops as custom_ops


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="Triton is importable here")
def test_without_triton_the_cuda_kernel_is_the_composite_and_says_why():
    assert custom_ops.CUDA_KERNEL == "composite (Triton is not installed)"  # the host venv keeps Triton off its path


@pytest.mark.launches
def test_a_triton_that_fails_to_import_leaves_the_ops_registered_and_is_named(tmp_path):
    """A broken Triton (built for another torch, say) must not break ``import eplb_graph``, nor let
    the composite serve a GPU unnoticed: CUDA_KERNEL names the failure for the reports."""
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text("raise ImportError('built for another torch')\n")
    code = ("import eplb_graph, torch; from eplb_graph.custom_ops import CUDA_KERNEL; "
            "assert hasattr(torch.ops.eplb_graph, 'map_and_record_layer'); print(CUDA_KERNEL)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "composite (Triton failed to import: ImportError: built for another torch)"
