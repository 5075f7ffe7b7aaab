import operator
import sys
import types

import pytest
import torch
from torch import fx

import eplb_graph
from eplb_reference.models.reference import ReferenceMoEConfig, build_reference_model
from eplb_graph.passes.insert_routing import insert_eplb_routing
from eplb_graph.passes.verify import EplbVerificationError, verify


def traced_reference(**options):
    """A Dynamo graph module of a 2-layer reference model (no pass run), and its handle."""
    model = build_reference_model(ReferenceMoEConfig(num_layers=2, num_experts=8, top_k=2))
    handle = eplb_graph.enable(model, **options)
    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    with torch.no_grad():
        torch.compile(model, backend=capture, fullgraph=True)(torch.randint(0, 256, (1, 4)))
    return graphs[0], handle


def test_unmapped_graph_fails_naming_each_router():
    graph_module, handle = traced_reference()
    report = verify(graph_module, handle.routers())
    assert not report.ok
    assert report.routers_found == 2 and report.routers_mapped == 0
    assert any("topk" in p and "mapped 0 times" in p for p in report.problems)
    with pytest.raises(EplbVerificationError, match=r"router top-k topk_1 \(eplb\d+\.1\) is mapped 0 times"):
        verify(graph_module, handle.routers(), strict=True)


def test_mapped_graph_passes_with_live_tables():
    graph_module, handle = traced_reference()
    insert_eplb_routing(graph_module.graph, handle.routers())
    report = verify(graph_module, handle.routers(), live_tables=handle.layer, strict=True)
    assert report.ok and report.routers_mapped == 2
    assert set(report.layers) == {layer.key for layer in handle.layers}


def test_an_expert_reading_logical_ids_is_a_leak():
    graph_module, handle = traced_reference()
    insert_eplb_routing(graph_module.graph, handle.routers())
    graph = graph_module.graph
    logical = next(n for n in graph.nodes if n.target is operator.getitem and n.args[0].name == "topk" and n.args[1] == 1)
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):
        leak = graph.call_function(torch.add, (logical, 1))  # no module stack: outside the router
    leak.name = "leaky_expert"
    report = verify(graph_module, handle.routers())
    assert any(p.startswith("leaky_expert reads logical ids") for p in report.problems)


def test_tables_of_a_closed_handle_are_reported():
    graph_module, handle = traced_reference()
    insert_eplb_routing(graph_module.graph, handle.routers())
    handle.close()
    report = verify(graph_module, handle.routers())
    assert any("no live EPLB layer named" in p for p in report.problems)


def test_tables_that_are_not_the_owners_are_reported():
    graph_module, handle = traced_reference()
    insert_eplb_routing(graph_module.graph, handle.routers())
    _, other = traced_reference()
    report = verify(graph_module, handle.routers(), live_tables=lambda key: other.layers[0])
    assert any("other than its owner's live ones" in p for p in report.problems)


def test_explicit_map_and_record_must_read_graph_inputs_not_constants():
    layer = eplb_graph.LayerLookup(4, 4)
    flags = eplb_graph.BatchFlags()

    class Frozen(torch.nn.Module):
        def forward(self, ids):
            return torch.ops.eplb_graph.map_and_record(
                ids, self.lookup, self.replica_count, self.load, self.record_enabled, self.num_unpadded
            )

    module = Frozen()
    for name, tensor in [("lookup", layer.lookup), ("replica_count", layer.replica_count), ("load", layer.load),
                         ("record_enabled", flags.record_enabled), ("num_unpadded", flags.num_unpadded_tokens)]:
        setattr(module, name, tensor)  # plain attributes: fx.symbolic_trace makes them get_attr constants
    folded = fx.symbolic_trace(module)
    report = verify(folded, [])
    assert any("reads lookup from a get_attr" in p for p in report.problems)

    def live(ids, lookup, replica_count, load, record_enabled, num_unpadded):
        return torch.ops.eplb_graph.map_and_record(ids, lookup, replica_count, load, record_enabled, num_unpadded)

    assert verify(fx.symbolic_trace(live), []).ok


def test_torchair_backend_runs_the_pass_before_the_npu_backend(monkeypatch):
    """Contract test with a stand-in torchair module.

    Proves: the wrapper asks torchair for its NPU backend with the caller's compiler config,
    runs the EPLB pass on the Dynamo graph first, and hands the rewritten graph on.
    Does NOT prove: that real torchair (inside torch_npu, not importable here) accepts the
    map_and_record_layer op, or that ACL graphs capture it -- that needs an Ascend host.
    """
    calls = []

    def get_npu_backend(compiler_config=None):
        def npu_backend(graph_module, example_inputs):
            calls.append(("npu", compiler_config, graph_module.code.count("torch.ops.eplb_graph.map_and_record_layer.default(")))
            return graph_module.forward

        return npu_backend

    monkeypatch.setitem(sys.modules, "torchair", types.SimpleNamespace(get_npu_backend=get_npu_backend))
    model = build_reference_model(ReferenceMoEConfig(num_layers=2, num_experts=8, top_k=2))
    handle = eplb_graph.enable(model)
    backend = handle.torchair_backend(compiler_config="cfg")
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(torch.randint(0, 256, (1, 3)))
    assert calls == [("npu", "cfg", 2)]
    assert handle.compiled_graphs[-1].report.ok
