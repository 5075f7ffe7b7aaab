"""Quantization-owned expert weight views: the exact storage each expert kernel reads.

Each format stores one rank's physical experts as tensors with a leading
[num_local_experts] dimension and exposes ``weight_view()``: those tensors, in a fixed
order, and nothing else -- the list upstream's mover reads and writes (invariant 5).
Its ``forward`` (a plain torch reference kernel) reads the very same tensors, so a
moved expert is what the next forward computes with. ``dequantized()`` recovers float
weights for comparisons.

Both expert kernels (``expert_kernels``: ``pairs`` with ids given, ``dense`` without) keep
shapes static and are exact against themselves across batch sizes, which keeps the EP model,
on all ranks' tokens, exactly equal to the one-process reference on its own.

    unquantized   w13 [E, 2I, H], w2 [E, H, I] (+ optional b13 [E, 2I], b2 [E, H])
    w8a8_dynamic  int8 w13/w2 with per-output-channel scales; activations quantised
                  per token at run time
    w4a8          int4 packed two per int8 along the input dim, per-output-channel scales
                  and a per-output-channel scale bias (the mean the symmetric int4 grid
                  cannot hold, applied as mean * sum(x))
"""

from __future__ import annotations

import torch
from torch import nn

from eplb_graph.movement.expert_kernels import kernel, swiglu


class ExpertWeights(nn.Module):
    """Base: ``view_names`` lists, in order, every tensor the kernel reads."""

    format_name = "base"
    view_names: tuple[str, ...] = ()
    # How far this format's output may move when the same math runs in another order
    # (Inductor's fused kernels against the eager reference): float32 rounding, or, in a
    # quantized format, a whole quantization step wherever a value sits on a rounding
    # boundary; a lost weight move moves it by orders of magnitude more (the runtime's
    # tests, tests/eplb_reference/runtime/test_rank.py, hold both).
    output_tolerance: float = 1e-5

    @property
    def num_experts(self) -> int:
        return getattr(self, self.view_names[0]).shape[0]

    def weight_view(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.view_names]

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor | None = None) -> torch.Tensor:
        """pairs: x [S, H] one row per (token, k), expert_ids [S] local slots -> [S, H];
        dense (expert_ids None): x [N, H] tokens -> [E, N, H], every local expert on every token."""
        raise NotImplementedError

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) in float32."""
        raise NotImplementedError

    @classmethod
    def from_float(cls, w13: torch.Tensor, w2: torch.Tensor, **kwargs) -> ExpertWeights:
        raise NotImplementedError

    @classmethod
    def check_dims(cls, hidden: int, intermediate: int) -> None:
        """Refuses expert widths this format cannot store (before any weight or process exists)."""


class UnquantizedExperts(ExpertWeights):
    format_name = "unquantized"

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None):
        super().__init__()
        self.w13 = nn.Parameter(w13.contiguous(), requires_grad=False)
        self.w2 = nn.Parameter(w2.contiguous(), requires_grad=False)
        names = ["w13", "w2"]
        if b13 is not None:
            self.b13 = nn.Parameter(b13.contiguous(), requires_grad=False)
            self.b2 = nn.Parameter(b2.contiguous(), requires_grad=False)
            names += ["b13", "b2"]
        self.view_names = tuple(names)

    @classmethod
    def from_float(cls, w13, w2, *, bias: bool = False, b13=None, b2=None):
        return cls(w13, w2, b13 if bias else None, b2 if bias else None)

    def forward(self, x, expert_ids=None):
        k = kernel(expert_ids)
        hidden = k.linear(x, k.weight(self.w13))  # [S, 2I] / [E, N, 2I]
        if "b13" in self.view_names:
            hidden = hidden + k.channel(self.b13)
        out = k.linear(swiglu(hidden), k.weight(self.w2))  # [S, H] / [E, N, H]
        if "b2" in self.view_names:
            out = out + k.channel(self.b2)
        return out

    def dequantized(self):
        return self.w13.float(), self.w2.float()


def _quantize_per_channel(w: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel quantisation of w [E, O, I] to ints in [-levels, levels]."""
    scale = (w.abs().amax(dim=-1) / levels).clamp_min(1e-8)  # [E, O]
    q = torch.round(w / scale.unsqueeze(-1)).clamp(-levels, levels).to(torch.int8)
    return q, scale.float()


def _quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row int8: x [..., I] -> (x_q as float [..., I], scale [..., 1])."""
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127).clamp_min(1e-8)
    return torch.round(x / scale).clamp(-127, 127), scale


class W8A8DynamicExperts(ExpertWeights):
    format_name = "w8a8_dynamic"
    output_tolerance = 1e-3
    view_names = ("w13_q", "w13_scale", "w2_q", "w2_scale")

    def __init__(self, w13_q, w13_scale, w2_q, w2_scale):
        super().__init__()
        for name, tensor in zip(self.view_names, (w13_q, w13_scale, w2_q, w2_scale)):
            self.register_buffer(name, tensor.contiguous())

    @classmethod
    def from_float(cls, w13, w2, **_):
        return cls(*_quantize_per_channel(w13.float(), 127), *_quantize_per_channel(w2.float(), 127))

    @staticmethod
    def _linear(k, x, q, scale):  # q [E, O, I] int8; scale [E, O]
        x_q, x_scale = _quantize_activations(x)
        # int8 x int8 products summed exactly in float32 (|sum| < 2^24 for these sizes)
        return k.linear(x_q, k.weight(q).float()) * x_scale * k.channel(scale)

    def forward(self, x, expert_ids=None):
        k = kernel(expert_ids)
        hidden = self._linear(k, x.float(), self.w13_q, self.w13_scale)  # [S, 2I] / [E, N, 2I]
        return self._linear(k, swiglu(hidden), self.w2_q, self.w2_scale).to(x.dtype)

    def dequantized(self):
        return self.w13_q.float() * self.w13_scale.unsqueeze(-1), self.w2_q.float() * self.w2_scale.unsqueeze(-1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[..., I] ints in [-8, 7] -> [..., I/2] int8, element 2j in the low nibble."""
    low, high = q[..., 0::2].to(torch.int16), q[..., 1::2].to(torch.int16)
    packed = (low & 0xF) | ((high & 0xF) << 4)
    return torch.where(packed > 127, packed - 256, packed).to(torch.int8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: [..., I/2] int8 -> [..., I] int8 in [-8, 7]."""
    low = torch.bitwise_right_shift(torch.bitwise_left_shift(packed, 4), 4)  # arithmetic: sign-extends
    high = torch.bitwise_right_shift(packed, 4)
    return torch.stack([low, high], dim=-1).flatten(-2)


class W4A8Experts(ExpertWeights):
    format_name = "w4a8"
    output_tolerance = 1e-3
    view_names = ("w13_packed", "w13_scale", "w13_scale_bias", "w2_packed", "w2_scale", "w2_scale_bias")

    def __init__(self, *tensors):
        super().__init__()
        for name, tensor in zip(self.view_names, tensors):
            self.register_buffer(name, tensor.contiguous())

    @classmethod
    def check_dims(cls, hidden: int, intermediate: int) -> None:
        for name, size in (("hidden", hidden), ("intermediate", intermediate)):  # w13's and w2's input dims
            cls._check_input_dim(size, name)

    @staticmethod
    def _check_input_dim(size: int, name: str = "input") -> None:
        if size % 2:
            raise ValueError(f"w4a8 packs two int4 per byte along the input dim; got odd {name} size {size}")

    @classmethod
    def _quantize(cls, w):  # w [E, O, I] -> packed [E, O, I/2], scale [E, O], scale_bias [E, O]
        cls._check_input_dim(w.shape[-1])
        mean = w.mean(dim=-1)  # [E, O]
        q, scale = _quantize_per_channel(w - mean.unsqueeze(-1), 7)
        return pack_int4(q), scale, mean.float()

    @classmethod
    def from_float(cls, w13, w2, **_):
        return cls(*cls._quantize(w13.float()), *cls._quantize(w2.float()))

    @staticmethod
    def _linear(k, x, packed, scale, scale_bias):  # packed [E, O, I/2]; scale, scale_bias [E, O]
        x_q, x_scale = _quantize_activations(x)
        q = unpack_int4(k.weight(packed)).float()  # [S, O, I] / [E, O, I]
        return k.linear(x_q, q) * x_scale * k.channel(scale) + k.channel(scale_bias) * x.sum(-1, keepdim=True)

    def forward(self, x, expert_ids=None):
        k = kernel(expert_ids)
        hidden = self._linear(k, x.float(), self.w13_packed, self.w13_scale, self.w13_scale_bias)
        return self._linear(k, swiglu(hidden), self.w2_packed, self.w2_scale, self.w2_scale_bias).to(x.dtype)

    def dequantized(self):
        def dq(packed, scale, bias):
            return unpack_int4(packed).float() * scale.unsqueeze(-1) + bias.unsqueeze(-1)

        return dq(self.w13_packed, self.w13_scale, self.w13_scale_bias), dq(self.w2_packed, self.w2_scale, self.w2_scale_bias)


EXPERT_FORMATS: dict[str, type[ExpertWeights]] = {
    cls.format_name: cls for cls in (UnquantizedExperts, W8A8DynamicExperts, W4A8Experts)
}
# Formats users ask for that cannot be moved per expert, and why (rejected at start-up).
UNSUPPORTED_FORMATS = {
    "w8a8_static": "its activation scale is one tensor shared by all experts, not per expert, so movement cannot carry it",
    "fp8_block": "the reference runtime has no FP8 kernel (the vLLM plugin serves FP8 checkpoints: vllm_plugin/expert_views.py)",
    "gptq_marlin": "its Marlin-repacked tiles interleave experts' columns; a per-expert view would not be the kernel's storage",
}


def expert_format(name: str) -> type[ExpertWeights]:
    if name in EXPERT_FORMATS:
        return EXPERT_FORMATS[name]
    why = UNSUPPORTED_FORMATS.get(name, "unknown format")
    raise ValueError(
        f"quantization format {name!r} is not supported by EPLB: {why}; supported: {', '.join(EXPERT_FORMATS)}"
    )


def is_expert_major(tensor: torch.Tensor, num_local_experts: int) -> bool:
    """[E, ...] with one row per expert (a stride-0 expert dim is one tensor broadcast to all)."""
    return tensor.dim() > 0 and tensor.shape[0] == num_local_experts and tensor.stride(0) != 0


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.nbytes == b.nbytes


def check_view_layout(owner: str, view: dict[str, torch.Tensor], num_local_experts: int) -> None:
    """Every tensor of a weight view is a contiguous [E, ...] expert-major tensor, on one device:
    what upstream's mover reads and writes row by row."""
    devices = {t.device for t in view.values()}
    if len(devices) > 1:
        raise ValueError(f"{owner}: weight view spans devices {devices}")
    for name, tensor in view.items():
        if tensor.dim() == 0 or tensor.shape[0] != num_local_experts or not tensor.is_contiguous():
            raise ValueError(
                f"{owner}: view tensor {name} {tuple(tensor.shape)} is not a contiguous "
                f"[{num_local_experts}, ...] expert-major tensor"
            )


def outside_view(view: dict[str, torch.Tensor], read: dict[str, torch.Tensor], num_local_experts: int) -> list[str]:
    """The expert-major tensors of ``read`` (what the kernel reads) whose storage no view tensor is."""
    return [
        name for name, tensor in read.items()
        if is_expert_major(tensor, num_local_experts) and not any(shares_storage(tensor, t) for t in view.values())
    ]


def check_weight_view(experts: ExpertWeights, num_local_experts: int) -> None:
    """The view must be the kernel's storage: every tensor expert-major, contiguous, on one device,
    and no expert-major tensor of the module left out of it (coupled metadata moves together)."""
    view = dict(zip(experts.view_names, experts.weight_view()))
    check_view_layout(experts.format_name, view, num_local_experts)
    left_out = outside_view(view, dict([*experts.named_parameters(), *experts.named_buffers()]), num_local_experts)
    if left_out:
        raise ValueError(f"{experts.format_name}: expert tensors {left_out} are outside the weight view and would not move")
