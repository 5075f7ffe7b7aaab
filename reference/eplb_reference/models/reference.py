"""Reference MoE decoder (DeepSeek-V3 / Qwen3-MoE style), small enough to read on one screen.

Router (linear -> softmax -> top-k -> renormalise) and routed experts in batched layout
([num_experts, ...] weights gathered per (token, k) pair, as gpt-fast's mixtral-moe
does), plus an optional shared expert. The router returns *logical* expert ids; the
experts index their weights with whatever ids they are given. ``eplb_graph.enable``
turns the experts' weights into physical layout and the EPLB pass maps ids in between.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eplb_graph.pytorch.adapter_base import MoEAdapter, MoELayerSpec, join_path


@dataclass
class ReferenceMoEConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_experts: int = 16
    top_k: int = 4
    expert_intermediate_size: int = 32
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")


class TopKRouter(nn.Module):
    """linear -> softmax -> top-k -> (renormalise); returns (weights, logical ids)."""

    def __init__(self, config: ReferenceMoEConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.num_experts = config.num_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))

    @classmethod
    def from_weight(cls, weight: torch.Tensor, top_k: int) -> TopKRouter:
        """A renormalising router over ``weight`` [E, H] itself (the EP layers' replicated gate)."""
        num_experts, hidden_size = weight.shape
        router = cls(ReferenceMoEConfig(hidden_size=hidden_size, num_heads=1, num_experts=num_experts, top_k=top_k))
        router.weight = nn.Parameter(weight, requires_grad=False)
        return router

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x: [T, H]
        probs = F.linear(x, self.weight).softmax(dim=-1, dtype=torch.float32)  # [T, E]
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)  # [T, K], [T, K] logical
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), expert_ids


class BatchedExperts(nn.Module):
    """SwiGLU experts; w13: [E, 2I, H] (gate and up), w2: [E, H, I]. E is logical or physical."""

    def __init__(self, config: ReferenceMoEConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.w13 = nn.Parameter(torch.empty(config.num_experts, 2 * config.expert_intermediate_size, config.hidden_size))
        self.w2 = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, config.expert_intermediate_size))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = expert_ids.shape  # [T, K]
        flat_ids = expert_ids.reshape(-1)  # [T*K]
        x_rep = x.repeat_interleave(top_k, dim=0)  # [T*K, H]
        gate, up = torch.bmm(self.w13[flat_ids], x_rep.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)  # [T*K, I]
        out = torch.bmm(self.w2[flat_ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # [T*K, H]
        return (out * weights.reshape(-1, 1)).view(num_tokens, top_k, -1).sum(dim=1)  # [T, H]


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class ReferenceAdapter(MoEAdapter):
    """``MoEBlock`` with ``.gate`` (TopKRouter) and ``.experts`` (w13, w2): the adapter ``MoEBlock`` names."""

    name = "reference"
    searched_for = "eplb_reference MoEBlock modules (.gate TopKRouter, .experts BatchedExperts)"

    def find_layers(self, model: nn.Module) -> list[MoELayerSpec]:
        return [
            MoELayerSpec(
                name=path,
                router_path=join_path(path, "gate"),
                experts=block.experts,
                expert_param_names=("w13", "w2"),
                num_experts=block.gate.num_experts,
                top_k=block.gate.top_k,
                experts_path=join_path(path, "experts"),
            )
            for path, block in model.named_modules()
            if isinstance(block, MoEBlock)
        ]


class MoEBlock(nn.Module):
    eplb_moe_adapter = ReferenceAdapter()  # eplb_graph.pytorch.adapters.OWN_ADAPTER

    def __init__(self, config: ReferenceMoEConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = BatchedExperts(config)
        self.shared_expert = (
            SwiGLU(config.hidden_size, config.shared_expert_intermediate_size)
            if config.shared_expert_intermediate_size
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, S, H]
        tokens = x.reshape(-1, x.shape[-1])  # [T, H]
        weights, expert_ids = self.gate(tokens)  # [T, K], [T, K]
        out = self.experts(tokens, expert_ids, weights)  # [T, H]
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        return out.view_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ReferenceMoEConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.out = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, S, H]
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)  # 3 x [B, nh, S, hd]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, nh, S, hd]
        return self.out(y.transpose(1, 2).reshape(batch, seq, hidden))


class DecoderLayer(nn.Module):
    def __init__(self, config: ReferenceMoEConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden_size)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = nn.RMSNorm(config.hidden_size)
        self.mlp = MoEBlock(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class ReferenceMoEModel(nn.Module):
    def __init__(self, config: ReferenceMoEConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, S] -> logits [B, S, V]
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build_reference_model(config: ReferenceMoEConfig | None = None, *, seed: int = 0,
                          device: torch.device | str = "cpu") -> ReferenceMoEModel:
    """A randomly initialised reference model (deterministic for a seed and a device type), in
    eval mode, built on ``device``: drawn there, a large model's weights do not wait on the
    host's single-threaded generator and a copy across."""
    config = config or ReferenceMoEConfig()
    gen = torch.Generator(device).manual_seed(seed)
    with torch.device(device):
        model = ReferenceMoEModel(config)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, device=device) * param.shape[-1] ** -0.5)
    return model.eval()


def inspect_example() -> tuple[ReferenceMoEModel, torch.Tensor]:
    """`eplb-graph inspect --model reference`: a two-layer reference model and a batch for it."""
    model = build_reference_model(ReferenceMoEConfig(num_layers=2, shared_expert_intermediate_size=32))
    return model, torch.randint(0, model.config.vocab_size, (2, 8))
