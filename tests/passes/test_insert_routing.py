import copy

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import eplb_graph
from eplb_graph.tools.inspect_models import HF_FAMILIES, build_tiny_hf_model
from eplb_reference.models.reference import ReferenceMoEConfig, build_reference_model
from eplb_graph.passes.insert_routing import UnattributedRouterError, insert_eplb_routing
from eplb_graph.passes.router_sites import RouterSpec, normalise_module_path
from eplb_graph.passes.verify import verify


def reference_pair(**config):
    logical = build_reference_model(ReferenceMoEConfig(**config))
    return logical, copy.deepcopy(logical)


def skewed_tokens(batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, max(vocab // 8, 1), (batch, seq), generator=gen)  # a narrow vocab skews routing


def random_placement(num_logical: int, num_physical: int, num_layers: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_layers):
        extra = torch.randint(0, num_logical, (num_physical - num_logical,), generator=gen)
        rows.append(torch.cat([torch.arange(num_logical), extra])[torch.randperm(num_physical, generator=gen)])
    return torch.stack(rows)


def test_module_paths_are_normalised():
    assert normalise_module_path("L['self'].model.layers[3].mlp.gate") == "model.layers.3.mlp.gate"
    assert normalise_module_path("L['self'].layers.0.mlp") == "layers.0.mlp"
    assert normalise_module_path("G['net'].blocks['a'].gate") == "blocks.a.gate"


@torch.no_grad()
def test_reference_model_matches_logical_model_bitwise_across_placements():
    logical, model = reference_pair(num_layers=2, shared_expert_intermediate_size=16)
    handle = eplb_graph.enable(model, num_redundant_experts=4, ep_size=4)
    compiled = torch.compile(model, backend=handle.backend("aot_eager"), fullgraph=True)
    tokens = [skewed_tokens(2, 9, 256, seed) for seed in range(4)]

    handle.set_batch(num_tokens=18)
    assert torch.equal(compiled(tokens[0]), logical(tokens[0]))
    record = handle.compiled_graphs[-1]
    assert record.report.ok and record.report.routers_mapped == 2
    assert torch._dynamo.utils.counters["graph_break"] == {}

    pointers = [layer.lookup.data_ptr() for layer in handle.layers]
    placements = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step, x in enumerate(tokens * 2):
            assert torch.equal(compiled(x), logical(x)), f"step {step}"
            if step % 2:
                placements.append(handle.rearrange())  # upstream policy on the recorded load
            else:
                placements.append(handle.apply_placement(random_placement(16, 20, 2, seed=step)))
    assert [layer.lookup.data_ptr() for layer in handle.layers] == pointers
    assert len({tuple(p.flatten().tolist()) for p in placements}) > 1  # placement really changed
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@torch.no_grad()
def test_rearrange_balances_the_recorded_load():
    logical, model = reference_pair(num_layers=1, num_experts=16, top_k=2)
    handle = eplb_graph.enable(model, num_redundant_experts=4, ep_size=4)
    compiled = torch.compile(model, backend=handle.backend("aot_eager"), fullgraph=True)

    def rank_balance() -> float:
        per_rank = handle.layers[0].load.double().reshape(4, -1).sum(-1)
        return float(per_rank.mean() / per_rank.max())

    def run() -> None:
        handle.layers[0].tables.reset_load_()
        for seed in range(6):
            x = skewed_tokens(4, 16, 256, seed)
            handle.set_batch(num_tokens=x.numel())
            compiled(x)

    run()
    before = rank_balance()
    handle.rearrange()
    run()
    assert rank_balance() > before
    # the hosted weights follow the lookup: every slot holds its logical expert's weights
    experts = model.layers[0].mlp.experts
    placement = handle.layers[0].tables.physical_to_logical
    assert torch.equal(experts.w13, logical.layers[0].mlp.experts.w13[placement])
    assert torch.equal(experts.w2, logical.layers[0].mlp.experts.w2[placement])


@pytest.mark.parametrize("family", HF_FAMILIES)
@torch.no_grad()
def test_hugging_face_families_map_only_the_expert_topk(family):
    logical = build_tiny_hf_model(family)
    model = copy.deepcopy(logical)
    handle = eplb_graph.enable(model, num_redundant_experts=2, ep_size=2)
    compiled = torch.compile(model, backend=handle.backend("aot_eager"), fullgraph=True)
    x = torch.randint(0, 128, (2, 6))
    handle.set_batch(num_tokens=12)
    assert torch.equal(compiled(x).logits, logical(x).logits)

    record = handle.compiled_graphs[-1]
    assert record.report.ok, record.report.problems
    assert record.result.routers_mapped == 2 == len(handle.layers)
    skipped = [s for s in record.result.sites if s.router is not None and not s.selects_experts]
    # DeepSeek-V3: two group-level top-k per router, neither maps
    assert len(skipped) == (4 if family == "deepseek_v3" else 0)
    assert int(handle.logical_load().sum()) == 2 * 12 * 2  # layers x tokens x top_k

    placement = random_placement(8, 10, 2, seed=1)
    handle.apply_placement(placement)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(compiled(x).logits, logical(x).logits)


@torch.no_grad()
def test_graph_text_has_routing_between_topk_and_experts():
    _, model = reference_pair(num_layers=2)
    handle = eplb_graph.enable(model, num_redundant_experts=2)
    torch.compile(model, backend=handle.backend("aot_eager"), fullgraph=True)(torch.randint(0, 256, (1, 4)))
    code = handle.compiled_graphs[-1].graph_after
    check = torch.testing.FileCheck()
    for index in range(2):
        key = handle.layers[index].key
        (
            check.check("torch.topk(")
            .check("torch.ops.eplb_graph.map_and_record_layer.default(")
            .check(f"'{key}'")
            .check("torch.bmm(")
            .check("torch.bmm(")
        )
    check.run(code)
    torch.testing.FileCheck().check_count("map_and_record_layer.default(", 2, exactly=True).run(code)
    # before the pass: no routing op at all
    torch.testing.FileCheck().check_not("map_and_record_layer").run(handle.compiled_graphs[-1].graph_before)


@torch.no_grad()
def test_inductor_with_freezing_and_constant_folding_reads_live_tables_and_weights():
    logical, model = reference_pair(num_layers=1, num_experts=8, top_k=2)
    handle = eplb_graph.enable(model, num_redundant_experts=2)
    x = skewed_tokens(2, 8, 256, seed=0)
    with inductor_config.patch(freezing=True, joint_graph_constant_folding=True):
        compiled = torch.compile(model, backend=handle.backend("inductor"), fullgraph=True)
        torch.testing.assert_close(compiled(x), logical(x), rtol=1e-5, atol=1e-5)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for seed in range(3):
                handle.apply_placement(random_placement(8, 10, 1, seed))
                handle.layers[0].tables.reset_load_()
                handle.set_batch(num_tokens=16)
                torch.testing.assert_close(compiled(x), logical(x), rtol=1e-5, atol=1e-5)
                # routed by the new placement: load sits only on slots that host an expert
                ids = torch.topk(
                    torch.nn.functional.linear(
                        model.layers[0].mlp_norm(x_hidden(model, x)), model.layers[0].mlp.gate.weight
                    ).softmax(-1),
                    2,
                ).indices
                expected = torch.ops.eplb_graph.map_to_physical(ids.reshape(-1, 2), handle.layers[0].lookup, handle.layers[0].replica_count)
                assert torch.equal(handle.layers[0].load, torch.bincount(expected.flatten(), minlength=10))


def x_hidden(model, x):
    """Hidden state entering layer 0's MoE block (after attention), for recomputing routing."""
    h = model.embed(x)
    layer = model.layers[0]
    return h + layer.attn(layer.attn_norm(h))


@torch.no_grad()
def test_post_grad_pass_in_inductor():
    logical, model = reference_pair(num_layers=2, num_experts=8, top_k=2)
    handle = eplb_graph.enable(model, num_redundant_experts=2)
    post_grad = handle.post_grad_pass()
    x = skewed_tokens(2, 5, 256, seed=3)
    with inductor_config.patch(post_grad_custom_post_pass=post_grad, fx_graph_cache=False):
        compiled = torch.compile(model, fullgraph=True)
        handle.set_batch(num_tokens=10)
        torch.testing.assert_close(compiled(x), logical(x), rtol=1e-5, atol=1e-5)
        handle.apply_placement(random_placement(8, 10, 2, seed=5))
        with torch._dynamo.config.patch(error_on_recompile=True):
            torch.testing.assert_close(compiled(x), logical(x), rtol=1e-5, atol=1e-5)
    assert [(r.routers_found, r.routers_mapped) for r in post_grad.results] == [(2, 2)]
    assert int(handle.logical_load().sum()) == 2 * 10 * 2


def test_post_grad_pass_uuid_is_stable_and_tracks_configuration():
    _, model = reference_pair(num_layers=1)
    handle = eplb_graph.enable(model)
    first, second = handle.post_grad_pass(), handle.post_grad_pass()
    assert first.uuid() == second.uuid()
    other = eplb_graph.enable(reference_pair(num_layers=1)[1])
    assert other.post_grad_pass().uuid() != first.uuid()  # other layer keys
    assert isinstance(first, CustomGraphPass)


def test_vllm_inductor_pass_wraps_the_same_pass():
    from vllm.compilation.passes.inductor_pass import InductorPass

    _, model = reference_pair(num_layers=1)
    handle = eplb_graph.enable(model)
    wrapped = handle.vllm_inductor_pass()
    assert isinstance(wrapped, InductorPass)
    assert wrapped.uuid() == handle.post_grad_pass().uuid()


def _expert_shaped_topk_graph(router_path_in_stack: str):
    """A Dynamo-like graph: one top-k over 8 experts, k=2, inside the given module path."""
    graph = torch.fx.Graph()
    probs = graph.placeholder("probs")
    probs.meta["example_value"] = torch.empty(4, 8)
    topk = graph.call_function(torch.topk, (probs, 2), {"dim": -1})
    topk.meta["nn_module_stack"] = {"a": (f"L['self'].{router_path_in_stack}", torch.nn.Module)}
    ids = graph.call_function(__import__("operator").getitem, (topk, 1))
    graph.output(ids)
    return graph


def test_unattributable_expert_topk_errors_in_strict_mode_and_warns_otherwise():
    router = RouterSpec("eplb-test.0", "layers.0.mlp.gate", num_experts=8, top_k=2)
    with pytest.raises(UnattributedRouterError, match=r"topk \(module other.router\)"):
        insert_eplb_routing(_expert_shaped_topk_graph("other.router"), [router], strict=True)
    with pytest.warns(UserWarning, match="not attributable"):
        result = insert_eplb_routing(_expert_shaped_topk_graph("other.router"), [router], strict=False)
    assert result.routers_mapped == 0 and len(result.unattributed) == 1


def test_model_without_router_is_rejected_naming_what_was_searched():
    with pytest.raises(ValueError, match="no MoE layer found in Sequential: searched for .*gate_up_proj"):
        eplb_graph.enable(torch.nn.Sequential(torch.nn.Linear(4, 4)))


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(num_redundant_experts=-1), "num_redundant_experts must be an int >= 0"),
        (dict(num_redundant_experts=1, ep_size=2), r"ep_size=2\): 17 physical experts do not divide over 2 ranks"),
        (dict(load_phase="sometimes"), "unknown load_phase 'sometimes'"),
        (dict(ep_size=0), "ep_size must be an int >= 1"),
    ],
)
def test_bad_configuration_is_rejected_before_the_model_is_touched(options, match):
    _, model = reference_pair(num_layers=1)
    before = {name: p.clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=match):
        eplb_graph.enable(model, **options)
    after = dict(model.named_parameters())
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_eager_experts_implementation_is_rejected():
    model = build_tiny_hf_model("qwen3_moe")
    model.config._experts_implementation = "eager"
    with pytest.raises(ValueError, match="experts implementation 'eager' is not graph-safe"):
        eplb_graph.enable(model)


def _shared_module_graph():
    """vLLM's shape: router and expert kernel inside one module, told apart by source file.

    top-k -> ids -> cast (router file) -> experts (experts file); ids -> gather (router file).
    """
    import operator

    graph = torch.fx.Graph()
    probs = graph.placeholder("probs")
    probs.meta["example_value"] = torch.empty(4, 8)
    stack = {"a": ("L['self'].layers.0.mlp.experts", torch.nn.Module)}
    router_frame = 'File "/site/vllm/model_executor/layers/fused_moe/router/cpu_router.py", line 9, in _softmax_topk\n  x'
    experts_frame = 'File "/site/vllm/model_executor/layers/fused_moe/experts/cpu_moe.py", line 3, in apply\n  y'

    def node(target, args, frame):
        n = graph.call_method(target, args) if isinstance(target, str) else graph.call_function(target, args)
        n.meta["nn_module_stack"] = dict(stack)
        n.meta["stack_trace"] = frame
        return n

    topk = node(torch.topk, (probs, 2), router_frame)
    ids = node(operator.getitem, (topk, 1), router_frame)
    weights_of_ids = node(torch.gather, (probs, 1, ids), router_frame)
    cast = node("int", (ids,), router_frame)
    experts = node(torch.add, (cast, 0), experts_frame)
    graph.output((experts, weights_of_ids))
    return graph, {"ids": ids, "gather": weights_of_ids, "cast": cast, "experts": experts}


def test_router_source_splits_router_and_experts_sharing_one_module():
    graph, nodes = _shared_module_graph()
    router = RouterSpec(
        "eplb-test.0", "layers.0.mlp.experts", num_experts=8, top_k=2,
        router_source="layers/fused_moe/router/",
    )
    result = insert_eplb_routing(graph, [router], strict=True)
    assert result.routers_mapped == 1
    (physical,) = result.mapped_sites[0].mapped
    assert nodes["gather"].args[2] is nodes["ids"]  # the router keeps logical ids for its weights
    experts_input = nodes["experts"].args[0]
    assert experts_input is not nodes["cast"] and experts_input.args[0] is physical  # a twin cast of physical ids
    leaks = [p for p in verify(graph, [router]).problems if "reads logical ids" in p]
    assert leaks == []  # (no live layer is registered for this key: only the id-flow check matters here)


def test_without_router_source_the_shared_module_would_keep_logical_ids():
    """Why router_source exists: by module path alone the expert kernel looks router-internal."""
    graph, nodes = _shared_module_graph()
    router = RouterSpec("eplb-test.0", "layers.0.mlp.experts", num_experts=8, top_k=2)
    insert_eplb_routing(graph, [router], strict=True)
    assert nodes["experts"].args[0] is nodes["cast"] and nodes["cast"].args[0] is nodes["ids"]
