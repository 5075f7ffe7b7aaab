"""The expert kernels' indexing: a row's result does not depend on how many rows run beside it."""

import pytest
import torch

from eplb_graph.movement.expert_kernels import MIN_GEMM_ROWS, EveryExpert, OnePerPair, check_expert_kernel, kernel


def test_a_lone_pair_equals_the_same_pair_in_a_batch():
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(4, 6, 5, generator=gen), torch.randn(3, 5, generator=gen)  # [E, O, I], [S, I]
    ids = torch.tensor([2, 0, 3])
    batch = OnePerPair(ids)
    together = batch.linear(x, batch.weight(weight))  # [S, O]
    for row in range(3):
        alone = OnePerPair(ids[row : row + 1])
        assert torch.equal(alone.linear(x[row : row + 1], alone.weight(weight)), together[row : row + 1])


def test_every_expert_pads_small_batches_and_drops_the_padding():
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(4, 6, 5, generator=gen), torch.randn(MIN_GEMM_ROWS + 2, 5, generator=gen)
    full = EveryExpert.linear(x, weight)  # [E, N, O]
    small = EveryExpert.linear(x[:1], weight)
    assert small.shape == (4, 1, 6) and torch.equal(small, full[:, :1])


def test_the_kernel_follows_the_ids_and_unknown_kernels_are_refused():
    assert isinstance(kernel(None), EveryExpert) and isinstance(kernel(torch.tensor([0])), OnePerPair)
    check_expert_kernel("dense")
    with pytest.raises(ValueError, match="unknown expert kernel 'fused'; expected one of pairs, dense"):
        check_expert_kernel("fused")
