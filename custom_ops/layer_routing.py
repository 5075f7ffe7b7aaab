"""``eplb_graph::map_and_record_layer(Tensor topk_ids, str layer) -> Tensor``: the op the FX pass inserts.

A pass cannot easily add new tensor inputs to a traced graph (a ``get_attr`` of a plain
tensor breaks fake-tensor propagation, a new placeholder needs Dynamo source metadata),
so, like vLLM's attention and ``moe_forward`` ops, the inserted op names its layer and
reads that layer's live tables at run time: lookup, replica count, load buffer and the
two batch flags. The graph holds a string, never a tensor, so nothing can be copied,
folded or frozen into it; a refresh in place is seen by the next call or replay.

Recording into the layer's load buffer is a side effect the schema cannot name (the
buffer is not an argument). That is safe here: the output is always consumed (the
experts read it), so the node is never dead, and no two routers share ids and key, so
it is never merged with another.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch

from . import routing

MAP_AND_RECORD_LAYER_SCHEMA = "map_and_record_layer(Tensor topk_ids, str layer) -> Tensor"


class RoutingTables(Protocol):
    """What the op needs from a layer: its live tables, in the order of map_and_record.

    A layer whose tensors change identity (a rebound load buffer) tells the registry with
    ``LAYER_TABLES.tables_changed(key)``; refreshes in place need no word.
    """

    def routing_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(lookup, replica_count, load, record_enabled, num_unpadded_tokens)."""
        ...


class NativeIndex(Protocol):
    """A C++ kernel's own copy of the index (native_routing.NativeLayerIndex)."""

    def bind(self, key: str, tensors: tuple[torch.Tensor, ...]) -> None: ...

    def unbind(self, key: str) -> None: ...

    def calls(self, key: str) -> int: ...


class LayerTableRegistry:
    """Layer key -> live layer, for the one op that reaches tables by name.

    Holds weak references: a layer whose owner (an ``EplbHandle``) is gone disappears,
    and a graph that still names it fails with a clear error instead of routing by
    stale tables. Where a C++ kernel serves the op it reads its own index of table
    tensors, which this registry keeps equal to its own: bound on ``register`` and
    ``tables_changed`` (validated there, before anything is stored), unbound when a
    layer is unregistered or dies.
    """

    def __init__(self) -> None:
        self._layers: dict[str, weakref.ReferenceType] = {}
        self._python_calls: dict[str, int] = {}  # calls the Python kernels routed, per key
        self._native: NativeIndex | None = None

    def attach_native(self, native: NativeIndex) -> None:
        """From now on ``native`` mirrors this registry (the layers live now included)."""
        for key, ref in self._layers.items():
            layer = ref()
            if layer is not None:
                native.bind(key, layer.routing_tensors())
        self._native = native

    def register(self, key: str, layer: RoutingTables) -> None:
        existing = self._layers.get(key)
        if existing is not None and existing() is not None and existing() is not layer:
            raise ValueError(f"EPLB layer key {key!r} is already registered to another layer")
        if self._native is not None:
            self._native.bind(key, layer.routing_tensors())
        self._layers[key] = weakref.ref(layer, lambda ref, key=key: self._forget(key, ref))

    def unregister(self, key: str) -> None:
        if self._layers.pop(key, None) is not None and self._native is not None:
            self._native.unbind(key)
        self._python_calls.pop(key, None)

    def _forget(self, key: str, ref: weakref.ReferenceType) -> None:
        """A layer died without ``unregister``: its key goes unless another layer holds it now."""
        if self._layers.get(key) is ref:
            self.unregister(key)

    def tables_changed(self, key: str) -> None:
        """The layer under ``key`` holds new tensors: the C++ index binds them (validated first)."""
        if self._native is not None and key in self:
            self._native.bind(key, self.resolve(key).routing_tensors())

    def resolve(self, key: str) -> RoutingTables:
        ref = self._layers.get(key)
        layer = ref() if ref is not None else None
        if layer is None:
            raise KeyError(
                f"no live EPLB layer named {key!r}: the graph was compiled for an EplbHandle that no "
                f"longer exists (known: {sorted(k for k, r in self._layers.items() if r() is not None)[:8]})"
            )
        return layer

    def resolve_for_call(self, key: str) -> RoutingTables:
        """``resolve``, counted as one call of a Python kernel."""
        layer = self.resolve(key)
        self._python_calls[key] = self._python_calls.get(key, 0) + 1
        return layer

    def calls(self, key: str) -> int:
        """Op calls that routed by the layer under ``key`` since it was registered, on any kernel
        (a replayed device graph makes none: the host does not see them)."""
        native = self._native.calls(key) if self._native is not None and key in self else 0
        return self._python_calls.get(key, 0) + native

    def live(self) -> list[RoutingTables]:
        """The layers registered now and still alive, in registration order."""
        return [layer for layer in (ref() for ref in self._layers.values()) if layer is not None]

    def __contains__(self, key: str) -> bool:
        ref = self._layers.get(key)
        return ref is not None and ref() is not None


# The op implementation must find layers from a string, so the index is process-wide,
# exactly as the op registrations themselves are.
LAYER_TABLES = LayerTableRegistry()


def on_tables(map_and_record_impl):
    """A layer kernel from a device's unchecked map_and_record over table tensors."""

    def layer_kernel(topk_ids: torch.Tensor, layer: RoutingTables) -> torch.Tensor:
        return map_and_record_impl(topk_ids, *layer.routing_tensors())

    return layer_kernel


def python_op_kernel(layer_kernel):
    """The op's kernel in Python over ``layer_kernel(topk_ids, layer)``: map_and_record on
    that live layer's tables. The tables are the layer's own (LayerLookup creates them typed
    and validates a rebound load buffer), so the hot path checks only the ids the caller passes."""

    def kernel(topk_ids: torch.Tensor, layer: str) -> torch.Tensor:
        routing.check_ids(topk_ids)
        return layer_kernel(topk_ids, LAYER_TABLES.resolve_for_call(layer))

    return kernel


def map_and_record_layer_fake(topk_ids: torch.Tensor, layer: str) -> torch.Tensor:
    routing.check_ids(topk_ids)
    if layer not in LAYER_TABLES:  # fail when the graph is built, not at the first replay
        LAYER_TABLES.resolve(layer)
    return torch.empty_like(topk_ids)


def register(lib: torch.library.Library, cpu_layer_kernel, cuda_layer_kernel) -> None:
    """Registers the op over per-device layer kernels (``on_tables`` makes one from the
    table-taking op's implementation, without its table checks). ``cpu_layer_kernel`` None:
    a C++ kernel registers itself for CPU (native_routing.py)."""
    lib.define(MAP_AND_RECORD_LAYER_SCHEMA)
    if cpu_layer_kernel is not None:
        lib.impl("map_and_record_layer", python_op_kernel(cpu_layer_kernel), "CPU")
    lib.impl("map_and_record_layer", python_op_kernel(cuda_layer_kernel), "CUDA")
    lib.impl("map_and_record_layer", python_op_kernel(on_tables(routing.map_and_record_composite)), "PrivateUse1")
    torch.library.register_fake("eplb_graph::map_and_record_layer", map_and_record_layer_fake, lib=lib)
