"""The stand-ins of vLLM's quantized CPU MoE kernels, called directly (nothing registered, so on
every host): several FP8 blocks and int4 groups per dimension against a dequantized reference,
int4 converted by vLLM's own load-time code, packing that stays inside each expert's slab, and
clear refusals of what they do not implement."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from vllm._custom_ops import CPUQuantAlgo, CPUQuantMethod  # noqa: E402
from vllm.model_executor.layers.fused_moe.experts import cpu_moe  # noqa: E402

from eplb_reference.models.tiny_checkpoint import (  # noqa: E402
    FP8_BLOCK,
    INT4_GROUP,
    quantize_fp8_blocks,
    quantize_int4_groups,
)
from tests.eplb_graph.vllm_plugin import cpu_kernel_stand_ins as stand_ins  # noqa: E402
from tests.eplb_graph.vllm_plugin.cpu_quantized_experts import (  # noqa: E402
    close_to,
    cpu_experts,
    int4_blocked_for_cpu,
    moe_reference,
    stacked,
)

E, H, I, K, T = 4, 256, 256, 2, 6  # two FP8 blocks and two int4 groups along each dimension
BLOCK_FACTORS = torch.tensor([1.0, 4.0, 0.25, 2.0, 0.5, 8.0, 0.125, 3.0])  # a scale of its own per block
REL = 0.01  # bf16 output


def run(method: str, w13, w2, s13, s2, x, weights, ids, **kwargs) -> torch.Tensor:
    return cpu_experts(x, method, w13, w2, s13, s2, weights, ids, kernel=stand_ins.fused_experts_cpu, **kwargs)


def by_block(w: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
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


@pytest.fixture
def vllm_converts_on_the_stand_in(monkeypatch):
    """vLLM's int4 load-time conversion (``_process_weights_cpu``), packing with the stand-in."""
    monkeypatch.setattr(cpu_moe, "convert_weight_packed_scale_zp", stand_ins.convert_weight_packed_scale_zp)


def test_fp8_blocks_each_scale_their_own_block(batch):
    w13, w2, x, weights, ids = batch
    (q13, s13), (q2, s2) = stacked(quantize_fp8_blocks, w13), stacked(quantize_fp8_blocks, w2)
    assert s13.shape == (E, 4, 2) and s2.shape == (E, 2, 2)
    dequantized = [q.double() * s.double().repeat_interleave(FP8_BLOCK, 1).repeat_interleave(FP8_BLOCK, 2)
                   for q, s in ((q13, s13), (q2, s2))]
    packed = [stand_ins.convert_weight_packed(q) for q in (q13, q2)]
    out = run("FP8_W8A16", *packed, s13, s2, x, weights, ids, block=[FP8_BLOCK, FP8_BLOCK])
    assert close_to(out, moe_reference(x, *dequantized, weights, ids), REL)
    one_scale_each = [q.double() * s[:, :1, :1].double() for q, s in ((q13, s13), (q2, s2))]
    assert not close_to(out, moe_reference(x, *one_scale_each, weights, ids), REL)


def int4_packed(q: torch.Tensor) -> torch.Tensor:
    """Unsigned int4 [E, N, K] -> compressed-tensors' [E, N, K/8] int32 (its offset of 8 makes signed input unsigned)."""
    return torch.stack([pack_to_int32((e - 8).to(torch.int8), 4, packed_dim=1) for e in q])


def test_int4_groups_each_scale_their_own_group(batch, vllm_converts_on_the_stand_in):
    """A symmetric checkpoint: vLLM's conversion makes its zero points."""
    w13, w2, x, weights, ids = batch
    (q13, s13), (q2, s2) = stacked(quantize_int4_groups, w13), stacked(quantize_int4_groups, w2)
    assert s13.shape[-1] == 2 and s2.shape[-1] == 2
    dequantized = [q.double() * s.double().repeat_interleave(INT4_GROUP, 2) for q, s in ((q13, s13), (q2, s2))]
    b13, b2, bs13, bs2, z13, z2 = int4_blocked_for_cpu(int4_packed(q13 + 8), int4_packed(q2 + 8), s13, s2)
    out = run("INT4_W4A8", b13, b2, bs13, bs2, x, weights, ids, zeros=(z13, z2))
    assert close_to(out, moe_reference(x, *dequantized, weights, ids), REL)


def test_int4_zero_points_are_each_experts_and_groups_own(batch, vllm_converts_on_the_stand_in):
    """An asymmetric checkpoint: zero points [E, N/8, G] stored one below, as the GPTQ unpacking reads them."""
    _, _, x, weights, ids = batch
    gen = torch.Generator().manual_seed(1)
    dequantized, packed, scales, zeros = [], [], [], []
    for N, Kd in ((2 * I, H), (H, I)):
        q = torch.randint(0, 16, (E, N, Kd), generator=gen)
        zero = torch.randint(1, 16, (E, N, Kd // INT4_GROUP), generator=gen)  # stored one below: 1..15
        scale = torch.rand(E, N, Kd // INT4_GROUP, generator=gen) * 0.02 + 0.005
        dequantized.append((q - zero.repeat_interleave(INT4_GROUP, 2)) * scale.repeat_interleave(INT4_GROUP, 2))
        packed.append(int4_packed(q))
        scales.append(scale)
        zeros.append(torch.stack([pack_to_int32((z - 1 - 8).to(torch.int8), 4, packed_dim=0) for z in zero]))
    b13, b2, bs13, bs2, z13, z2 = int4_blocked_for_cpu(*packed, *scales, zeros=tuple(zeros))
    out = run("INT4_W4A8", b13, b2, bs13, bs2, x, weights, ids, zeros=(z13, z2))
    assert close_to(out, moe_reference(x, *dequantized, weights, ids), REL)
    rolled = run("INT4_W4A8", b13, b2, bs13, bs2, x, weights, ids, zeros=(z13.roll(1, 0), z2))
    assert not close_to(rolled, moe_reference(x, *dequantized, weights, ids), REL)  # another expert's zero points


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
    block = [FP8_BLOCK, FP8_BLOCK]
    with pytest.raises(NotImplementedError, match=f"quant method {int(CPUQuantMethod.INT8_W8A8)}"):
        run("INT8_W8A8", q13, q2, s13, s2, x, weights, ids)
    with pytest.raises(NotImplementedError, match="only GPTQ packing"):
        stand_ins.convert_weight_packed_scale_zp(q13, q13, s13, CPUQuantAlgo.AWQ)
    with pytest.raises(ValueError, match=rf"scales \({E}, 2, 2\) for weights \({E}, {2 * I}, {H}\)"):
        run("FP8_W8A16", q13, q2, s2, s2, x, weights, ids, block=block)
    with pytest.raises(NotImplementedError, match="FP8 without block scales"):
        run("FP8_W8A16", q13, q2, s13, s2, x, weights, ids)
    with pytest.raises(NotImplementedError, match="expert ids on another rank"):
        run("FP8_W8A16", q13, q2, s13, s2, x, weights, ids - E, block=block)
    with pytest.raises(RuntimeError, match="stand-ins would mix with kernels of another packing"):
        stand_ins.StandInKernels(["fused_experts_cpu"])  # refused before anything is registered
