"""Model-family adapters: where a model keeps its routers and its routed-expert weights.

An adapter answers two questions for ``enable`` and the pass, and nothing else: which
modules are the MoE layers (router path, expert count, top-k), and which expert tensors
have a leading [num_experts] dimension that must move to physical layout. A new MoE
architecture is a new adapter of a dozen lines, not a change to the pass. transformers'
families share one adapter (``hf_adapter.py``).
"""

from __future__ import annotations

from torch import nn

from eplb_graph.adapter_base import ENABLED_MARK, MoEAdapter, MoELayerSpec, join_path
from eplb_graph.hf_adapter import HuggingFaceExpertsAdapter

__all__ = ["DEFAULT_ADAPTERS", "HuggingFaceExpertsAdapter", "MoEAdapter", "MoELayerSpec", "ReferenceAdapter", "find_moe_layers"]


class ReferenceAdapter(MoEAdapter):
    """eplb_graph.models.reference: ``MoEBlock`` with ``.gate`` (TopKRouter) and ``.experts`` (w13, w2)."""

    name = "reference"
    searched_for = "eplb_graph reference MoEBlock modules (.gate TopKRouter, .experts BatchedExperts)"

    def find_layers(self, model: nn.Module) -> list[MoELayerSpec]:
        from eplb_graph.models.reference import MoEBlock

        return [
            MoELayerSpec(
                name=path,
                router_path=join_path(path, "gate"),
                experts=block.experts,
                expert_param_names=("w13", "w2"),
                num_experts=block.gate.num_experts,
                top_k=block.gate.top_k,
                experts_path=join_path(path, "experts"),
            )
            for path, block in model.named_modules()
            if isinstance(block, MoEBlock)
        ]


DEFAULT_ADAPTERS: tuple[MoEAdapter, ...] = (ReferenceAdapter(), HuggingFaceExpertsAdapter())


def find_moe_layers(
    model: nn.Module, adapters: tuple[MoEAdapter, ...] = DEFAULT_ADAPTERS
) -> tuple[MoEAdapter, list[MoELayerSpec]]:
    """The first adapter that finds MoE layers in the model, and those layers."""
    for path, module in model.named_modules():
        if hasattr(module, ENABLED_MARK):
            raise ValueError(f"{path}: already under graph-mode EPLB (layer {getattr(module, ENABLED_MARK)}); enable a model once")
    for adapter in adapters:
        specs = adapter.find_layers(model)
        if specs:
            return adapter, specs
    searched = "; ".join(a.searched_for for a in adapters)
    raise ValueError(f"no MoE layer found in {type(model).__name__}: searched for {searched}")
