"""The premises of the FP8 engine tests, on vLLM's own CPU FP8 MoE kernel (no engine): it computes
FP8 MoE on this CPU, and a token's row does not depend on the batch while its expert gets at most
EXACT_TOKENS_PER_EXPERT tokens -- which replica of an expert a token reaches included."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from eplb_graph.models.tiny_checkpoint import quantize_fp8_blocks  # noqa: E402
from tests.vllm_plugin.cpu_fp8 import EXACT_TOKENS_PER_EXPERT, fp8_experts, packed_for_cpu  # noqa: E402

E, H, I, K = 8, 128, 128, 2


@pytest.fixture(scope="module")
def experts():
    """Block-FP8 experts as vLLM holds them after loading: (packed w13, packed w2, scales, dequantized)."""
    gen = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen) * H**-0.5, torch.randn(E, H, I, generator=gen) * I**-0.5
    (q13, s13), (q2, s2) = ([torch.stack(t) for t in zip(*map(quantize_fp8_blocks, w))] for w in (w13, w2))
    dequantized = [q.float() * s.repeat_interleave(128, 1).repeat_interleave(128, 2) for q, s in ((q13, s13), (q2, s2))]
    packed = [packed_for_cpu(q) for q in (q13, q2)]
    return packed, (s13, s2), dequantized


def run(experts, x, ids, weights):
    (p13, p2), (s13, s2), _ = experts
    return fp8_experts(x, p13, p2, s13, s2, weights, ids.to(torch.int32))


def test_the_kernel_computes_fp8_moe_on_this_cpu(experts):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, H, generator=gen).bfloat16()
    ids = torch.randint(0, E, (16, K), generator=gen)
    weights = torch.softmax(torch.randn(16, K, generator=gen), -1)
    _, _, (w13, w2) = experts
    hidden = torch.einsum("th,tkoh->tko", x.float(), w13[ids])  # [T, K, 2I]
    gate, up = hidden.chunk(2, dim=-1)
    reference = torch.einsum("tk,tki,tkhi->th", weights, torch.nn.functional.silu(gate) * up, w2[ids])  # [T, H]
    out = run(experts, x, ids, weights).float()
    assert (out - reference).abs().max() <= 0.02 * reference.abs().max()  # bf16 activations


def test_a_row_is_the_same_in_any_batch_up_to_the_exact_bound(experts):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(EXACT_TOKENS_PER_EXPERT, H, generator=gen).bfloat16()
    ids = torch.tensor([[3, 5]] * EXACT_TOKENS_PER_EXPERT)  # both experts get every token
    weights = torch.full((EXACT_TOKENS_PER_EXPERT, K), 0.5)
    batch = run(experts, x, ids, weights)
    alone = torch.cat([run(experts, x[t : t + 1], ids[t : t + 1], weights[t : t + 1]) for t in range(len(x))])
    assert torch.equal(batch, alone)


def test_a_replica_in_another_slot_computes_the_same_rows(experts):
    """What EPLB does: expert 3 copied into slot 8, half of its tokens sent there."""
    (p13, p2), (s13, s2), _ = experts
    replicated = [torch.cat([t, t[3:4]]) for t in (p13, p2, s13, s2)]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(EXACT_TOKENS_PER_EXPERT, H, generator=gen).bfloat16()
    ids = torch.tensor([[3, 1]] * EXACT_TOKENS_PER_EXPERT)
    weights = torch.full((EXACT_TOKENS_PER_EXPERT, K), 0.5)
    to_replica = ids.clone()
    to_replica[::2, 0] = 8
    assert torch.equal(run(experts, x, ids, weights),
                       fp8_experts(x, *replicated, weights, to_replica.to(torch.int32)))
