"""CPU kernel for the routing ops: one compiled loop instead of ~25 small torch ops.

The torch composite costs about 100 µs per call at decode sizes, almost all of it per-op
overhead; this numba loop does the same work in a few µs. Same semantics as
``routing.map_and_record_composite`` (tests hold both to the same Python reference): the
flags are read inside the kernel at every call, so nothing is frozen into a graph.
Compiled on first use and cached next to this file.
"""

from __future__ import annotations

import weakref

import numba
import numpy as np
import torch

from .layer_routing import RoutingTables
from .routing import HASH_MASK, KNUTH_MULTIPLIER


@numba.njit(cache=True, nogil=True)
def _map_and_record(ids, lookup, replica_count, physical, load, record_enabled, num_unpadded_tokens, record):
    num_tokens, top_k = ids.shape
    num_logical = lookup.shape[0]
    num_physical = load.shape[0]
    counting = record and record_enabled[0] != 0
    limit = num_unpadded_tokens[0]
    for t in range(num_tokens):
        replica_hash = (t * KNUTH_MULTIPLIER) & HASH_MASK
        for k in range(top_k):
            expert = ids[t, k]
            if expert < 0 or expert >= num_logical:
                physical[t, k] = -1
                continue
            count = max(replica_count[expert], 1)
            slot = lookup[expert, replica_hash % count]
            physical[t, k] = slot
            if counting and t < limit and 0 <= slot < num_physical:
                load[slot] += 1


@numba.njit(cache=True, nogil=True)
def _record(physical, load, record_enabled, num_unpadded_tokens):
    if record_enabled[0] == 0:
        return
    num_tokens, top_k = physical.shape
    num_physical = load.shape[0]
    for t in range(min(num_tokens, num_unpadded_tokens[0])):
        for k in range(top_k):
            slot = physical[t, k]
            if 0 <= slot < num_physical:
                load[slot] += 1


def _flag(tensor: torch.Tensor) -> np.ndarray:
    """A 1-element view of a flag tensor (bool or int): read inside the loop, never copied."""
    return tensor.reshape(1).numpy()


def map_and_record_cpu(topk_ids, lookup, replica_count, load, record_enabled, num_unpadded_tokens):
    physical = torch.empty_like(topk_ids)
    _map_and_record(
        topk_ids.detach().numpy(), lookup.numpy(), replica_count.numpy(), physical.numpy(), load.detach().numpy(),
        _flag(record_enabled), _flag(num_unpadded_tokens), True,
    )
    return physical


class LayerMapAndRecord:
    """``map_and_record_layer``'s CPU kernel: the numba loop over a named layer's live tables.

    Turning a tensor into a numpy view costs ~1 µs, seven of them per call most of the
    op's time, so the five table views are made once per layer and kept. They share the
    tensors' memory and the tables are refreshed in place, so a view sees every refresh;
    a table whose storage changes (a rebound load buffer) changes the fingerprint (data
    pointers) and the views are remade. Views die with their layer (weak keys).
    """

    def __init__(self) -> None:
        self._views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> (fingerprint, views)

    def table_views(self, layer: RoutingTables) -> tuple[np.ndarray, ...]:
        """(lookup, replica_count, load, record_enabled, num_unpadded_tokens) as numpy views."""
        tensors = layer.routing_tensors()
        fingerprint = [tensor.data_ptr() for tensor in tensors]
        cached = self._views.get(layer)
        if cached is None or cached[0] != fingerprint:
            lookup, replica_count, load, record_enabled, num_unpadded_tokens = tensors
            views = (lookup.numpy(), replica_count.numpy(), load.detach().numpy(), _flag(record_enabled),
                     _flag(num_unpadded_tokens))
            cached = (fingerprint, views)
            self._views[layer] = cached
        return cached[1]

    def __call__(self, topk_ids: torch.Tensor, layer: RoutingTables) -> torch.Tensor:
        lookup, replica_count, load, record_enabled, num_unpadded_tokens = self.table_views(layer)
        physical = torch.empty_like(topk_ids)  # [T, K]
        _map_and_record(
            topk_ids.detach().numpy(), lookup, replica_count, physical.numpy(), load, record_enabled,
            num_unpadded_tokens, True,
        )
        return physical


def map_to_physical_cpu(topk_ids, lookup, replica_count):
    physical = torch.empty_like(topk_ids)
    unused = np.zeros(1, dtype=np.int64)
    _map_and_record(
        topk_ids.detach().numpy(), lookup.numpy(), replica_count.numpy(), physical.numpy(),
        np.zeros(0, dtype=np.int64), unused, unused, False,
    )
    return physical


def record_load_cpu(physical_ids, load, record_enabled, num_unpadded_tokens):
    _record(
        physical_ids.detach().numpy(), load.detach().numpy(),
        _flag(record_enabled), _flag(num_unpadded_tokens),
    )
