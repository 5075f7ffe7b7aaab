"""The two expert kernels' indexing, shared by every weight format (``weight_views``).

    pairs   (ids given) row s of x [S, I] through expert expert_ids[s] -> [S, O]
            (gpt-fast's decode kernel): work grows with the (token, k) pairs, not with the
            slots, as in a fused MoE kernel, but every pair gathers its expert's weights,
            which is what makes width expensive
    dense   (no ids) x [N, I] through every local expert -> [E, N, O], the caller picking
            the rows its routing chose: each expert's weights read once, faster at width
            (``eplb-graph bench --expert-kernel dense`` measures it), but work grows with the
            local slots, so redundant experts cost compute a fused kernel would not spend

Both keep every shape static (capture needs them). A format's ``forward`` asks ``kernel``
for the indexing and applies its own arithmetic (dequantisation, scales) in between.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EXPERT_KERNELS = ("pairs", "dense")


def check_expert_kernel(name: str) -> None:
    if name not in EXPERT_KERNELS:
        raise ValueError(f"unknown expert kernel {name!r}; expected one of {', '.join(EXPERT_KERNELS)}")


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# The host's BLAS takes other paths for small batches, whose sums round differently, so a
# token's output would depend on its batch's size; smaller batches are padded (a GEMM's rows
# agree from 4 rows up, a bmm's matvecs from a batch of 2; checked in tests/eplb_graph/
# test_weight_views.py).
MIN_GEMM_ROWS = 4
MIN_BMM_BATCH = 2


class EveryExpert:
    """The dense kernel's indexing: x [N, I] (or [E, N, I]) through every expert -> [E, N, O]."""

    @staticmethod
    def weight(w: torch.Tensor) -> torch.Tensor:  # [E, O, I]
        return w

    @staticmethod
    def channel(c: torch.Tensor) -> torch.Tensor:  # per-output-channel [E, O] -> [E, 1, O]
        return c.unsqueeze(1)

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.shape[-2]
        if rows >= MIN_GEMM_ROWS:
            return torch.matmul(x, weight.transpose(1, 2))
        padded = F.pad(x, (0, 0, 0, MIN_GEMM_ROWS - rows))  # zero rows, dropped below
        return torch.matmul(padded, weight.transpose(1, 2))[..., :rows, :]


class OnePerPair:
    """The pairs kernel's indexing: row s of x [S, I] through expert expert_ids[s] -> [S, O]."""

    def __init__(self, expert_ids: torch.Tensor) -> None:
        self.expert_ids = expert_ids  # [S]

    def weight(self, w: torch.Tensor) -> torch.Tensor:  # [E, O, I] -> [S, O, I]: a copy per pair
        return w[self.expert_ids]

    def channel(self, c: torch.Tensor) -> torch.Tensor:  # [E, O] -> [S, O]
        return c[self.expert_ids]

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if 0 < x.shape[0] < MIN_BMM_BATCH:  # a lone pair: run it twice, keep one
            return OnePerPair.linear(x.repeat(MIN_BMM_BATCH, 1), weight.repeat(MIN_BMM_BATCH, 1, 1))[: x.shape[0]]
        return torch.bmm(weight, x.unsqueeze(-1)).squeeze(-1)  # [S, O, I] x [S, I] -> [S, O]


def kernel(expert_ids: torch.Tensor | None) -> EveryExpert | OnePerPair:
    return EveryExpert() if expert_ids is None else OnePerPair(expert_ids)
