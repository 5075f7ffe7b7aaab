"""Every transformers MoE family built on ``use_experts_implementation``, as a tiny random model.

``moe_families()`` lists the families of the installed transformers whose modeling code uses
the decorator; ``build_tiny_family(name)`` builds one from a tiny config written in code (no
download): the family's text model (its causal LM where transformers has one, else its text
decoder), with every size shrunk by ``TINY_SIZES`` where the family's config has that key,
and ``FAMILY_OVERRIDES`` where a family needs more. A family that cannot be built tiny here
raises ``CannotBuildTiny`` naming why.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

# Applied to a family's config where it has the key (a list default gets the value per entry).
TINY_SIZES = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
    "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "qk_head_dim": 16,
    "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8, "moe_num_experts": 8,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_k": 2, "moe_topk": 2, "top_k_experts": 2, "max_position_embeddings": 128,
    "index_topk": 16, "index_head_dim": 16, "index_n_heads": 2, "index_kpool": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_head_dim": 16,
    "linear_num_heads": 4, "mamba_d_state": 8, "mamba_d_head": 16, "mamba_n_heads": 8, "mamba_chunk_size": 16,
    "mamba_dt_rank": 8, "vocab_size_per_layer_input": 256, "hidden_size_per_layer_input": 16,
    "router_hidden_size": 16, "ngram_vocab_size_base": 512, "ple_embed_dim": 64, "hc_lowrank": 8,
    "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16, "o_lora_rank": 16,
    "o_groups": 2, "sliding_window": 64, "sliding_window_size": 64,
}
# Set even where the family's default is None (a model without them has no MoE layer).
MOE_KEYS = frozenset({
    "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok",
    "num_experts_per_token", "moe_k",
    "moe_topk", "top_k_experts", "moe_intermediate_size",
})
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# What a family needs beyond TINY_SIZES (a validator's rule, a None default the model multiplies).
FAMILY_OVERRIDES: dict[str, dict] = {
    "zaya": {"num_experts_per_tok": 1},  # its config validator allows top-1 only
    "dots1": {"n_shared_experts": 1},
    "gemma4": {"enable_moe_block": True},
    "diffusion_gemma": {"enable_moe_block": True},
    "hunyuan_v1_moe": {"head_dim": 16},
    "lfm2_moe": {"num_hidden_layers": 3, "num_dense_layers": 1, "layer_types": ["conv", "full_attention", "full_attention"]},
    # 3-D rope over the rotary half of head_dim 16: four frequencies in [t, h, w] sections
    "glm4v_moe": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                      "mrope_section": [2, 1, 1]}},
    "deepseek_v4": {"mlp_layer_types": ["hash_moe", "moe"]},  # one hash-routed layer, one top-k layer
    "deepseek_ocr2": {"mlp_layer_types": ["dense", "sparse"]},
    "glm5_next": {"qk_rope_head_dim": 0, "head_dim": 0},  # its DSA attention layers are NoPE
    # 3-D rope pre-rotates [h, w, t] sections of head_dim / 2 frequencies: sections that fit 16
    "ernie4_5_vl_moe": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 4]}},
}


class CannotBuildTiny(Exception):
    """A family that has no tiny text model here; the message says why."""


@dataclass(frozen=True)
class TinyFamily:
    family: str
    model_type: str  # the config's model_type that was built
    model: nn.Module
    causal_lm: bool  # returns .logits; else a text decoder returning .last_hidden_state


def moe_families() -> tuple[str, ...]:
    """Model packages of the installed transformers whose experts use ``use_experts_implementation``."""
    import transformers

    root = Path(transformers.__file__).parent / "models"
    return tuple(
        sorted({p.parent.name for p in root.glob("*/modeling_*.py") if "@use_experts_implementation" in p.read_text()})
    )


def _model_types(family: str) -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    types = [t for t in CONFIG_MAPPING_NAMES if model_type_to_module_name(t) == family]
    # text models only (no vision or audio towers): the family's own text config first
    text = [t for t in types if t in (family, f"{family}_text") or t.endswith("_text") and "talker" not in t]
    return sorted(text, key=lambda t: (t != f"{family}_text", t != family, t))


def _text_model_class(family: str, config_class: type) -> tuple[type, bool] | None:
    """(class, is causal LM) of the family's text model for this config class, if there is one."""
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    classes = [c for _, c in vars(module).items() if inspect.isclass(c) and getattr(c, "config_class", None) is config_class]
    for suffix, causal in (("ForCausalLM", True), ("TextModel", False), ("Model", False)):
        found = [c for c in classes if c.__name__.endswith(suffix) and "PreTrained" not in c.__name__]
        if found:
            return found[0], causal
    return None


def tiny_config(config_class: type, family: str, experts_implementation: str):
    default = config_class().to_dict()
    overrides = {}
    for key, value in TINY_SIZES.items():
        if key in default and (default[key] is not None or key in MOE_KEYS):
            overrides[key] = [value] * len(default[key]) if isinstance(default[key], list) else value
    heads, kv_heads = default.get("num_attention_heads"), default.get("num_key_value_heads")
    if kv_heads is not None:  # keep the family's attention kind: MHA, GQA or MQA
        overrides["num_key_value_heads"] = 4 if kv_heads == heads else 1 if kv_heads == 1 else 2
    if "qk_rope_head_dim" in default and default.get("head_dim") == default["qk_rope_head_dim"]:
        overrides["head_dim"] = TINY_SIZES["qk_rope_head_dim"]  # MLA: head_dim is the rope part
    if default.get("q_lora_rank"):
        overrides["q_lora_rank"] = 32
    if (default.get("n_group") or 0) > 1:  # grouped top-k: two groups, one chosen
        overrides.update(n_group=2, topk_group=1)
    if default.get("shared_intermediate_size"):
        overrides["shared_intermediate_size"] = 32
    if default.get("first_k_dense_replace"):  # keep one dense layer in front of the MoE ones
        overrides.update(first_k_dense_replace=1, num_hidden_layers=3)
    if "moe_layer_end_index" in default:
        overrides["moe_layer_end_index"] = overrides.get("num_hidden_layers", 2) - 1
    overrides.update({k: v for k, v in TOKEN_IDS.items() if isinstance(default.get(k), int)})
    overrides.update(FAMILY_OVERRIDES.get(family, {}))
    config = config_class(**overrides)
    schedule = getattr(config, "mlp_layer_types", None)
    if isinstance(schedule, list) and set(schedule) == {"dense"}:  # dense-first defaults leave a tiny model no MoE layer
        overrides["mlp_layer_types"] = ["dense"] + ["sparse"] * (len(schedule) - 1)
        config = config_class(**overrides)
    config._experts_implementation = experts_implementation
    return config


def build_tiny_family(family: str, *, experts_implementation: str = "grouped_mm", seed: int = 0) -> TinyFamily:
    from transformers import CONFIG_MAPPING

    errors = []
    for model_type in _model_types(family):
        config_class = CONFIG_MAPPING[model_type]
        found = _text_model_class(family, config_class)
        if found is None or getattr(config_class, "sub_configs", None):  # composite: a multimodal wrapper
            continue
        model_class, causal = found
        try:
            config = tiny_config(config_class, family, experts_implementation)
            model = _instantiate(model_class, config, seed)
        except Exception as error:  # the family's own validation or construction refused the tiny config
            errors.append(f"{model_class.__name__}: {type(error).__name__}: {' '.join(str(error).split())[:300]}")
            continue
        return TinyFamily(family, model_type, model, causal)
    raise CannotBuildTiny("; ".join(errors) or f"no text model class in transformers.models.{family} (a multimodal wrapper only)")


def _instantiate(model_class: type, config, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    for attention in ("sdpa", "eager"):
        config._attn_implementation = attention
        try:
            model = model_class(config)
            break
        except ValueError as error:  # families without an sdpa path say so at construction
            if attention == "eager" or "attention implementation" not in str(error):
                raise
    randomize_routers(model, seed)
    return model.eval()


@torch.no_grad()
def randomize_routers(model: nn.Module, seed: int) -> None:
    """transformers leaves some routers zero-initialised; random ones give real routing."""
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        leaf = name.rsplit(".", 1)[-1]
        in_router = any(part in ("gate", "router") for part in name.split(".")[:-1])
        if "e_score_correction_bias" in name:
            tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))
        elif in_router and leaf == "weight" and tensor.dim() == 2:
            tensor.copy_(torch.randn(tensor.shape, generator=generator))
