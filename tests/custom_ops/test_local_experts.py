"""``eplb_graph::local_expert_pairs``: a rank's experts over exactly the pairs routed to its slots,
with the C++ compaction and combine (csrc/local_pairs.cpp) where they are built and the torch
composite: each is held to the other bit for bit, and the op's tests run on both."""

from __future__ import annotations

import pytest
import torch

from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_graph.custom_ops import CPU_LAYER_KERNEL, LOCAL_EXPERTS
from eplb_graph.custom_ops.local_experts import PairPasses, combine_rows, compact_pairs, local_expert_pairs_fake

H, I, E_GLOBAL = 16, 8, 6


def silu_moe(x, w13, w2, weights, ids) -> torch.Tensor:
    """The SiLU-gated MoE over experts ``w13`` [E, 2I, H], ``w2`` [E, H, I]: [T, H]."""
    gate, up = torch.einsum("th,tkoh->tko", x, w13[ids]).chunk(2, dim=-1)  # [T, K, I] each
    return torch.einsum("tk,tki,tkhi->th", weights, torch.nn.functional.silu(gate) * up, w2[ids])


class LocalKernel:
    """A rank's kernel as vLLM's CPU experts are: local ids only (a foreign id raises, as theirs crash)."""

    def __init__(self) -> None:
        self.rows_seen: list[int] = []

    def run_pairs(self, hidden_states, topk_weights, local_ids, weights):
        w13, w2 = weights
        assert local_ids.shape[1] == 1 and int(local_ids.min()) >= 0 and int(local_ids.max()) < w13.shape[0]
        self.rows_seen.append(hidden_states.shape[0])
        return silu_moe(hidden_states, w13, w2, topk_weights, local_ids.long())


native_only = pytest.mark.skipif(CPU_LAYER_KERNEL != "native", reason="the C++ kernels are not built here")


@pytest.fixture(params=["served", "composite"])
def rank(request, monkeypatch):
    """Rank 1 of 2 over 6 global slots: it holds slots 3, 4, 5 as its local 0, 1, 2; the op's passes
    those that serve here (C++ where built), then the torch composite."""
    if request.param == "composite":
        monkeypatch.setattr(LOCAL_EXPERTS, "passes", PairPasses())
    torch.manual_seed(0)
    w13, w2 = torch.randn(E_GLOBAL, 2 * I, H), torch.randn(E_GLOBAL, H, I)
    expert_map = torch.tensor([-1, -1, -1, 0, 1, 2], dtype=torch.int32)
    kernel = LocalKernel()
    key = "test.rank1.experts"
    LOCAL_EXPERTS.register(key, kernel)
    yield key, kernel, expert_map, w13, w2
    LOCAL_EXPERTS.unregister(key)


def routed(tokens: int, k: int = 2):
    ids = torch.stack([torch.randperm(E_GLOBAL)[:k] for _ in range(tokens)]).to(torch.int32)  # [T, K]
    return torch.randn(tokens, H), torch.rand(tokens, k), ids


def test_sums_exactly_the_local_pairs_and_computes_nothing_else(rank):
    key, kernel, expert_map, w13, w2 = rank
    x, weights, ids = routed(12)
    out = torch.ops.eplb_graph.local_expert_pairs(x, weights, ids, expert_map, [w13[3:], w2[3:]], key)
    local = ids >= 3
    expected = silu_moe(x, w13, w2, weights * local, ids.long())  # foreign pairs contribute nothing
    torch.testing.assert_close(out, expected)
    assert kernel.rows_seen == [int(local.sum())]  # the kernel ran the local pairs only
    counts = LOCAL_EXPERTS.counts(key)
    assert (counts.pairs, counts.seen, counts.calls) == (int(local.sum()), ids.numel(), 1) and counts.seconds > 0


def test_two_ranks_together_equal_one_rank_holding_every_expert(rank):
    key, _kernel, expert_map, w13, w2 = rank
    x, weights, ids = routed(9)
    other = LocalKernel()
    LOCAL_EXPERTS.register("test.rank0.experts", other)
    try:
        rank0_map = torch.tensor([0, 1, 2, -1, -1, -1], dtype=torch.int32)
        rank0 = torch.ops.eplb_graph.local_expert_pairs(x, weights, ids, rank0_map, [w13[:3], w2[:3]],
                                                        "test.rank0.experts")
    finally:
        LOCAL_EXPERTS.unregister("test.rank0.experts")
    rank1 = torch.ops.eplb_graph.local_expert_pairs(x, weights, ids, expert_map, [w13[3:], w2[3:]], key)
    torch.testing.assert_close(rank0 + rank1, silu_moe(x, w13, w2, weights, ids.long()))  # what TP's all-reduce sums


def test_no_local_pair_gives_zeros_without_calling_the_kernel(rank):
    key, kernel, expert_map, w13, w2 = rank
    x, weights = torch.randn(3, H), torch.rand(3, 2)
    ids = torch.tensor([[0, 1], [2, 0], [1, 2]], dtype=torch.int32)
    out = torch.ops.eplb_graph.local_expert_pairs(x, weights, ids, expert_map, [w13[3:], w2[3:]], key)
    assert torch.equal(out, torch.zeros_like(x)) and kernel.rows_seen == []


def test_ids_out_of_range_are_nobodys_pairs(rank):
    """-1 (the routing ops' id for an unknown logical expert) and ids past the slots run on no rank."""
    key, kernel, expert_map, w13, w2 = rank
    x, weights = torch.randn(3, H), torch.rand(3, 2)
    ids = torch.tensor([[-1, 5], [6, 4], [-1, 9]], dtype=torch.int32)
    out = torch.ops.eplb_graph.local_expert_pairs(x, weights, ids, expert_map, [w13[3:], w2[3:]], key)
    expected = silu_moe(x, w13, w2, weights * torch.tensor([[0, 1], [0, 1], [0, 0]]), ids.clamp(0, 5).long())
    torch.testing.assert_close(out, expected)
    assert kernel.rows_seen == [2]


def test_bfloat16_rows_from_the_kernel_are_summed_in_float32_and_the_sum_rounded(rank):
    key, _kernel, expert_map, w13, w2 = rank
    x, weights, ids = routed(8)
    ids[:, 0], ids[:, 1] = 3, 4  # both pairs of every token local
    out = torch.ops.eplb_graph.local_expert_pairs(x.bfloat16(), weights.bfloat16(), ids, expert_map,
                                                  [w13[3:].bfloat16(), w2[3:].bfloat16()], key)
    rows = [silu_moe(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights.bfloat16()[:, k:k + 1], ids[:, k:k + 1].long())
            for k in range(2)]
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (rows[0].float() + rows[1].float()).bfloat16())


def test_the_fake_is_contiguous_as_the_result_is(rank):
    key, _kernel, expert_map, w13, w2 = rank
    x, weights, ids = routed(6)
    strided = x.t().contiguous().t()  # [T, H] with column-major strides
    args = (strided, weights, ids, expert_map, [w13[3:], w2[3:]], key)
    assert not strided.is_contiguous()
    assert local_expert_pairs_fake(*args).is_contiguous()
    assert torch.ops.eplb_graph.local_expert_pairs(*args).is_contiguous()


def test_opcheck(rank):
    key, _kernel, expert_map, w13, w2 = rank
    x, weights, ids = routed(6)
    torch.library.opcheck(torch.ops.eplb_graph.local_expert_pairs.default,
                          (x, weights, ids, expert_map, [w13[3:], w2[3:]], key))


def test_compiled_graph_keeps_the_op_opaque_and_serves_any_routing(rank):
    key, kernel, expert_map, w13, w2 = rank
    local_w13, local_w2 = w13[3:], w2[3:]

    def experts(x, weights, ids):
        return torch.ops.eplb_graph.local_expert_pairs(x, weights, ids, expert_map, [local_w13, local_w2], key) * 2

    compiled = torch.compile(experts, fullgraph=True, backend="aot_eager", dynamic=True)
    for tokens in (5, 7, 11):  # other token counts, other numbers of local pairs: one graph
        x, weights, ids = routed(tokens)
        torch.testing.assert_close(compiled(x, weights, ids), experts(x, weights, ids))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_fake_refuses_a_layer_with_no_kernel_when_the_graph_is_built():
    def experts(x, weights, ids, expert_map):
        return torch.ops.eplb_graph.local_expert_pairs(x, weights, ids, expert_map, [], "no.such.layer")

    x, weights, ids = routed(4)
    with pytest.raises(Exception, match="no live local experts named 'no.such.layer'"):
        torch.compile(experts, fullgraph=True, backend="aot_eager")(x, weights, ids, torch.zeros(6, dtype=torch.int32))


@pytest.mark.parametrize("bad, message", [
    ({"x": torch.randn(5, H)}, r"hidden_states must be \[T, H\] with T = 4"),
    ({"weights": torch.rand(4, 3)}, r"topk_weights \(4, 3\) must match topk_ids \(4, 2\)"),
    ({"expert_map": torch.zeros(6)}, "expert_map must be"),
    ({"ids": torch.zeros(4, 2)}, "topk_ids must be int32 or int64"),
])
def test_bad_arguments_are_named(rank, bad, message):
    key, kernel, expert_map, w13, w2 = rank
    x, weights, ids = routed(4)
    args = {"x": x, "weights": weights, "ids": ids, "expert_map": expert_map, **bad}
    with pytest.raises(RuntimeError, match=message):
        torch.ops.eplb_graph.local_expert_pairs(args["x"], args["weights"], args["ids"], args["expert_map"],
                                                [w13, w2], key)
    assert kernel.rows_seen == []


def test_a_key_is_registered_once():
    kernel = LocalKernel()
    LOCAL_EXPERTS.register("test.once", kernel)
    try:
        with pytest.raises(ValueError, match="already registered"):
            LOCAL_EXPERTS.register("test.once", LocalKernel())
    finally:
        LOCAL_EXPERTS.unregister("test.once")
    assert "test.once" not in LOCAL_EXPERTS


@native_only
def test_the_cpp_passes_serve_where_the_cpp_kernels_are_built():
    assert LOCAL_EXPERTS.passes.kind == "native"


@native_only
@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(0, 40), top_k=st.integers(1, 6), width=st.sampled_from([1, 16, 48]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
       id_dtype=st.sampled_from([torch.int32, torch.int64]), map_dtype=st.sampled_from([torch.int32, torch.int64]),
       seed=st.integers(0, 2**16))
def test_the_cpp_passes_equal_the_composite_bit_for_bit(tokens, top_k, width, dtype, id_dtype, map_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    expert_map = torch.tensor([-1, 0, 1, -1, 2, 3, -1, -1, 4, 5], dtype=map_dtype)  # [num_physical]
    ids = torch.randint(-1, 12, (tokens, top_k), generator=gen).to(id_dtype)  # [T, K], some out of range
    x = torch.randn(tokens, width, generator=gen).to(dtype)
    weights = torch.rand(tokens, top_k, generator=gen)
    native = LOCAL_EXPERTS.passes.compact(x, weights, ids, expert_map)
    for got, want in zip(native, compact_pairs(x, weights, ids, expert_map)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    rows = torch.randn(native[0].shape, generator=gen).to(dtype)  # what a kernel hands back, [P, H]
    combined = LOCAL_EXPERTS.passes.combine(rows, native[3], tokens)
    assert combined.dtype == dtype and torch.equal(combined, combine_rows(rows, native[3], tokens))


@native_only
@pytest.mark.parametrize("row_tokens, message", [
    ([1, 0], "non-decreasing token indices in \\[0, 3\\)"),
    ([0, 3], "non-decreasing token indices in \\[0, 3\\)"),
    ([-1, 0], "non-decreasing token indices"),
])
def test_the_cpp_combine_refuses_rows_it_cannot_place(row_tokens, message):
    with pytest.raises(RuntimeError, match=message):
        LOCAL_EXPERTS.passes.combine(torch.ones(2, 4), torch.tensor(row_tokens), 3)
