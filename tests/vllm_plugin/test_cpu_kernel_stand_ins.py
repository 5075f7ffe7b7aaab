"""The stand-ins of vLLM's quantized CPU MoE kernels, called directly (nothing registered, so on
every host): several FP8 blocks and int4 groups per dimension against a dequantized reference,
packing that stays inside each expert's slab, and clear refusals of what they do not implement."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from vllm._custom_ops import CPUQuantAlgo, CPUQuantMethod  # noqa: E402

from eplb_graph.models.tiny_checkpoint import quantize_fp8_blocks, quantize_int4_groups  # noqa: E402
from tests.vllm_plugin import cpu_kernel_stand_ins as stand_ins  # noqa: E402

E, H, I, K, T = 4, 256, 256, 2, 6  # two FP8 blocks and two int4 groups along each dimension
GPTQ_ZERO = 0x77777777  # vLLM's synthetic zero points of a symmetric checkpoint (stored one below 8)


def moe_reference(x, w13, w2, weights, ids) -> torch.Tensor:
    hidden = torch.einsum("th,tkoh->tko", x.double(), w13[ids].double())  # [T, K, 2I]
    gate, up = hidden.chunk(2, dim=-1)
    return torch.einsum("tk,tki,tkhi->th", weights.double(), torch.nn.functional.silu(gate) * up, w2[ids].double())


def run(method, w13, w2, s13, s2, x, weights, ids, zeros=(None, None), block=None) -> torch.Tensor:
    out = torch.empty_like(x)
    stand_ins.fused_experts_cpu(out, x, w13, w2, weights, ids, method, s13, s2, *zeros, None, block,
                                None, None, None, None, True)
    return out


BLOCK_FACTORS = torch.tensor([1.0, 4.0, 0.25, 2.0, 0.5, 8.0, 0.125, 3.0])  # a scale of its own per block


def by_block(w: torch.Tensor, block: int = 128) -> torch.Tensor:
    """[E, N, K] scaled by a distinct factor per [block, block] tile, so a scale read from another tile shows."""
    nb, kb = w.shape[1] // block, w.shape[2] // block
    factors = BLOCK_FACTORS[: nb * kb].view(nb, kb).repeat_interleave(block, 0).repeat_interleave(block, 1)
    return w * factors


@pytest.fixture
def batch():
    gen = torch.Generator().manual_seed(0)
    w13 = by_block(torch.randn(E, 2 * I, H, generator=gen) * H**-0.5)
    w2 = by_block(torch.randn(E, H, I, generator=gen) * I**-0.5)
    x = torch.randn(T, H, generator=gen).bfloat16()
    ids = torch.randint(0, E, (T, K), generator=gen, dtype=torch.int32)
    return w13, w2, x, torch.softmax(torch.randn(T, K, generator=gen), -1), ids


def stacked(quantize, w: torch.Tensor) -> list[torch.Tensor]:
    return [torch.stack(t) for t in zip(*map(quantize, w))]


def close_to(out: torch.Tensor, reference: torch.Tensor) -> bool:
    return bool((out.double() - reference).abs().max() <= 0.01 * reference.abs().max())  # bf16 output


def test_fp8_blocks_each_scale_their_own_block(batch):
    w13, w2, x, weights, ids = batch
    (q13, s13), (q2, s2) = stacked(quantize_fp8_blocks, w13), stacked(quantize_fp8_blocks, w2)
    assert s13.shape == (E, 4, 2) and s2.shape == (E, 2, 2)
    dequantized = [q.double() * s.double().repeat_interleave(128, 1).repeat_interleave(128, 2) for q, s in
                   ((q13, s13), (q2, s2))]
    packed = [stand_ins.convert_weight_packed(q) for q in (q13, q2)]
    out = run(CPUQuantMethod.FP8_W8A16, *packed, s13, s2, x, weights, ids, block=[128, 128])
    assert close_to(out, moe_reference(x, *dequantized, weights, ids))
    assert not close_to(out, moe_reference(x, *(q.double() * s[:, :1, :1].double() for q, s in  # one scale each
                                                 ((q13, s13), (q2, s2))), weights, ids))


def gptq_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Unsigned int4 [E, N, K], scales and zero points [E, N, G] -> what vLLM's ``_process_weights_cpu``
    hands the packing: weights [E, K/8, N], zero points stored one below [E, G, N/8], scales [E, G, N]
    (packed by compressed-tensors, whose offset of 8 makes its signed input these unsigned nibbles)."""
    packed = torch.stack([pack_to_int32((e - 8).to(torch.int8), 4, packed_dim=1) for e in q]).transpose(1, 2).contiguous()
    stored = torch.stack([pack_to_int32((z.T - 1 - 8).to(torch.int8), 4, packed_dim=1) for z in zeros])
    return packed, stored, scales.transpose(1, 2).contiguous()


def test_int4_groups_each_scale_their_own_group(batch):
    """A symmetric checkpoint, as vLLM's ``_process_weights_cpu`` hands it over: its synthetic zero points."""
    w13, w2, x, weights, ids = batch
    (q13, s13), (q2, s2) = stacked(quantize_int4_groups, w13), stacked(quantize_int4_groups, w2)
    assert s13.shape[-1] == 2 and s2.shape[-1] == 2
    dequantized = [q.double() * s.double().repeat_interleave(128, 2) for q, s in ((q13, s13), (q2, s2))]
    blocked = []
    for q, s in ((q13, s13), (q2, s2)):
        packed, _, scales = gptq_int4(q + 8, s, torch.full_like(s, 8, dtype=torch.long))
        zeros = torch.full((E, scales.shape[1], scales.shape[2] // 8), GPTQ_ZERO, dtype=torch.int32)
        blocked.append(stand_ins.convert_weight_packed_scale_zp(packed, zeros, scales, CPUQuantAlgo.GPTQ))
    (b13, z13, bs13), (b2, z2, bs2) = blocked
    out = run(CPUQuantMethod.INT4_W4A8, b13, b2, bs13, bs2, x, weights, ids, zeros=(z13, z2))
    assert close_to(out, moe_reference(x, *dequantized, weights, ids))


def test_int4_zero_points_are_each_experts_and_groups_own(batch):
    _, _, x, weights, ids = batch
    gen = torch.Generator().manual_seed(1)
    dequantized, blocked = [], []
    for N, Kd in ((2 * I, H), (H, I)):
        q = torch.randint(0, 16, (E, N, Kd), generator=gen)
        zeros = torch.randint(1, 16, (E, N, Kd // 128), generator=gen)  # stored one below: 1..15
        scales = torch.rand(E, N, Kd // 128, generator=gen) * 0.02 + 0.005
        dequantized.append((q - zeros.repeat_interleave(128, 2)) * scales.repeat_interleave(128, 2))
        blocked.append(stand_ins.convert_weight_packed_scale_zp(*gptq_int4(q, scales, zeros), CPUQuantAlgo.GPTQ))
    (b13, z13, bs13), (b2, z2, bs2) = blocked
    out = run(CPUQuantMethod.INT4_W4A8, b13, b2, bs13, bs2, x, weights, ids, zeros=(z13, z2))
    assert close_to(out, moe_reference(x, *dequantized, weights, ids))
    rolled = run(CPUQuantMethod.INT4_W4A8, b13, b2, bs13, bs2, x, weights, ids, zeros=(z13.roll(1, 0), z2))
    assert not close_to(rolled, moe_reference(x, *dequantized, weights, ids))  # another expert's zero points


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_packing_reorders_inside_each_experts_slab_only(dtype):
    weight = torch.randn(E, 64, 32).to(dtype)
    packed = stand_ins.convert_weight_packed(weight)
    assert packed.shape == weight.shape and packed.dtype == dtype
    assert not torch.equal(packed.view(torch.uint8), weight.view(torch.uint8))  # a layout of its own
    for e in range(E):  # each slab holds its own expert's values, and only them
        assert torch.equal(packed[e].view(torch.uint8).flatten().sort().values,
                           weight[e].view(torch.uint8).flatten().sort().values)
    assert torch.equal(stand_ins.vnni_unpack(packed, torch.tensor([2, 0])).view(torch.uint8),
                       weight[[2, 0]].view(torch.uint8))


def test_what_the_stand_ins_do_not_implement_is_refused_by_name(batch):
    w13, w2, x, weights, ids = batch
    (q13, s13), (q2, s2) = stacked(quantize_fp8_blocks, w13), stacked(quantize_fp8_blocks, w2)
    with pytest.raises(NotImplementedError, match="quant method 1"):
        run(CPUQuantMethod.INT8_W8A8, q13, q2, s13, s2, x, weights, ids)
    with pytest.raises(NotImplementedError, match="only GPTQ packing"):
        stand_ins.convert_weight_packed_scale_zp(q13, q13, s13, CPUQuantAlgo.AWQ)
    with pytest.raises(ValueError, match=r"scales \(4, 2, 2\) for weights \(4, 512, 256\)"):
        run(CPUQuantMethod.FP8_W8A16, q13, q2, s2, s2, x, weights, ids, block=[128, 128])
    with pytest.raises(NotImplementedError, match="expert ids on another rank"):
        run(CPUQuantMethod.FP8_W8A16, q13, q2, s13, s2, x, weights, ids - E, block=[128, 128])
    with pytest.raises(RuntimeError, match="stand-ins would mix with kernels of another packing"):
        stand_ins.StandInKernels(["fused_experts_cpu"])  # refused before anything is registered
