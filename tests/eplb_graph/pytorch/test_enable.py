"""``eplb_graph.enable`` on Hugging Face MoE models as users build them: default ``grouped_mm``
experts, ``batched_mm``, load recorded without ceremony, and every bad input refused at
``enable()`` with the model exactly as it was."""

import copy
import types

import pytest
import torch
from torch import nn

import eplb_graph
from eplb_graph.pytorch.enable import NoLoadRecordedError
from eplb_graph.tools.inspect_models import build_tiny_hf_model
from eplb_reference.models.hf_families import build_tiny_family
from tests.markers import requires_cuda

TOKENS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def pair(family="qwen3_moe", implementation="grouped_mm"):
    logical = build_tiny_hf_model(family, experts_implementation=implementation)
    return logical, copy.deepcopy(logical)


def compiled_model(model, handle, backend="aot_eager"):
    return torch.compile(model, backend=handle.backend(backend), fullgraph=True)


def check_inductor_across_a_rearrangement(logical, model, handle, tokens, tolerance):
    """Compiled with Inductor: the logical output before and after rearrange(), no recompile."""
    compiled = compiled_model(model, handle, "inductor")
    expected = logical(tokens).logits
    torch.testing.assert_close(compiled(tokens).logits, expected, rtol=tolerance, atol=tolerance)
    handle.rearrange()
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(compiled(tokens).logits, expected, rtol=tolerance, atol=tolerance)
    assert handle.compiled_graphs[-1].report.ok


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
@torch.no_grad()
def test_experts_implementations_run_over_the_physical_layout(implementation):
    logical, model = pair(implementation=implementation)
    handle = eplb_graph.enable(model, num_redundant_experts=2, ep_size=2)
    experts = model.model.layers[0].mlp.experts
    assert experts.num_experts == 10 and experts.gate_up_proj.shape[0] == 10 and experts.down_proj.shape[0] == 10
    compiled = compiled_model(model, handle)
    expected = logical(TOKENS).logits
    torch.testing.assert_close(compiled(TOKENS).logits, expected, rtol=1e-5, atol=1e-5)
    record = handle.compiled_graphs[-1]
    assert record.report.ok and record.result.routers_mapped == 2

    before = handle.physical_to_logical()
    assert not torch.equal(handle.rearrange(), before)  # balanced on what that forward recorded
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(compiled(TOKENS).logits, expected, rtol=1e-5, atol=1e-5)
    placement = handle.layers[0].tables.physical_to_logical
    assert torch.equal(experts.gate_up_proj, logical.model.layers[0].mlp.experts.gate_up_proj[placement])


@torch.no_grad()
def test_default_grouped_mm_with_inductor_on_a_grouped_bias_corrected_router():
    logical, model = pair("deepseek_v3")
    handle = eplb_graph.enable(model, num_redundant_experts=2, ep_size=2)
    check_inductor_across_a_rearrangement(logical, model, handle, TOKENS, 1e-4)


@torch.no_grad()
def test_every_token_is_recorded_without_set_batch_and_set_batch_still_narrows():
    _, model = pair()
    handle = eplb_graph.enable(model, num_redundant_experts=2)
    compiled = compiled_model(model, handle)
    layers, rows, top_k = 2, TOKENS.numel(), 2

    compiled(TOKENS)
    assert int(handle.logical_load().sum()) == layers * rows * top_k
    handle.set_batch(num_tokens=5)  # the last rows are padding
    compiled(TOKENS)
    assert int(handle.logical_load().sum()) == layers * (rows + 5) * top_k
    handle.set_batch()  # every row again
    compiled(TOKENS)
    assert int(handle.logical_load().sum()) == layers * (2 * rows + 5) * top_k


@torch.no_grad()
def test_a_phase_filtered_handle_records_only_announced_batches():
    _, model = pair()
    handle = eplb_graph.enable(model, num_redundant_experts=2, load_phase="decode")
    compiled = compiled_model(model, handle)
    compiled(TOKENS)
    assert int(handle.logical_load().sum()) == 0
    with pytest.raises(NoLoadRecordedError, match="load_phase='decode' records only batches announced"):
        handle.rearrange()
    handle.set_batch(is_prefill=True)
    compiled(TOKENS)
    assert int(handle.logical_load().sum()) == 0
    handle.set_batch(is_prefill=False)
    compiled(TOKENS)
    assert int(handle.logical_load().sum()) == 2 * TOKENS.numel() * 2


@torch.no_grad()
def test_rearrange_refuses_to_balance_on_no_load_and_idle_layers_keep_their_placement():
    _, model = pair()
    handle = eplb_graph.enable(model, num_redundant_experts=2)
    with pytest.raises(NoLoadRecordedError, match="no load recorded in any of the 2 MoE layers"):
        handle.rearrange()
    compiled = compiled_model(model, handle)
    compiled(TOKENS)
    handle.rearrange()
    with pytest.raises(NoLoadRecordedError):
        handle.rearrange()  # the last rearrangement consumed the load

    compiled(TOKENS)
    handle.layers[1].tables.reset_load_()  # layer 1 saw no token (e.g. vision experts, text traffic)
    before = handle.physical_to_logical()
    after = handle.rearrange()
    assert torch.equal(after[1], before[1])


def test_enabling_a_model_twice_is_refused():
    _, model = pair()
    eplb_graph.enable(model, num_redundant_experts=2)
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts: already under graph-mode EPLB"):
        eplb_graph.enable(model, num_redundant_experts=2)


# -- bad input: ValueError at enable(), naming the module and the reason; the model untouched ----------


class OpaqueRouter(nn.Module):
    """A router that exposes neither top_k nor num_experts."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states):
        return self.inner(hidden_states)


def dense_model():
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def opaque_router():
    _, model = pair()
    for layer in model.model.layers:
        layer.mlp.gate = OpaqueRouter(layer.mlp.gate)
    return model


def scale_not_expert_major():
    _, model = pair()
    experts = model.model.layers[1].mlp.experts
    experts.register_buffer("down_proj_scale", torch.ones(16, 8))  # [inter, E]: a placement could not move it
    return model


def ids_shifted_after_topk():
    _, model = pair()
    gate = model.model.layers[0].mlp.gate

    def forward(self, hidden_states):
        logits, weights, ids = type(self).forward(self, hidden_states)
        return logits, weights, (ids + 1) % self.num_experts  # not the ids the top-k chose

    gate.forward = types.MethodType(forward, gate)
    return model


def eager_experts():
    _, model = pair()
    model.config._experts_implementation = "eager"
    return model


@pytest.fixture
def registered_experts(monkeypatch):
    """An experts implementation of the user's own, registered as transformers documents it."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, batched_mm_experts_forward

    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS, "my_experts", batched_mm_experts_forward)


def unproven_experts():
    _, model = pair()
    model.config._experts_implementation = "my_experts"
    return model


def transformers_expert_parallel():
    _, model = pair()
    model.model.layers[0].mlp.experts._is_expert_parallel = True
    return model


BAD_INPUTS = {
    "no_moe_layer": (dense_model, r"no MoE layer found in Qwen3ForCausalLM: searched for .*use_experts_implementation"),
    "router_without_top_k": (opaque_router, r"model.layers.0.mlp.gate: no readable top_k on the router"),
    "not_expert_major": (scale_not_expert_major, r"model.layers.1.mlp.experts.down_proj_scale \(16, 8\) is not expert-major"),
    "selection_without_topk": (
        lambda: build_tiny_family("phimoe").model,
        r"model.layers.0.mlp: no torch.topk over the 8 experts with k=2 selects them",
    ),
    "ids_changed_after_topk": (ids_shifted_after_topk, r"model.layers.0.mlp: the experts do not receive the ids"),
    "eager_experts": (
        eager_experts,
        r"model.layers.0.mlp: experts implementation 'eager' is not graph-safe.*set_experts_implementation\(\"grouped_mm\"\)",
    ),
    "unproven_experts": (
        unproven_experts,
        r"experts implementation 'my_experts' is not proven with graph-mode EPLB \(proven: grouped_mm, batched_mm\)",
    ),
    "transformers_expert_parallel": (transformers_expert_parallel, r"model.layers.0.mlp.experts: transformers' own expert parallel"),
}


def snapshot(model: nn.Module) -> dict:
    """Everything enable() could change: tensors (values, identity, shape), plain attributes, hooks."""
    modules = {}
    for name, module in model.named_modules():
        plain = {k: v for k, v in vars(module).items() if isinstance(v, (int, float, str, bool, type(None)))}
        tensors = {k: (id(t), tuple(t.shape)) for k, t in [*module._parameters.items(), *module._buffers.items()] if t is not None}
        hooks = [len(module._forward_hooks), len(module._forward_pre_hooks)]
        modules[name] = (plain, tensors, hooks, sorted(vars(module).get("__dict__", {})))
    return {"state": {k: v.clone() for k, v in model.state_dict().items()}, "modules": modules}


@pytest.mark.parametrize("case", BAD_INPUTS)
@torch.no_grad()
def test_bad_input_is_refused_at_enable_with_the_model_untouched(case, registered_experts):
    build, match = BAD_INPUTS[case]
    model = build()
    tokens = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(1))
    before, output_before = snapshot(model), model(tokens).logits
    rng_before = torch.random.get_rng_state()
    with pytest.raises(ValueError, match=match):
        eplb_graph.enable(model, num_redundant_experts=2)
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    after = snapshot(model)
    assert after["modules"] == before["modules"]
    assert after["state"].keys() == before["state"].keys()
    assert all(torch.equal(after["state"][k], before["state"][k]) for k in before["state"])
    assert torch.equal(model(tokens).logits, output_before)


# -- CUDA: torch._grouped_mm over physical offsets (skipped without a GPU) ------------------------------


@requires_cuda
@torch.no_grad()
def test_cuda_grouped_mm_bins_offsets_over_the_physical_experts():
    """bf16 on CUDA under torch.compile is the path where transformers calls torch._grouped_mm with
    offsets from histc over ``experts.num_experts`` bins: enable() makes that the physical count,
    so the offsets have one entry per physical slot, as the weights' leading dim."""
    logical, model = pair()
    logical, model = logical.to("cuda", torch.bfloat16), model.to("cuda", torch.bfloat16)
    handle = eplb_graph.enable(model, num_redundant_experts=4, ep_size=2)
    assert model.model.layers[0].mlp.experts.num_experts == 12
    check_inductor_across_a_rearrangement(logical, model, handle, TOKENS.cuda(), 2e-2)


@requires_cuda
@torch.no_grad()
def test_cuda_graph_replays_follow_rearrangement():
    logical, model = pair(implementation="grouped_mm")
    logical, model = logical.to("cuda", torch.bfloat16), model.to("cuda", torch.bfloat16)
    handle = eplb_graph.enable(model, num_redundant_experts=4, ep_size=2)
    compiled = torch.compile(model, backend=handle.backend("inductor"), fullgraph=True, mode="reduce-overhead")
    tokens = TOKENS.cuda()
    expected = logical(tokens).logits
    for _ in range(3):  # warm-up, record, replay
        output = compiled(tokens).logits.clone()
    torch.testing.assert_close(output, expected, rtol=2e-2, atol=2e-2)
    pointers = [layer.lookup.data_ptr() for layer in handle.layers]
    handle.rearrange()
    torch.testing.assert_close(compiled(tokens).logits.clone(), expected, rtol=2e-2, atol=2e-2)
    assert [layer.lookup.data_ptr() for layer in handle.layers] == pointers
