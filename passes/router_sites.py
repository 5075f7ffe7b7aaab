"""Finding router top-k nodes in a traced graph and attributing them to MoE layers.

Shared by the insertion pass and the verifier. Works on Dynamo graphs (``torch.topk`` /
``Tensor.topk``) and on ATen graphs (``aten.topk``), attributing each top-k by the module
path Dynamo records in ``node.meta["nn_module_stack"]`` (kept through AOT autograd into
post-grad graphs).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field

import torch
from torch import fx


@dataclass(frozen=True)
class RouterSpec:
    """One MoE layer as the pass sees it: where its router is and what its top-k looks like."""

    key: str  # the name map_and_record_layer resolves (LAYER_TABLES)
    router_path: str  # module path relative to the model root, e.g. "model.layers.0.mlp.gate"
    num_experts: int
    top_k: int
    # Where router and expert kernel run inside one module (vLLM's MoERunner), the module
    # path cannot tell them apart; then a node is router-internal only if its innermost
    # source frame lies in a file whose path contains this fragment.
    router_source: str | None = None
    # Module path of the layer's routed experts. Nodes inside it are never router-internal,
    # even where the router path encloses them (a MoE block that runs its own top-k and
    # calls ``.experts``), and the verifier requires a mapped router wherever they run.
    experts_path: str | None = None


@dataclass
class RouterSite:
    """A top-k in the graph and what the pass made of it."""

    topk: fx.Node
    module_path: str | None  # innermost module path of the top-k, normalised
    router: RouterSpec | None  # the layer it belongs to, None if unattributed
    selects_experts: bool  # top-k over the layer's experts with the layer's k
    reason: str = ""  # why it is not mapped, where it is not
    mapped: list[fx.Node] = field(default_factory=list)  # inserted routing node(s)


_DYNAMO_ROOT = re.compile(r"^[LG]\['[^']*'\]\.?")


def normalise_module_path(path: str) -> str:
    """Dynamo's "L['self'].model.layers[0].mlp" -> "model.layers.0.mlp"."""
    path = _DYNAMO_ROOT.sub("", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    return path.strip(".")


def module_paths(node: fx.Node) -> list[str]:
    """Normalised module paths enclosing the node, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [normalise_module_path(value[0]) for value in stack.values()]


def path_matches(path: str, registered: str) -> bool:
    # The compiled callable may be the model or something holding it: match on a suffix.
    return path == registered or path.endswith("." + registered)


def inside_module(node: fx.Node, registered: str) -> bool:
    return any(path_matches(path, registered) for path in module_paths(node))


_FRAME_FILE = re.compile(r'File "([^"]+)", line \d+')


def innermost_source_file(node: fx.Node) -> str | None:
    """The file of the innermost frame in the node's recorded stack trace, if any."""
    frames = _FRAME_FILE.findall(node.meta.get("stack_trace") or "")
    return frames[-1].replace("\\", "/") if frames else None


def inside_router(node: fx.Node, router: RouterSpec) -> bool:
    """Is the node part of the router's own computation (so it keeps logical ids)?"""
    if not inside_module(node, router.router_path):
        return False
    if router.experts_path is not None and inside_module(node, router.experts_path):
        return False
    if router.router_source is None:
        return True
    source = innermost_source_file(node)
    return source is not None and router.router_source in source


def is_topk(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in (torch.topk, torch.ops.aten.topk.default)) or (
        node.op == "call_method" and node.target == "topk"
    )


def topk_arguments(node: fx.Node) -> tuple[fx.Node, int | None, int]:
    """(input, k, dim) of a top-k node; k is None where it is symbolic."""
    args = list(node.args) + [None] * 3
    source, k = args[0], node.kwargs.get("k", args[1])
    dim = node.kwargs.get("dim", args[2] if args[2] is not None else -1)
    return source, k if isinstance(k, int) else None, dim


def _value(node: fx.Node):
    return node.meta.get("val", node.meta.get("example_value"))


def topk_indices(node: fx.Node) -> list[fx.Node]:
    """The getitem(topk, 1) nodes: where the graph reads the selected ids."""
    return [u for u in node.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == 1]


def selects_experts(node: fx.Node, router: RouterSpec) -> tuple[bool, str]:
    source, k, dim = topk_arguments(node)
    value = _value(source) if isinstance(source, fx.Node) else None
    if value is None or not hasattr(value, "shape"):
        return False, "input shape unknown"
    if dim not in (-1, value.dim() - 1):
        return False, f"top-k over dim {dim}, not the last"
    if value.shape[-1] != router.num_experts:
        return False, f"over {value.shape[-1]} candidates, not the layer's {router.num_experts} experts"
    if k != router.top_k:
        return False, f"k={k}, not the layer's top_k={router.top_k}"
    return True, ""


def find_router_sites(graph: fx.Graph, routers: list[RouterSpec]) -> list[RouterSite]:
    """Every top-k in the graph, attributed to a layer where its module path allows.

    Within one layer only the *last* expert-shaped top-k selects experts: DeepSeek-V3's
    router first takes top-k over expert groups, which is not an expert selection.
    """
    sites = []
    for node in graph.nodes:
        if not is_topk(node):
            continue
        paths = module_paths(node)
        router = next((b for b in routers if any(path_matches(p, b.router_path) for p in paths)), None)
        if router is None:
            # Unattributed: does it look like some layer's expert selection?
            shaped = [b for b in routers if selects_experts(node, b)[0]]
            reason = "expert-shaped top-k outside every registered router" if shaped else "not in a registered router"
            sites.append(RouterSite(node, paths[-1] if paths else None, None, bool(shaped), reason))
            continue
        selected, reason = selects_experts(node, router)
        sites.append(RouterSite(node, paths[-1], router, selected, reason))

    last_per_layer: dict[str, RouterSite] = {}
    for site in sites:
        if site.router is not None and site.selects_experts:
            previous = last_per_layer.get(site.router.key)
            if previous is not None:
                previous.selects_experts = False
                previous.reason = "an earlier top-k of the same router; the last one selects experts"
            last_per_layer[site.router.key] = site
    return sites


def is_unattributed_router(site: RouterSite) -> bool:
    return site.router is None and site.selects_experts
