"""Registers the ``eplb_graph`` ops with torch.library on import.

    torch.ops.eplb_graph.map_to_physical(topk_ids, lookup, replica_count) -> physical_ids
    torch.ops.eplb_graph.record_load(physical_ids, load, record_enabled, num_unpadded_tokens)
    torch.ops.eplb_graph.map_and_record(topk_ids, lookup, replica_count, load,
                                        record_enabled, num_unpadded_tokens) -> physical_ids
    torch.ops.eplb_graph.map_and_record_layer(topk_ids, layer: str) -> physical_ids
        (what the FX pass inserts: map_and_record on the named layer's live tables,
         see layer_routing.py)
    torch.ops.eplb_graph.ep_all_gather / ep_local_slots / ep_sum_own_rows(..., group: str)
        (EP collectives over the named elastic group as it is now, see ep_collectives.py)
    torch.ops.eplb_graph.local_expert_pairs(hidden_states, topk_weights, topk_ids, expert_map,
                                            weights, layer: str) -> output
        (the named layer's experts over the pairs routed to this rank's slots only, CPU;
         see local_experts.py; its compaction and combine are C++ where the routing ops are)

Kernels per dispatch key:
  CPU          C++ (csrc/routing.cpp, built once per machine by native_routing.py) where it can
               be built, else the torch composite (custom_ops/routing.py); CPU_LAYER_KERNEL
               says which
  CUDA         one Triton launch where Triton imports, else the torch composite (CUDA_KERNEL says which)
  PrivateUse1  torch composite (torch_npu implements the aten ops it uses); torch_npu is
               never imported here -- the registration is inert until an NPU backend exists
  Meta/fake    shapes only
"""

from __future__ import annotations

import importlib.util

import torch

from . import ep_collectives, layer_routing, local_experts, native_routing, routing
from .ep_collectives import EP_GROUPS, EpGroupRegistry
from .layer_routing import LAYER_TABLES, LayerTableRegistry
from .local_experts import LOCAL_EXPERTS, LocalExpertsRegistry

NAMESPACE = "eplb_graph"


def _triton_kernels():
    """(the Triton routing module, "triton"), or (None, why the CUDA kernel is the composite).
    Where Triton is installed but broken, the ops still register, and the reason is kept in
    ``CUDA_KERNEL`` for reports to name: a composite serving on a GPU is a different figure."""
    if importlib.util.find_spec("triton") is None:
        return None, "composite (Triton is not installed)"
    try:
        from . import triton_routing
    except Exception as error:  # an ImportError, or a Triton built for another torch
        return None, f"composite (Triton failed to import: {type(error).__name__}: {error})"
    return triton_routing, "triton"


def _register(lib: torch.library.Library) -> tuple[str, str, str]:
    """Defines and implements the ops; returns which kernel serves them on CPU ("native" or
    "composite"), why not the native one (or ""), and which kernel serves them on CUDA."""
    lib.define(routing.MAP_TO_PHYSICAL_SCHEMA)
    lib.define(routing.RECORD_LOAD_SCHEMA)
    lib.define(routing.MAP_AND_RECORD_SCHEMA)

    composite = {
        "map_to_physical": routing.map_to_physical_kernel,
        "record_load": routing.record_load_kernel,
        "map_and_record": routing.map_and_record_kernel,
    }
    composite_layer_kernel = layer_routing.on_tables(routing.map_and_record_composite)
    cuda, cuda_layer_kernel = dict(composite), composite_layer_kernel
    triton_routing, cuda_kernel_name = _triton_kernels()
    if triton_routing is not None:
        cuda_layer_kernel = layer_routing.on_tables(triton_routing.map_and_record_cuda)
        cuda["map_to_physical"] = routing.checked_map_to_physical(triton_routing.map_to_physical_cuda)
        cuda["map_and_record"] = routing.checked_map_and_record(triton_routing.map_and_record_cuda)

    native, native_why = native_routing.load_native_kernel()  # registers its own CPU kernels on load
    for name in composite:
        if native is None:
            lib.impl(name, composite[name], "CPU")
        lib.impl(name, cuda[name], "CUDA")
        lib.impl(name, composite[name], "PrivateUse1")

    torch.library.register_fake(f"{NAMESPACE}::map_to_physical", routing.map_to_physical_fake, lib=lib)
    torch.library.register_fake(f"{NAMESPACE}::record_load", routing.record_load_fake, lib=lib)
    torch.library.register_fake(f"{NAMESPACE}::map_and_record", routing.map_and_record_fake, lib=lib)
    layer_routing.register(lib, None if native is not None else composite_layer_kernel, cuda_layer_kernel)
    ep_collectives.register(lib, NAMESPACE)
    local_experts.register(lib)
    if native is None:
        return "composite", native_why, cuda_kernel_name
    LAYER_TABLES.attach_native(native)
    LOCAL_EXPERTS.passes.attach_native()
    return "native", "", cuda_kernel_name


def _already_registered() -> bool:
    # A second import under another module name (e.g. an editable and an installed copy)
    # must not redefine the schemas: torch.library refuses a duplicate definition.
    return hasattr(torch.ops, NAMESPACE) and hasattr(getattr(torch.ops, NAMESPACE), "map_and_record_layer")


# The Library object owns the registrations: they live exactly as long as it does, so it
# is held for the life of the process, like every torch.library fragment.
_LIBRARY: torch.library.Library | None = None
# "native" (C++) or "composite": what a CPU call of the ops runs; and why not the native one.
CPU_LAYER_KERNEL = "registered by another copy of this module"
CPU_KERNEL_WHY = ""
# "triton", or "composite (why)": what a CUDA call of the ops runs.
CUDA_KERNEL = "registered by another copy of this module"
if not _already_registered():
    _LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
    CPU_LAYER_KERNEL, CPU_KERNEL_WHY, CUDA_KERNEL = _register(_LIBRARY)

map_to_physical = torch.ops.eplb_graph.map_to_physical
record_load = torch.ops.eplb_graph.record_load
map_and_record = torch.ops.eplb_graph.map_and_record
map_and_record_layer = torch.ops.eplb_graph.map_and_record_layer
local_expert_pairs = torch.ops.eplb_graph.local_expert_pairs

__all__ = [
    "CPU_LAYER_KERNEL",
    "CUDA_KERNEL",
    "EP_GROUPS",
    "EpGroupRegistry",
    "LAYER_TABLES",
    "LOCAL_EXPERTS",
    "LayerTableRegistry",
    "LocalExpertsRegistry",
    "NAMESPACE",
    "map_and_record",
    "map_and_record_layer",
    "local_expert_pairs",
    "map_to_physical",
    "record_load",
]
