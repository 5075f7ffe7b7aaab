"""vLLM's CPU experts under expert parallel: each rank computes only the pairs routed to its slots.

vLLM 0.32's CPU experts (``CPUUnquantizedExperts``, ``CPUExpertsFp8``, ``CPUExpertsInt4``) receive
the layer's ``expert_map`` at ``apply`` and drop it: their kernels index per-expert buffers with
global physical ids, which crashes once a rank holds a part of the slots. ``LocalPairExperts``
binds one layer's experts *instance* (the class and every other layer keep upstream's ``apply``)
to ``eplb_graph::local_expert_pairs``, which hands the upstream ``apply`` of that same instance
only this rank's (token, k) pairs, as top-1 rows with local slot ids: the kernel, its packed
weights and its scales are upstream's, and a pair routed to another rank costs this rank nothing.
An experts class not listed is refused by name when the worker binds the layer.
"""

from __future__ import annotations

import importlib

import torch

from eplb_graph.custom_ops import LOCAL_EXPERTS
from eplb_graph.custom_ops.local_experts import PairCounts
from eplb_graph.upstream import patches
from eplb_graph.upstream.adaptations import ADAPTATIONS

# vLLM's CPU experts whose apply takes (token, k) rows with local ids and top-k weights, applies
# the weights and sums over k itself (TopKWeightAndReduceNoOP), and keeps its own scratch space:
# class name -> the adaptation (``local_experts.*``) that names its module and hooks its instances' apply
PAIR_EXPERTS = {a.qualname.split(".")[0]: a for a in ADAPTATIONS if a.key.startswith("local_experts.")}


class LocalExpertsError(RuntimeError):
    """A layer's experts cannot run on this rank's pairs only."""


def listed_classes() -> dict[str, type]:
    """``PAIR_EXPERTS``' classes by name, as vLLM's module defines them (one it no longer has is
    left out)."""
    found = {name: getattr(importlib.import_module(a.module), name, None) for name, a in PAIR_EXPERTS.items()}
    return {name: cls for name, cls in found.items() if isinstance(cls, type)}


def pair_experts_class(experts: object) -> str | None:
    """The listed class ``experts`` is an instance of (the x86 / Arm / Power unquantized ones derive
    from vLLM's portable one), matched by identity: a class of the same name elsewhere (vLLM 0.32
    has a second, monolithic ``CPUExpertsInt4``) is none of them."""
    return next((name for name, cls in listed_classes().items() if isinstance(experts, cls)), None)


def experts_name(experts: object) -> str:
    """The experts' class by module and name (two classes may share a name)."""
    return f"{type(experts).__module__}.{type(experts).__qualname__}"


class LocalPairExperts:
    """One layer's vLLM CPU experts over this rank's pairs (a ``PairKernel`` of ``LOCAL_EXPERTS``)."""

    def __init__(self, routed_experts: torch.nn.Module, key: str) -> None:
        kernel = getattr(routed_experts.quant_method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        listed = None if experts is None else pair_experts_class(experts)
        if listed is None:
            raise LocalExpertsError(
                f"layer {key}: expert parallel on CPU runs each rank's own pairs through vLLM's "
                f"{', '.join(PAIR_EXPERTS)}; this layer's experts are {experts_name(experts)}"
            )
        self.adaptation = PAIR_EXPERTS[listed].key
        if patches.installed(self.adaptation, on=experts):
            raise LocalExpertsError(f"layer {key}: its experts' apply is already bound")
        self.key = key
        self.routed_experts = routed_experts
        self.experts = experts
        self.upstream_apply = type(experts).apply.__get__(experts)
        self.activation = routed_experts.activation
        self.global_num_experts = int(routed_experts.global_num_experts)
        self.apply_router_weight_on_input = bool(routed_experts.apply_router_weight_on_input)
        patches.install(self.adaptation, self.apply, by=self, on=experts)
        try:  # registered only once its install held: a refused one leaves no entry behind
            LOCAL_EXPERTS.register(key, self)
        except BaseException:
            patches.uninstall(self.adaptation, on=experts)
            raise

    def unbind(self) -> None:
        patches.uninstall(self.adaptation, on=self.experts)
        LOCAL_EXPERTS.unregister(self.key)

    def rebind(self) -> LocalPairExperts:
        """Bound to the layer's experts instance now: vLLM's elastic EP builds new ones at a resize
        (``elastic_follow.after_switch``), with the EP group's new ``global_num_experts``."""
        self.unbind()
        return LocalPairExperts(self.routed_experts, self.key)

    @property
    def counts(self) -> PairCounts:
        """Pairs this rank's kernel computed, pairs its calls saw, the kernel's seconds."""
        return LOCAL_EXPERTS.counts(self.key)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input) -> None:
        """Upstream's ``apply`` signature; runs when Dynamo traces the layer (or each eager call)."""
        if expert_map is None:  # every slot is local: nothing to select
            return self.upstream_apply(output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                                       global_num_experts, expert_map, a1q_scale, a2_scale, workspace13,
                                       workspace2, expert_tokens_meta, apply_router_weight_on_input)
        bound = (self.activation, self.global_num_experts, self.apply_router_weight_on_input)
        if (activation, global_num_experts, apply_router_weight_on_input) != bound or a1q_scale is not None \
                or a2_scale is not None or expert_tokens_meta is not None:
            raise LocalExpertsError(
                f"layer {self.key}: its experts were called with activation={activation}, global experts="
                f"{global_num_experts}, weights on input={apply_router_weight_on_input}, input scales="
                f"{a1q_scale is not None}, intermediate scales={a2_scale is not None}, token metadata="
                f"{expert_tokens_meta is not None}; bound for {bound} and unquantized, standard-format inputs"
            )
        output.copy_(torch.ops.eplb_graph.local_expert_pairs(
            hidden_states, topk_weights, topk_ids, expert_map, [w1, w2], self.key))  # [T, H]

    def run_pairs(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor,
                  weights: list[torch.Tensor]) -> torch.Tensor:
        """Upstream's kernel on ``[P, H]`` rows with ``[P, 1]`` local ids and weights."""
        w1, w2 = weights
        out = torch.empty_like(hidden_states)  # [P, H]
        local_experts, rows, n, k, top_k = self.experts.moe_problem_size(hidden_states, w1, w2, local_ids)
        shapes = self.experts.workspace_shapes(rows, n, k, top_k, self.global_num_experts, local_experts, None,
                                               self.activation)
        workspace13, workspace2 = (hidden_states.new_empty(shape) for shape in shapes[:2])
        self.upstream_apply(out, hidden_states, w1, w2, topk_weights, local_ids, self.activation,
                            self.global_num_experts, None, None, None, workspace13, workspace2, None,
                            self.apply_router_weight_on_input)
        return out
