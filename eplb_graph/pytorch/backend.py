"""The torch.compile backend of the EPLB pass: the pass on the Dynamo graph, the verifier on its
result, a record of both for ``eplb-graph inspect``, then the inner compiler."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx

from eplb_graph.passes.insert_routing import RoutingPassResult, insert_eplb_routing
from eplb_graph.passes.router_sites import RouterSpec
from eplb_graph.passes.verify import VerifierReport, verify


@dataclass
class CompiledGraphRecord:
    """What the backend saw and did, for ``eplb-graph inspect``."""

    graph_before: str
    graph_after: str
    result: RoutingPassResult
    report: VerifierReport | None
    graph_module: fx.GraphModule = field(repr=False)


def make_eplb_backend(
    routers: list[RouterSpec],
    inner: str | Callable,
    records: list[CompiledGraphRecord],
    live_tables: Callable[[str], object] | None = None,
    *,
    strict: bool = True,
    verify_graphs: bool = True,
) -> Callable:
    """A torch.compile backend: insert EPLB routing into the Dynamo graph, verify it, then ``inner``."""
    inner_backend = torch._dynamo.lookup_backend(inner) if isinstance(inner, str) else inner

    def eplb_backend(graph_module: fx.GraphModule, example_inputs):
        before = graph_module.print_readable(print_output=False)
        result = insert_eplb_routing(graph_module.graph, routers, strict=strict)
        graph_module.recompile()
        report = verify(graph_module, routers, live_tables=live_tables, strict=strict) if verify_graphs else None
        after = graph_module.print_readable(print_output=False)
        records.append(CompiledGraphRecord(before, after, result, report, graph_module))
        return inner_backend(graph_module, example_inputs)

    return eplb_backend
