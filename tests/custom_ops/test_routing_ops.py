import pytest
import torch
from hypothesis import given, settings

from eplb_graph import BatchFlags, build_lookup
from eplb_graph.custom_ops.routing import map_and_record_composite
from tests.custom_ops.routing_cases import ROUTING_CASES, check_layer_kernel_follows_its_tables, flags, random_tables
from tests.markers import requires_cuda
from tests.routing_reference import map_to_physical_reference, record_load_reference

ops = torch.ops.eplb_graph


SHAPES = [(0, 1), (1, 1), (1, 8), (7, 8), (33, 1), (1000, 8)]


@pytest.mark.parametrize("num_tokens,top_k", SHAPES)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_opcheck_map_to_physical(num_tokens, top_k, id_dtype):
    _, lookup, replica_count = random_tables(16, 5, seed=num_tokens)
    ids = torch.randint(-2, 18, (num_tokens, top_k), dtype=id_dtype)
    torch.library.opcheck(ops.map_to_physical, (ids, lookup, replica_count))


@pytest.mark.parametrize("num_tokens,top_k", SHAPES)
@pytest.mark.parametrize("load_dtype", [torch.int32, torch.int64, torch.float32])
@pytest.mark.parametrize("flag_shape", [(), (1,)])
def test_opcheck_record_load_and_map_and_record(num_tokens, top_k, load_dtype, flag_shape):
    _, lookup, replica_count = random_tables(16, 5, seed=top_k)
    ids = torch.randint(-2, 18, (num_tokens, top_k), dtype=torch.int64)
    record_enabled, num_unpadded = flags(True, max(num_tokens - 1, 0), flag_shape)
    load = torch.zeros(21, dtype=load_dtype)
    torch.library.opcheck(ops.record_load, (ids, load, record_enabled, num_unpadded))
    torch.library.opcheck(
        ops.map_and_record, (ids, lookup, replica_count, load.clone(), record_enabled, num_unpadded)
    )


@settings(max_examples=60, deadline=None)
@given(**ROUTING_CASES)
def test_map_and_record_matches_python_reference(
    num_logical, num_redundant, num_tokens, top_k, num_unpadded, record, seed, id_dtype
):
    _, lookup, replica_count = random_tables(num_logical, num_redundant, seed)
    gen = torch.Generator().manual_seed(seed)
    # ids out of range on both sides are part of the input space
    ids = torch.randint(-3, num_logical + 3, (num_tokens, top_k), generator=gen, dtype=id_dtype)
    record_enabled, num_unpadded_tokens = flags(record, num_unpadded)
    load = torch.zeros(num_logical + num_redundant, dtype=torch.int64)

    physical = ops.map_and_record(ids, lookup, replica_count, load, record_enabled, num_unpadded_tokens)

    expected = map_to_physical_reference(ids.tolist(), lookup.tolist(), replica_count.tolist())
    assert physical.dtype == id_dtype
    assert physical.tolist() == expected
    assert ops.map_to_physical(ids, lookup, replica_count).tolist() == expected
    assert load.tolist() == record_load_reference(expected, load.numel(), record, num_unpadded)
    # the torch composite (the NPU kernel and the CUDA fallback) holds to the same reference
    composite_load = torch.zeros_like(load)
    composite = map_and_record_composite(ids, lookup, replica_count, composite_load, record_enabled, num_unpadded_tokens)
    assert composite.dtype == id_dtype and composite.tolist() == expected
    assert torch.equal(composite_load, load)


def test_every_replica_of_an_expert_is_used_and_rows_share_one_replica():
    # expert 0 has 3 replicas; expert 1 has one
    lookup, replica_count = build_lookup(torch.tensor([0, 1, 0, 0]), 2, 3)
    ids = torch.tensor([[0, 0]] * 64)
    physical = ops.map_to_physical(ids, lookup, replica_count)
    assert set(physical.flatten().tolist()) == {0, 2, 3}
    assert torch.equal(physical[:, 0], physical[:, 1])  # same replica for every k of a row
    assert torch.equal(physical, ops.map_to_physical(ids, lookup, replica_count))  # deterministic


@pytest.mark.parametrize("num_unpadded", [0, 5, 9, 1000])
def test_padding_rows_are_never_counted(num_unpadded):
    lookup, replica_count = build_lookup(torch.arange(4), 4, 1)
    ids = torch.tensor([[0, 1]] * 9)  # T = 9
    load = torch.zeros(4, dtype=torch.int64)
    record_enabled, num_unpadded_tokens = flags(True, num_unpadded, (1,))
    ops.map_and_record(ids, lookup, replica_count, load, record_enabled, num_unpadded_tokens)
    counted = min(num_unpadded, 9)
    assert load.tolist() == [counted, counted, 0, 0]


def test_out_of_range_ids_map_to_minus_one_and_are_not_counted():
    lookup, replica_count = build_lookup(torch.arange(4), 4, 1)
    ids = torch.tensor([[-1, 4], [100, 3], [-7, 0]], dtype=torch.int32)
    load = torch.zeros(4, dtype=torch.int32)
    physical = ops.map_and_record(ids, lookup, replica_count, load, *flags(True, 3))
    assert physical.tolist() == [[-1, -1], [-1, 3], [-1, 0]]
    assert load.tolist() == [1, 0, 0, 1]


def test_record_flag_off_leaves_load_untouched():
    lookup, replica_count = build_lookup(torch.arange(4), 4, 1)
    load = torch.full((4,), 7, dtype=torch.int64)
    ops.map_and_record(torch.tensor([[0, 1]]), lookup, replica_count, load, *flags(False, 1))
    assert load.tolist() == [7, 7, 7, 7]


@pytest.mark.parametrize(
    "ids,lookup,count,match",
    [
        (torch.zeros(4, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32), "topk_ids must be"),
        (torch.zeros(2, 2, dtype=torch.float32), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32), "int32 or int64"),
        (torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, dtype=torch.int32), "lookup must be int32"),
        (torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int32), torch.ones(3, dtype=torch.int32), "replica_count must be"),
    ],
)
def test_bad_arguments_raise_clear_errors(ids, lookup, count, match):
    with pytest.raises(RuntimeError, match=match):
        ops.map_to_physical(ids, lookup, count)


@pytest.mark.parametrize(
    "ids,match",
    [(torch.zeros(4, dtype=torch.int64), r"topk_ids must be \[T, K\], got \(4,\)"),
     (torch.zeros(2, 2), "topk_ids must be int32 or int64, got torch.float32")],
)
def test_the_layer_op_checks_its_ids(ids, match):
    from eplb_graph.layer_lookup import LayerLookup, RoutedLayer

    layer = RoutedLayer("checks.0", LayerLookup(4, 6), BatchFlags())
    try:
        with pytest.raises(RuntimeError, match=match):
            ops.map_and_record_layer(ids, "checks.0")
        assert ops.map_and_record_layer(torch.zeros(2, 2, dtype=torch.int32), "checks.0").tolist() == [[0, 0], [4, 4]]
    finally:
        layer.close()


def test_record_flags_must_be_single_element():
    lookup, replica_count = build_lookup(torch.arange(2), 2, 1)
    with pytest.raises(RuntimeError, match="record_enabled must be"):
        ops.map_and_record(
            torch.zeros(1, 1, dtype=torch.int64), lookup, replica_count, torch.zeros(2),
            torch.ones(2, dtype=torch.bool), torch.ones((), dtype=torch.int32),
        )


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_topk_then_map_and_record_compiles_without_graph_breaks(backend):
    _, lookup, replica_count = random_tables(8, 2, seed=0)
    batch = BatchFlags()
    load = torch.zeros(10, dtype=torch.int64)

    def route(logits):  # [T, E]
        weights, ids = torch.topk(logits.softmax(-1), k=2, dim=-1)  # [T, 2]
        physical = ops.map_and_record(ids, lookup, replica_count, load, batch.record_enabled, batch.num_unpadded_tokens)
        return weights, physical

    compiled = torch.compile(route, backend=backend, fullgraph=True)
    logits = torch.randn(6, 8)
    batch.set_(record=True, num_unpadded_tokens=4)
    weights, physical = compiled(logits)
    expected_load = torch.zeros(10, dtype=torch.int64)
    expected_weights, expected_physical = (lambda w, i: (w, i))(*torch.topk(logits.softmax(-1), 2, dim=-1))
    expected_physical = ops.map_and_record(
        expected_physical, lookup, replica_count, expected_load, batch.record_enabled, batch.num_unpadded_tokens
    )
    assert torch.equal(physical, expected_physical)
    torch.testing.assert_close(weights, expected_weights)
    assert torch.equal(load, expected_load)
    assert int(load.sum()) == 4 * 2
    assert torch._dynamo.utils.counters["graph_break"] == {}


@requires_cuda
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_tokens", [0, 1, 17, 4096])
def test_cuda_kernel_matches_the_cpu_kernel(num_tokens, id_dtype):
    _, lookup, replica_count = random_tables(64, 16, seed=num_tokens)
    ids = torch.randint(-2, 66, (num_tokens, 8), dtype=id_dtype)
    record_enabled, num_unpadded = flags(True, max(num_tokens - 3, 0), (1,))
    cpu_load = torch.zeros(80, dtype=torch.int32)
    expected = ops.map_and_record(ids, lookup, replica_count, cpu_load, record_enabled, num_unpadded)
    cuda = [t.cuda() for t in (ids, lookup, replica_count, torch.zeros(80, dtype=torch.int32), record_enabled, num_unpadded)]
    physical = ops.map_and_record(*cuda)
    assert torch.equal(physical.cpu(), expected)
    assert torch.equal(cuda[3].cpu(), cpu_load)
    torch.library.opcheck(ops.map_and_record, tuple(t.clone() for t in cuda))


def test_the_layer_op_follows_refreshes_flags_and_a_rebound_load_buffer():
    # the registered op: the C++ kernel where it was built, else numba (CPU_LAYER_KERNEL)
    check_layer_kernel_follows_its_tables(ops.map_and_record_layer, "follow.0")
