"""Upstream's EPLB refusal of the int4 (WNA16) MoE method, answered for its CPU backend only."""

from __future__ import annotations

import importlib
import sys
import types

import pytest

pytest.importorskip("vllm")

from eplb_graph.vllm_plugin import quant_methods  # noqa: E402


def method_on(backend: str):
    module = importlib.import_module(quant_methods.WNA16_MODULE)
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend

    method = object.__new__(module.CompressedTensorsWNA16MoEMethod)
    method.wna16_backend = WNA16MoEBackend(backend)
    return method


def test_the_cpu_backend_supports_eplb_and_the_others_keep_upstreams_answer():
    quant_methods.install_quant_method_hooks()  # the plugin did at load too: idempotent
    assert method_on("CPU").supports_eplb is True
    assert method_on("TRITON").supports_eplb is True  # upstream's own
    assert method_on("MARLIN").supports_eplb is False and method_on("ZEN_CPU").supports_eplb is False


def test_w4a8_int8_keeps_upstreams_refusal():
    """Its CPU kernel runs on AArch64 only and no view of it was bound: upstream's layer build
    refuses EPLB for it by name (``supports_eplb`` False), with the plugin's hooks installed."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a8_int8 as w4a8,
    )

    quant_methods.install_quant_method_hooks()
    method = object.__new__(w4a8.CompressedTensorsW4A8Int8MoEMethod)
    assert method.supports_eplb is False


def test_an_upstream_refactor_of_the_property_is_named_and_left_alone(monkeypatch):
    """With EPLB off too the module imports as upstream's; with EPLB on upstream refuses the method."""
    stand_in = types.ModuleType(quant_methods.WNA16_MODULE)
    stand_in.CompressedTensorsWNA16MoEMethod = type("CompressedTensorsWNA16MoEMethod", (), {"supports_eplb": False})
    monkeypatch.setitem(sys.modules, quant_methods.WNA16_MODULE, stand_in)  # as during vLLM's import of it
    with pytest.warns(RuntimeWarning, match="CompressedTensorsWNA16MoEMethod.supports_eplb: signature changed "
                                            r"\(expected a property, found bool\)"):
        quant_methods._serve_wna16(stand_in)
    assert stand_in.CompressedTensorsWNA16MoEMethod.supports_eplb is False


def test_a_module_imported_later_is_served_once_imported(tmp_path, monkeypatch):
    from eplb_graph.vllm_plugin.import_hooks import AfterImport, call_after_import

    (tmp_path / "later_quant_module.py").write_text("class Method:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    call_after_import("later_quant_module", "test", lambda module: seen.append(module.Method))
    call_after_import("later_quant_module", "test", lambda module: seen.append(module.Method))  # same key: once
    assert seen == [] and "later_quant_module" not in sys.modules  # nothing imported by the hook
    import later_quant_module

    assert seen == [later_quant_module.Method]
    del sys.modules["later_quant_module"]
    finder, = [f for f in sys.meta_path if isinstance(f, AfterImport)]
    del finder.callbacks["later_quant_module"]
