"""The Triton (CUDA) routing kernel run by Triton's interpreter on host tensors.

Not collected by ``make test`` directly (the name has no ``test_`` prefix):
``test_triton_routing.py`` runs this file in a subprocess with
``TRITON_INTERPRET=1`` and the Triton release the lent GPU image has on its path. The main
test process never imports Triton (vLLM's CPU build and Inductor change behaviour when
it is importable).

What this proves: the kernel's own logic — masks, the replica hash, -1 for out-of-range
ids, padding rows, the record flag, atomic counts over several program blocks, both id
and load dtypes — equals the Python reference and the CPU kernel, through the same
wrappers the CUDA registration uses. What it does not prove: that Triton compiles it for
a GPU, CUDA-graph capture and replay, or speed; ``benchmarks/gpu_bench.py`` covers those
on a GPU.
"""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_graph.custom_ops import layer_routing, routing
from tests.custom_ops.routing_cases import check_layer_kernel_follows_its_tables, flags, random_tables
from tests.routing_reference import map_to_physical_reference, record_load_reference

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by test_triton_routing.py with TRITON_INTERPRET=1", allow_module_level=True)

triton_routing = pytest.importorskip("eplb_graph.custom_ops.triton_routing")

# exactly what custom_ops/__init__.py registers for the CUDA dispatch key
map_and_record_cuda = routing.checked_map_and_record(triton_routing.map_and_record_cuda)
map_to_physical_cuda = routing.checked_map_to_physical(triton_routing.map_to_physical_cuda)
map_and_record_layer_cuda = layer_routing.python_op_kernel(layer_routing.on_tables(triton_routing.map_and_record_cuda))

cpu_ops = torch.ops.eplb_graph


@settings(max_examples=40, deadline=None)
@given(
    num_logical=st.integers(1, 12),
    num_redundant_experts=st.integers(0, 6),
    num_tokens=st.integers(0, 80),  # up to 640 (token, k) slots: three 256-slot programs
    top_k=st.integers(1, 8),
    num_unpadded=st.integers(0, 90),
    record=st.booleans(),
    seed=st.integers(0, 2**16),
    id_dtype=st.sampled_from([torch.int32, torch.int64]),
    load_dtype=st.sampled_from([torch.int32, torch.int64]),
    flag_shape=st.sampled_from([(), (1,)]),
)
def test_kernel_matches_the_python_reference_and_the_cpu_kernel(
    num_logical, num_redundant_experts, num_tokens, top_k, num_unpadded, record, seed, id_dtype, load_dtype, flag_shape
):
    _, lookup, replica_count = random_tables(num_logical, num_redundant_experts, seed)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-3, num_logical + 3, (num_tokens, top_k), generator=gen, dtype=id_dtype)  # [T, K]
    record_enabled, num_unpadded_tokens = flags(record, num_unpadded, flag_shape)
    load = torch.zeros(num_logical + num_redundant_experts, dtype=load_dtype)
    cpu_load = torch.zeros_like(load)

    physical = map_and_record_cuda(ids, lookup, replica_count, load, record_enabled, num_unpadded_tokens)

    expected = map_to_physical_reference(ids.tolist(), lookup.tolist(), replica_count.tolist())
    assert physical.dtype == id_dtype and physical.shape == ids.shape
    assert physical.tolist() == expected
    assert load.tolist() == record_load_reference(expected, load.numel(), record, num_unpadded)
    cpu = cpu_ops.map_and_record(ids, lookup, replica_count, cpu_load, record_enabled, num_unpadded_tokens)
    assert torch.equal(physical, cpu) and torch.equal(load, cpu_load)
    assert map_to_physical_cuda(ids, lookup, replica_count).tolist() == expected


def test_many_blocks_count_every_duplicate_once():
    """4096 x 8 slots = 128 programs, every slot on one of 80 experts: atomics must not lose counts."""
    _, lookup, replica_count = random_tables(64, 16, seed=4096)
    ids = torch.randint(0, 64, (4096, 8), generator=torch.Generator().manual_seed(1))
    load = torch.zeros(80, dtype=torch.int32)
    cpu_load = torch.zeros_like(load)
    record_enabled, num_unpadded_tokens = flags(True, 4093, (1,))

    physical = map_and_record_cuda(ids, lookup, replica_count, load, record_enabled, num_unpadded_tokens)

    expected = cpu_ops.map_and_record(ids, lookup, replica_count, cpu_load, record_enabled, num_unpadded_tokens)
    assert torch.equal(physical, expected)
    assert torch.equal(load, cpu_load)
    assert int(load.sum()) == 4093 * 8


def test_map_only_never_writes_the_record_arguments():
    """map_to_physical passes replica_count in the record slots (RECORD=False): it must stay intact."""
    _, lookup, replica_count = random_tables(8, 4, seed=3)
    before = replica_count.clone()
    map_to_physical_cuda(torch.randint(0, 8, (40, 4)), lookup, replica_count)
    assert torch.equal(replica_count, before)


def test_non_contiguous_ids_and_empty_batches():
    _, lookup, replica_count = random_tables(8, 4, seed=5)
    ids = torch.randint(0, 8, (4, 30)).t()  # [30, 4], not contiguous
    assert not ids.is_contiguous()
    assert map_to_physical_cuda(ids, lookup, replica_count).tolist() == map_to_physical_reference(
        ids.tolist(), lookup.tolist(), replica_count.tolist()
    )
    empty = torch.empty(0, 4, dtype=torch.int64)
    load = torch.zeros(12, dtype=torch.int64)
    out = map_and_record_cuda(empty, lookup, replica_count, load, *flags(True, 5))
    assert out.shape == (0, 4) and int(load.sum()) == 0


def test_the_layer_kernel_follows_refreshes_flags_and_a_rebound_load_buffer():
    """The CUDA layer kernel reads the live tables at every call, as a replayed graph does."""
    check_layer_kernel_follows_its_tables(map_and_record_layer_cuda, "interpreted.layer0")
