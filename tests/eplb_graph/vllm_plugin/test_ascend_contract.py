"""Contract test for the runner hook-up, with a stand-in ``vllm_ascend`` package on disk.

The names come from ``ascend_names.py``: read in vllm-ascend's source at the commit it names
(``VLLM_ASCEND_COMMIT``). Proves: our runner list is that commit's; the upstream vLLM bases
those classes subclass exist in the installed vLLM; the plugin imports no runner module
itself; when a runner module is imported later (a stand-in laid out as at that commit: V1
with its own ``load_model``, V2 inheriting vLLM's MRv2 one), its ``load_model`` gets the EPLB
attach step, once, and MRv2 with EPLB on is refused by name. Does NOT prove: anything on an
NPU (tests/npu_emulation runs our NPU paths on an emulated device), ACL graph capture, the
torchair backend on a real model, or vllm-ascend at any other commit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from eplb_graph.upstream import patches  # noqa: E402
from eplb_graph.vllm_plugin import install_runner_hooks  # noqa: E402
from eplb_graph.vllm_plugin.ascend import ASCEND_RUNNERS  # noqa: E402
from tests.eplb_graph.vllm_plugin import ascend_names  # noqa: E402

STAND_IN_RUNNER = """
import types

loaded = []


class GPUModelRunner:  # stands in for {base}
    parallel_config = types.SimpleNamespace(enable_eplb=False)

    def load_model(self):
        loaded.append("upstream")


class NPUModelRunner(GPUModelRunner):
    {body}
"""
OWN_LOAD_MODEL = """def load_model(self):
        loaded.append("upstream")"""
MRV2_STATE = """eplb = object()  # MRv2 keeps its EPLB controller here, no eplb_state"""


def _stand_in_module(base: str, defines_load_model: bool) -> str:
    return STAND_IN_RUNNER.format(base=base, body=OWN_LOAD_MODEL if defines_load_model else MRV2_STATE)


@pytest.fixture
def stand_in_vllm_ascend(tmp_path, monkeypatch):
    for module, _, base, defines_load_model in ascend_names.RUNNERS:
        path = tmp_path.joinpath(*module.split("."))
        for package in [tmp_path.joinpath(*module.split(".")[:i]) for i in range(1, module.count(".") + 1)]:
            package.mkdir(exist_ok=True)
            (package / "__init__.py").touch()
        path.with_suffix(".py").write_text(textwrap.dedent(_stand_in_module(base, defines_load_model)))
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
    assert patches.installed("runner.ascend_v1_load_model")
    assert model_runner_v1.NPUModelRunner.load_model.__wrapped__.__qualname__ == "NPUModelRunner.load_model"


def test_the_mrv2_runner_inherits_load_model_and_is_refused_with_eplb_on(stand_in_vllm_ascend):
    install_runner_hooks()
    from vllm_ascend.worker.v2 import model_runner

    assert patches.installed("runner.ascend_v2_load_model")  # the inherited one, wrapped on the subclass
    assert "load_model" in vars(model_runner.NPUModelRunner)
    runner = model_runner.NPUModelRunner()
    runner.load_model()  # EPLB off: upstream's load only
    assert model_runner.loaded == ["upstream"]
    runner.parallel_config = type(runner.parallel_config)(enable_eplb=True)
    with pytest.raises(RuntimeError, match="does not support Model Runner V2 yet"):
        runner.load_model()


def test_a_runner_upstream_renamed_warns_and_never_fails_vllms_import(tmp_path, monkeypatch):
    """EPLB off too the module imports as upstream's; with EPLB on the config gate refuses it by name."""
    module = ascend_names.RUNNERS[0][0]
    for i in range(1, module.count(".") + 1):
        package = tmp_path.joinpath(*module.split(".")[:i])
        package.mkdir(exist_ok=True)
        (package / "__init__.py").touch()
    tmp_path.joinpath(*module.split(".")).with_suffix(".py").write_text("class RenamedRunner:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    install_runner_hooks()
    try:
        with pytest.warns(RuntimeWarning, match=r"cannot bind EPLB after this runner's load: "
                                                r"vllm_ascend.worker.model_runner_v1.NPUModelRunner.load_model: target missing"):
            importlib.import_module(module)
        assert not patches.installed("runner.ascend_v1_load_model")
    finally:
        for name in [n for n in sys.modules if n == "vllm_ascend" or n.startswith("vllm_ascend.")]:
            del sys.modules[name]


def test_our_runner_names_are_the_ones_at_the_checked_commit():
    assert ASCEND_RUNNERS == tuple((module, name) for module, name, _, _ in ascend_names.RUNNERS)
    assert len(ascend_names.VLLM_ASCEND_COMMIT) == 40


@pytest.mark.parametrize("qualified", sorted({base for *_, base, _ in ascend_names.RUNNERS}
                                             | {base for *_, base in ascend_names.MRV2_EPLB}))
def test_the_upstream_bases_vllm_ascend_subclasses_exist_in_the_installed_vllm(qualified):
    """Read from the source, not imported: the GPU runner modules take seconds and a GPU to import."""
    module, name = qualified.rsplit(".", 1)
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"{module} is not in the installed vLLM"
    assert f"class {name}(" in Path(spec.origin).read_text() or f"class {name}:" in Path(spec.origin).read_text()


@pytest.mark.launches
def test_loading_the_plugin_imports_no_runner_module():
    """EPLB off, plugin loaded by EngineArgs: start-up pays for no runner import of ours."""
    script = (
        "import sys\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from eplb_graph.upstream import patches\n"
        "assert patches.installed('gate.create_engine_config'), 'plugin not loaded'\n"
        "print(sorted(m for m in sys.modules if m.startswith(('vllm.v1.worker.', 'vllm_ascend')) and 'runner' in m))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_PLUGINS": "eplb_graph"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
