"""The C++ CPU kernel of map_and_record_layer (custom_ops/csrc/layer_routing.cpp) and the
index of layers it keeps, mirrored from LAYER_TABLES.

What these tests do not prove: that a machine without a C++ compiler gets the C++ kernel (it
gets the numba kernel, tested here by making the build fail), or anything about CUDA tables
(the kernel refuses non-CPU tables; a meta-device layer stands in for them)."""

import gc
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_graph import BatchFlags
from eplb_graph.custom_ops import CPU_LAYER_KERNEL, LAYER_TABLES, cpu_routing, layer_routing, native_routing
from eplb_graph.layer_lookup import LayerLookup, RoutedLayer
from tests.custom_ops.routing_cases import ROUTING_CASES, check_layer_kernel_follows_its_tables, random_tables
from tests.routing_reference import map_to_physical_reference, record_load_reference

CAN_BUILD = (shutil.which(os.environ.get("CXX", "c++")) is not None and shutil.which("ninja") is not None
             and os.environ.get(native_routing.SWITCH) != "0")
native_only = pytest.mark.skipif(CPU_LAYER_KERNEL != "native", reason="the C++ kernel is not what serves CPU here")
op = torch.ops.eplb_graph.map_and_record_layer


@pytest.mark.skipif(not CAN_BUILD, reason="no C++ compiler or ninja on this machine, or the C++ kernel switched off")
def test_a_machine_that_can_build_routes_cpu_calls_through_cpp():
    assert CPU_LAYER_KERNEL == "native"
    assert native_routing.build_directory().joinpath(f"{native_routing.LIBRARY_NAME}.so").exists()


@native_only
@settings(max_examples=80, deadline=None)
@given(
    **ROUTING_CASES,
    load_dtype=st.sampled_from([torch.int32, torch.int64, torch.float32]),
    transposed=st.booleans(),
    flag_dtype=st.sampled_from([torch.bool, torch.int32]),
)
def test_the_cpp_kernel_matches_the_reference_and_the_numba_kernel(
    num_logical, num_redundant, num_tokens, top_k, num_unpadded, record, seed, id_dtype, load_dtype, transposed,
    flag_dtype,
):
    placement, _, _ = random_tables(num_logical, num_redundant, seed)
    tables = LayerLookup(num_logical, num_logical + num_redundant, placement=placement, load_dtype=load_dtype)
    flags = BatchFlags.sharing(torch.tensor([record], dtype=flag_dtype), torch.tensor(num_unpadded, dtype=torch.int32))
    layer = RoutedLayer("native.ref", tables, flags)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-3, num_logical + 3, (num_tokens, top_k), generator=gen, dtype=id_dtype)
    if transposed:  # strided ids, as a transposed top-k output would be
        ids = torch.randint(-3, num_logical + 3, (top_k, num_tokens), generator=gen, dtype=id_dtype).t()
    try:
        physical = op(ids, "native.ref")
        expected = map_to_physical_reference(ids.tolist(), tables.lookup.tolist(), tables.replica_count.tolist())
        assert physical.dtype == id_dtype and physical.stride() == torch.empty_like(ids).stride()
        assert physical.tolist() == expected
        assert tables.load.tolist() == record_load_reference(expected, tables.load.numel(), record, num_unpadded)

        numba_load = torch.zeros_like(tables.load)
        tables.bind_load_(numba_load)
        numba_physical = cpu_routing.LayerMapAndRecord()(ids, layer)
        assert torch.equal(numba_physical, physical) and numba_load.tolist() == tables.load.tolist()
    finally:
        layer.close()


def test_the_numba_kernel_behind_a_python_kernel_follows_its_layer_too():
    # what serves CPU calls where C++ cannot be built
    check_layer_kernel_follows_its_tables(layer_routing.python_op_kernel(cpu_routing.LayerMapAndRecord()), "numba.follow")


@native_only
def test_a_layer_closed_or_dead_is_gone_from_the_cpp_index_and_its_key_can_be_reused():
    ids = torch.tensor([[0, 1]])
    first = RoutedLayer("native.life", LayerLookup(2, 3), BatchFlags())
    assert op(ids, "native.life").tolist() == [[0, 1]]
    first.close()
    with pytest.raises(RuntimeError, match="no live EPLB layer named 'native.life'"):
        op(ids, "native.life")

    second = RoutedLayer("native.life", LayerLookup(2, 3, placement=torch.tensor([1, 0, 1])), BatchFlags())
    assert op(ids, "native.life").tolist() == [[1, 0]]  # the new layer's tables, not the closed one's
    del second
    gc.collect()
    with pytest.raises(RuntimeError, match="no live EPLB layer named 'native.life'"):
        op(ids, "native.life")  # the index held tensors, not the layer: its death unbinds them


@native_only
def test_calls_are_counted_per_layer_across_a_rebound_load_buffer():
    layer = RoutedLayer("native.calls", LayerLookup(2, 3), BatchFlags())
    try:
        ids = torch.tensor([[0, 1]])
        for _ in range(3):
            op(ids, "native.calls")
        layer.tables.bind_load_(torch.zeros(3, dtype=torch.int64))
        op(ids, "native.calls")
        assert LAYER_TABLES.calls("native.calls") == 4
    finally:
        layer.close()
    assert LAYER_TABLES.calls("native.calls") == 0


@native_only
def test_a_load_buffer_the_kernel_refuses_leaves_the_old_binding_whole():
    tables, flags = LayerLookup(2, 3), BatchFlags()
    flags.set_(record=True, num_unpadded_tokens=1)
    layer = RoutedLayer("native.refuse", tables, flags)
    old_load = tables.load
    try:
        with pytest.raises(RuntimeError, match="load must be a contiguous 1-d int32/int64/float32/float64"):
            tables.bind_load_(torch.zeros(3, dtype=torch.float16))
        assert tables.load is old_load
        op(torch.tensor([[0, 1]]), "native.refuse")
        assert old_load.tolist() == [1, 1, 0]  # still recorded where the layer says it records
    finally:
        layer.close()


@native_only
def test_flags_of_a_wrong_kind_are_refused_when_the_layer_registers():
    flags = BatchFlags.sharing(torch.ones(1, dtype=torch.bool), torch.ones(1, dtype=torch.float32))
    with pytest.raises(RuntimeError, match="num_unpadded_tokens must be one int32/int64 element"):
        RoutedLayer("native.badflags", LayerLookup(2, 3), flags)
    assert "native.badflags" not in LAYER_TABLES  # nothing half-registered


@native_only
def test_a_layer_whose_tables_are_not_on_the_cpu_registers_but_cannot_route_cpu_ids():
    layer = RoutedLayer("native.meta", LayerLookup(2, 3, device="meta"), BatchFlags("meta"))
    try:
        with pytest.raises(RuntimeError, match="EPLB layer 'native.meta' has its tables on meta, the topk_ids on the CPU"):
            op(torch.tensor([[0, 1]]), "native.meta")
    finally:
        layer.close()


def _fresh_interpreter(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          env={**os.environ, **env})


FOLLOWS = (
    "import sys, warnings; warnings.simplefilter('always')\n"
    "from eplb_graph.custom_ops import CPU_LAYER_KERNEL, map_and_record_layer\n"
    "from tests.custom_ops.routing_cases import check_layer_kernel_follows_its_tables\n"
    "check_layer_kernel_follows_its_tables(map_and_record_layer, 'fresh.0')\n"
    "print(CPU_LAYER_KERNEL, 'torch.utils.cpp_extension' in sys.modules)\n"
    # a layer alive at exit dies during shutdown, after module globals are cleared
    "from eplb_graph import BatchFlags\n"
    "from eplb_graph.layer_lookup import LayerLookup, RoutedLayer\n"
    "alive_at_exit = RoutedLayer('fresh.exit', LayerLookup(2, 3), BatchFlags())\n"
)


def _exited_quietly(done: subprocess.CompletedProcess) -> bool:
    return done.returncode == 0 and "Exception ignored" not in done.stderr and "Traceback" not in done.stderr


def test_switched_off_the_numba_kernel_serves_cpu_calls():
    done = _fresh_interpreter(FOLLOWS, **{native_routing.SWITCH: "0"})
    assert _exited_quietly(done), done.stderr[-3000:]
    assert done.stdout.split() == ["numba", "False"]


def test_a_failed_build_falls_back_to_numba_with_a_warning_naming_it(tmp_path):
    done = _fresh_interpreter(FOLLOWS, **{native_routing.CACHE_DIR: str(tmp_path), "CXX": "/bin/false",
                                          native_routing.SWITCH: "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[0] == "numba"
    assert "the C++ routing kernel could not be built or loaded" in done.stderr


@native_only
def test_a_process_that_finds_the_kernel_built_loads_it_without_build_machinery_and_exits_quietly():
    done = _fresh_interpreter(FOLLOWS)
    assert _exited_quietly(done), done.stderr[-3000:]
    assert done.stdout.split() == ["native", "False"]  # vLLM's workers import this at start
