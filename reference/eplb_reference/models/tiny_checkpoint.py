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


FP8_BLOCK = 128  # DeepSeek-V3's [128, 128] weight blocks


def quantize_fp8_blocks(weight, block: int = FP8_BLOCK):
    """weight [O, I] -> (float8_e4m3fn [O, I], weight_scale_inv float32 [ceil(O/block), ceil(I/block)]):
    one scale per block, its amax mapped to float8's largest value, as FP8 checkpoints store it."""
    import torch

    rows, cols = weight.shape
    pad = torch.zeros(-(-rows // block) * block, -(-cols // block) * block, dtype=torch.float32)
    pad[:rows, :cols] = weight.float()
    blocks = pad.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [O/b, b, I/b, b]
    scale = (blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max).clamp_min(1e-12)  # [O/b, I/b]
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return (weight.float() / full).to(torch.float8_e4m3fn), scale


def write_tiny_qwen3_moe_fp8_checkpoint(directory: str | Path, *, seed: int = 0, **overrides) -> Path:
    """The seeded checkpoint with its routed experts stored as block-quantized FP8, in the format of
    DeepSeek-V3's and Qwen3-MoE-FP8's checkpoints (``quant_method: fp8``, ``weight_block_size``,
    ``weight_scale_inv``); attention, the router and the head stay float (``ignored_layers``).
    The experts' widths default to one whole block."""
    def fp8(name, weight):
        quantized, scale_inv = quantize_fp8_blocks(weight)
        return {name: quantized, name.removesuffix("weight") + "weight_scale_inv": scale_inv}

    overrides = {"hidden_size": FP8_BLOCK, "moe_intermediate_size": FP8_BLOCK, **overrides}
    layers = range({**TINY_QWEN3_MOE, **overrides}["num_hidden_layers"])
    return _with_quantized_experts(directory, seed, overrides, fp8, {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        "ignored_layers": [f"model.layers.{i}.{module}" for i in layers for module in
                           ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate")],
    })


INT4_GROUP = 128


def quantize_int4_groups(weight, group: int = INT4_GROUP):
    """weight [O, I] -> (ints in [-8, 7] as int8 [O, I], scale bfloat16 [O, I/group]): symmetric, one
    scale per group of ``group`` inputs, as GPTQ / RTN int4 checkpoints store it."""
    import torch

    grouped = weight.float().unflatten(1, (-1, group))  # [O, I/group, group]
    scale = (grouped.abs().amax(dim=-1) / 7).clamp_min(1e-8).bfloat16()
    q = torch.round(grouped / scale.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int8).flatten(1)
    return q, scale


def write_tiny_qwen3_moe_int4_checkpoint(directory: str | Path, *, seed: int = 0, **overrides) -> Path:
    """The seeded checkpoint with its routed experts stored as int4, in compressed-tensors'
    pack-quantized format (as llm-compressor writes W4A16 checkpoints: ``weight_packed`` int32
    [O, I/8], ``weight_scale`` [O, I/group], ``weight_shape``); vLLM's CPU experts run it as W4A8.
    Attention, the router and the head stay float (``ignore``). Widths default to one group."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    def int4(name, weight):
        q, scale = quantize_int4_groups(weight)
        base = name.removesuffix("weight")
        return {base + "weight_packed": pack_to_int32(q, 4, packed_dim=1), base + "weight_scale": scale,
                base + "weight_shape": torch.tensor(list(weight.shape), dtype=torch.int64)}

    overrides = {"hidden_size": INT4_GROUP, "moe_intermediate_size": INT4_GROUP, **overrides}
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": INT4_GROUP,
               "dynamic": False}
    return _with_quantized_experts(directory, seed, overrides, int4, {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "weights": weights,
                                      "input_activations": None, "output_activations": None}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$"], "kv_cache_scheme": None,
    })


def _with_quantized_experts(directory, seed: int, overrides: dict, quantize, quantization_config: dict) -> Path:
    """The seeded checkpoint, each routed expert weight replaced by ``quantize(name, weight)``'s tensors."""
    from safetensors.torch import load_file, save_file

    directory = write_tiny_qwen3_moe_checkpoint(directory, seed=seed, **overrides)
    (weights_file,) = directory.glob("*.safetensors")
    tensors = load_file(weights_file)
    for name in [n for n in tensors if ".mlp.experts." in n and n.endswith("_proj.weight")]:
        tensors.update(quantize(name, tensors.pop(name)))
    save_file({name: t.contiguous() for name, t in tensors.items()}, weights_file, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
