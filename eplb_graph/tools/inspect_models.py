"""Tiny random-weight Hugging Face MoE models of three families, built in code (no download).

The experts run transformers' ``batched_mm`` implementation unless asked otherwise: it
gathers expert weights by id, so eager and compiled outputs agree bitwise, which the pass
tests assert. transformers' default, ``grouped_mm``, works as well (``experts_implementation=
"grouped_mm"``; eager and compiled then run different grouped-mm kernels). Every other
family of the installed transformers is built by ``hf_families.py``.
"""

from __future__ import annotations

import torch
from torch import nn

HF_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")


def tiny_hf_config(
    family: str, *, num_experts: int = 8, top_k: int = 2, num_layers: int = 2, experts_implementation: str = "batched_mm"
):
    import transformers

    common = dict(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=top_k,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common, intermediate_size=64, moe_intermediate_size=16, head_dim=8,
            num_experts=num_experts, decoder_sparse_step=1, mlp_only_layers=[],
        )
    elif family == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=16, num_local_experts=num_experts)
    elif family == "deepseek_v3":
        common["num_key_value_heads"] = common["num_attention_heads"]  # MLA expands one latent to every head
        config = transformers.DeepseekV3Config(
            **common, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=num_experts,
            n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=0, q_lora_rank=None,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=1.0,
        )
    else:
        raise ValueError(f"unknown Hugging Face family {family!r}; known: {', '.join(HF_FAMILIES)}")
    config._experts_implementation = experts_implementation
    config._attn_implementation = "sdpa"
    return config


def build_tiny_hf_model(family: str, *, seed: int = 0, **config_overrides) -> nn.Module:
    import transformers

    config = tiny_hf_config(family, **config_overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        # transformers leaves some routers zero-initialised; random ones give real routing
        gen = torch.Generator().manual_seed(seed)
        for name, param in model.named_parameters():
            if name.endswith("gate.weight") or "e_score_correction_bias" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
        for name, buffer in model.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
    return model.eval()
