"""Contract test for the Ascend hook-up, with a stand-in ``vllm_ascend`` package.

Proves: where vllm-ascend is installed, the plugin wraps its runner's ``load_model`` so the
EPLB worker attaches after load, and it imports nothing Ascend-specific otherwise.
Does NOT prove: anything on an NPU (no CANN, no torch_npu here), ACL graph capture, the
torchair backend on a real model, or vllm-ascend's current runner class names.
"""

from __future__ import annotations

import sys
import types

import pytest

pytest.importorskip("vllm")

from eplb_graph.vllm_plugin import ascend, install_runner_hooks  # noqa: E402


def test_without_vllm_ascend_nothing_is_imported(monkeypatch):
    monkeypatch.setattr(ascend, "vllm_ascend_installed", lambda: False)
    assert ascend.ascend_runner_classes() == []
    assert "torch_npu" not in sys.modules and "vllm_ascend" not in sys.modules


def test_stand_in_ascend_runner_gets_the_eplb_hook(monkeypatch):
    loaded = []

    class NPUModelRunner:
        parallel_config = types.SimpleNamespace(enable_eplb=False)

        def load_model(self):
            loaded.append("upstream")

    package = types.ModuleType("vllm_ascend")
    worker = types.ModuleType("vllm_ascend.worker")
    runner_module = types.ModuleType("vllm_ascend.worker.model_runner_v1")
    runner_module.NPUModelRunner = NPUModelRunner
    for name, module in (("vllm_ascend", package), ("vllm_ascend.worker", worker),
                         ("vllm_ascend.worker.model_runner_v1", runner_module)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(ascend, "vllm_ascend_installed", lambda: True)

    assert ascend.ascend_runner_classes() == [NPUModelRunner]
    install_runner_hooks()
    install_runner_hooks()  # idempotent: wrapped once
    runner = NPUModelRunner()
    runner.load_model()
    assert loaded == ["upstream"]  # EPLB off: upstream's load and nothing else
    assert getattr(runner, "eplb_graph", None) is None
    assert getattr(NPUModelRunner.load_model, "__eplb_graph_runner__", False)
