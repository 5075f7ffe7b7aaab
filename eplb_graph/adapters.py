"""Model-family adapters: where a model keeps its routers and its routed-expert weights.

An adapter answers two questions for ``enable`` and the pass, and nothing else: which
modules are the MoE layers (router path, expert count, top-k), and which expert tensors
have a leading [num_experts] dimension that must move to physical layout. A new MoE
architecture is a new adapter of a dozen lines, not a change to the pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class MoELayerSpec:
    name: str  # module path of the MoE block, e.g. "model.layers.0.mlp"
    router_path: str  # module path of the router whose top-k selects experts
    experts: nn.Module  # the module holding the routed-expert weights
    expert_param_names: tuple[str, ...]  # its tensors with a leading [num_experts] dim
    num_experts: int  # logical experts
    top_k: int


class MoEAdapter:
    """Base: subclasses implement ``find_layers`` and may extend ``set_num_physical``."""

    name = "base"
    searched_for = ""

    def find_layers(self, model: nn.Module) -> list[MoELayerSpec]:
        raise NotImplementedError

    def check_supported(self, spec: MoELayerSpec) -> None:
        """Raises ValueError if this layer cannot run graph-mode EPLB as configured."""

    def set_num_physical(self, spec: MoELayerSpec, num_physical: int) -> None:
        spec.experts.num_experts = num_physical


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class ReferenceAdapter(MoEAdapter):
    """eplb_graph.models.reference: ``MoEBlock`` with ``.gate`` (TopKRouter) and ``.experts`` (w13, w2)."""

    name = "reference"
    searched_for = "eplb_graph reference MoEBlock modules (.gate TopKRouter, .experts BatchedExperts)"

    def find_layers(self, model: nn.Module) -> list[MoELayerSpec]:
        from eplb_graph.models.reference import MoEBlock

        return [
            MoELayerSpec(
                name=path,
                router_path=_join(path, "gate"),
                experts=block.experts,
                expert_param_names=("w13", "w2"),
                num_experts=block.gate.num_experts,
                top_k=block.gate.top_k,
            )
            for path, block in model.named_modules()
            if isinstance(block, MoEBlock)
        ]


class HuggingFaceExpertsAdapter(MoEAdapter):
    """transformers 5.x MoE blocks: ``.gate`` (a top-k router with ``top_k``, ``num_experts``)
    beside ``.experts`` (fused ``gate_up_proj`` / ``down_proj``, optional biases) -- Qwen3-MoE,
    Mixtral, DeepSeek-V3 and the other families built on ``use_experts_implementation``."""

    name = "huggingface"
    searched_for = "transformers MoE blocks with .gate (top_k, num_experts) and .experts (gate_up_proj, down_proj)"
    # Implementations that index expert weights by id with static shapes.
    graph_safe_implementations = ("batched_mm",)

    def find_layers(self, model: nn.Module) -> list[MoELayerSpec]:
        specs = []
        for path, block in model.named_modules():
            gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
            if not (isinstance(gate, nn.Module) and isinstance(experts, nn.Module)):
                continue
            if not (hasattr(gate, "top_k") and hasattr(gate, "num_experts") and hasattr(experts, "down_proj")):
                continue
            weights = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")
            specs.append(
                MoELayerSpec(
                    name=path,
                    router_path=_join(path, "gate"),
                    experts=experts,
                    expert_param_names=tuple(n for n in weights if getattr(experts, n, None) is not None),
                    num_experts=int(gate.num_experts),
                    top_k=int(gate.top_k),
                )
            )
        return specs

    def check_supported(self, spec: MoELayerSpec) -> None:
        config = getattr(spec.experts, "config", None)
        implementation = getattr(config, "_experts_implementation", None)
        if implementation not in self.graph_safe_implementations:
            raise ValueError(
                f"{spec.name}: experts implementation {implementation!r} is not graph-safe for EPLB "
                f"(the 'eager' loop uses nonzero(), a data-dependent shape); build the model with "
                f"experts_implementation='batched_mm'"
            )


DEFAULT_ADAPTERS: tuple[MoEAdapter, ...] = (ReferenceAdapter(), HuggingFaceExpertsAdapter())


def find_moe_layers(
    model: nn.Module, adapters: tuple[MoEAdapter, ...] = DEFAULT_ADAPTERS
) -> tuple[MoEAdapter, list[MoELayerSpec]]:
    """The first adapter that finds MoE layers in the model, and those layers."""
    for adapter in adapters:
        specs = adapter.find_layers(model)
        if specs:
            return adapter, specs
    searched = "; ".join(a.searched_for for a in adapters)
    raise ValueError(f"no MoE layer found in {type(model).__name__}: searched for {searched}")
