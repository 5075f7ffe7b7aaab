"""The registered routing ops, on whatever kernel serves them here: on the CPU, the C++ kernels
where they could be built (custom_ops/csrc/routing.cpp), else the torch composite. Held to the
plain-Python reference and to the composite; test_native_routing.py runs this file again with the
C++ kernels switched off, so the composite passes every check here too."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_graph import BatchFlags, build_lookup
from eplb_graph.custom_ops import routing
from eplb_graph.custom_ops.routing import map_and_record_composite
from tests.custom_ops.routing_cases import (
    FLAG_SHAPES,
    ID_DTYPES,
    LAYOUTS,
    LOAD_DTYPES,
    ROUTING_CASES,
    as_load,
    check_layer_kernel_follows_its_tables,
    flags,
    laid_out,
    random_tables,
)
from tests.markers import requires_cuda
from tests.routing_reference import map_to_physical_reference, record_load_reference

ops = torch.ops.eplb_graph


SHAPES = [(0, 1), (1, 1), (1, 8), (7, 8), (33, 1), (1000, 8)]


@pytest.mark.parametrize("num_tokens,top_k", SHAPES)
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck_map_to_physical(num_tokens, top_k, id_dtype, layout):
    _, lookup, replica_count = random_tables(16, 5, seed=num_tokens)
    ids = laid_out(torch.randint(-2, 18, (num_tokens, top_k), dtype=id_dtype), layout)
    torch.library.opcheck(ops.map_to_physical, (ids, lookup, replica_count))


@pytest.mark.parametrize("num_tokens,top_k", SHAPES)
@pytest.mark.parametrize("load_dtype", [torch.int32, torch.int64, torch.float32])
@pytest.mark.parametrize("flag_shape", FLAG_SHAPES)
def test_opcheck_record_load_and_map_and_record(num_tokens, top_k, load_dtype, flag_shape):
    _, lookup, replica_count = random_tables(16, 5, seed=top_k)
    ids = torch.randint(-2, 18, (num_tokens, top_k), dtype=torch.int64)
    record_enabled, num_unpadded = flags(True, max(num_tokens - 1, 0), flag_shape)
    load = torch.zeros(21, dtype=load_dtype)
    torch.library.opcheck(ops.record_load, (ids, load, record_enabled, num_unpadded))
    torch.library.opcheck(
        ops.map_and_record, (ids, lookup, replica_count, load.clone(), record_enabled, num_unpadded)
    )


@pytest.mark.parametrize("id_dtype", ID_DTYPES)
@pytest.mark.parametrize("load_dtype", [torch.int32, torch.int64, torch.float32])
def test_opcheck_strided_ids_and_tables(id_dtype, load_dtype):
    _, lookup, replica_count = random_tables(16, 5, seed=7)
    ids = laid_out(torch.randint(-2, 18, (33, 8), dtype=id_dtype), "transposed")
    lookup, replica_count = laid_out(lookup, "strided"), laid_out(replica_count, "strided")
    record_enabled, num_unpadded = flags(True, 30, (1,))
    load = torch.zeros(21, dtype=load_dtype)
    torch.library.opcheck(ops.map_to_physical, (ids, lookup, replica_count))
    torch.library.opcheck(ops.record_load, (ids, load, record_enabled, num_unpadded))
    torch.library.opcheck(ops.map_and_record, (ids, lookup, replica_count, load.clone(), record_enabled, num_unpadded))


@settings(max_examples=80, deadline=None)
@given(
    **ROUTING_CASES,
    # dtypes that hold every count exactly (test_every_load_dtype_counts_... takes the rest)
    load_dtype=st.sampled_from([torch.int32, torch.int64, torch.float32, torch.float64]),
    flag_shape=st.sampled_from(FLAG_SHAPES),
    ids_layout=st.sampled_from(LAYOUTS),
    tables_layout=st.sampled_from(["contiguous", "strided"]),
)
def test_map_and_record_matches_python_reference(
    num_logical, num_redundant_experts, num_tokens, top_k, num_unpadded, record, seed, id_dtype, load_dtype, flag_shape,
    ids_layout, tables_layout,
):
    _, lookup, replica_count = random_tables(num_logical, num_redundant_experts, seed)
    lookup, replica_count = laid_out(lookup, tables_layout), laid_out(replica_count, tables_layout)
    gen = torch.Generator().manual_seed(seed)
    # ids out of range on both sides are part of the input space
    ids = torch.randint(-3, num_logical + 3, (num_tokens, top_k), generator=gen, dtype=id_dtype)
    ids = laid_out(ids, ids_layout)
    record_enabled, num_unpadded_tokens = flags(record, num_unpadded, flag_shape)
    load = torch.zeros(num_logical + num_redundant_experts, dtype=load_dtype)

    physical = ops.map_and_record(ids, lookup, replica_count, load, record_enabled, num_unpadded_tokens)

    expected = map_to_physical_reference(ids.tolist(), lookup.tolist(), replica_count.tolist())
    expected_load = as_load(record_load_reference(expected, load.numel(), record, num_unpadded), load_dtype)
    assert physical.dtype == id_dtype
    assert physical.tolist() == expected
    assert ops.map_to_physical(ids, lookup, replica_count).tolist() == expected
    assert load.tolist() == expected_load
    recorded = torch.zeros_like(load)
    ops.record_load(laid_out(torch.tensor(expected, dtype=id_dtype).reshape(ids.shape), ids_layout), recorded,
                    record_enabled, num_unpadded_tokens)
    assert recorded.tolist() == expected_load
    # the torch composite (the NPU kernel and the CUDA fallback) holds to the same reference
    composite_load = torch.zeros_like(load)
    composite = map_and_record_composite(ids, lookup, replica_count, composite_load, record_enabled, num_unpadded_tokens)
    assert composite.dtype == id_dtype and composite.tolist() == expected
    assert torch.equal(composite_load, load)


@pytest.mark.parametrize("load_dtype", LOAD_DTYPES)
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
@pytest.mark.parametrize("flag_shape", FLAG_SHAPES)
def test_every_load_dtype_counts_like_the_reference_and_the_composite(load_dtype, id_dtype, flag_shape):
    _, lookup, replica_count = random_tables(16, 5, seed=3)
    ids = laid_out(torch.randint(-2, 18, (40, 8), generator=torch.Generator().manual_seed(3), dtype=id_dtype),
                   "transposed")
    record_enabled, num_unpadded = flags(True, 30, flag_shape)
    expected = map_to_physical_reference(ids.tolist(), lookup.tolist(), replica_count.tolist())
    expected_load = as_load(record_load_reference(expected, 21, True, 30), load_dtype)
    assert any(count > 1 for count in record_load_reference(expected, 21, True, 30))  # counts, not flags

    load, composite_load, recorded = (torch.zeros(21, dtype=load_dtype) for _ in range(3))
    physical = ops.map_and_record(ids, lookup, replica_count, load, record_enabled, num_unpadded)
    composite = map_and_record_composite(ids, lookup, replica_count, composite_load, record_enabled, num_unpadded)
    ops.record_load(physical, recorded, record_enabled, num_unpadded)
    assert physical.tolist() == composite.tolist() == expected
    assert load.tolist() == composite_load.tolist() == recorded.tolist() == expected_load
    torch.library.opcheck(ops.map_and_record, (ids, lookup, replica_count, load, record_enabled, num_unpadded))
    torch.library.opcheck(ops.record_load, (physical, recorded, record_enabled, num_unpadded))


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


def _routing_args(**bad):
    """Valid map_and_record arguments, with ``bad`` ones in their place."""
    lookup, replica_count = build_lookup(torch.arange(2), 2, 1)
    record_enabled, num_unpadded = flags(True, 1)
    args = dict(ids=torch.zeros(2, 2, dtype=torch.int64), lookup=lookup, replica_count=replica_count,
                load=torch.zeros(2), record_enabled=record_enabled, num_unpadded=num_unpadded)
    return {**args, **bad}


# Every check of routing.check_routing_args / check_record_args, with its whole message: the C++
# kernels must say the same (the fakes, at trace time, run the Python checks).
ROUTING_ARG_ERRORS = [
    (dict(ids=torch.zeros(4, dtype=torch.int64)), "topk_ids must be [T, K], got (4,)"),
    (dict(ids=torch.zeros(2, 2, dtype=torch.float32)), "topk_ids must be int32 or int64, got torch.float32"),
    (dict(lookup=torch.zeros(2, dtype=torch.int32)), "lookup must be [num_logical, max_replicas], got (2,)"),
    (dict(lookup=torch.zeros(2, 1, dtype=torch.int64)), "lookup must be int32, got torch.int64"),
    (dict(replica_count=torch.ones(3, dtype=torch.int32)), "replica_count must be [num_logical=2], got (3,)"),
    (dict(replica_count=torch.ones(2, 1, dtype=torch.int32)), "replica_count must be [num_logical=2], got (2, 1)"),
    (dict(replica_count=torch.ones(2, dtype=torch.int64)), "replica_count must be int32, got torch.int64"),
]
RECORD_ARG_ERRORS = [
    (dict(load=torch.zeros(2, 1)), "load must be [num_physical], got (2, 1)"),
    (dict(load=torch.zeros(4)[::2]), "load must be contiguous"),
    (dict(record_enabled=torch.ones(2, dtype=torch.bool)),
     "record_enabled must be a 0-dim or 1-element tensor, got (2,)"),
    (dict(record_enabled=torch.ones(())), "record_enabled must be bool, int32 or int64, got torch.float32"),
    (dict(record_enabled=torch.ones((), dtype=torch.uint8)),
     "record_enabled must be bool, int32 or int64, got torch.uint8"),
    (dict(num_unpadded=torch.ones(1, 1, 2, dtype=torch.int32)),
     "num_unpadded_tokens must be a 0-dim or 1-element tensor, got (1, 1, 2)"),
    (dict(num_unpadded=torch.ones((), dtype=torch.bool)),
     "num_unpadded_tokens must be int32 or int64, got torch.bool"),
    (dict(num_unpadded=torch.ones(1)), "num_unpadded_tokens must be int32 or int64, got torch.float32"),
]
RECORD_IDS_ERRORS = [  # record_load's own ids; map_and_record's are topk_ids, checked before
    (dict(ids=torch.zeros(4, dtype=torch.int64)), "physical_ids must be [T, K], got (4,)"),
    (dict(ids=torch.zeros(2, 2, dtype=torch.int16)), "physical_ids must be int32 or int64, got torch.int16"),
]
# (op, its composite kernel -- what the fallback registers --, which arguments it takes)
CHECKED_OPS = {
    "map_to_physical": (ops.map_to_physical, routing.map_to_physical_kernel, ("ids", "lookup", "replica_count")),
    "record_load": (ops.record_load, routing.record_load_kernel, ("ids", "load", "record_enabled", "num_unpadded")),
    "map_and_record": (ops.map_and_record, routing.map_and_record_kernel,
                       ("ids", "lookup", "replica_count", "load", "record_enabled", "num_unpadded")),
}
ARG_ERROR_CASES = (
    [("map_to_physical", *case) for case in ROUTING_ARG_ERRORS]
    + [("record_load", *case) for case in RECORD_IDS_ERRORS + RECORD_ARG_ERRORS]
    + [("map_and_record", *case) for case in ROUTING_ARG_ERRORS + RECORD_ARG_ERRORS]
)


@pytest.mark.parametrize("name,bad,message", ARG_ERROR_CASES)
@pytest.mark.parametrize("kernel", ["registered", "composite"])
def test_bad_arguments_raise_the_same_clear_error_on_every_kernel(name, bad, message, kernel):
    op, composite, arg_names = CHECKED_OPS[name]
    args = _routing_args(**bad)
    with pytest.raises(RuntimeError) as error:
        (op if kernel == "registered" else composite)(*(args[arg] for arg in arg_names))
    assert str(error.value).splitlines()[0] == message


@pytest.mark.parametrize(
    "ids,match",
    [(torch.zeros(4, dtype=torch.int64), r"topk_ids must be \[T, K\], got \(4,\)"),
     (torch.zeros(2, 2), "topk_ids must be int32 or int64, got torch.float32")],
)
def test_the_layer_op_checks_its_ids(ids, match):
    from eplb_graph.core.layer_lookup import LayerLookup, RoutedLayer

    layer = RoutedLayer("checks.0", LayerLookup(4, 6), BatchFlags())
    try:
        with pytest.raises(RuntimeError, match=match):
            ops.map_and_record_layer(ids, "checks.0")
        assert ops.map_and_record_layer(torch.zeros(2, 2, dtype=torch.int32), "checks.0").tolist() == [[0, 0], [4, 4]]
    finally:
        layer.close()


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
    # the registered op: the C++ kernel where it was built, else the composite (CPU_LAYER_KERNEL)
    check_layer_kernel_follows_its_tables(ops.map_and_record_layer, "follow.0")
