"""vLLM's CPU FP8 and int4 MoE experts on hosts without AMX, for the engine and server tests.

vLLM 0.32 serves quantized MoE on CPU with ``CPUExpertsFp8`` (FP8 W8A16, [128, 128] blocks) and
``CPUExpertsInt4`` (int4 weights, run as W4A8), which it admits only where the CPU has AMX tiles
(Sapphire Rapids and newer). Hosts with AVX-512 and AVX-512 BF16 but no AMX compute both kernels
(``_C.fused_experts_cpu``) on their AVX-512 path; elsewhere vLLM's build has no such kernel, and
the tests run on torch stand-ins of it (cpu_kernel_stand_ins.py says what they do not prove).
``test_cpu_quantized_kernels.py`` checks the kernels in use against a dequantized reference, and
checks the premise of the exact on/off comparisons: a token's row is the same in any batch where
its expert gets at most ``EXACT_TOKENS_PER_EXPERT`` tokens (the engines here run that many
tokens per step).

``lift_if_asked`` lifts the gate for those experts classes only -- lifting
``torch.cpu._is_amx_tile_supported`` would make CPU attention execute AMX instructions (SIGILL)
-- and registers the stand-ins where the kernels are missing, in every process of an engine:
the variable is inherited, and each entry script calls it at import, which a spawned engine core
repeats (it imports its parent's main module). What this does not prove: vLLM's AMX code path
of the same kernels.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # imported where registered: importing it imports vLLM, and test modules importskip vLLM
    from tests.eplb_graph.vllm_plugin.cpu_kernel_stand_ins import StandInKernels

LIFT_ENV = "EPLB_GRAPH_TESTS_LIFT_AMX_GATE"
EXACT_TOKENS_PER_EXPERT = 4
LIFTED_EXPERTS = ("CPUExpertsFp8", "CPUExpertsInt4")


def missing_quantized_kernels() -> list[str]:
    """The quantized CPU MoE ops this host's vLLM build lacks. vLLM's x86 build loads the library
    that holds them (``vllm._C``) only where the CPU has AVX-512 and AVX-512 BF16; elsewhere it
    loads ``_C_AVX2`` or ``_C_AVX512``, without them."""
    from tests.eplb_graph.vllm_plugin.cpu_kernel_stand_ins import STAND_INS  # imports vLLM: the kernel library this CPU takes

    return [op for op in STAND_INS if not hasattr(torch.ops._C, op)]


def kernels_in_use() -> str:
    """'vllm' where this host runs vLLM's own quantized kernels, 'stand-ins' where the tests register
    ours (asked in a process that has registered none). Stand-ins only where vLLM's x86 CPU build
    was meant to lack the kernels: a CPU with AVX-512 BF16 that misses them had vLLM's library fail."""
    missing = missing_quantized_kernels()
    if not missing:
        return "vllm"
    from vllm.platforms import CpuArchEnum, current_platform

    if not (current_platform.is_cpu() and current_platform.get_cpu_architecture() == CpuArchEnum.X86):
        raise RuntimeError("the quantized-kernel stand-ins are for vLLM's x86 CPU build")
    if torch.cpu._is_avx512_bf16_supported():
        raise RuntimeError(f"this CPU has AVX-512 BF16, yet vLLM's build lacks {missing}: vllm._C did not load")
    return "stand-ins"


def registered_stand_ins() -> StandInKernels | None:
    """The stand-ins registered for what vLLM's build lacks on this host, or None where it has the kernels."""
    if kernels_in_use() == "vllm":
        return None
    from tests.eplb_graph.vllm_plugin.cpu_kernel_stand_ins import StandInKernels

    return StandInKernels(missing_quantized_kernels())


@functools.cache
def stand_ins_for_this_process() -> StandInKernels | None:
    """The stand-ins an engine process runs on, registered once and held for the process's life."""
    return registered_stand_ins()


def kernels_report() -> dict:
    """What this process's quantized experts ran on: vLLM's kernels, or the stand-ins and their calls."""
    stand_ins = stand_ins_for_this_process()
    return {"kernels": "vllm"} if stand_ins is None else {"kernels": "stand-ins", "calls": dict(stand_ins.calls)}


def lift_if_asked() -> bool:
    """Admits vLLM's quantized CPU experts on this CPU if the environment asks and vLLM's gate
    refuses them, on the stand-ins where its build lacks the kernels."""
    if os.environ.get(LIFT_ENV) != "1" or torch.cpu._is_amx_tile_supported():
        return False
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    for name in LIFTED_EXPERTS:
        getattr(cpu_moe, name)._supports_current_device = staticmethod(lambda: True)
    stand_ins_for_this_process()
    return True


def packed_for_cpu(weight: torch.Tensor) -> torch.Tensor:
    """[E, O, I] float8 -> the VNNI-packed layout vLLM's CPU FP8 experts read (as it packs at load)."""
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    return torch.ops._C.convert_weight_packed(weight)


def int4_blocked_for_cpu(w13_packed, w2_packed, w13_scale, w2_scale, zeros=(None, None)) -> tuple[torch.Tensor, ...]:
    """compressed-tensors int4 [E, O, I/8] int32, scales [E, O, I/group] and, for an asymmetric
    checkpoint, zero points [E, O/8, I/group] stored one below -> the blocked (w13, w2, w13 scales,
    w2 scales, w13 zero points, w2 zero points) vLLM's CPU int4 experts read: vLLM's own load-time
    conversion (which makes the zero points of a symmetric checkpoint)."""
    from compressed_tensors.quantization import QuantizationArgs
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import _process_weights_cpu

    group = w13_packed.shape[-1] * 8 // w13_scale.shape[-1]
    args = QuantizationArgs(num_bits=4, type="int", symmetric=zeros[0] is None, strategy="group", group_size=group)
    return _process_weights_cpu(args, w13_packed, w2_packed, w13_scale, w2_scale, *zeros)[:6]


def cpu_experts(x, method: str, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, *, zeros=(None, None),
                block=None, kernel=None):
    """vLLM's CPU experts (``method``: FP8_W8A16 or INT4_W4A8), called as its experts classes call
    them: ``torch.ops._C.fused_experts_cpu``, or ``kernel`` called the same way."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUQuantMethod

    out = torch.empty_like(x)
    (kernel or torch.ops._C.fused_experts_cpu)(out, x, w13, w2, topk_weights, topk_ids.to(torch.int32),
                                               getattr(CPUQuantMethod, method), w13_scale, w2_scale, *zeros, None,
                                               block, None, None, None, None, True)
    return out


def stacked(quantize, w: torch.Tensor) -> list[torch.Tensor]:
    """Each expert of [E, ...] quantized -> the quantizer's outputs, each stacked over the experts."""
    return [torch.stack(t) for t in zip(*map(quantize, w))]


def moe_reference(x, w13, w2, weights, ids) -> torch.Tensor:
    """The SiLU-gated MoE the kernels compute, over dequantized [E, 2I, H] and [E, H, I], in float64: [T, H]."""
    hidden = torch.einsum("th,tkoh->tko", x.double(), w13[ids].double())  # [T, K, 2I]
    gate, up = hidden.chunk(2, dim=-1)
    return torch.einsum("tk,tki,tkhi->th", weights.double(), torch.nn.functional.silu(gate) * up, w2[ids].double())


def close_to(out: torch.Tensor, reference: torch.Tensor, rel: float) -> bool:
    """Within ``rel`` of the reference's largest magnitude."""
    return bool((out.double() - reference).abs().max() <= rel * reference.abs().max())
