"""skewed_router.py: the checkpoints the vLLM EP benchmarks serve, read back with transformers and
routed, every layer, over prompts of the benchmarks' own pattern (not the calibration's)."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from tests.benchmarks.scripts import load_benchmark

pytest.importorskip("transformers")
router = load_benchmark("skewed_router")


def routed_counts(directory, top_k: int, experts: int) -> list[torch.Tensor]:
    """Each layer's count of tokens per expert, top-k over its router logits: [L] of [E]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    prompts = torch.tensor([[(7 * r + 13 * j) % 500 + 3 for j in range(240)] for r in range(4)])  # the benchmarks'
    return [torch.bincount((x @ block.mlp.gate.weight.T).topk(top_k).indices.flatten(), minlength=experts)
            for x, block in zip(router.router_inputs(model, prompts), model.model.layers)]


@pytest.mark.parametrize("placement, hot", [("rank0", [4, 5]), ("rank1", [6, 7])])
def test_the_worst_case_routes_about_half_the_pairs_to_the_hot_experts_of_its_rank(tmp_path, placement, hot):
    args = argparse.Namespace(hidden=256, intermediate=64, layers=2, experts=8, redundant=4, hot=[4, 5], bias=1.5,
                              placement=placement)
    router.skewed_checkpoint(argparse.ArgumentParser(), args, tmp_path)
    cold = [e for e in range(8) if e not in hot]
    for counts in routed_counts(tmp_path, 2, 8):  # every layer, not only the first
        assert float(counts[hot].sum() / counts.sum()) > 0.4 and counts[hot].min() > counts[cold].max()


def test_mirror_swaps_the_unreplicated_halves_and_keeps_the_replicated_experts():
    assert [router.mirror(e, 8, 4) for e in range(8)] == [0, 1, 2, 3, 6, 7, 4, 5]
    assert sorted(router.mirror(e, 32, 8) for e in range(32)) == list(range(32))
    assert all(router.mirror(router.mirror(e, 32, 8), 32, 8) == e for e in range(32))


def natural(placement: str, layers: int = 2) -> argparse.Namespace:
    return argparse.Namespace(hidden=256, intermediate=64, layers=layers, experts=32, redundant=8, top_k=8, zipf=1.0,
                              seed=0, placement=placement, dtype="bfloat16")


@pytest.mark.parametrize("placement", ["rank0", "rank1"])
def test_the_natural_shift_is_zipf_per_layer_with_the_heavier_half_on_the_placements_rank(placement):
    for layer in range(3):
        shift = router.natural_logit_shift(natural(placement), layer)
        assert sorted(shift, reverse=True) == pytest.approx([-math.log(i) for i in range(1, 33)])
        mass = [sum(math.exp(x) for x in shift[start:start + 12]) for start in (8, 20)]  # rank 0's, rank 1's
        assert (mass[0] >= mass[1]) is (placement == "rank0")
    assert router.natural_logit_shift(natural("rank0"), 0) != router.natural_logit_shift(natural("rank0"), 1)


def test_the_natural_checkpoint_loads_every_expert_zipf_like_in_every_layer_in_its_dtype(tmp_path):
    from safetensors.torch import load_file

    router.natural_checkpoint(natural("rank0"), tmp_path)
    assert load_file(next(tmp_path.glob("*.safetensors")))["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    hottest = []
    for layer, counts in enumerate(routed_counts(tmp_path, 8, 32)):
        shift = torch.tensor(router.natural_logit_shift(natural("rank0"), layer))
        assert int((counts > 0).sum()) >= 24  # tokens differ: most experts get some
        assert 2.0 < float(counts.max() * 32 / counts.sum()) <= 4.0  # skewed, under top-8's cap of 32 / 8
        assert int(counts.argmax()) in shift.topk(3).indices.tolist()  # the most popular by the law is among the hottest
        assert 0.3 < router.zipf_exponent(counts.tolist()) < 1.5
        hottest.append(int(counts.argmax()))
    assert hottest[0] != hottest[1]  # each layer its own hot experts


def test_the_zipf_fit_recovers_an_exact_law_and_needs_two_loaded_experts():
    assert router.zipf_exponent([round(1000 * i ** -0.8) for i in range(1, 40)]) == pytest.approx(0.8, abs=0.01)
    assert router.zipf_exponent([5, 0, 0]) is None
