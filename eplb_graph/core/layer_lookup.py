"""Per-MoE-layer routing state with stable storage: the tables a captured graph reads.

A ``LayerLookup`` owns three device tensors that compiled and captured graphs hold by
address -- ``lookup``, ``replica_count`` and ``load`` -- and never replaces them.
``refresh_`` validates a new placement on the host first and only then copies it into
the same storage, so an invalid placement is never visible to routing (invariant 3:
the lookup changes only after a placement commits; the caller commits, then refreshes).
"""

from __future__ import annotations

import torch

from eplb_graph.custom_ops import LAYER_TABLES
from eplb_graph.core.placement import build_lookup, initial_placement, validate_placement

# Which batches record load: every batch, or only those of one phase.
LOAD_PHASES = ("all", "prefill", "decode")


def check_load_phase(phase: str) -> None:
    if phase not in LOAD_PHASES:
        raise ValueError(f"unknown load_phase {phase!r}; expected one of {', '.join(LOAD_PHASES)}")


def batch_in_load_phase(phase: str, is_prefill: bool) -> bool:
    """Decided once per batch; a batch with any prefill work is a prefill batch."""
    return phase == "all" or (phase == "prefill") == is_prefill


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
        self.record_enabled = record_enabled  # [] or [1] bool: this batch records load
        self.num_unpadded_tokens = num_unpadded_tokens  # [] or [1] int: tokens before the padding
        # On the host, set_ writes through numpy views of the flags' own storage: a fill_ is a
        # dispatcher call, paid every step (bench_op_in_step.py times such calls after a step).
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

    ``max_replicas`` defaults to num_redundant_experts + 1, the most one expert can ever have
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
        allow_empty_slots: bool = False,
    ) -> None:
        num_redundant_experts = num_physical_experts - num_logical_experts
        if num_logical_experts <= 0 or num_redundant_experts < 0:
            raise ValueError(
                f"need 0 < num_logical_experts <= num_physical_experts, got "
                f"{num_logical_experts} and {num_physical_experts}"
            )
        if max_replicas is None:
            max_replicas = num_redundant_experts + 1
        if not 1 <= max_replicas:
            raise ValueError(f"max_replicas must be >= 1, got {max_replicas}")
        self.num_logical_experts = num_logical_experts
        self.num_physical_experts = num_physical_experts
        self.max_replicas = max_replicas
        self.allow_empty_slots = allow_empty_slots  # -1 slots: an elastic group's absent ranks
        # [num_logical, max_replicas] int32: each expert's physical slots, -1 padded
        self.lookup = torch.full((num_logical_experts, max_replicas), -1, dtype=torch.int32, device=device)
        # [num_logical] int32: how many of a row's slots are real
        self.replica_count = torch.zeros(num_logical_experts, dtype=torch.int32, device=device)
        # [num_physical] load_dtype: executed (token, k) pairs per physical slot since the last reset
        self.load = torch.zeros(num_physical_experts, dtype=load_dtype, device=device)
        # [num_physical] int64, host: the placement routed by now (-1: an empty slot)
        self.physical_to_logical = torch.empty(num_physical_experts, dtype=torch.int64)
        self.routed_as: set[str] = set()  # keys of the RoutedLayers over these tables
        self.refresh_(initial_placement(num_logical_experts, num_redundant_experts) if placement is None else placement)

    @property
    def device(self) -> torch.device:
        return self.lookup.device

    def refresh_(self, physical_to_logical: torch.Tensor) -> None:
        """Routes by a new placement from now on, writing into the existing tensors.

        Validation and table building happen on the host before any live byte changes;
        on error nothing is modified.
        """
        placement = validate_placement(
            physical_to_logical, self.num_logical_experts, self.num_physical_experts, self.max_replicas,
            allow_empty=self.allow_empty_slots,
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
        hosted = self.physical_to_logical >= 0  # empty slots (elastic) route nothing
        return torch.zeros(self.num_logical_experts, dtype=torch.int64).index_add_(
            0, self.physical_to_logical[hosted], load[hosted]
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

    def commit_placement_(self, placement: torch.Tensor) -> bool:
        """Routes by a committed placement [num_physical] from now on (upstream's commit
        point calls it between its commit and the staging ack); returns whether it changed."""
        before = self.tables.physical_to_logical.clone()
        self.tables.refresh_(placement)
        return not torch.equal(before, self.tables.physical_to_logical)

    def routing_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What map_and_record_layer reads, in map_and_record's argument order."""
        t = self.tables
        return t.lookup, t.replica_count, t.load, self.flags.record_enabled, self.flags.num_unpadded_tokens

    def close(self) -> None:
        LAYER_TABLES.unregister(self.key)
        self.tables.routed_as.discard(self.key)
