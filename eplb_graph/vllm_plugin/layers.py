"""Our routing state for one vLLM MoE layer (``MoERunner``), bound to upstream's EPLB tensors.

Upstream's ``EplbLayerState`` holds the layer's row of ``expert_load_pass``, its
logical->physical map (``[num_logical, 1024]`` int64, -1 padded), its replica counts and
the two flags ``EplbState`` shares with every layer (record this batch, unpadded tokens).
Our op records into upstream's load row and reads upstream's flags -- exactly what the
router's EPLB hook does on CUDA -- but maps through our own tight ``LayerLookup``, which is
refreshed in place from upstream's committed placement at each commit point.
``check_agrees_with_upstream`` proves after every refresh that both say the same.

Each layer is mapped by exactly one mechanism (``mapped_by``):

* ``graph_pass``: vLLM traces the router's top-k (the CPU path); the post-grad pass inserts
  ``map_and_record_layer`` after it;
* ``router_hook``: top-k runs where no pass sees it (eager, or inside the opaque
  ``torch.ops.vllm.moe_forward`` on CUDA and Ascend); the router instance's EPLB mapping
  hook is bound to our op (``router_hook.py``).
"""

from __future__ import annotations

import torch

from eplb_graph.custom_ops import LAYER_TABLES
from eplb_graph.core.layer_lookup import BatchFlags, LayerLookup, RoutedLayer
from eplb_graph.passes.router_sites import RouterSpec

from . import router_hook

GRAPH_PASS = "graph_pass"
ROUTER_HOOK = "router_hook"
MAPPING_MECHANISMS = (GRAPH_PASS, ROUTER_HOOK)


def compiled_roots(model: torch.nn.Module) -> list[str]:
    """Module paths vLLM compiles (its ``support_torch_compile`` classes), deepest first."""
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    roots = [name for name, module in model.named_modules() if isinstance(module, TorchCompileWithNoGuardsWrapper)]
    return sorted(roots, key=len, reverse=True)


def relative_path(path: str, roots: list[str]) -> str | None:
    """``model.layers.0.mlp.experts`` under root ``model`` -> ``layers.0.mlp.experts``."""
    for root in roots:
        if root == "":
            return path
        if path.startswith(root + "."):
            return path[len(root) + 1 :]
    return None


def mapping_mechanism(moe_runner: torch.nn.Module, compilation_config, traced_path: str | None) -> str:
    """The pass maps a layer only where Inductor compiles a graph in which its top-k is traced."""
    from vllm.config import CompilationMode

    opaque_entries = (torch.ops.vllm.moe_forward, torch.ops.vllm.moe_forward_shared)
    traced = getattr(moe_runner, "_forward_entry", None) not in opaque_entries
    compiled = compilation_config.mode in (CompilationMode.DYNAMO_TRACE_ONCE, CompilationMode.VLLM_COMPILE)
    inductor = compilation_config.backend in ("inductor", "")
    return GRAPH_PASS if traced and compiled and inductor and traced_path is not None else ROUTER_HOOK


# vLLM runs the router and the fused experts inside one module (MoERunner); the router's
# own nodes are the ones whose innermost frame is in vLLM's router package.
VLLM_ROUTER_SOURCE = "layers/fused_moe/router/"


class EplbStateDivergedError(RuntimeError):
    """Our lookup and upstream's EplbLayerState disagree after a commit."""


class VllmMoELayer(RoutedLayer):
    """One vLLM MoE layer under eplb-graph: our lookup, upstream's load row and flags."""

    def __init__(
        self,
        moe_runner: torch.nn.Module,
        *,
        num_logical_experts: int,
        num_physical_experts: int,
        placement: torch.Tensor,
        mapped_by: str,
        router_path: str | None,
        capacity: int | None = None,
    ) -> None:
        """``capacity``: under vLLM's elastic EP, upstream's capacity of physical slots (its
        ``physical_expert_capacity``: local slots x the most DP ranks, at TP=1). The tables then hold
        that many slots, those beyond the ``num_physical_experts`` placed now empty (-1), and the load
        row is upstream's whole capacity row: a resize re-views upstream's buffers, ours are that size
        already, so the tensors a graph reads keep their storage. None: the size placed now."""
        if mapped_by not in MAPPING_MECHANISMS:
            raise ValueError(f"mapped_by must be one of {MAPPING_MECHANISMS}, got {mapped_by!r}")
        if mapped_by == GRAPH_PASS and not router_path:
            raise ValueError(f"layer {moe_runner.layer_name}: the graph pass needs the layer's module path")
        upstream = moe_runner.eplb_state
        missing = [
            name
            for name in ("expert_load_view", "logical_to_physical_map", "logical_replica_count",
                         "should_record_tensor", "num_unpadded_tokens_tensors")
            if upstream is None or getattr(upstream, name) is None
        ]
        if missing:
            raise RuntimeError(
                f"layer {moe_runner.layer_name}: upstream EPLB state lacks {', '.join(missing)}; "
                f"EplbState.add_model must run before eplb-graph binds the layer"
            )
        device = upstream.expert_load_view.device
        if capacity is None:
            tables = LayerLookup(num_logical_experts, num_physical_experts, placement=placement, device=device)
        else:
            if not num_physical_experts <= capacity <= upstream.expert_load_view.shape[0]:
                raise ValueError(f"layer {moe_runner.layer_name}: slot capacity {capacity} is below the "
                                 f"{num_physical_experts} slots placed, or beyond upstream's load row "
                                 f"({upstream.expert_load_view.shape[0]})")
            padded = torch.full((capacity,), -1, dtype=torch.int64)  # the slots beyond today's group: empty
            padded[: placement.shape[0]] = placement
            tables = LayerLookup(num_logical_experts, capacity, max_replicas=capacity - num_logical_experts + 1,
                                 placement=padded, device=device, allow_empty_slots=True)
        tables.bind_load_(upstream.expert_load_view[: tables.num_physical_experts])
        flags = BatchFlags.sharing(upstream.should_record_tensor, upstream.num_unpadded_tokens_tensors[0])
        super().__init__(moe_runner.layer_name, tables, flags)
        self.upstream = upstream
        self.router = moe_runner.router
        self.top_k = int(moe_runner.router.top_k)
        self.mapped_by = mapped_by
        self.router_path = router_path
        self.graph_mappings = 0  # routing nodes the pass inserted for this layer (0 if a cached graph was served)
        self.check_agrees_with_upstream()

    def router_spec(self) -> RouterSpec:
        return RouterSpec(
            self.key, self.router_path or "", self.tables.num_logical_experts, self.top_k, router_source=VLLM_ROUTER_SOURCE
        )

    @property
    def host_calls(self) -> int:
        """Op calls the host saw (eager and CPU graphs; a replayed device graph adds none)."""
        return LAYER_TABLES.calls(self.key)

    def commit_placement_(self, placement: torch.Tensor) -> bool:
        """Routes by upstream's committed placement from now on, checked equal to upstream's
        own maps; returns whether it changed."""
        changed = super().commit_placement_(placement)
        self.check_agrees_with_upstream()
        return changed

    def check_agrees_with_upstream(self) -> None:
        """Our [L, R] lookup equals the first R columns of upstream's map; the rest is padding."""
        ours_lookup = self.tables.lookup.cpu()  # [num_logical, R]
        ours_counts = self.tables.replica_count.cpu()  # [num_logical]
        upstream_map = self.upstream.logical_to_physical_map.cpu()  # [num_logical, 1024]
        upstream_counts = self.upstream.logical_replica_count.cpu()  # [num_logical]
        width = ours_lookup.shape[1]
        problems = []
        if not torch.equal(ours_counts.to(torch.int64), upstream_counts.to(torch.int64)):
            problems.append(f"replica counts {ours_counts.tolist()} vs upstream {upstream_counts.tolist()}")
        if not torch.equal(ours_lookup.to(torch.int64), upstream_map[:, :width].to(torch.int64)):
            problems.append("logical->physical slots differ")
        if (upstream_map[:, width:] != -1).any():
            problems.append(f"upstream lists more than {width} replicas for some expert")
        if problems:
            raise EplbStateDivergedError(f"layer {self.key}: our lookup and upstream's EplbLayerState disagree: "
                                         + "; ".join(problems))

    def summary(self) -> dict:
        return {
            "mapped_by": self.mapped_by,
            "graph_mappings": self.graph_mappings,
            "host_calls": self.host_calls,
            "placement": self.tables.physical_to_logical.tolist(),
            "recorded_load": int(self.tables.load.sum()),
        }


class EplbMappingError(RuntimeError):
    """A layer is routed by no mechanism, or by two."""


def verify_mapping(layers: list[VllmMoELayer], *, require_calls: bool) -> dict[str, str]:
    """Each layer is routed by exactly its mechanism; returns {layer: mechanism}."""
    problems = []
    for layer in layers:
        hook_bound = router_hook.is_bound(layer.router)
        if layer.mapped_by == GRAPH_PASS and hook_bound:
            problems.append(f"{layer.key}: mapped by the graph pass but its router hook is bound too")
        if layer.mapped_by == ROUTER_HOOK and (not hook_bound or layer.graph_mappings):
            problems.append(f"{layer.key}: mapped by the router hook but bound={hook_bound}, "
                            f"graph mappings={layer.graph_mappings}")
        if require_calls and layer.mapped_by == GRAPH_PASS and layer.host_calls == 0:
            problems.append(f"{layer.key}: mapped by the graph pass, but the compiled graph never ran the routing "
                            f"op for it (a compile-cache entry built without eplb-graph?)")
    if problems:
        raise EplbMappingError("eplb-graph routing check failed:\n  " + "\n  ".join(problems))
    return {layer.key: layer.mapped_by for layer in layers}
