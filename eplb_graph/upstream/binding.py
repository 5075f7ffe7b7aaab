"""The one binding between our layers and upstream vLLM's ``EplbState``.

Upstream owns the placement (invariant 1), the window, the policy and the async worker; this
object owns only the boundaries, the same for our runtime's controller and for the vLLM
plugin's worker:

* it installs the capability adaptations before the caller builds ``EplbState`` (which constructs
  events and starts the worker), and takes it back on ``close``;
* each placement upstream's policy returns is checked against the bound layers' tables before
  any byte moves; an invalid one is replaced by the current placement and reported;
* at each of upstream's commit points, every committed layer routes by upstream's committed
  placement from then on (``commit_placement_``), after upstream commits it and before it
  acknowledges the staging buffer (invariants 3 and 6);
* it counts what committed, and surfaces a dead async worker (upstream's only logs it) and a
  stalled one (``watchdog.StallWatchdog``: in flight too long with no layer committed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from eplb_graph.core.layer_lookup import LayerLookup
from eplb_graph.core.placement import validate_layer_placements
from eplb_graph.upstream.capability import CapabilityAdaptations, ends_rearrangement
from eplb_graph.upstream.watchdog import StallBound, StallWatchdog


def padded_to_tables(placements: torch.Tensor, tables: list[LayerLookup]) -> torch.Tensor:
    """[L, width] upstream's [L, num_physical] placements, -1 in the slots beyond them: an elastic
    member's tables have the maximum size's slots and upstream places the current size's. Tables
    without empty slots are as wide as upstream's placements (a narrower policy output is refused
    by the check, as any wrong width)."""
    width = tables[0].num_physical_experts if tables else placements.shape[-1]
    if placements.dim() != 2 or placements.shape[1] >= width or not tables[0].allow_empty_slots:
        return placements
    padded = torch.full((placements.shape[0], width), -1, dtype=placements.dtype)
    padded[:, : placements.shape[1]] = placements
    return padded


class BoundLayer(Protocol):
    """A layer upstream commits placements to (``RoutedLayer`` and its subclasses)."""

    tables: LayerLookup

    def commit_placement_(self, placement: torch.Tensor) -> bool:
        """Routes by upstream's committed placement [num_physical] from now on; returns whether it changed."""
        ...


@dataclass
class BindingStats:
    layers_committed: int = 0
    placement_changes: int = 0  # layer commits that changed the layer's placement
    rearrangements_started: int = 0  # kept by the runtime's controller, which sees upstream's state between steps
    rearrangements_finished: int = 0  # commits of a model's last layer (or of all layers at once)
    layers_committed_in_flight: int = 0  # of layers_committed: those of the rearrangement not finished yet
    placements_restored: int = 0  # placements moved to at start from a placement file (not rearrangements)


class UpstreamBinding:
    """Our layers under upstream's EPLB state machine, for one process (see the module docstring)."""

    def __init__(self, device: torch.device | str, stall_bound: StallBound | None = None) -> None:
        self.stats = BindingStats()
        self.watchdog = StallWatchdog(stall_bound or StallBound())  # validated before any patch goes in
        self._layers: dict[int, list[BoundLayer]] = {}  # id(upstream model) -> its layers, upstream's order
        self._restoring = False
        self.capabilities = CapabilityAdaptations(
            torch.device(device), commit_hook=self._after_commit, placement_check=self.check_placements
        ).install()

    def bind(self, upstream_model: object, layers: list[BoundLayer]) -> None:
        """``layers`` route upstream's MoE layers of ``upstream_model`` (what ``add_model`` got), in its order."""
        self._layers[id(upstream_model)] = list(layers)

    @property
    def layers(self) -> list[BoundLayer]:
        return [layer for layers in self._layers.values() for layer in layers]

    def layers_of(self, model_state) -> list[BoundLayer]:
        """The layers bound for ``model_state``'s model; ValueError for a model never bound (on the
        policy path that rejects the placement, moving nothing; on a commit it is raised)."""
        layers = self._layers.get(id(model_state.model))
        if layers is None:
            raise ValueError(f"upstream placed experts for a model eplb-graph did not bind "
                             f"({type(model_state.model).__name__})")
        return layers

    # -- upstream's hooks (the capability adaptations call them) ------------------------------

    def check_placements(self, model_state, placements: torch.Tensor) -> None:
        """ValueError unless ``placements`` [L, P] fit every bound layer's tables."""
        tables = [layer.tables for layer in self.layers_of(model_state)]
        validate_layer_placements(padded_to_tables(placements, tables), tables)

    def _after_commit(self, model_state, layer_index: int | None) -> None:
        layers = self.layers_of(model_state)
        # [L, width]: upstream's is the truth; an elastic member's tables are wider than what it places
        committed = padded_to_tables(model_state.physical_to_logical_map.cpu(), [layer.tables for layer in layers])
        for index in range(len(layers)) if layer_index is None else [layer_index]:
            changed = layers[index].commit_placement_(committed[index])
            if not self._restoring:  # the counts are of rearrangements
                self.stats.placement_changes += changed
                self.stats.layers_committed += 1
                self.stats.layers_committed_in_flight += 1
        # counted here, not from upstream's flag between steps: one step() can finish a
        # rearrangement and start the next
        if self._restoring:
            self.stats.placements_restored += 1
        elif ends_rearrangement(model_state, layer_index):
            self.stats.rearrangements_finished += 1
            self.stats.layers_committed_in_flight = 0

    def refresh(self, model_state) -> None:
        """Every bound layer of ``model_state`` routes by upstream's placement now, each checked
        against upstream's maps. A refresh, not a rearrangement: nothing moved and nothing is
        counted. For what upstream installs without its commit functions, under vLLM's elastic EP:
        a new engine's ``update_mapping``, a resize's re-viewed slots
        (``reconfigure_physical_expert_slots``)."""
        layers = self.layers_of(model_state)
        current = padded_to_tables(model_state.physical_to_logical_map.cpu(), [layer.tables for layer in layers])
        for layer, placement in zip(layers, current):
            layer.commit_placement_(placement)

    def restore(self, model_state, placements: torch.Tensor) -> None:
        """Moves the experts to ``placements`` [L, P] and commits them, synchronously through
        upstream's own rearrangement: its weight move (every tensor of each expert, quantization
        scales included) and its commit of all layers, at which our lookups refresh. Every EP rank
        calls it with the same placements, before the first forward (``kept_placement.py``)."""
        from vllm.distributed.eplb import eplb_state, rebalance_execute
        from vllm.distributed.parallel_state import get_ep_group

        self.check_placements(model_state, placements)  # before any byte moves
        committed = model_state.physical_to_logical_map
        target = placements.to("cpu", committed.dtype)  # on the host, as upstream's policy output: both read it there
        rebalance_execute.rearrange_expert_weights_inplace(
            committed, target, model_state.model.expert_weights, model_state.expert_buffer,
            get_ep_group().device_group, model_state.communicator)
        self._restoring = True
        try:  # through the module attribute: the capability adaptations' commit_all wrap refreshes our lookups
            eplb_state._commit_eplb_maps(model_state, new_physical_to_logical_map=target)
        finally:
            self._restoring = False

    # -- health ----------------------------------------------------------------------------

    @property
    def worker_error(self) -> BaseException | None:
        return self.capabilities.health.error

    @property
    def rejected_placements(self) -> list[str]:
        return self.capabilities.health.rejected_placements

    def check_worker(self, where: str) -> None:
        """Raises ``EplbWorkerError`` on the main thread if upstream's async worker died."""
        self.capabilities.health.raise_if_dead(where)

    def after_step(self, *, in_flight: bool, where: str) -> None:
        """After each of upstream's steps: a rearrangement in flight too long with no layer
        committed is a stall (warned or raised, per the bound's ``on_stall``, and counted)."""
        self.watchdog.observe(in_flight=in_flight, layers_committed=self.stats.layers_committed, where=where)

    @property
    def rearrangement_stalls(self) -> int:
        return self.watchdog.stalls

    def close(self) -> None:
        self.capabilities.uninstall()
