"""RouterSpec.experts_path: experts inside the router's module get physical ids, and the
verifier refuses a graph whose experts run without a mapped router."""

import operator

import torch

from eplb_graph.passes.insert_routing import insert_eplb_routing
from eplb_graph.passes.router_sites import RouterSpec
from eplb_graph.passes.verify import verify


def block_level_graph():
    """Jamba's shape: the MoE block runs the top-k itself and calls its ``.experts`` child."""
    graph = torch.fx.Graph()
    probs = graph.placeholder("probs")
    probs.meta["example_value"] = torch.empty(4, 8)
    block = {"a": ("L['self'].layers.1.feed_forward", torch.nn.Module)}
    experts = {**block, "b": ("L['self'].layers.1.feed_forward.experts", torch.nn.Module)}

    def node(target, args, stack):
        n = graph.call_function(target, args)
        n.meta["nn_module_stack"] = dict(stack)
        return n

    topk = node(torch.topk, (probs, 2), block)
    ids = node(operator.getitem, (topk, 1), block)
    gathered = node(torch.gather, (probs, 1, ids), block)  # router-internal: keeps logical ids
    expert_input = node(torch.add, (ids, 0), experts)
    graph.output((expert_input, gathered))
    return graph, {"ids": ids, "gather": gathered, "experts": expert_input}


def router(**overrides):
    fields = dict(key="eplb-test.0", router_path="layers.1.feed_forward", num_experts=8, top_k=2,
                  experts_path="layers.1.feed_forward.experts")
    return RouterSpec(**{**fields, **overrides})


def test_experts_inside_the_router_module_get_physical_ids():
    graph, nodes = block_level_graph()
    result = insert_eplb_routing(graph, [router()], strict=True)
    (physical,) = result.mapped_sites[0].mapped
    assert nodes["experts"].args[0] is physical
    assert nodes["gather"].args[2] is nodes["ids"]
    assert not [p for p in verify(graph, [router()]).problems if "reads logical ids" in p]


def test_without_experts_path_the_block_level_experts_would_keep_logical_ids():
    graph, nodes = block_level_graph()
    insert_eplb_routing(graph, [router(experts_path=None)], strict=True)
    assert nodes["experts"].args[0] is nodes["ids"]


def test_experts_running_without_a_mapped_router_fail_verification():
    graph, _ = block_level_graph()
    stale = router(top_k=4)  # the router no longer looks like the layer's selection: nothing is mapped
    assert insert_eplb_routing(graph, [stale], strict=True).routers_mapped == 0
    report = verify(graph, [stale])
    assert not report.ok
    assert any("experts layers.1.feed_forward.experts of eplb-test.0 run in this graph" in p for p in report.problems)
