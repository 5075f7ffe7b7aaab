"""``eplb_graph::local_expert_pairs``: a rank's experts over the (token, k) pairs routed to its own slots.

Under expert parallel every rank sees top-k ids in the global physical space; a rank holds the
slots its ``expert_map`` ([num_physical], local slot or -1) names. A kernel that ignores the map
(vLLM's CPU fused-MoE kernels) either crashes on a foreign id or, given a remap that sends
foreign pairs to a local expert with weight 0, still computes every pair on every rank -- so a
hot rank could never be relieved by moving experts off it. This op computes exactly the pairs
that are local: it compacts them into rows of top-1 work ([P, H] inputs, [P, 1] ids and weights),
runs the layer's own kernel on those, and sums each row back into its token.

The compaction has a data-dependent size, so it lives inside this opaque op (invariant 9: the
traced graph sees one op with the shape of ``hidden_states``, no host sync, no dynamic shape);
expert selection stays where it was (invariant 2): the op consumes the physical ids the routing
op produced. Like ``map_and_record_layer``, the op names its layer and finds the layer's kernel
at run time (``LOCAL_EXPERTS``); the expert weights it hands that kernel are passed in
``weights``, so the graph states what it depends on (a quantized kernel's scales and zero points
are its own state, moved with the weights: ``expert_views``).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from .routing import check_ids

LOCAL_EXPERT_PAIRS_SCHEMA = (
    "local_expert_pairs(Tensor hidden_states, Tensor topk_weights, Tensor topk_ids, Tensor expert_map, "
    "Tensor[] weights, str layer) -> Tensor"
)


class PairKernel(Protocol):
    """A layer's experts over top-1 rows: ``[P, H]`` inputs, ``[P, 1]`` local slots and weights,
    ``weights`` as the op received them; returns each row's weighted expert output ``[P, H]``."""

    def run_pairs(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor,
                  weights: list[torch.Tensor]) -> torch.Tensor: ...


@dataclass
class PairCounts:
    """What one layer's calls did since it was registered."""

    calls: int = 0
    pairs: int = 0  # (token, k) pairs its kernel computed: this rank's own
    seen: int = 0  # (token, k) pairs its calls received, routed to any rank
    seconds: float = 0.0  # its kernel's time (a CPU kernel: the host clock sees all of it)


class LocalExpertsRegistry:
    """Layer key -> its live ``PairKernel`` (weakly held: a graph naming a dead layer fails by name)
    and its ``PairCounts``, so a caller can prove foreign pairs cost nothing and see what a rank's
    share of the experts costs it."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[weakref.ReferenceType, PairCounts]] = {}
        self.passes = PairPasses()  # the compaction and combine every layer's call runs

    def register(self, key: str, kernel: PairKernel) -> None:
        existing = self._entries.get(key)
        if existing is not None and existing[0]() is not None and existing[0]() is not kernel:
            raise ValueError(f"local experts of layer {key!r} are already registered")
        self._entries[key] = (weakref.ref(kernel), PairCounts())

    def unregister(self, key: str) -> None:
        self._entries.pop(key, None)

    def resolve(self, key: str) -> tuple[PairKernel, PairCounts]:
        ref, counts = self._entries.get(key, (None, None))
        kernel = ref() if ref is not None else None
        if kernel is None:
            raise KeyError(f"no live local experts named {key!r} (known: {sorted(self._entries)[:8]})")
        return kernel, counts

    def counts(self, key: str) -> PairCounts:
        """The layer's counts (zeros for a key never registered)."""
        entry = self._entries.get(key)
        return entry[1] if entry is not None else PairCounts()

    def __contains__(self, key: str) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry[0]() is not None

    @contextmanager
    def serving_with(self, passes: PairPasses) -> Iterator[None]:
        """Every call of the op runs ``passes`` for the body of the ``with``, then those before
        (a benchmark's arm with the torch composite where the C++ serves)."""
        served, self.passes = self.passes, passes
        try:
            yield
        finally:
            self.passes = served


def check_pair_args(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    expert_map: torch.Tensor) -> None:
    check_ids(topk_ids)
    if hidden_states.dim() != 2 or hidden_states.shape[0] != topk_ids.shape[0]:
        raise RuntimeError(f"hidden_states must be [T, H] with T = {topk_ids.shape[0]} (topk_ids' rows), "
                           f"got {tuple(hidden_states.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise RuntimeError(f"topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}")
    if expert_map.dim() != 1 or expert_map.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(f"expert_map must be [num_physical] int32/int64, got {tuple(expert_map.shape)} "
                           f"{expert_map.dtype}")


def local_pairs(topk_ids: torch.Tensor, expert_map: torch.Tensor) -> torch.Tensor:
    """[T, K] physical ids -> this rank's local slot of each, or -1: held elsewhere, or an id
    out of range (the routing ops' -1 for an unknown logical expert included)."""
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < expert_map.numel())
    return torch.where(valid, expert_map[ids.clamp(0, expert_map.numel() - 1)].long(), -1)


def compact_pairs(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  expert_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The local pairs as top-1 rows, token-major: (rows [P, H], weights [P, 1], local slots [P, 1]
    in ``topk_ids``' dtype, owning token [P] int64). The torch composite of the C++
    ``local_pairs_compact`` (csrc/local_pairs.cpp)."""
    local = local_pairs(topk_ids, expert_map)  # [T, K]
    token, slot = (local >= 0).nonzero(as_tuple=True)  # [P], [P]
    return (hidden_states.index_select(0, token), topk_weights[token, slot].unsqueeze(1),
            local[token, slot].unsqueeze(1).to(topk_ids.dtype), token)


def combine_rows(rows: torch.Tensor, row_tokens: torch.Tensor, tokens: int) -> torch.Tensor:
    """[P, H] rows -> [T, H]: each token's rows summed in float32 and the sum rounded once to the
    rows' dtype (zeros for a token without rows). The torch composite of ``local_pairs_combine``."""
    total = rows.new_zeros((tokens, rows.shape[1]), dtype=torch.float32)  # [T, H]
    return total.index_add_(0, row_tokens, rows.float()).to(rows.dtype)


class PairPasses:
    """The passes around a layer's kernel: the torch composite, or the C++ kernels where they are
    built (``attach_native``), which do the same in one call each."""

    def __init__(self) -> None:
        self.compact, self.combine, self.kind = compact_pairs, combine_rows, "composite"

    def attach_native(self) -> None:
        native = torch.ops.eplb_graph_native
        self.compact, self.combine, self.kind = native.local_pairs_compact, native.local_pairs_combine, "native"


# The op finds kernels from a string, so the index is process-wide, as the registrations are.
LOCAL_EXPERTS = LocalExpertsRegistry()


def local_expert_pairs_kernel(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                              expert_map: torch.Tensor, weights: list[torch.Tensor], layer: str) -> torch.Tensor:
    check_pair_args(hidden_states, topk_weights, topk_ids, expert_map)
    kernel, counts = LOCAL_EXPERTS.resolve(layer)
    passes = LOCAL_EXPERTS.passes
    rows, row_weights, row_ids, row_tokens = passes.compact(hidden_states, topk_weights, topk_ids, expert_map)
    counts.calls += 1
    counts.seen += topk_ids.numel()
    if row_tokens.numel() > 0:
        start = time.perf_counter()
        # each row comes back in the layer's dtype, rounded there by the kernel; the combine sums a
        # token's rows in float32 and rounds that sum once more to the layer's dtype
        rows = kernel.run_pairs(rows, row_weights, row_ids, weights)  # [P, H]
        counts.seconds += time.perf_counter() - start
        counts.pairs += row_tokens.numel()
    return passes.combine(rows, row_tokens, hidden_states.shape[0])  # [T, H]


def local_expert_pairs_fake(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                            expert_map: torch.Tensor, weights: list[torch.Tensor], layer: str) -> torch.Tensor:
    check_pair_args(hidden_states, topk_weights, topk_ids, expert_map)
    if layer not in LOCAL_EXPERTS:  # fail when the graph is built, not at its first run
        LOCAL_EXPERTS.resolve(layer)
    return hidden_states.new_empty(hidden_states.shape)  # contiguous, as the kernel's result is


def register(lib: torch.library.Library) -> None:
    """CPU only: device kernels (CUDA's, Ascend's) honour the expert map themselves, and this
    op's compaction would sync a device with its host."""
    lib.define(LOCAL_EXPERT_PAIRS_SCHEMA)
    lib.impl("local_expert_pairs", local_expert_pairs_kernel, "CPU")
    torch.library.register_fake("eplb_graph::local_expert_pairs", local_expert_pairs_fake, lib=lib)
