"""Per-MoE-layer routing state with stable storage: the tables a captured graph reads.

A ``LayerLookup`` owns three device tensors that compiled and captured graphs hold by
address -- ``lookup``, ``replica_count`` and ``load`` -- and never replaces them.
``refresh_`` validates a new placement on the host first and only then copies it into
the same storage, so an invalid placement is never visible to routing (invariant 3:
the lookup changes only after a placement commits; the caller commits, then refreshes).
"""

from __future__ import annotations

import numpy as np
import torch

from eplb_graph.custom_ops import LAYER_TABLES

# Which batches record load: every batch, or only those of one phase.
LOAD_PHASES = ("all", "prefill", "decode")


def check_load_phase(phase: str) -> None:
    if phase not in LOAD_PHASES:
        raise ValueError(f"unknown load_phase {phase!r}; expected one of {', '.join(LOAD_PHASES)}")


def batch_in_load_phase(phase: str, is_prefill: bool) -> bool:
    """Decided once per batch; a batch with any prefill work is a prefill batch."""
    return phase == "all" or (phase == "prefill") == is_prefill


def check_expert_layout(num_logical: int, num_redundant: int, top_k: int, ranks: int) -> None:
    """Expert counts as a run, a stack or the demo is configured with: ValueError naming what is
    wrong, before any process or table exists."""
    if num_logical < 1:
        raise ValueError(f"experts must be >= 1, got {num_logical}")
    if num_redundant < 0:
        raise ValueError(f"redundant experts must be >= 0, got {num_redundant}")
    if not 0 < top_k <= num_logical:
        raise ValueError(f"top_k must be in [1, {num_logical}], got {top_k}")
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if (num_logical + num_redundant) % ranks:
        raise ValueError(f"{num_logical + num_redundant} physical experts do not divide over {ranks} ranks")


def initial_placement(num_logical_experts: int, num_redundant_experts: int) -> torch.Tensor:
    """[num_physical] int64: every logical expert once, then redundant slots round-robin.

    The same layout as upstream vLLM's ``build_initial_global_physical_to_logical_map``.
    """
    if num_logical_experts <= 0:
        raise ValueError(f"num_logical_experts must be positive, got {num_logical_experts}")
    if num_redundant_experts < 0:
        raise ValueError(f"num_redundant_experts must be >= 0, got {num_redundant_experts}")
    logical = torch.arange(num_logical_experts, dtype=torch.int64)
    redundant = torch.arange(num_redundant_experts, dtype=torch.int64) % num_logical_experts
    return torch.cat([logical, redundant])


def validate_placement(
    physical_to_logical: torch.Tensor,
    num_logical_experts: int,
    num_physical_experts: int,
    max_replicas: int,
) -> torch.Tensor:
    """Checks a placement and returns it as a CPU int64 tensor [num_physical].

    Raises ValueError naming the first problem found: wrong rank, dtype or length,
    logical ids out of range, a logical expert with no replica, or more replicas
    than the lookup has slots for. Runs at every layer commit, between two forwards:
    a few numpy reductions decide, and the message is worked out only for a bad one.
    """
    if not isinstance(physical_to_logical, torch.Tensor):
        physical_to_logical = torch.as_tensor(physical_to_logical)
    if physical_to_logical.dtype.is_floating_point or physical_to_logical.dtype.is_complex:
        raise ValueError(f"placement must hold integer logical ids, got dtype {physical_to_logical.dtype}")
    if physical_to_logical.dim() != 1:
        raise ValueError(f"placement must be 1-D [num_physical], got shape {tuple(physical_to_logical.shape)}")
    if physical_to_logical.numel() != num_physical_experts:
        raise ValueError(
            f"placement has {physical_to_logical.numel()} physical slots, expected {num_physical_experts}"
        )
    placement = physical_to_logical.detach().to("cpu", torch.int64)
    ids = placement.numpy()  # [num_physical], a view
    if ids.size and (ids.min() < 0 or ids.max() >= num_logical_experts):
        out_of_range = np.flatnonzero((ids < 0) | (ids >= num_logical_experts))
        slot = int(out_of_range[0])
        raise ValueError(
            f"placement slot {slot} holds logical id {int(ids[slot])}, outside "
            f"[0, {num_logical_experts}) ({out_of_range.size} bad slot(s))"
        )
    counts = np.bincount(ids, minlength=num_logical_experts)  # [num_logical]
    if counts.min() == 0:
        raise ValueError(f"logical experts {np.flatnonzero(counts == 0)[:8].tolist()} have no replica in the placement")
    if counts.max() > max_replicas:
        expert = int(np.argmax(counts > max_replicas))
        raise ValueError(
            f"logical expert {expert} has {int(counts[expert])} replicas, more than "
            f"max_replicas={max_replicas}"
        )
    return placement


def validate_layer_placements(placements: torch.Tensor, tables: list[LayerLookup]) -> None:
    """Checks a policy's [num_layers, num_physical] output against every layer's tables."""
    if placements.dim() != 2 or placements.shape[0] != len(tables):
        raise ValueError(f"policy returned placements of shape {tuple(placements.shape)}, expected {len(tables)} layers")
    for layer, placement in zip(tables, placements):
        validate_placement(placement, layer.num_logical_experts, layer.num_physical_experts, layer.max_replicas)


def logical_maps(
    physical_to_logical: torch.Tensor, num_logical_experts: int, *, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverts placements: the physical slots of each logical expert, vectorized.

    The contract of upstream vLLM's ``eplb_state.compute_logical_maps`` (which loops over the
    physical slots in Python: ~8 ms per layer at 256 + 32 experts, on the main thread at every
    layer commit), so it can stand in for it:

    Args:
        physical_to_logical: [num_physical] or [num_layers, num_physical] integer CPU tensor;
            -1 marks an empty slot (elastic scale-up) and is skipped.
        num_logical_experts: N.
        width: pad each expert's row to this many slots (ValueError if one has more
            replicas); None, as upstream: to the largest replica count present.

    Returns (same dtype as the input, the layer dim only if the input had one):
        logical_to_physical: [num_layers, N, width] slots of each expert in ascending order,
            -1 padded.
        replica_count: [num_layers, N].
    """
    if physical_to_logical.device.type != "cpu":
        raise ValueError(f"placements are inverted on the host, got a tensor on {physical_to_logical.device}")
    if physical_to_logical.dtype.is_floating_point or physical_to_logical.dtype.is_complex:
        raise ValueError(f"placements must hold integer logical ids, got dtype {physical_to_logical.dtype}")
    per_layer = physical_to_logical.dim() == 1
    placements = physical_to_logical.unsqueeze(0) if per_layer else physical_to_logical  # [L, P]
    if placements.dim() != 2:
        shape = tuple(physical_to_logical.shape)
        raise ValueError(f"placements must be [num_physical] or [num_layers, num_physical], got {shape}")
    ids = placements.numpy()  # numpy: a handful of calls on ~100 ids, where torch's per-op cost would dominate
    if ids.size and ids.max() >= num_logical_experts:
        raise ValueError(f"placement holds logical id {int(ids.max())}, outside [-1, {num_logical_experts})")
    num_layers, num_physical = ids.shape
    # Each slot gets a group: its logical id, or N for an empty slot (written like the others --
    # every index stays in range, no mask -- and dropped at the end). Layer l's groups are
    # offset by l * (N + 1), so one stable sort of the flat groups orders every layer's slots
    # by logical id, ascending slot order within an id.
    group_width = num_logical_experts + 1
    groups = np.where(ids >= 0, ids, num_logical_experts)  # [L, P]
    if num_layers > 1:
        groups = groups + np.arange(0, num_layers * group_width, group_width)[:, None]
    groups = groups.ravel()  # [L * P]
    slots = np.argsort(groups, kind="stable")  # [L * P] flat slot indices, grouped
    sorted_groups = groups[slots]  # [L * P]
    counts = np.bincount(sorted_groups, minlength=num_layers * group_width)  # [L * (N + 1)]
    rank_in_group = np.arange(slots.size) - (np.cumsum(counts) - counts)[sorted_groups]  # [L * P]
    counts = counts.reshape(num_layers, group_width)  # [L, N + 1]
    replica_count = counts[:, :num_logical_experts]  # [L, N]
    max_replicas = int(replica_count.max()) if replica_count.size else 0
    if width is None:
        width = max_replicas
    elif max_replicas > width:
        raise ValueError(f"a logical expert has {max_replicas} replicas, more than width={width}")
    grouped = np.full((num_layers * group_width, max(width, int(counts.max()))), -1, dtype=ids.dtype)
    grouped[sorted_groups, rank_in_group] = slots % num_physical  # flat slot -> slot within its layer
    grouped = grouped.reshape(num_layers, group_width, -1)[:, :num_logical_experts, :width]  # [L, N, width]
    replica_count = replica_count.astype(ids.dtype)  # [L, N], the input's dtype
    if per_layer:  # the layer dim dropped in numpy: a torch squeeze is a dispatcher call (~4 us here)
        grouped, replica_count = grouped[0], replica_count[0]
    return torch.from_numpy(np.ascontiguousarray(grouped)), torch.from_numpy(replica_count)


def build_lookup(
    placement: torch.Tensor, num_logical_experts: int, max_replicas: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Derives the routing tables from a *validated* CPU placement [num_physical].

    Returns:
        lookup: [num_logical, max_replicas] int32, physical slots of each logical expert
            in ascending order (upstream's order), -1 padded.
        replica_count: [num_logical] int32.
    """
    return logical_maps(placement.to(torch.int32), num_logical_experts, width=max_replicas)


class BatchFlags:
    """The two per-batch device scalars every layer's recording reads.

    Filled between forwards with ``set_``; a captured graph reads their current values
    (a Python int would be frozen into it). One object is shared by all layers.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._hold(torch.ones((), dtype=torch.bool, device=device), torch.zeros((), dtype=torch.int64, device=device))

    @classmethod
    def sharing(cls, record_enabled: torch.Tensor, num_unpadded_tokens: torch.Tensor) -> BatchFlags:
        """Flags backed by tensors someone else fills (upstream vLLM's ``EplbState``)."""
        for name, flag in (("record_enabled", record_enabled), ("num_unpadded_tokens", num_unpadded_tokens)):
            if flag.numel() != 1:
                raise ValueError(f"{name} must be a 1-element tensor, got shape {tuple(flag.shape)}")
        if record_enabled.device != num_unpadded_tokens.device:
            raise ValueError(f"flags on different devices: {record_enabled.device} and {num_unpadded_tokens.device}")
        flags = cls.__new__(cls)
        flags._hold(record_enabled, num_unpadded_tokens)
        return flags

    def _hold(self, record_enabled: torch.Tensor, num_unpadded_tokens: torch.Tensor) -> None:
        self.record_enabled = record_enabled
        self.num_unpadded_tokens = num_unpadded_tokens
        # On the host, set_ writes through numpy views of the flags' own storage: a fill_ is
        # a dispatcher call, ~3-4 us each right after a compiled step, paid every step.
        self._host_views = None
        if record_enabled.device.type == "cpu":
            self._host_views = tuple(flag.detach().numpy().reshape(()) for flag in (record_enabled, num_unpadded_tokens))

    def set_(self, *, record: bool, num_unpadded_tokens: int) -> None:
        if num_unpadded_tokens < 0:
            raise ValueError(f"num_unpadded_tokens must be >= 0, got {num_unpadded_tokens}")
        if self._host_views is not None:
            record_view, tokens_view = self._host_views
            tokens_view[()] = int(num_unpadded_tokens)  # first: one too large for the flag's dtype fails here
            record_view[()] = bool(record)
            return
        self.record_enabled.fill_(bool(record))
        self.num_unpadded_tokens.fill_(int(num_unpadded_tokens))


class LayerLookup:
    """Routing tables and load buffer of one MoE layer.

    lookup:         [num_logical, max_replicas] int32, -1 padded
    replica_count:  [num_logical] int32
    load:           [num_physical] executed tokens per physical expert since last reset
    physical_to_logical: [num_physical] int64 on the host, the placement now routed by

    ``max_replicas`` defaults to num_redundant + 1, the most one expert can ever have
    (upstream pads every layer to 1024 slots; a tight table keeps the gather small).
    """

    def __init__(
        self,
        num_logical_experts: int,
        num_physical_experts: int,
        *,
        max_replicas: int | None = None,
        placement: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        load_dtype: torch.dtype = torch.int64,
    ) -> None:
        num_redundant = num_physical_experts - num_logical_experts
        if num_logical_experts <= 0 or num_redundant < 0:
            raise ValueError(
                f"need 0 < num_logical_experts <= num_physical_experts, got "
                f"{num_logical_experts} and {num_physical_experts}"
            )
        if max_replicas is None:
            max_replicas = num_redundant + 1
        if not 1 <= max_replicas:
            raise ValueError(f"max_replicas must be >= 1, got {max_replicas}")
        self.num_logical_experts = num_logical_experts
        self.num_physical_experts = num_physical_experts
        self.max_replicas = max_replicas
        self.lookup = torch.full((num_logical_experts, max_replicas), -1, dtype=torch.int32, device=device)
        self.replica_count = torch.zeros(num_logical_experts, dtype=torch.int32, device=device)
        self.load = torch.zeros(num_physical_experts, dtype=load_dtype, device=device)
        self.physical_to_logical = torch.empty(num_physical_experts, dtype=torch.int64)
        self.routed_as: set[str] = set()  # keys of the RoutedLayers over these tables
        self.refresh_(initial_placement(num_logical_experts, num_redundant) if placement is None else placement)

    @property
    def device(self) -> torch.device:
        return self.lookup.device

    def refresh_(self, physical_to_logical: torch.Tensor) -> None:
        """Routes by a new placement from now on, writing into the existing tensors.

        Validation and table building happen on the host before any live byte changes;
        on error nothing is modified.
        """
        placement = validate_placement(
            physical_to_logical, self.num_logical_experts, self.num_physical_experts, self.max_replicas
        )
        lookup, replica_count = build_lookup(placement, self.num_logical_experts, self.max_replicas)
        self.lookup.copy_(lookup)
        self.replica_count.copy_(replica_count)
        self.physical_to_logical.copy_(placement)

    def bind_load_(self, load: torch.Tensor) -> None:
        """Records into ``load`` from now on (e.g. a row of upstream's ``expert_load_pass``).

        For set-up, before graphs are captured: a graph that holds the old buffer by
        address would keep recording there. Graphs built by the EPLB pass resolve the
        layer by name and follow the new buffer.
        """
        if load.dim() != 1 or load.shape[0] != self.num_physical_experts or not load.is_contiguous():
            raise ValueError(
                f"load must be a contiguous [{self.num_physical_experts}] tensor, got {tuple(load.shape)}"
            )
        if load.device != self.device:
            raise ValueError(f"load lives on {load.device}, the lookup on {self.device}")
        previous, self.load = self.load, load
        try:
            self._announce_new_tensors()
        except Exception:
            self.load = previous  # a buffer the kernel refuses is not bound anywhere
            self._announce_new_tensors()
            raise

    def _announce_new_tensors(self) -> None:
        # The C++ kernel's index holds tensors, not this object: it must be told.
        for key in self.routed_as:
            LAYER_TABLES.tables_changed(key)

    def reset_load_(self) -> None:
        self.load.zero_()

    def logical_load(self) -> torch.Tensor:
        """[num_logical] the recorded load folded back onto logical experts (host)."""
        load = self.load.detach().to("cpu", torch.int64)
        return torch.zeros(self.num_logical_experts, dtype=torch.int64).index_add_(
            0, self.physical_to_logical, load
        )

    def __repr__(self) -> str:
        return (
            f"LayerLookup(num_logical={self.num_logical_experts}, num_physical={self.num_physical_experts}, "
            f"max_replicas={self.max_replicas}, device={self.device})"
        )


class RoutedLayer:
    """A MoE layer the routing op reaches by name: its tables and the batch flags it shares.

    Registered in ``LAYER_TABLES`` for as long as it lives (weakly) or until ``close``.
    """

    def __init__(self, key: str, tables: LayerLookup, flags: BatchFlags) -> None:
        self.key = key
        self.tables = tables
        self.flags = flags
        LAYER_TABLES.register(key, self)
        tables.routed_as.add(key)

    @property
    def lookup(self) -> torch.Tensor:
        return self.tables.lookup

    @property
    def replica_count(self) -> torch.Tensor:
        return self.tables.replica_count

    @property
    def load(self) -> torch.Tensor:
        return self.tables.load

    def routing_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What map_and_record_layer reads, in map_and_record's argument order."""
        t = self.tables
        return t.lookup, t.replica_count, t.load, self.flags.record_enabled, self.flags.num_unpadded_tokens

    def close(self) -> None:
        LAYER_TABLES.unregister(self.key)
        self.tables.routed_as.discard(self.key)
