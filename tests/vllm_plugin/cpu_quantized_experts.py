"""vLLM's CPU FP8 MoE experts on hosts without AMX, for the engine and server tests.

vLLM 0.32 serves FP8 MoE on CPU with ``CPUExpertsFp8``, which it admits only where the CPU has
AMX tiles (Sapphire Rapids and newer). These hosts (AMD EPYC, AVX-512) have none, yet the
experts' kernel (``_C.fused_experts_cpu``) computes FP8 MoE on their AVX-512 path:
``test_cpu_fp8_kernel.py`` checks it against a dequantized reference, and checks the premise of
the exact on/off comparisons: a token's row is the same in any batch where its expert gets at
most ``EXACT_TOKENS_PER_EXPERT`` tokens (the engines here run that many tokens per step).

``lift_if_asked`` lifts the gate for that experts class only -- lifting
``torch.cpu._is_amx_tile_supported`` would make CPU attention execute AMX instructions (SIGILL)
-- in every process of an engine: the variable is inherited, and each entry script calls it at
import, which a spawned engine core repeats (it imports its parent's main module). What this
does not prove: vLLM's AMX code path of the same kernel.
"""

from __future__ import annotations

import os

import torch

LIFT_ENV = "EPLB_GRAPH_TESTS_LIFT_FP8_AMX_GATE"
EXACT_TOKENS_PER_EXPERT = 4


def lift_if_asked() -> bool:
    """Admits ``CPUExpertsFp8`` on this CPU if the environment asks and vLLM's gate refuses it."""
    if os.environ.get(LIFT_ENV) != "1" or torch.cpu._is_amx_tile_supported():
        return False
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsFp8

    CPUExpertsFp8._supports_current_device = staticmethod(lambda: True)
    return True


def packed_for_cpu(weight: torch.Tensor) -> torch.Tensor:
    """[E, O, I] float8 -> the VNNI-packed layout vLLM's CPU experts read (as it packs at load)."""
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    return torch.ops._C.convert_weight_packed(weight)


def fp8_experts(x, packed_w13, packed_w2, w13_scale, w2_scale, topk_weights, topk_ids):
    """vLLM's CPU FP8 W8A16 experts ([128, 128] blocks), called as CPUExpertsFp8 calls them."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUQuantMethod

    out = torch.empty_like(x)
    torch.ops._C.fused_experts_cpu(out, x, packed_w13, packed_w2, topk_weights, topk_ids, CPUQuantMethod.FP8_W8A16,
                                   w13_scale, w2_scale, None, None, None, [128, 128], None, None, None, None, True)
    return out
