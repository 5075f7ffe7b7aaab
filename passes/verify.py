"""Proves the EPLB routing invariants on a compiled graph.

    1. every attributed router top-k is mapped exactly once (selection runs once);
    2. no node outside the router reads logical ids (experts see physical ids only);
    3. recording happens in the routing op, on physical ids, with the record flag and the
       padding count read from 0-dim/1-element tensors on the layer's device;
    4. the op reads the live lookup of the right layer: by name for map_and_record_layer
       (resolved now, compared by identity with the owner's tables), or, for an explicit
       map_and_record, from a graph input -- never a constant, get_attr or frozen copy;
    5. where a layer's routed experts run in the graph (``RouterSpec.experts_path``),
       its router top-k was found and mapped: experts never index physical weights with
       logical ids because a router changed shape and the pass no longer recognised it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx

from eplb_graph.custom_ops import LAYER_TABLES

from .insert_routing import is_id_preserving, is_routing_node
from .router_sites import (
    RouterSpec,
    find_router_sites,
    inside_module,
    inside_router,
    is_unattributed_router,
    topk_indices,
)

# Dynamo and fx.symbolic_trace record the overload packet, ATen graphs the overload.
MAP_AND_RECORD = (torch.ops.eplb_graph.map_and_record, torch.ops.eplb_graph.map_and_record.default)


class EplbVerificationError(AssertionError):
    pass


@dataclass
class VerifierReport:
    ok: bool = True
    routers_found: int = 0
    routers_mapped: int = 0
    unattributed: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    layers: dict[str, str] = field(default_factory=dict)  # layer key -> routing node name

    def fail(self, message: str) -> None:
        self.ok = False
        self.problems.append(message)

    def as_dict(self) -> dict:
        return {
            "ok": self.ok,
            "routers_found": self.routers_found,
            "routers_mapped": self.routers_mapped,
            "unattributed": self.unattributed,
            "problems": self.problems,
            "layers": self.layers,
        }


def _logical_leaks(logical: fx.Node, router: RouterSpec) -> list[fx.Node]:
    """Nodes outside the router that read logical ids, directly or through id-preserving ops
    (casts, views) inside the router. Values the router computes *from* the ids (DeepSeek's
    gathered routing weights) are not ids and may leave it."""
    leaks, frontier, seen = [], [logical], {logical}
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in seen or is_routing_node(user):
                continue
            seen.add(user)
            if not inside_router(user, router):
                leaks.append(user)
            elif is_id_preserving(user):
                frontier.append(user)
    return leaks


def _is_live_input(node: object) -> bool:
    # A placeholder is read at every call; get_attr / constants are what folding produces.
    return isinstance(node, fx.Node) and node.op == "placeholder"


def _check_flags(report: VerifierReport, key: str, tensors, device: torch.device) -> None:
    _, _, _, record_enabled, num_unpadded = tensors
    for name, flag in (("record_enabled", record_enabled), ("num_unpadded_tokens", num_unpadded)):
        if not isinstance(flag, torch.Tensor) or flag.numel() != 1:
            report.fail(f"layer {key}: {name} is not a 1-element tensor")
        elif flag.device != device:
            report.fail(f"layer {key}: {name} lives on {flag.device}, the lookup on {device}")


def _check_experts_are_routed(report: VerifierReport, graph: fx.Graph, routers: list[RouterSpec]) -> None:
    for router in routers:
        if router.experts_path is None or router.key in report.layers:
            continue
        runs = next((n for n in graph.nodes if n.op != "placeholder" and inside_module(n, router.experts_path)), None)
        if runs is not None:
            report.fail(
                f"experts {router.experts_path} of {router.key} run in this graph ({runs.name}) but no top-k "
                f"of router {router.router_path} over {router.num_experts} experts with k={router.top_k} was mapped"
            )


def verify(
    graph_module: fx.GraphModule | fx.Graph,
    routers: list[RouterSpec],
    *,
    live_tables: Callable[[str], object] | None = None,
    strict: bool = False,
) -> VerifierReport:
    """Checks the invariants; ``live_tables(key)`` returns the owner's layer for identity checks.

    strict=True raises EplbVerificationError listing every problem with node names.
    """
    graph = graph_module.graph if isinstance(graph_module, fx.GraphModule) else graph_module
    report = VerifierReport()
    sites = find_router_sites(graph, routers)
    report.unattributed = [f"{s.topk.name} ({s.module_path or '?'})" for s in sites if is_unattributed_router(s)]
    for entry in report.unattributed:
        report.fail(f"unattributed expert-shaped top-k {entry}")

    for site in sites:
        if site.router is None or not site.selects_experts:
            continue
        report.routers_found += 1
        key = site.router.key
        indices = topk_indices(site.topk)
        routing = [u for ids in indices for u in ids.users if is_routing_node(u)]
        if len(routing) != 1:
            report.fail(f"router top-k {site.topk.name} ({key}) is mapped {len(routing)} times, expected once")
            continue
        report.routers_mapped += 1
        node = routing[0]
        report.layers[key] = node.name
        if node.args[1] != key:
            report.fail(f"{node.name} routes top-k of {key} through layer {node.args[1]!r}")
        for ids in indices:
            for leak in _logical_leaks(ids, site.router):
                report.fail(f"{leak.name} reads logical ids of {key} (from {site.topk.name}) outside the router")
        try:
            layer = LAYER_TABLES.resolve(node.args[1])
        except KeyError as error:
            report.fail(f"{node.name}: {error.args[0]}")
            continue
        tensors = layer.routing_tensors()
        if live_tables is not None:
            owner = live_tables(key)
            if owner is not layer or any(a is not b for a, b in zip(tensors, owner.routing_tensors())):
                report.fail(f"{node.name}: layer {key} resolves to tables other than its owner's live ones")
        _check_flags(report, key, tensors, tensors[0].device)

    _check_experts_are_routed(report, graph, routers)

    # Explicit map_and_record calls (user code): tables must be graph inputs, not constants.
    for node in graph.nodes:
        if node.op == "call_function" and node.target in MAP_AND_RECORD:
            names = ("lookup", "replica_count", "load", "record_enabled", "num_unpadded_tokens")
            for name, arg in zip(names, node.args[1:6]):
                if not _is_live_input(arg):
                    what = arg.op if isinstance(arg, fx.Node) else type(arg).__name__
                    report.fail(f"{node.name} reads {name} from a {what}, not a live graph input")

    if strict and not report.ok:
        raise EplbVerificationError("EPLB graph verification failed:\n  " + "\n  ".join(report.problems))
    return report
