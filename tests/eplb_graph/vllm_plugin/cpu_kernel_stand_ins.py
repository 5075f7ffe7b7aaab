"""Stand-ins for vLLM's quantized CPU MoE kernels, on hosts whose vLLM build has none.

vLLM's x86 build holds ``_C.fused_experts_cpu`` and its load-time packing ops
(``convert_weight_packed``, ``convert_weight_packed_scale_zp``) only in the library it loads on
CPUs with AVX-512 and AVX-512 BF16. Elsewhere the quantized engine and server tests run on these
torch implementations, registered under the same names and called by vLLM's own code: its
checkpoint loading, its ``process_weights_after_loading``, its experts classes, its EPLB.

Each stand-in keeps what the plugin relies on: a packed tensor keeps its source's shape and dtype
and each expert in its own slab of dim 0, with the content reordered inside the slab (so
a move that copied unpacked data, or half a slab, would change the tokens); the kernel reads
the weights, scales and zero points of exactly the slots ``topk_ids`` names, and a token's row
depends on nothing but that token (float64 arithmetic, one matrix-vector product per token and
expert), so replicas and batches give the same rows.

What this does not prove: vLLM's C++ kernels -- their packed layouts, their numerics (int8
activations for W4A8, bfloat16 products), their AMX and AVX-512 code paths.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from vllm._custom_ops import CPUQuantAlgo, CPUQuantMethod

def vnni_pack(weight: torch.Tensor) -> torch.Tensor:
    """[E, N, K] -> [E, N, K]: each expert's K split in groups of V (4 bytes a group), the groups
    laid N-innermost, as VNNI lays them."""
    E, N, K = weight.shape
    V = max(4 // weight.element_size(), 1)
    if K % V:
        raise ValueError(f"convert_weight_packed stand-in: K={K} is not a multiple of {V}")
    return weight.reshape(E, N, K // V, V).transpose(1, 2).contiguous().view(E, N, K)


def vnni_unpack(packed: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The inverse of ``vnni_pack`` for the slots ``experts`` names: [...] -> [..., N, K]."""
    _, N, K = packed.shape
    V = max(4 // packed.element_size(), 1)
    slabs = packed[experts]  # [..., N, K]
    return slabs.reshape(*slabs.shape[:-2], K // V, N, V).transpose(-3, -2).reshape(*slabs.shape)


def convert_weight_packed(weight: torch.Tensor) -> torch.Tensor:
    if weight.dim() != 3:
        raise ValueError(f"convert_weight_packed stand-in: expected [E, N, K] expert weights, got {tuple(weight.shape)}")
    return vnni_pack(weight)


def convert_weight_packed_scale_zp(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                                   quant_method_4bit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ int4 [E, K/8, N] int32, zero points [E, G, N/8] int32, scales [E, G, N] -> the same
    shapes; the weights transposed inside each expert, the rest copied."""
    if quant_method_4bit != CPUQuantAlgo.GPTQ:
        raise NotImplementedError(f"convert_weight_packed_scale_zp stand-in: only GPTQ packing, not {quant_method_4bit}")
    E, K8, N = qweight.shape
    blocked = qweight.transpose(1, 2).contiguous().view(E, K8, N)  # [E, N, K/8] laid in [E, K/8, N]'s shape
    return blocked, qzeros.clone(memory_format=torch.contiguous_format), scales.clone(memory_format=torch.contiguous_format)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[..., M] int32 holding 8 unsigned nibbles each, lowest first -> [..., 8 M] int64 values."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).flatten(-2).long()


def fp8_weights(packed: torch.Tensor, scale: torch.Tensor, experts: torch.Tensor, block_size: list[int]) -> torch.Tensor:
    """[E, N, K] packed FP8 and [E, N/bn, K/bk] block scales -> float64 [..., N, K] of ``experts``."""
    bn, bk = block_size
    _, N, K = packed.shape
    if scale.shape[1:] != (-(-N // bn), -(-K // bk)):  # a scale per [bn, bk] block, the last ones partial
        raise ValueError(f"fused_experts_cpu stand-in: scales {tuple(scale.shape)} for weights {tuple(packed.shape)} "
                         f"in {block_size} blocks")
    weight = vnni_unpack(packed, experts).double()  # [..., N, K]
    scale = scale[experts].double().repeat_interleave(bn, -2)[..., :N, :].repeat_interleave(bk, -1)[..., :K]
    return weight * scale


def int4_weights(blocked: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The stand-in's blocked GPTQ int4 -> float64 [..., N, K] of ``experts`` (the kernel's [N, K] orientation)."""
    E, K8, N = blocked.shape
    K, G = 8 * K8, scales.shape[-2]
    if K % G or scales.shape[1:] != (G, N) or zeros.shape[1:] != (G, N // 8):
        raise ValueError(f"fused_experts_cpu stand-in: scales {tuple(scales.shape)} and zero points "
                         f"{tuple(zeros.shape)} for int4 weights of K={K}, N={N}")
    weight = unpack_int4(blocked.view(E, N, K8)[experts])  # [..., N, K]
    group = K // G
    zero = (unpack_int4(zeros[experts]) + 1).repeat_interleave(group, -2)  # [..., K, N]
    scale = scales[experts].double().repeat_interleave(group, -2)  # [..., K, N]
    return (weight - zero.transpose(-2, -1)) * scale.transpose(-2, -1)


def expert_weights(method: int, w: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None,
                   experts: torch.Tensor, block_size: list[int] | None) -> torch.Tensor:
    if method == CPUQuantMethod.FP8_W8A16:
        if block_size is None:
            raise NotImplementedError("fused_experts_cpu stand-in: FP8 without block scales")
        return fp8_weights(w, scale, experts, block_size)
    if method == CPUQuantMethod.INT4_W4A8:
        return int4_weights(w, zero, scale, experts)
    raise NotImplementedError(f"fused_experts_cpu stand-in: quant method {method} (only FP8_W8A16 and INT4_W4A8)")


def fused_experts_cpu(out: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor, moe_comp_method: int,
                      w1_scale: torch.Tensor | None, w2_scale: torch.Tensor | None, w1_zero: torch.Tensor | None,
                      w2_zero: torch.Tensor | None, a1_scale: torch.Tensor | None, block_size: list[int] | None,
                      w1_bias: torch.Tensor | None, w2_bias: torch.Tensor | None, alpha: float | None,
                      limit: float | None, is_vnni: bool) -> None:
    """SiLU-gated MoE over the slots ``topk_ids`` names, written into ``out``."""
    unsupported = [name for name, given in [("unpacked weights", not is_vnni), ("a1_scale", a1_scale is not None),
                                            ("biases", w1_bias is not None or w2_bias is not None),
                                            ("alpha or limit", alpha is not None or limit is not None)] if given]
    if unsupported:
        raise NotImplementedError(f"fused_experts_cpu stand-in: {', '.join(unsupported)} not supported")
    ids = topk_ids.long()  # [T, K]
    if ids.numel() and ids.min() < 0:  # vLLM marks an expert on another rank with -1: one rank here
        raise NotImplementedError("fused_experts_cpu stand-in: expert ids on another rank (-1)")
    x = hidden_states.double()  # [T, H]
    up = expert_weights(moe_comp_method, w1, w1_scale, w1_zero, ids, block_size)  # [T, K, 2I, H]
    gate, value = torch.einsum("th,tkoh->tko", x, up).chunk(2, dim=-1)  # [T, K, I] each
    down = expert_weights(moe_comp_method, w2, w2_scale, w2_zero, ids, block_size)  # [T, K, H, I]
    per_expert = torch.einsum("tki,tkhi->tkh", F.silu(gate) * value, down)  # [T, K, H]
    out.copy_(torch.einsum("tk,tkh->th", topk_weights.double(), per_expert))


STAND_INS = {  # name -> (schema, implementation, fake); the schemas are vLLM 0.32's, as its wrappers call them
    "convert_weight_packed": ("convert_weight_packed(Tensor weight) -> Tensor",
                              convert_weight_packed, torch.empty_like),
    "convert_weight_packed_scale_zp": ("convert_weight_packed_scale_zp(Tensor qweight, Tensor qzeros, Tensor scales, "
                                       "int quant_method_4bit) -> (Tensor, Tensor, Tensor)",
                                       convert_weight_packed_scale_zp,
                                       lambda w, z, s, algo: tuple(map(torch.empty_like, (w, z, s)))),
    "fused_experts_cpu": ("fused_experts_cpu(Tensor(a0!) out, Tensor hidden_states, Tensor w1, Tensor w2, "
                          "Tensor topk_weights, Tensor topk_ids, int moe_comp_method, Tensor? w1_scale, "
                          "Tensor? w2_scale, Tensor? w1_zero, Tensor? w2_zero, Tensor? a1_scale, int[]? block_size, "
                          "Tensor? w1_bias, Tensor? w2_bias, float? alpha, float? limit, bool is_vnni) -> ()",
                          fused_experts_cpu, lambda *args: None),
}


class StandInKernels:
    """Registers the stand-ins under ``torch.ops._C`` and counts their calls; the registrations
    live as long as this object. All three or none: the kernel reads the stand-ins' packing only."""

    def __init__(self, missing: list[str]):
        if sorted(missing) != sorted(STAND_INS):
            raise RuntimeError(f"vLLM's build lacks {missing} but has the rest of {sorted(STAND_INS)}: "
                               "stand-ins would mix with kernels of another packing")
        self.calls: Counter[str] = Counter()
        self.library = torch.library.Library("_C", "FRAGMENT")
        for name, (schema, implementation, fake) in STAND_INS.items():
            self.library.define(schema)
            self.library.impl(name, self.counted(name, implementation), "CPU")
            torch.library.register_fake(f"_C::{name}", fake, lib=self.library)

    def counted(self, name: str, implementation):
        def call(*args, **kwargs):
            self.calls[name] += 1
            return implementation(*args, **kwargs)

        return call

    def close(self) -> None:
        """Removes the registrations (a test process that registered them for one module), as
        collecting the library would; torch has no public call for it."""
        self.library._destroy()
