"""Expert-weight views of vLLM's MoE layers: what the fused-MoE kernel reads is what upstream moves.

Upstream's EPLB moves each layer's ``get_expert_weights()``: every parameter of its
``RoutedExperts`` as an [E, -1] view, collected after ``process_weights_after_loading``, so the
storage a kernel repacked at load (VNNI-packed FP8, blocked scales) is what moves. The kernel
reads the two weights its quant method passes at ``apply`` (``layer.w13_weight``,
``layer.w2_weight``), the tensors of the quant config its experts object holds (weight and
activation scales, global scales / alphas, zero points, biases) and any tensor the experts object
keeps itself.

``ExpertWeightView`` proves at start, per layer, that these are one storage (invariant 5), with
the layout check our own formats use (``weight_views``). An expert-major tensor the kernel reads
that no parameter holds -- per-expert state a method derives after loading -- is added to what
upstream moves, so it follows its expert; one shared by every expert (a per-tensor input scale, a
broadcast view) needs no move. A quant method without a view is refused by name.
"""

from __future__ import annotations

import torch

from eplb_graph.movement.weight_views import check_view_layout, outside_view, shares_storage

# vLLM's MoE quant methods with a view, and the quantization names (``quantization=`` or a
# checkpoint's ``quant_method``) that build them: those an engine test has bound a view to. Each
# runs a modular kernel: its inputs are visible. Online per-tensor and per-channel FP8
# (``Fp8PerTensorOnlineMoEMethod``, ``Fp8PtpcOnlineMoEMethod``) are not listed: vLLM's CPU build
# cannot load them (docs/support-matrix.md), so no view of theirs has been bound.
VIEWED_MOE_METHODS: dict[str, tuple[str | None, ...]] = {
    "UnquantizedFusedMoEMethod": (None,),
    "Fp8MoEMethod": ("fp8",),  # a pre-quantized FP8 checkpoint
    "Fp8PerBlockOnlineMoEMethod": ("fp8_per_block",),  # online, from a bf16/fp16 checkpoint
    # int4 weights (pack-quantized): W4A8 on vLLM's CPU backend (quant_methods.py)
    "CompressedTensorsWNA16MoEMethod": ("compressed-tensors",),
}
SUPPORTED_QUANTIZATIONS: tuple[str | None, ...] = tuple(
    dict.fromkeys(name for names in VIEWED_MOE_METHODS.values() for name in names))
QUANT_OPERANDS = ("a1", "a2", "w1", "w2")
QUANT_FIELDS = ("scale", "alpha_or_gscale", "zp", "bias")


class ExpertViewError(ValueError):
    """A MoE layer's kernel reads expert storage that upstream's EPLB would not move."""


def kernel_inputs(routed_experts: torch.nn.Module, owner: str) -> dict[str, torch.Tensor]:
    """Every tensor the layer's fused-MoE kernel reads, by name; a kernel whose inputs this cannot
    see (no modular kernel, a monolithic one, a quant-config field that is no tensor) is refused."""
    kernel = getattr(routed_experts.quant_method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None or getattr(kernel, "is_monolithic", True):
        raise ExpertViewError(f"{owner}: the quant method runs no modular, non-monolithic kernel, so what it reads "
                              f"is not visible")
    inputs = {"w13_weight": routed_experts.w13_weight, "w2_weight": routed_experts.w2_weight}
    for operand in QUANT_OPERANDS:
        desc = getattr(experts.quant_config, f"_{operand}")
        for field in QUANT_FIELDS:
            value = getattr(desc, field)
            if value is not None and not isinstance(value, torch.Tensor):  # e.g. GPT-OSS's PrecisionConfig
                raise ExpertViewError(f"{owner}: its kernel reads {operand}.{field} as a {type(value).__name__}, "
                                      f"whose expert storage the view cannot see")
            if value is not None:
                inputs[f"{operand}_{field}"] = value
    inputs.update((f"experts.{name}", value) for name, value in vars(experts).items() if isinstance(value, torch.Tensor))
    return inputs


class ExpertWeightView:
    """One layer's expert storage: what upstream moves, completed with what else its kernel reads
    per expert (``derived``, appended to upstream's list by ``complete_move_list``)."""

    def __init__(self, layer_name: str, routed_experts: torch.nn.Module, moved: list[torch.Tensor]) -> None:
        method = type(routed_experts.quant_method).__name__
        self.layer_name = layer_name
        self.owner = f"layer {layer_name} ({method})"
        if method not in VIEWED_MOE_METHODS:
            raise ExpertViewError(
                f"{self.owner}: no expert-weight view for this quant method, so EPLB cannot move its experts "
                f"(viewed: {', '.join(VIEWED_MOE_METHODS)})"
            )
        self.num_local_experts = int(routed_experts.local_num_experts)
        parameters = dict(routed_experts.named_parameters())
        self.moved = {  # upstream's [E, -1] views, named by the parameter whose storage each is
            next((name for name, p in parameters.items() if shares_storage(p, t)), f"moved[{i}]"): t
            for i, t in enumerate(moved)
        }
        try:
            inputs = kernel_inputs(routed_experts, self.owner)
            self.derived = {name: inputs[name] for name in outside_view(self.moved, inputs, self.num_local_experts)}
            check_view_layout(self.owner, {**self.moved, **self.derived}, self.num_local_experts)  # row by row, one device
        except ValueError as error:
            raise ExpertViewError(str(error)) from None
        # what each kernel input is: the moved tensor it is, derived (moved by us), or shared by all experts
        self.kernel_reads = {
            name: "derived" if name in self.derived else next(
                (moved for moved, t in self.moved.items() if shares_storage(t, tensor)), "shared")
            for name, tensor in inputs.items()
        }

    def summary(self) -> dict:
        return {"moved": list(self.moved), "derived": list(self.derived), "kernel_reads": self.kernel_reads}

    def slot_digests(self) -> list[str]:
        """One digest per local slot over the bytes of every tensor that moves with its expert."""
        import hashlib

        digests = [hashlib.sha256() for _ in range(self.num_local_experts)]
        for tensor in [*self.moved.values(), *self.derived.values()]:
            rows = tensor.detach().reshape(self.num_local_experts, -1).cpu().contiguous().view(torch.uint8)  # [E, bytes]
            for digest, row in zip(digests, rows):
                digest.update(row.numpy().tobytes())
        return [digest.hexdigest()[:16] for digest in digests]

    def row_layout(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each tensor moved with an expert, upstream's and derived, in move order."""
        return [(tuple(t.shape), t.dtype) for t in [*self.moved.values(), *self.derived.values()]]


def complete_move_list(views: list[ExpertWeightView], model_state) -> None:
    """Appends each layer's derived tensors to upstream's per-layer move lists (one staging buffer
    each), before any rearrangement reads them. Upstream moves every layer through the buffers it
    sized from layer 0, pairing them with each layer's tensors by position: every layer must move
    the same shapes and dtypes (an FP8 checkpoint that leaves one MoE layer unquantized does not)."""
    different = [view.layer_name for view in views if view.row_layout() != views[0].row_layout()]
    if different:
        raise ExpertViewError(f"MoE layers {different} move other expert tensors than {views[0].layer_name} "
                              f"({views[0].row_layout()}): upstream moves every layer through one buffer list")
    if not views or not views[0].derived:
        return
    if model_state.rebalanced or model_state.pending_result is not None:  # upstream's worker reads the lists
        raise RuntimeError(f"{views[0].owner}: a rearrangement is in flight before eplb-graph bound the layers")
    if type(model_state.communicator).__name__ == "NixlEplbCommunicator":  # registered its tensors when built
        raise ExpertViewError(f"{views[0].owner}: derived expert tensors {list(views[0].derived)} cannot move "
                              f"through the NIXL communicator; use torch_gloo or torch_nccl")
    for index, view in enumerate(views):
        extra = [t.view(view.num_local_experts, -1) for t in view.derived.values()]
        model_state.model.expert_weights[index].extend(extra)
        if index == 0:
            model_state.expert_buffer.extend(torch.empty_like(t) for t in extra)
