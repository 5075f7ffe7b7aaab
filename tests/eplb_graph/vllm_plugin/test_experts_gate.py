"""The experts gate: under expert parallel on CPU, a MoE layer built with experts the local-pairs
op cannot bind is refused when vLLM builds the model, before any weight loads (the bind's own
refusal of an instance is test_local_experts.py's; a real engine refusing is not booted here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn
from vllm.model_executor.layers.fused_moe.experts import cpu_int4_moe, cpu_moe
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

from eplb_graph.upstream import patches
from eplb_graph.vllm_plugin import experts_gate
from eplb_graph.vllm_plugin.local_experts import LocalExpertsError


def routed_experts(name: str, experts_cls: type | None, *, use_ep: bool = True) -> RoutedExperts:
    """A layer as upstream's constructor leaves it, for what the gate reads: its name, its
    quant method's chosen experts class, its parallel config."""
    layer = RoutedExperts.__new__(RoutedExperts)
    nn.Module.__init__(layer)
    layer.layer_name = name
    layer.quant_method = SimpleNamespace(experts_cls=experts_cls)
    layer.moe_config = SimpleNamespace(moe_parallel_config=SimpleNamespace(use_ep=use_ep))
    return layer


def model(*layers: RoutedExperts) -> nn.Module:
    built = nn.Module()
    built.layers = nn.ModuleList(layers)
    return built


def test_bindable_classes_and_layers_without_expert_parallel_or_a_named_class_pass():
    built = model(routed_experts("model.layers.0.mlp.experts", cpu_moe.CPUUnquantizedExperts),
                  routed_experts("model.layers.1.mlp.experts", cpu_moe.CPUExpertsFp8),
                  routed_experts("model.layers.2.mlp.experts", cpu_moe.CPUExpertsInt4),
                  routed_experts("model.layers.3.mlp.experts", cpu_moe.CPUExpertsInt8, use_ep=False),
                  routed_experts("model.layers.4.mlp.experts", None))  # left to the bind
    assert experts_gate.unbindable_layers(built) == []
    experts_gate.refuse_unbindable(built)


def test_an_unbindable_class_is_refused_by_layer_and_class_and_a_namesake_is_matched_by_identity():
    built = model(routed_experts("model.layers.0.mlp.experts", cpu_moe.CPUUnquantizedExperts),
                  routed_experts("model.layers.1.mlp.experts", cpu_moe.CPUExpertsInt8),
                  routed_experts("model.layers.2.mlp.experts", cpu_int4_moe.CPUExpertsInt4),
                  routed_experts("model.layers.3.mlp.experts", cpu_moe.CPUExpertsFp8W8A8))
    with pytest.raises(LocalExpertsError) as refused:
        experts_gate.refuse_unbindable(built)
    message = str(refused.value)
    assert "refused before loading any weight" in message and "3 MoE layer(s)" in message
    assert "model.layers.1.mlp.experts: vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUExpertsInt8" in message
    assert "model.layers.2.mlp.experts: vllm.model_executor.layers.fused_moe.experts.cpu_int4_moe.CPUExpertsInt4" \
        in message
    assert "model.layers.3.mlp.experts: vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUExpertsFp8W8A8" \
        in message
    assert "layers.0" not in message


def config(*, eplb: bool, device: str) -> SimpleNamespace:
    return SimpleNamespace(parallel_config=SimpleNamespace(enable_eplb=eplb),
                           device_config=SimpleNamespace(device_type=device))


def test_create_model_refuses_with_eplb_on_cpu_only():
    unbindable = model(routed_experts("model.layers.0.mlp.experts", cpu_moe.CPUExpertsInt8))
    create_model = experts_gate.checked(lambda loader, vllm_config, **kwargs: unbindable)
    with pytest.raises(LocalExpertsError, match="CPUExpertsInt8"):
        create_model(object(), config(eplb=True, device="cpu"), model_config=None)
    assert create_model(object(), config(eplb=False, device="cpu"), model_config=None) is unbindable
    assert create_model(object(), config(eplb=True, device="cuda"), model_config=None) is unbindable


def test_the_plugin_wraps_upstreams_create_model_when_vllm_imports_the_loader():
    from vllm.model_executor.model_loader import base_loader

    was_installed = patches.installed(experts_gate.ADAPTATION)
    experts_gate._wrap_create_model(base_loader)
    try:
        assert patches.installed(experts_gate.ADAPTATION)
        assert base_loader.BaseModelLoader.create_model.__wrapped__.__qualname__ == "BaseModelLoader.create_model"
    finally:
        if not was_installed:
            patches.uninstall(experts_gate.ADAPTATION)
