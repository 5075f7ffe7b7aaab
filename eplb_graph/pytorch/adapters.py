"""Model-family adapters: where a model keeps its routers and its routed-expert weights.

An adapter answers two questions for ``enable`` and the pass, and nothing else: which
modules are the MoE layers (router path, expert count, top-k), and which expert tensors
have a leading [num_experts] dimension that must move to physical layout. A new MoE
architecture is a new adapter of a dozen lines, not a change to the pass. transformers'
families share one adapter (``hf_adapter.py``); a model class may carry its own
(``OWN_ADAPTER``), as the reference decoder does.
"""

from __future__ import annotations

from torch import nn

from eplb_graph.pytorch.adapter_base import ENABLED_MARK, MoEAdapter, MoELayerSpec, join_path
from eplb_graph.pytorch.hf_adapter import HuggingFaceExpertsAdapter

__all__ = ["DEFAULT_ADAPTERS", "OWN_ADAPTER", "HuggingFaceExpertsAdapter", "MoEAdapter", "MoELayerSpec", "find_moe_layers"]


DEFAULT_ADAPTERS: tuple[MoEAdapter, ...] = (HuggingFaceExpertsAdapter(),)
# A module class may name the adapter that finds it (a MoEAdapter instance) in this attribute: the
# adapters a model's modules name are asked first.
OWN_ADAPTER = "eplb_moe_adapter"


def find_moe_layers(
    model: nn.Module, adapters: tuple[MoEAdapter, ...] = DEFAULT_ADAPTERS
) -> tuple[MoEAdapter, list[MoELayerSpec]]:
    """The first adapter that finds MoE layers in the model (those its modules name first), and those layers."""
    named: dict[int, MoEAdapter] = {}
    for path, module in model.named_modules():
        own = getattr(module, OWN_ADAPTER, None)
        if own is not None and not isinstance(own, MoEAdapter):
            raise ValueError(f"{path or type(model).__name__}: {OWN_ADAPTER} must be a MoEAdapter, got {type(own).__name__}")
        if own is not None:
            named.setdefault(id(own), own)
        if hasattr(module, ENABLED_MARK):
            raise ValueError(f"{path}: already under graph-mode EPLB (layer {getattr(module, ENABLED_MARK)}); enable a model once")
    for adapter in (*named.values(), *adapters):
        specs = adapter.find_layers(model)
        if specs:
            return adapter, specs
    searched = "; ".join(a.searched_for for a in (*named.values(), *adapters))
    raise ValueError(f"no MoE layer found in {type(model).__name__}: searched for {searched}")
