"""ExpertWeightView on stand-ins for vLLM's RoutedExperts: the real quant-method classes and the
real FusedMoEQuantConfig the kernel reads, the parameters a layer holds after loading, and the
move lists upstream collects from them (its ``get_expert_weights``: every parameter as [E, -1])."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.model_executor.layers.fused_moe.config import (  # noqa: E402
    FUSED_MOE_UNQUANTIZED_CONFIG,
    fp8_w8a8_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod  # noqa: E402
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod  # noqa: E402
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w4a8_int8 import (  # noqa: E402,E501
    CompressedTensorsW4A8Int8MoEMethod,
)
from vllm.model_executor.layers.quantization.online.fp8 import (  # noqa: E402
    Fp8PerBlockOnlineMoEMethod,
    Fp8PerTensorOnlineMoEMethod,
    Fp8PtpcOnlineMoEMethod,
)

from eplb_graph.vllm_plugin.expert_views import (  # noqa: E402
    ExpertViewError,
    ExpertWeightView,
    complete_move_list,
)

E = 6


class Experts(torch.nn.Module):
    """A block-FP8 RoutedExperts after loading (an unquantized one with ``method`` unquantized):
    weights and block scales as parameters, the kernel holding the scales (and whatever else
    ``kernel_state`` names) in its quant config."""

    def __init__(self, method=Fp8MoEMethod, **kernel_state) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        fp8 = method is not UnquantizedFusedMoEMethod
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        self.w13_weight = torch.nn.Parameter(torch.randn(E, 16, 8, generator=gen).to(dtype), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.randn(E, 8, 8, generator=gen).to(dtype), requires_grad=False)
        quant_config = FUSED_MOE_UNQUANTIZED_CONFIG
        if fp8:
            self.w13_weight_scale_inv = torch.nn.Parameter(torch.rand(E, 1, 1, generator=gen), requires_grad=False)
            self.w2_weight_scale_inv = torch.nn.Parameter(torch.rand(E, 1, 1, generator=gen), requires_grad=False)
            quant_config = fp8_w8a8_moe_quant_config(
                self.w13_weight_scale_inv, self.w2_weight_scale_inv, block_shape=[128, 128], **kernel_state)
        self.local_num_experts = E
        quant_method = method.__new__(method)  # the real class; its kernel stands in
        if isinstance(quant_method, torch.nn.Module):  # vLLM's unquantized method is a CustomOp
            torch.nn.Module.__init__(quant_method)
        self.quant_method = quant_method
        self.quant_method.moe_kernel = SimpleNamespace(fused_experts=SimpleNamespace(quant_config=quant_config),
                                                       is_monolithic=False)

    def upstream_move_list(self) -> list[torch.Tensor]:
        return [p.view(E, -1) for p in self.parameters()]


def upstream_state(moved: list[list[torch.Tensor]], **overrides) -> SimpleNamespace:
    """Upstream's EplbModelState as far as the move lists go: idle, its buffers sized from layer 0."""
    return SimpleNamespace(**{"model": SimpleNamespace(expert_weights=moved), "communicator": None,
                              "expert_buffer": [torch.empty_like(t) for t in moved[0]], "rebalanced": False,
                              "pending_result": None, **overrides})


def test_a_block_fp8_layers_kernel_reads_only_what_upstream_moves():
    experts = Experts()
    view = ExpertWeightView("layers.0", experts, experts.upstream_move_list())
    assert list(view.moved) == ["w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"]
    assert view.derived == {}
    assert view.kernel_reads == {"w13_weight": "w13_weight", "w2_weight": "w2_weight",
                                 "w1_scale": "w13_weight_scale_inv", "w2_scale": "w2_weight_scale_inv"}


def test_a_scale_shared_by_every_expert_needs_no_move():
    experts = Experts(Fp8PerBlockOnlineMoEMethod, a1_scale=torch.ones(1), a2_scale=torch.ones(1).expand(E))
    view = ExpertWeightView("layers.0", experts, experts.upstream_move_list())
    assert view.kernel_reads["a1_scale"] == view.kernel_reads["a2_scale"] == "shared" and view.derived == {}


def test_per_expert_kernel_state_no_parameter_holds_is_added_to_what_upstream_moves():
    """FlashInfer's FP8 keeps per-expert alphas (scale products) only in its quant config."""
    experts = Experts(g1_alphas=torch.rand(E), g2_alphas=torch.rand(E))
    layers = [experts, Experts(g1_alphas=torch.rand(E), g2_alphas=torch.rand(E))]
    moved = [layer.upstream_move_list() for layer in layers]
    views = [ExpertWeightView(f"layers.{i}", layer, moved[i]) for i, layer in enumerate(layers)]
    assert list(views[0].derived) == ["w1_alpha_or_gscale", "w2_alpha_or_gscale"]
    model_state = upstream_state(moved)
    complete_move_list(views, model_state)
    for layer, tensors in zip(layers, moved):  # upstream now moves the alphas' own storage, row per expert
        alphas = layer.quant_method.moe_kernel.fused_experts.quant_config.g1_alphas
        assert len(tensors) == 6 and tensors[4].shape == (E, 1) and tensors[4].data_ptr() == alphas.data_ptr()
    assert [tuple(b.shape) for b in model_state.expert_buffer[4:]] == [(E, 1), (E, 1)]


def test_layers_deriving_different_state_are_refused():
    plain, alphas = Experts(), Experts(g1_alphas=torch.rand(E))
    views = [ExpertWeightView(f"layers.{i}", x, x.upstream_move_list()) for i, x in enumerate((plain, alphas))]
    with pytest.raises(ExpertViewError, match=r"MoE layers \['layers.1'\] move other expert tensors than layers.0"):
        complete_move_list(views, upstream_state([x.upstream_move_list() for x in (plain, alphas)]))


def test_layers_of_two_quant_methods_are_refused():
    """An FP8 checkpoint ignoring one MoE layer: upstream's buffers, sized from layer 0, would
    carry the other layer's bf16 rows as float8, or leave some tensors behind."""
    fp8, plain = Experts(), Experts(UnquantizedFusedMoEMethod)
    views = [ExpertWeightView(f"layers.{i}", x, x.upstream_move_list()) for i, x in enumerate((fp8, plain))]
    with pytest.raises(ExpertViewError, match=r"\['layers.1'\] move other expert tensors"):
        complete_move_list(views, upstream_state([x.upstream_move_list() for x in (fp8, plain)]))


def test_derived_state_is_not_added_while_a_rearrangement_is_in_flight():
    experts = Experts(g1_alphas=torch.rand(E))
    moved = [experts.upstream_move_list()]
    with pytest.raises(RuntimeError, match="in flight"):
        complete_move_list([ExpertWeightView("layers.0", experts, moved[0])], upstream_state(moved, rebalanced=True))


def test_per_expert_kernel_state_that_cannot_move_row_by_row_is_refused():
    experts = Experts(g1_alphas=torch.rand(2, E).t())  # [E, 2], not contiguous
    with pytest.raises(ExpertViewError, match=r"layer layers.0 \(Fp8MoEMethod\): view tensor w1_alpha_or_gscale"):
        ExpertWeightView("layers.0", experts, experts.upstream_move_list())


# no view was bound to these: W4A8-int8 runs only on AArch64, online per-tensor / per-channel FP8
# does not load on vLLM's CPU build (docs/support-matrix.md)
UNVIEWED = [CompressedTensorsW4A8Int8MoEMethod, Fp8PerTensorOnlineMoEMethod, Fp8PtpcOnlineMoEMethod]


@pytest.mark.parametrize("method", [SimpleNamespace, *UNVIEWED], ids=lambda m: m.__name__)
def test_a_quant_method_without_a_view_is_refused_by_name(method):
    experts = Experts(method=method)  # the kernel's inputs are visible, but the method was never viewed
    with pytest.raises(ExpertViewError, match=rf"layer layers.3 \({method.__name__}\): no expert-weight view"):
        ExpertWeightView("layers.3", experts, experts.upstream_move_list())


@pytest.mark.parametrize("kernel", [None, "monolithic"])
def test_a_method_running_no_modular_kernel_is_refused(kernel):
    experts = Experts()
    if kernel is None:
        experts.quant_method.moe_kernel = None
    else:
        experts.quant_method.moe_kernel.is_monolithic = True
    with pytest.raises(ExpertViewError, match="runs no modular, non-monolithic kernel"):
        ExpertWeightView("layers.0", experts, experts.upstream_move_list())


def test_a_quant_config_field_that_is_no_tensor_is_refused():
    experts = Experts()
    experts.quant_method.moe_kernel.fused_experts.quant_config._w1.scale = SimpleNamespace()  # a PrecisionConfig
    with pytest.raises(ExpertViewError, match="reads w1.scale as a SimpleNamespace"):
        ExpertWeightView("layers.0", experts, experts.upstream_move_list())
