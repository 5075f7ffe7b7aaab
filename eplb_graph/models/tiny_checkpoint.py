"""A tiny random-weight Qwen3-MoE checkpoint for vLLM on CPU, written locally (no download).

The model of docs/quickstart-hf.md's vLLM server and of the plugin's engine tests.

vLLM's CPU attention needs head_dim 64 (16 is refused). ``write_tiny_qwen3_moe`` writes the
config only (for ``load_format="dummy"``); ``write_tiny_qwen3_moe_checkpoint`` also writes
seeded random safetensors weights. Tests that compare tokens use the checkpoint: vLLM's
dummy loader fills every tensor with uniform +-1e-3 noise, under which greedy tokens do not
depend on the experts at all, and it gives each redundant slot its own values, whereas a
real load puts each logical expert into all of its replicas.
"""

from __future__ import annotations

import json
from pathlib import Path

TINY_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "norm_topk_prob": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_tiny_qwen3_moe(directory: str | Path, **overrides) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**TINY_QWEN3_MOE, **overrides}, indent=2))
    return directory


def write_tiny_qwen3_moe_checkpoint(directory: str | Path, *, seed: int = 0, **overrides) -> Path:
    """config.json plus seeded random weights (transformers' own initialisation), safetensors."""
    import torch
    import transformers

    directory = write_tiny_qwen3_moe(directory, **overrides)
    config = transformers.AutoConfig.from_pretrained(directory)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # a wider init than 0.02 so that the routed experts decide the tokens
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, parameter.shape[-1] ** -0.5)
    model.save_pretrained(directory, safe_serialization=True)
    return directory
