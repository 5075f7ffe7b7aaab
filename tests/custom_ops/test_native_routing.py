"""The C++ CPU kernels of the routing ops (custom_ops/csrc/routing.cpp), the index of layers the
layer op keeps, mirrored from LAYER_TABLES, and the torch composite that serves where they
cannot be had. test_routing_ops.py holds the table-taking ops to the Python reference and the
composite on whichever kernel serves; it is run here again with the C++ kernels switched off.

What these tests do not prove: that a machine without a C++ compiler gets the C++ kernels (it
gets the composite, tested here by making the build fail), or anything about CUDA tables
(the layer kernel refuses non-CPU tables; a meta-device layer stands in for them)."""

import gc
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_graph import BatchFlags
from eplb_graph.custom_ops import CPU_LAYER_KERNEL, LAYER_TABLES, layer_routing, native_routing, routing
from eplb_graph.core.layer_lookup import LayerLookup, RoutedLayer
from tests.custom_ops.routing_cases import ROUTING_CASES, check_layer_kernel_follows_its_tables, random_tables
from tests.routing_reference import map_to_physical_reference, record_load_reference

REPO_ROOT = Path(__file__).resolve().parents[2]
CAN_BUILD = (shutil.which(os.environ.get("CXX", "c++")) is not None and shutil.which("ninja") is not None
             and os.environ.get(native_routing.SWITCH) != "0")
native_only = pytest.mark.skipif(CPU_LAYER_KERNEL != "native", reason="the C++ kernel is not what serves CPU here")
op = torch.ops.eplb_graph.map_and_record_layer


@pytest.mark.skipif(not CAN_BUILD, reason="no C++ compiler or ninja on this machine, or the C++ kernel switched off")
def test_a_machine_that_can_build_routes_cpu_calls_through_cpp():
    assert CPU_LAYER_KERNEL == "native"
    assert native_routing.build_directory().joinpath(f"{native_routing.LIBRARY_NAME}.so").exists()


@native_only
@pytest.mark.parametrize("name", ["map_to_physical", "record_load", "map_and_record", "map_and_record_layer"])
def test_every_cpu_op_is_served_by_the_cpp_kernel(name):
    cpu = [line for line in torch._C._dispatch_dump(f"eplb_graph::{name}").splitlines() if line.startswith("CPU:")]
    assert len(cpu) == 1 and native_routing.SOURCE.name in cpu[0] and "unboxed" in cpu[0], cpu  # not a Python kernel


@native_only
@settings(max_examples=80, deadline=None)
@given(
    **ROUTING_CASES,
    load_dtype=st.sampled_from([torch.int32, torch.int64, torch.float32]),
    transposed=st.booleans(),
    flag_dtype=st.sampled_from([torch.bool, torch.int32]),
)
def test_the_cpp_layer_kernel_matches_the_reference_and_the_composite(
    num_logical, num_redundant_experts, num_tokens, top_k, num_unpadded, record, seed, id_dtype, load_dtype, transposed,
    flag_dtype,
):
    placement, _, _ = random_tables(num_logical, num_redundant_experts, seed)
    tables = LayerLookup(num_logical, num_logical + num_redundant_experts, placement=placement, load_dtype=load_dtype)
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

        composite_load = torch.zeros_like(tables.load)
        composite_physical = routing.map_and_record_composite(
            ids, tables.lookup, tables.replica_count, composite_load, flags.record_enabled, flags.num_unpadded_tokens)
        assert torch.equal(composite_physical, physical) and composite_load.tolist() == tables.load.tolist()
    finally:
        layer.close()


def _dtypes_on_the_cpu_key() -> list[torch.dtype]:
    """Every dtype a plain CPU tensor can have (quantized ones dispatch to QuantizedCPU)."""
    dtypes = {str(dtype): dtype for dtype in vars(torch).values() if isinstance(dtype, torch.dtype)}
    return [dtype for name, dtype in sorted(dtypes.items()) if not name.startswith("torch.q")]


@native_only
@pytest.mark.parametrize("dtype", _dtypes_on_the_cpu_key(), ids=str)
def test_the_cpp_kernels_name_every_dtype_as_the_composite_does(dtype):
    """Each argument checked for its dtype, given this one: the C++ kernel accepts it where the
    composite does, and refuses it where the composite does, in the composite's words."""
    lookup, replica_count = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    ids, load = torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2)
    record_enabled, num_unpadded = torch.ones((), dtype=torch.bool), torch.ones((), dtype=torch.int32)
    wrong = torch.zeros(2, 2, dtype=dtype)
    calls = [
        ("map_to_physical", (wrong, lookup, replica_count)),
        ("map_to_physical", (ids, wrong[:, :1], replica_count)),
        ("map_to_physical", (ids, lookup, wrong[:, 0])),
        ("record_load", (wrong, load, record_enabled, num_unpadded)),
        ("record_load", (ids, load, wrong[0, 0], num_unpadded)),
        ("record_load", (ids, load, record_enabled, wrong[0, 0])),
    ]

    def outcome(kernel, args) -> str:
        try:
            kernel(*args)
        except RuntimeError as error:
            return str(error).splitlines()[0]
        return "accepted"

    cpp = [outcome(getattr(torch.ops.eplb_graph, name), args) for name, args in calls]
    composite = [outcome(getattr(routing, f"{name}_kernel"), args) for name, args in calls]
    assert cpp == composite
    refused = [message for message in cpp if message != "accepted"]
    assert all(message.endswith(f"got {dtype}") for message in refused), refused
    assert len(refused) == {torch.int32: 0, torch.int64: 2, torch.bool: 5}.get(dtype, 6), refused


@native_only
def test_replica_counts_beyond_the_lookup_never_read_outside_it():
    """Table values are the caller's; the C++ kernels read only inside the tables whatever they hold."""
    lookup = torch.tensor([[5, 6], [7, 8]], dtype=torch.int32)[:1]  # a view: row 1 lies just past it
    replica_count = torch.tensor([1000], dtype=torch.int32)  # beyond the lookup's 2 columns
    ids = torch.zeros(64, 1, dtype=torch.int64)
    assert set(torch.ops.eplb_graph.map_to_physical(ids, lookup, replica_count).flatten().tolist()) == {5, 6}
    no_slots = torch.zeros(1, 0, dtype=torch.int32)
    assert torch.ops.eplb_graph.map_to_physical(ids, no_slots, replica_count).flatten().tolist() == [-1] * 64


def test_the_composite_behind_a_python_kernel_follows_its_layer_too():
    # what serves CPU calls where C++ cannot be built
    layer_kernel = layer_routing.python_op_kernel(layer_routing.on_tables(routing.map_and_record_composite))
    check_layer_kernel_follows_its_tables(layer_kernel, "composite.follow")


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
    "from eplb_graph.core.layer_lookup import LayerLookup, RoutedLayer\n"
    "alive_at_exit = RoutedLayer('fresh.exit', LayerLookup(2, 3), BatchFlags())\n"
)


def _exited_quietly(done: subprocess.CompletedProcess) -> bool:
    return done.returncode == 0 and "Exception ignored" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.launches
def test_switched_off_the_composite_serves_cpu_calls():
    done = _fresh_interpreter(FOLLOWS, **{native_routing.SWITCH: "0"})
    assert _exited_quietly(done), done.stderr[-3000:]
    assert done.stdout.split() == ["composite", "False"]


@pytest.mark.launches
def test_switched_off_the_composite_passes_every_registered_op_test():
    """test_routing_ops.py, whose ops the composite serves in that process (checked before it runs)."""
    code = ("import sys, pytest\n"
            "from eplb_graph.custom_ops import CPU_LAYER_KERNEL\n"
            "assert CPU_LAYER_KERNEL == 'composite', CPU_LAYER_KERNEL\n"
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/custom_ops/test_routing_ops.py']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                          env={**os.environ, native_routing.SWITCH: "0"})
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert re.match(r"\d+ passed", summary) and not re.search(r"failed|error", summary), summary


@pytest.mark.launches
def test_a_failed_build_falls_back_to_the_composite_with_a_warning_naming_it(tmp_path):
    done = _fresh_interpreter(FOLLOWS, **{native_routing.CACHE_DIR: str(tmp_path), "CXX": "/bin/false",
                                          native_routing.SWITCH: "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[0] == "composite"
    assert "the C++ kernels could not be built or loaded" in done.stderr
    assert "the torch composite serves the routing and local pairs ops on CPU" in done.stderr


@pytest.mark.launches
@native_only
def test_a_process_that_finds_the_kernel_built_loads_it_without_build_machinery_and_exits_quietly():
    done = _fresh_interpreter(FOLLOWS)
    assert _exited_quietly(done), done.stderr[-3000:]
    assert done.stdout.split() == ["native", "False"]  # vLLM's workers import this at start
