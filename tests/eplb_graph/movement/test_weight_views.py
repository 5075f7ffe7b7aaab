"""Quantization-owned weight views: exactly the kernel's storage, per-expert independence, refused formats."""

import pytest
import torch

from eplb_graph.movement.weight_views import (
    UNSUPPORTED_FORMATS,
    W4A8Experts,
    check_weight_view,
    expert_format,
    pack_int4,
    unpack_int4,
)


@pytest.mark.parametrize("name", ["unquantized", "w8a8_dynamic", "w4a8"])
def test_weight_views_expose_exactly_the_kernel_storage(name):
    fmt = expert_format(name)
    gen = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(4, 8, 6, generator=gen), torch.randn(4, 6, 4, generator=gen)
    experts = fmt.from_float(w13, w2)
    check_weight_view(experts, 4)
    x, ids = torch.randn(5, 6, generator=gen), torch.tensor([0, 3, 3, 1, 2])
    x[0] = x[1]  # pairs 0 and 1 differ only in the slot they read
    before_pairs, before = experts(x, ids), experts(x)  # [S, H] per pair; [E, N, H] every slot, every token
    assert before.shape == (4, 5, 6) and not torch.equal(before[0], before[3])
    assert not torch.equal(before_pairs[0], before_pairs[1])
    # moving slot 3's tensors into slot 0 through the view changes what either kernel computes
    for tensor in experts.weight_view():
        tensor[0].copy_(tensor[3])
    after_pairs, after = experts(x, ids), experts(x)
    assert torch.equal(after[0], before[3]) and torch.equal(after[1:], before[1:])
    assert torch.equal(after_pairs[0], before_pairs[1]) and torch.equal(after_pairs[1:], before_pairs[1:])
    dq13, dq2 = experts.dequantized()
    tolerance = {"unquantized": 0, "w8a8_dynamic": 0.02, "w4a8": 0.35}[name]
    assert (dq13[1:] - w13[1:]).abs().max() <= tolerance


@pytest.mark.parametrize("name", ["unquantized", "w8a8_dynamic", "w4a8"])
def test_a_token_s_expert_output_does_not_depend_on_the_other_tokens(name):
    """The EP model runs the experts over every rank's tokens, the one-process reference over
    its own: eager equality needs each token's row to be the same whatever else is in the
    batch (the row count, padding rows, the rows around it), with either kernel: pairs (one
    matvec each) and dense (batched GEMMs, padded below 4 rows). The two kernels compute the
    same function."""
    gen = torch.Generator().manual_seed(1)
    experts = expert_format(name).from_float(torch.randn(10, 128, 64, generator=gen), torch.randn(10, 64, 64, generator=gen))
    tokens = torch.randn(128, 64, generator=gen)  # the widest gathered batch: 2 ranks x capture size 64
    ids = torch.randint(0, 10, (128,), generator=gen)
    everyone, every_pair = experts(tokens), experts(tokens, ids)  # [E, 128, H], [128, H]
    for rows in (slice(0, 16), slice(16, 32), slice(64, 112), slice(5, 6), slice(7, 9), slice(9, 12), slice(0, 4)):
        assert torch.equal(experts(tokens[rows]), everyone[:, rows]), rows
        assert torch.equal(experts(tokens[rows], ids[rows]), every_pair[rows]), rows
    picked = everyone[ids, torch.arange(128)]  # what the dense kernel's caller keeps
    assert torch.allclose(picked, every_pair, rtol=1e-5, atol=1e-5 * float(every_pair.abs().max()))


def test_int4_packing_round_trips():
    q = torch.randint(-8, 8, (3, 5, 10), dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_FORMATS) + ["nf4"])
def test_unsupported_formats_are_rejected_naming_them(name):
    with pytest.raises(ValueError, match=f"quantization format '{name}' is not supported by EPLB"):
        expert_format(name)


def test_a_view_missing_coupled_metadata_is_rejected():
    experts = W4A8Experts.from_float(torch.randn(4, 8, 6), torch.randn(4, 6, 4))
    experts.view_names = experts.view_names[:-1]  # the w2 scale bias would be left behind
    with pytest.raises(ValueError, match=r"\['w2_scale_bias'\] are outside the weight view"):
        check_weight_view(experts, 4)
