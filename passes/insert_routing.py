"""The EPLB pass: map each router's selected expert ids to physical ids, right after top-k.

    topk(probs, k) -> getitem[1] (logical ids) --+--> router-internal users (e.g. weights gather)
                                                 |
                                                 +--> map_and_record_layer(ids, "layer") --> experts

Only the users of the ids outside the router are rewired: a router may still use the
logical ids itself (DeepSeek-V3 gathers its routing weights with them), and routing
weights are never touched. An id-preserving op inside the router (a dtype cast, a view)
whose result leaves the router gets a twin on the physical ids. Selection runs once:
nothing is recomputed, one routing node per router.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import fx

from .router_sites import (
    RouterSpec,
    RouterSite,
    find_router_sites,
    inside_router,
    is_unattributed_router,
    topk_indices,
)

MAP_AND_RECORD_LAYER = torch.ops.eplb_graph.map_and_record_layer.default

# Ops that carry ids through unchanged (dtype casts, views, copies), Dynamo and ATen level.
ID_PRESERVING_METHODS = frozenset({"to", "type", "int", "long", "contiguous", "clone", "view", "reshape"})
ID_PRESERVING_FUNCTIONS = frozenset(
    {
        torch.ops.aten._to_copy.default,
        torch.ops.aten.clone.default,
        torch.ops.aten.view.default,
        torch.ops.aten.reshape.default,
        torch.ops.prims.convert_element_type.default,
    }
)


class UnattributedRouterError(RuntimeError):
    """A top-k that looks like an expert selection but belongs to no registered router."""


@dataclass
class RoutingPassResult:
    sites: list[RouterSite]

    @property
    def mapped_sites(self) -> list[RouterSite]:
        return [s for s in self.sites if s.mapped]

    @property
    def unattributed(self) -> list[RouterSite]:
        return [s for s in self.sites if is_unattributed_router(s)]

    @property
    def routers_found(self) -> int:
        return sum(1 for s in self.sites if s.selects_experts)

    @property
    def routers_mapped(self) -> int:
        return len(self.mapped_sites)


def is_routing_node(node: fx.Node) -> bool:
    # the overload packet too: user code calling the op directly traces to the packet
    return node.op == "call_function" and node.target in (MAP_AND_RECORD_LAYER, MAP_AND_RECORD_LAYER.overloadpacket)


def is_id_preserving(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in ID_PRESERVING_METHODS
    return node.op == "call_function" and node.target in ID_PRESERVING_FUNCTIONS


def _rewire_consumers(graph: fx.Graph, logical: fx.Node, physical: fx.Node, router: RouterSpec) -> None:
    for user in list(logical.users):
        if user is physical:
            continue
        if not inside_router(user, router):
            user.replace_input_with(logical, physical)
        elif is_id_preserving(user):
            with graph.inserting_after(user):
                twin = graph.node_copy(user, lambda n: physical if n is logical else n)
            twin.meta = dict(user.meta)
            _rewire_consumers(graph, user, twin, router)
            if not twin.users:
                graph.erase_node(twin)


def insert_eplb_routing(
    graph: fx.Graph, routers: list[RouterSpec], *, strict: bool = True
) -> RoutingPassResult:
    """Inserts ``map_and_record_layer`` after every attributed router top-k, in place.

    Idempotent: ids already consumed by a routing node are left alone, so running the
    pass both as a backend and as a post-grad pass maps each router once.
    Raises UnattributedRouterError (strict) or warns for an expert-shaped top-k that no
    registered router owns.
    """
    sites = find_router_sites(graph, routers)
    result = RoutingPassResult(sites)
    if result.unattributed:
        names = ", ".join(f"{s.topk.name} (module {s.module_path or '?'})" for s in result.unattributed)
        message = f"expert-shaped top-k not attributable to a registered MoE router: {names}"
        if strict:
            raise UnattributedRouterError(message)
        warnings.warn(message, stacklevel=2)

    for site in sites:
        if site.router is None or not site.selects_experts:
            continue
        for logical in topk_indices(site.topk):
            existing = [u for u in logical.users if is_routing_node(u)]
            if existing:
                site.mapped.extend(existing)
                continue
            with graph.inserting_after(logical):
                physical = graph.call_function(MAP_AND_RECORD_LAYER, (logical, site.router.key))
            physical.meta = {k: v for k, v in logical.meta.items() if k in ("val", "example_value", "tensor_meta")}
            physical.meta["nn_module_stack"] = dict(site.topk.meta.get("nn_module_stack") or {})
            physical.meta["stack_trace"] = site.topk.meta.get("stack_trace")
            _rewire_consumers(graph, logical, physical, site.router)
            site.mapped.append(physical)
    graph.lint()
    return result
