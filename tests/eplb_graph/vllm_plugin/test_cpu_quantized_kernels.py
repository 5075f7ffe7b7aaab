"""The premises of the quantized engine tests, on the CPU MoE kernels the engines run here (no
engine): vLLM's own where its build has them, the stand-ins elsewhere (cpu_kernel_stand_ins.py).
Each computes its format (against a dequantized reference) from weights packed by vLLM's own
load-time code, and a token's row does not depend on the batch while its expert gets at most
EXACT_TOKENS_PER_EXPERT tokens -- which replica of an expert a token reaches included (on the
stand-ins, which compute each token alone, that holds by construction; the replica test still
checks that each slot reads its own slabs)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402

from eplb_reference.models.tiny_checkpoint import quantize_fp8_blocks, quantize_int4_groups  # noqa: E402
from tests.eplb_graph.vllm_plugin.cpu_quantized_experts import (  # noqa: E402
    EXACT_TOKENS_PER_EXPERT,
    close_to,
    cpu_experts,
    int4_blocked_for_cpu,
    moe_reference,
    packed_for_cpu,
    registered_stand_ins,
    stacked,
)

E, H, I, K = 8, 128, 128, 2


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """Registers the stand-ins for this module only, where vLLM's build lacks the kernels."""
    stand_ins = registered_stand_ins()
    yield
    if stand_ins is not None:
        stand_ins.close()


@pytest.fixture(scope="module", params=["fp8", "int4"])
def experts(request):
    """(kernel method, what the kernel reads, keyword arguments, dequantized (w13, w2)) of one format."""
    gen = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen) * H**-0.5, torch.randn(E, H, I, generator=gen) * I**-0.5
    if request.param == "fp8":
        (q13, s13), (q2, s2) = stacked(quantize_fp8_blocks, w13), stacked(quantize_fp8_blocks, w2)
        dequantized = [q.float() * s.repeat_interleave(128, 1).repeat_interleave(128, 2) for q, s in ((q13, s13), (q2, s2))]
        return "FP8_W8A16", [packed_for_cpu(q13), packed_for_cpu(q2), s13, s2], {"block": [128, 128]}, dequantized
    (q13, s13), (q2, s2) = stacked(quantize_int4_groups, w13), stacked(quantize_int4_groups, w2)
    dequantized = [q.float() * s.float().repeat_interleave(128, 2) for q, s in ((q13, s13), (q2, s2))]
    packed = [torch.stack([pack_to_int32(e, 4, packed_dim=1) for e in q]) for q in (q13, q2)]
    b13, b2, bs13, bs2, bz13, bz2 = int4_blocked_for_cpu(*packed, s13, s2)
    return "INT4_W4A8", [b13, b2, bs13, bs2], {"zeros": (bz13, bz2)}, dequantized


def run(experts, x, ids, weights, tensors=None):
    method, reads, kwargs, _ = experts
    return cpu_experts(x, method, *(tensors or reads), weights, ids, **kwargs)


def test_the_kernel_computes_its_format_on_this_cpu(experts):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, H, generator=gen).bfloat16()
    ids = torch.randint(0, E, (16, K), generator=gen)
    weights = torch.softmax(torch.randn(16, K, generator=gen), -1)
    reference = moe_reference(x, *experts[3], weights, ids)
    assert close_to(run(experts, x, ids, weights), reference, 0.03)  # bf16 (and int8) activations


@pytest.mark.parametrize("routing", ["all_on_two_experts", "mixed"])
def test_a_row_is_the_same_in_any_batch_up_to_the_exact_bound(experts, routing):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(EXACT_TOKENS_PER_EXPERT, H, generator=gen).bfloat16()
    if routing == "all_on_two_experts":  # both experts get every token: the bound itself
        ids = torch.tensor([[3, 5]] * EXACT_TOKENS_PER_EXPERT)
    else:  # experts with 1, 2 and 3 tokens beside each other
        ids = torch.tensor([[0, 1], [1, 2], [2, 6], [2, 7]])
    weights = torch.softmax(torch.randn(EXACT_TOKENS_PER_EXPERT, K, generator=gen), -1)
    alone = torch.cat([run(experts, x[t : t + 1], ids[t : t + 1], weights[t : t + 1]) for t in range(len(x))])
    assert torch.equal(run(experts, x, ids, weights), alone)


def test_a_replica_in_another_slot_computes_the_same_rows(experts):
    """What EPLB does: expert 3 copied into slot 8 (every tensor the kernel reads), half of its tokens sent there."""
    method, reads, kwargs, _ = experts
    replicated = [torch.cat([t, t[3:4]]) for t in reads]
    kwargs = {**kwargs, "zeros": tuple(torch.cat([z, z[3:4]]) for z in kwargs["zeros"])} if "zeros" in kwargs else kwargs
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(EXACT_TOKENS_PER_EXPERT, H, generator=gen).bfloat16()
    ids = torch.tensor([[3, 1]] * EXACT_TOKENS_PER_EXPERT)
    weights = torch.full((EXACT_TOKENS_PER_EXPERT, K), 0.5)
    to_replica = ids.clone()
    to_replica[::2, 0] = 8
    assert torch.equal(run(experts, x, ids, weights), cpu_experts(x, method, *replicated, weights, to_replica, **kwargs))
