"""transformers 5.x MoE layers: experts built with ``use_experts_implementation``, found generically.

Every family that decorates its experts class with ``use_experts_implementation`` stores the
routed experts the same way (expert-major ``gate_up_proj`` / ``up_proj`` / ``down_proj``,
optional biases, ``num_experts``) and runs one of transformers' experts implementations.
What differs is the router: ``.gate`` or ``.router`` beside ``.experts``, a router at the
decoder-layer level, a block that runs its own top-k over a plain ``nn.Linear``, grouped
top-k, bias-corrected scores, selection without ``torch.topk``. The adapter reads what the
structure says (experts, router, k, expert count) and lets ``router_probe`` prove on a
probe input that the experts receive the ids of the top-k the pass will map.

Implementations proven with graph-mode EPLB (``SUPPORTED_IMPLEMENTATIONS``), both over the
physical layout once ``num_experts`` is the physical count:
* ``grouped_mm`` (transformers' default): sorts ids, ``histc`` over ``self.num_experts``
  bins for the offsets, then ``torch._grouped_mm`` / ``F.grouped_mm`` on CUDA and CPU, or
  transformers' ``grouped_mm_fallback`` custom op under torch.compile with non-bf16
  weights. The bins, the offsets' length and the weights' leading dim are all physical.
* ``batched_mm``: gathers ``weight[ids]`` per (token, k).
``eager`` loops over ``nonzero()`` (a data-dependent shape) and is refused, as is any other
(``deepgemm``, ``sonicmoe``, FP8 kernels, a user's registration) until it is proven.
"""

from __future__ import annotations

import inspect

from torch import nn

from eplb_graph.pytorch.adapter_base import MoEAdapter, MoELayerSpec, join_path
from eplb_graph.pytorch.router_probe import probe_selection

SUPPORTED_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")
SET_IMPLEMENTATION = 'model.set_experts_implementation("grouped_mm")'
ROUTER_NAMES = ("gate", "router")
WEIGHT_NAMES = ("gate_up_proj", "up_proj", "down_proj")
# Where a router keeps k when it has no ``top_k`` attribute: the config its forward reads.
TOP_K_CONFIG_KEYS = ("num_experts_per_tok", "top_k_experts", "moe_k", "moe_topk")


def is_hf_experts(module: nn.Module) -> bool:
    """An experts module whose forward ``use_experts_implementation`` dispatches."""
    forward = getattr(type(module), "forward", None)
    markers = ("config", "has_gate", "has_bias", "is_transposed", "_is_expert_parallel")
    return hasattr(forward, "__wrapped__") and all(hasattr(module, name) for name in markers)


def experts_implementation(experts: nn.Module) -> str | None:
    return getattr(experts.config, "_experts_implementation", None)


def implementation_problem(implementation: str | None) -> str | None:
    if implementation in SUPPORTED_IMPLEMENTATIONS:
        return None
    if implementation == "eager":
        why = "is not graph-safe: its loop over nonzero() has a data-dependent shape no graph can hold"
    else:
        why = f"is not proven with graph-mode EPLB (proven: {', '.join(SUPPORTED_IMPLEMENTATIONS)})"
    return (
        f"experts implementation {implementation!r} {why}; switch with {SET_IMPLEMENTATION} "
        f'(or from_pretrained(..., experts_implementation="grouped_mm"))'
    )


def _int_attribute(owner: object, name: str) -> int | None:
    value = getattr(owner, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_top_k(router: nn.Module, block: nn.Module) -> int | None:
    for owner in (router, block):
        if (k := _int_attribute(owner, "top_k")) is not None:
            return k
    config = getattr(router, "config", None)
    return next((k for key in TOP_K_CONFIG_KEYS if (k := _int_attribute(config, key)) is not None), None)


def expert_tensors(experts: nn.Module, path: str, num_experts: int) -> tuple[str, ...]:
    """Every tensor of the experts module, each [num_experts, ...]; ValueError otherwise."""
    nested = [name for name, _ in experts.named_parameters() if "." in name]
    nested += [name for name, _ in experts.named_buffers() if "." in name]
    if nested:
        raise ValueError(f"{path}: tensors in submodules ({', '.join(nested)}): not a layout the experts view knows")
    tensors = dict(experts.named_parameters(recurse=False)) | dict(experts.named_buffers(recurse=False))
    if not any(name in tensors for name in ("gate_up_proj", "up_proj")) or "down_proj" not in tensors:
        raise ValueError(f"{path}: expected gate_up_proj (or up_proj) and down_proj, found {sorted(tensors)}")
    for name, tensor in tensors.items():
        if tensor.dim() == 0 or tensor.shape[0] != num_experts:
            raise ValueError(
                f"{path}.{name} {tuple(tensor.shape)} is not expert-major: the leading dim must be the "
                f"{num_experts} experts, so that a placement can move whole experts"
            )
    return tuple(tensors)


def hidden_size_of(experts: nn.Module) -> int:
    """The model width the experts read: down_proj is [E, hidden, inter], or [E, inter, hidden] transposed."""
    down = experts.down_proj
    return int(down.shape[2] if experts.is_transposed else down.shape[1])


class HuggingFaceExpertsAdapter(MoEAdapter):
    """Every MoE layer whose experts run through ``use_experts_implementation``."""

    name = "huggingface"
    searched_for = "transformers experts modules (gate_up_proj / down_proj) built with use_experts_implementation"

    def find_layers(self, model: nn.Module) -> list[MoELayerSpec]:
        return [self.layer_spec(model, path, experts) for path, experts in model.named_modules() if is_hf_experts(experts)]

    def layer_spec(self, model: nn.Module, path: str, experts: nn.Module) -> MoELayerSpec:
        block_path = path.rpartition(".")[0]
        block = model.get_submodule(block_path)
        routers = [(name, m) for name, m in block.named_children() if name in ROUTER_NAMES and m is not experts]
        if not routers:
            raise ValueError(f"{block_path}: no router beside {path} (looked for .{' / .'.join(ROUTER_NAMES)})")
        router_name, router = routers[0]
        if "input_ids" in inspect.signature(router.forward).parameters:
            raise ValueError(
                f"{join_path(block_path, router_name)}: {type(router).__name__} routes by token ids (hash routing), "
                f"not by a top-k over scores: there is no selection for the pass to map"
            )
        num_experts = _int_attribute(experts, "num_experts")
        router_experts = _int_attribute(router, "num_experts")
        top_k = read_top_k(router, block)
        if num_experts is None or top_k is None:
            raise ValueError(
                f"{join_path(block_path, router_name)}: no readable "
                f"{'num_experts' if num_experts is None else 'top_k'} on the router, its block or its config"
            )
        if router_experts not in (None, num_experts):
            raise ValueError(f"{block_path}: router selects among {router_experts} experts, {path} holds {num_experts}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"{block_path}: top_k={top_k} outside [1, {num_experts}]")
        names = expert_tensors(experts, path, num_experts)
        router_path = self.selecting_module(block, block_path, router, router_name, experts, num_experts, top_k)
        return MoELayerSpec(
            name=block_path, router_path=router_path, experts=experts, expert_param_names=names,
            num_experts=num_experts, top_k=top_k, experts_path=path,
            implementation=experts_implementation(experts),
        )

    def selecting_module(
        self, block: nn.Module, block_path: str, router: nn.Module, router_name: str, experts: nn.Module,
        num_experts: int, top_k: int,
    ) -> str:
        """The module path whose top-k the pass maps: the router, or the block that runs it."""
        hidden_dim = hidden_size_of(experts)
        try:
            probe = probe_selection(block, router, experts, hidden_dim=hidden_dim, num_experts=num_experts, top_k=top_k)
        except ValueError as error:
            raise ValueError(f"{block_path}: {error}") from None
        if probe.selection is None:
            seen = ", ".join(f"k={c.k} over {c.candidates}" for c in probe.calls) or "none"
            raise ValueError(
                f"{block_path}: no torch.topk over the {num_experts} experts with k={top_k} selects them "
                f"(top-k calls seen: {seen}); the pass cannot see this router's selection"
            )
        if not probe.mappable:
            raise ValueError(
                f"{block_path}: the experts do not receive the ids of the router's top-k unchanged; mapping "
                f"that top-k would not be what the experts index with"
            )
        return join_path(block_path, router_name) if probe.selection.in_router else block_path

    def check_supported(self, spec: MoELayerSpec) -> None:
        if spec.experts._is_expert_parallel:
            raise ValueError(
                f"{spec.experts_path}: transformers' own expert parallel is on (its router hook remaps ids to "
                f"local experts after the top-k); eplb_graph.enable places experts itself, in one process"
            )
        problem = implementation_problem(spec.implementation)
        if problem is not None:
            raise ValueError(f"{spec.name}: {problem}")
