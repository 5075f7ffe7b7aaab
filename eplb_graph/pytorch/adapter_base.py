"""What an adapter tells ``enable`` about one MoE layer, and the adapter interface itself."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

# Set on an experts module once enable() has moved it to physical layout.
ENABLED_MARK = "_eplb_graph_layer"


@dataclass(frozen=True)
class MoELayerSpec:
    name: str  # module path of the MoE block, e.g. "model.layers.0.mlp"
    router_path: str  # module path of the module whose top-k selects experts
    experts: nn.Module  # the module holding the routed-expert weights
    expert_param_names: tuple[str, ...]  # its tensors with a leading [num_experts] dim
    num_experts: int  # logical experts
    top_k: int
    experts_path: str | None = None  # module path of ``experts``, where the adapter knows it
    implementation: str | None = None  # the experts kernel, e.g. transformers' "grouped_mm"


class MoEAdapter:
    """Base: subclasses implement ``find_layers`` and may extend ``set_num_physical``.

    ``find_layers`` and ``check_supported`` must not modify the model: ``enable`` calls
    both for every layer before it touches a weight.
    """

    name = "base"
    searched_for = ""

    def find_layers(self, model: nn.Module) -> list[MoELayerSpec]:
        raise NotImplementedError

    def check_supported(self, spec: MoELayerSpec) -> None:
        """Raises ValueError if this layer cannot run graph-mode EPLB as configured."""

    def set_num_physical(self, spec: MoELayerSpec, num_physical: int) -> None:
        """The experts module counts its physical slots (``enable`` calls it once it has moved the
        weights). An edit of the user's model, as ``enable``'s own are: the model was handed over to
        be changed, whatever library its classes come from (the registry's scan allows user-model
        edits here and in ``enable.py`` only)."""
        spec.experts.num_experts = num_physical


def join_path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
