"""``LocalPairExperts``: one layer's CPU experts instance bound to run this rank's pairs only.

The experts here derive from vLLM's own class (the binding matches the class by identity) and
stand in for its contract and ``apply`` signature (the engine tests run vLLM's own, at TP=2 and
DP=2: test_engine.py); their kernel crashes on a global id as vLLM's does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm.model_executor.layers.fused_moe.experts import cpu_moe

from eplb_graph.custom_ops import LOCAL_EXPERTS
from eplb_graph.vllm_plugin.local_experts import LocalExpertsError, LocalPairExperts
from tests.custom_ops.test_local_experts import H, I, silu_moe


class CPUUnquantizedExperts(cpu_moe.CPUUnquantizedExperts):
    """vLLM's CPU experts' contract: local ids, weights applied, summed over k into ``output``."""

    def __init__(self) -> None:  # none of upstream's state: every method used here is overridden
        self.calls = []
        self.workspaces = []  # (M, topk) each workspace was sized for

    def moe_problem_size(self, a1, w1, w2, topk_ids):
        return w1.shape[0], a1.shape[0], w1.shape[1], a1.shape[1], topk_ids.shape[1]

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, meta, activation):
        self.workspaces.append((M, topk))
        return (0,), (0,), (M, K)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        assert expert_map is None and int(topk_ids.max()) < w1.shape[0], "the kernel indexes local buffers"
        self.calls.append(tuple(topk_ids.shape))
        output.copy_(silu_moe(hidden_states, w1, w2, topk_weights, topk_ids.long()))


class X86CPUUnquantizedExperts(CPUUnquantizedExperts):
    pass


def layer(experts) -> SimpleNamespace:
    return SimpleNamespace(quant_method=SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=experts)),
                           activation="silu", global_num_experts=4, apply_router_weight_on_input=False)


def call(experts, expert_map, w13, w2, x, weights, ids, **overrides):
    output = torch.empty_like(x)
    args = {**dict(activation="silu", global_num_experts=4, expert_map=expert_map, a1q_scale=None, a2_scale=None,
                   expert_tokens_meta=None, apply_router_weight_on_input=False), **overrides}
    experts.apply(output, x, w13, w2, weights, ids, args["activation"], args["global_num_experts"],
                  args["expert_map"], args["a1q_scale"], args["a2_scale"], None, None, args["expert_tokens_meta"],
                  args["apply_router_weight_on_input"])
    return output


@pytest.fixture
def bound():
    torch.manual_seed(0)
    experts = X86CPUUnquantizedExperts()
    binding = LocalPairExperts(layer(experts), "test.layers.0.experts")
    yield experts, binding
    binding.unbind()


def test_the_instance_runs_the_local_pairs_through_its_own_upstream_apply(bound):
    experts, binding = bound
    w13, w2 = torch.randn(4, 2 * I, H), torch.randn(4, H, I)  # global experts 0..3; this rank holds 2 and 3
    x, weights = torch.randn(5, H), torch.rand(5, 2)
    ids = torch.tensor([[0, 2], [3, 1], [2, 3], [0, 1], [3, 0]], dtype=torch.int32)
    out = call(experts, torch.tensor([-1, -1, 0, 1], dtype=torch.int32), w13[2:], w2[2:], x, weights, ids)
    torch.testing.assert_close(out, silu_moe(x, w13, w2, weights * (ids >= 2), ids.long()))
    assert experts.calls == [(5, 1)]  # five local pairs, as top-1 rows: the foreign five cost nothing
    assert experts.workspaces == [(5, 1)]  # the workspaces sized for those rows
    assert (binding.counts.pairs, binding.counts.seen, binding.counts.calls) == (5, 10, 1)


def test_without_an_expert_map_upstream_runs_as_is(bound):
    experts, _binding = bound
    w13, w2 = torch.randn(2, 2 * I, H), torch.randn(2, H, I)
    x, weights, ids = torch.randn(3, H), torch.rand(3, 2), torch.tensor([[0, 1]] * 3, dtype=torch.int32)
    torch.testing.assert_close(call(experts, None, w13, w2, x, weights, ids), silu_moe(x, w13, w2, weights, ids.long()))
    assert experts.calls == [(3, 2)]


def test_a_call_other_than_bound_is_refused_by_name(bound):
    experts, _binding = bound
    w13, w2 = torch.randn(2, 2 * I, H), torch.randn(2, H, I)
    x, weights, ids = torch.randn(3, H), torch.rand(3, 2), torch.tensor([[0, 1]] * 3, dtype=torch.int32)
    with pytest.raises(LocalExpertsError, match="test.layers.0.experts: its experts were called with activation=gelu"):
        call(experts, torch.tensor([0, 1], dtype=torch.int32), w13, w2, x, weights, ids, activation="gelu")
    with pytest.raises(LocalExpertsError, match="input scales=True"):
        call(experts, torch.tensor([0, 1], dtype=torch.int32), w13, w2, x, weights, ids, a1q_scale=torch.ones(1))
    with pytest.raises(LocalExpertsError, match="intermediate scales=True"):  # never silently dropped
        call(experts, torch.tensor([0, 1], dtype=torch.int32), w13, w2, x, weights, ids, a2_scale=torch.ones(1))
    assert experts.calls == []


def test_only_the_instance_is_bound_and_unbinding_restores_upstream(bound):
    experts, binding = bound
    other = X86CPUUnquantizedExperts()
    assert "apply" in vars(experts) and "apply" not in vars(other)
    with pytest.raises(LocalExpertsError, match="already bound"):
        LocalPairExperts(layer(experts), "test.layers.0.again")
    binding.unbind()
    assert "apply" not in vars(experts) and "test.layers.0.experts" not in LOCAL_EXPERTS


def test_a_binding_refused_at_registration_leaves_the_experts_unbound(bound):
    _experts, binding = bound
    other = X86CPUUnquantizedExperts()
    with pytest.raises(ValueError, match="already registered"):
        LocalPairExperts(layer(other), binding.key)  # the key is the bound layer's
    assert "apply" not in vars(other) and LOCAL_EXPERTS.resolve(binding.key)[0] is binding


def test_experts_of_another_class_are_refused_by_name():
    class TritonExperts:
        def apply(self, *args):
            raise AssertionError

    with pytest.raises(LocalExpertsError, match=r"this layer's experts are \S+\.TritonExperts"):
        LocalPairExperts(layer(TritonExperts()), "test.layers.1.experts")


def test_a_class_that_only_shares_a_listed_name_is_refused_naming_its_module():
    """vLLM 0.32 has two CPUExpertsInt4 classes; the monolithic one cannot run top-1 rows."""
    class CPUExpertsInt4:
        def apply(self, *args):
            raise AssertionError

    experts = CPUExpertsInt4()
    with pytest.raises(LocalExpertsError, match=rf"this layer's experts are {__name__}\.\S*CPUExpertsInt4$"):
        LocalPairExperts(layer(experts), "test.layers.3.experts")
    assert "apply" not in vars(experts) and "test.layers.3.experts" not in LOCAL_EXPERTS


def test_rebinding_follows_the_layers_new_experts_instance_and_expert_count():
    """vLLM's elastic EP gives a layer a new experts instance and global expert count at a resize."""
    old = X86CPUUnquantizedExperts()
    routed = layer(old)
    binding = LocalPairExperts(routed, "test.layers.2.experts")
    new = X86CPUUnquantizedExperts()
    routed.quant_method.moe_kernel.fused_experts, routed.global_num_experts = new, 6
    rebound = binding.rebind()
    try:
        assert "apply" not in vars(old) and "apply" in vars(new) and rebound.global_num_experts == 6
        w13, w2 = torch.randn(2, 2 * I, H), torch.randn(2, H, I)
        x, weights, ids = torch.randn(3, H), torch.rand(3, 2), torch.tensor([[4, 5]] * 3, dtype=torch.int32)
        expert_map = torch.tensor([-1, -1, -1, -1, 0, 1], dtype=torch.int32)
        out = call(new, expert_map, w13, w2, x, weights, ids, global_num_experts=6)
        torch.testing.assert_close(out, silu_moe(x, w13, w2, weights, ids.long() - 4))
    finally:
        rebound.unbind()
