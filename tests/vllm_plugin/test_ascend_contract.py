"""Contract test for the runner hook-up, with a stand-in ``vllm_ascend`` package on disk.

Proves: the plugin imports no runner module itself; when a runner module is imported later
(here a stand-in vllm-ascend runner), its ``load_model`` gets the EPLB attach step, once.
Does NOT prove: anything on an NPU (no CANN, no torch_npu here), ACL graph capture, the
torchair backend on a real model, or vllm-ascend's current runner class names.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")

from eplb_graph.vllm_plugin import install_runner_hooks  # noqa: E402

STAND_IN_RUNNER = """
import types

loaded = []


class NPUModelRunner:
    parallel_config = types.SimpleNamespace(enable_eplb=False)

    def load_model(self):
        loaded.append("upstream")
"""


@pytest.fixture
def stand_in_vllm_ascend(tmp_path, monkeypatch):
    package = tmp_path / "vllm_ascend" / "worker"
    package.mkdir(parents=True)
    (tmp_path / "vllm_ascend" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "model_runner_v1.py").write_text(textwrap.dedent(STAND_IN_RUNNER))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [n for n in sys.modules if n == "vllm_ascend" or n.startswith("vllm_ascend.")]:
        del sys.modules[name]


def test_a_runner_module_imported_later_gets_the_eplb_attach_step(stand_in_vllm_ascend):
    install_runner_hooks()
    assert "vllm_ascend" not in sys.modules and "torch_npu" not in sys.modules  # nothing imported by us
    from vllm_ascend.worker import model_runner_v1

    install_runner_hooks()  # idempotent: wrapped once
    runner = model_runner_v1.NPUModelRunner()
    runner.load_model()
    assert model_runner_v1.loaded == ["upstream"]  # EPLB off: upstream's load and nothing else
    assert getattr(runner, "eplb_graph", None) is None
    assert getattr(model_runner_v1.NPUModelRunner.load_model, "__eplb_graph_runner__", False)


@pytest.mark.launches
def test_loading_the_plugin_imports_no_runner_module():
    """EPLB off, plugin loaded by EngineArgs: start-up pays for no runner import of ours."""
    script = (
        "import sys\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "assert getattr(EngineArgs.create_engine_config, '__eplb_graph_gate__', False), 'plugin not loaded'\n"
        "print(sorted(m for m in sys.modules if m.startswith(('vllm.v1.worker.', 'vllm_ascend')) and 'runner' in m))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_PLUGINS": "eplb_graph"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
