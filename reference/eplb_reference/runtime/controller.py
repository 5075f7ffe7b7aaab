"""Our runtime's controller: the reference EP runtime's layers under upstream vLLM's EPLB (async only).

Upstream owns the load window, the step interval, the default policy, the async worker and
its one-layer-at-a-time handshake; ``UpstreamBinding`` owns the commit contract (placement
check, commit -> refresh -> ack, stats, worker health). This controller adds what a runtime
step needs around them:

* ``UpstreamModelView`` presents our layers as upstream's ``MixtureOfExperts``: expert
  weights are the quantization-owned views (the kernel's storage), and each layer's
  load buffer *is* a row of upstream's ``expert_load_pass`` (bound in ``set_eplb_state``),
  so what the routing op records is what upstream's window sees.
* ``begin_batch`` decides once per batch whether it records load: upstream's recording
  window and the configured phase (``all | prefill | decode``; a batch with any prefill
  work is prefill). A filtered batch records nothing, but ``end_batch`` still steps the
  upstream state on every rank, so collectives stay in the same order everywhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from eplb_graph.core.layer_lookup import BatchFlags, LayerLookup, RoutedLayer, batch_in_load_phase, check_load_phase
from eplb_graph.upstream import patches
from eplb_graph.upstream.binding import BindingStats, UpstreamBinding
from eplb_graph.upstream.kept_placement import PlacementKeeper
from eplb_graph.upstream.watchdog import StallBound


class EplbPeerLostError(RuntimeError):
    """An EP peer disappeared; this rank keeps its last committed placement and matching weights."""


class RankLayer(RoutedLayer):
    """One MoE layer on one EP rank: global routing tables, local expert weights, shared flags."""

    def __init__(self, key: str, tables: LayerLookup, flags: BatchFlags, weight_view: list[torch.Tensor]) -> None:
        super().__init__(key, tables, flags)
        self.weight_view = weight_view


class UpstreamModelView:
    """Duck-typed ``vllm.model_executor.models.interfaces.MixtureOfExperts`` over RankLayers."""

    def __init__(self, layers: list[RankLayer], num_logical: int, num_physical: int, ep_size: int,
                 load_buffer: torch.Tensor | None = None) -> None:
        self.layers = layers
        self.load_buffer = load_buffer  # [L, tables' width]: the layers' own load rows, kept (elastic)
        self.expert_weights = [layer.weight_view for layer in layers]
        self.num_moe_layers = len(layers)
        self.num_expert_groups = 1
        self.num_logical_experts = num_logical
        self.num_routed_experts = num_logical
        self.num_physical_experts = num_physical
        self.num_redundant_experts = num_physical - num_logical
        self.num_local_physical_experts = num_physical // ep_size
        self.num_shared_experts = 0
        self.moe_layers = []  # no upstream EplbLayerState: our op reads our own tables

    def set_eplb_state(self, expert_load_pass, logical_to_physical_map, logical_replica_count) -> None:
        if self.load_buffer is not None:  # the controller points upstream at these rows instead
            return
        for index, layer in enumerate(self.layers):
            layer.tables.bind_load_(expert_load_pass[index, : self.num_physical_experts])


@dataclass(frozen=True)
class ModelKey:
    """What EplbState needs of a ModelConfig: a stable hash and a name."""

    model: str

    def compute_hash(self) -> str:
        return f"eplb-graph:{self.model}"


class EplbController:
    """Drives upstream's EplbState for this rank's layers; one per process."""

    def __init__(
        self,
        layers: list[RankLayer],
        *,
        load_phase: str = "all",
        transfer_timeout_s: float = 60.0,
        device: torch.device | str = "cpu",
        model_name: str = "moe",
        policy_process: bool = False,
        stall_bound: StallBound | None = None,
        num_physical: int | None = None,
        load_buffer: torch.Tensor | None = None,
        placement_keeper: PlacementKeeper | None = None,
    ) -> None:
        """Window size and step interval are upstream's: the current vLLM config's ``eplb_config``.

        An elastic member's layers are wider than the group it serves now: ``num_physical`` is
        the slots upstream places (the current size's), the tables' slots beyond it are empty;
        ``load_buffer`` [L, tables' width] holds the layers' load rows, which keep their
        addresses for the graphs: upstream records into its first ``num_physical`` columns.

        ``policy_process``: upstream's policy runs in a helper process (``PolicyProcess``)
        instead of on the worker thread, whose Python would otherwise hold this process's GIL
        for the policy's whole run (seconds to start it, once).

        ``placement_keeper``: the experts start from its placement file where it exists (every
        rank, before the async worker starts), and the file is rewritten as rearrangements commit."""
        check_load_phase(load_phase)
        from vllm.config import get_current_vllm_config
        from vllm.distributed.eplb.eplb_state import EplbState
        from vllm.distributed.parallel_state import get_ep_group, get_eplb_group

        from eplb_graph.movement.mover import GlooStagedCommunicator

        parallel_config = get_current_vllm_config().parallel_config
        if not (parallel_config.enable_eplb and parallel_config.eplb_config.use_async):
            raise ValueError("eplb-graph supports asynchronous EPLB only: set enable_eplb=True with use_async=True")
        # Upstream keeps one placement width and sizes its transfer buffer from layer 0.
        sizes = {(layer.tables.num_logical_experts, layer.tables.num_physical_experts) for layer in layers}
        shapes = {tuple(tuple(t.shape) for t in layer.weight_view) for layer in layers}
        if len(sizes) != 1 or len(shapes) != 1:
            raise ValueError(
                f"every MoE layer must have the same expert counts and per-expert weight shapes for EPLB, "
                f"got counts {sizes} and shapes {shapes}"
            )
        (num_logical, width), = sizes
        num_physical = width if num_physical is None else num_physical
        self.layers = layers
        self.load_phase = load_phase
        self.flags = layers[0].flags
        self.ep_rank = get_ep_group().rank_in_group
        self.ep_size = get_ep_group().world_size

        self.binding = UpstreamBinding(device, stall_bound)  # before EplbState: it constructs events and starts the worker
        self.policy_process = None
        self.placement_keeper = placement_keeper
        try:  # a failure below leaves no patch installed and no helper running
            self.model_key = ModelKey(model_name)
            self.model_view = UpstreamModelView(layers, num_logical, num_physical, self.ep_size, load_buffer)
            self.binding.bind(self.model_view, layers)
            self.state = EplbState(parallel_config, torch.device(device))
            self.state.add_model(self.model_view, self.model_key)  # also picks upstream's policy
            if load_buffer is not None:
                self._adopt(load_buffer, num_physical)
            if policy_process:
                from eplb_reference.runtime.policy_process import PolicyProcess

                self.policy_process = PolicyProcess(self.state.policy, timeout_s=transfer_timeout_s)
                # what upstream's worker calls; same signature
                patches.install("runtime.policy_process", self.policy_process, by=self, on=self.state)
            self.communicator = GlooStagedCommunicator(get_eplb_group().cpu_group, timeout_s=transfer_timeout_s)
            self.state.update_communicator(self.model_key, self.communicator)
            self.model_state = next(iter(self.state.model_states.values()))
            if placement_keeper is not None:
                placement_keeper.restore(self.binding, self.state, get_ep_group().cpu_group)
            self.state.start_async_loop()
        except BaseException:
            if self.policy_process is not None:
                self.policy_process.close()
            if placement_keeper is not None:
                placement_keeper.abandon()
            self.binding.close()
            raise

    def _adopt(self, load_buffer: torch.Tensor, num_physical: int) -> None:
        """Upstream records into ``load_buffer`` and starts from the layers' current placement
        (upstream's own ``update_mapping``, as its ``from_mapping`` does)."""
        model_state = next(iter(self.state.model_states.values()))
        patches.configure("runtime.load_buffer", load_buffer, on=model_state)
        patches.configure("runtime.load_pass", load_buffer[:, :num_physical], on=model_state)
        placements = torch.stack([layer.tables.physical_to_logical for layer in self.layers])  # [L, width]
        if (placements[:, num_physical:] >= 0).any():
            raise ValueError(f"the layers place experts beyond the {num_physical} slots upstream is to place")
        self.state.update_mapping(self.model_key, placements[:, :num_physical].to(self.state.device))

    @property
    def stats(self) -> BindingStats:
        return self.binding.stats

    # -- per batch ----------------------------------------------------------------------

    def begin_batch(self, *, num_unpadded_tokens: int, is_prefill: bool) -> bool:
        """Before a forward (or replay): fill the record flag and padding count. Returns record."""
        self.check_worker()
        record = batch_in_load_phase(self.load_phase, is_prefill) and self.state._should_record_current_step()
        self.flags.set_(record=record, num_unpadded_tokens=num_unpadded_tokens)
        return record

    def end_batch(self) -> None:
        """After a forward: every rank steps upstream (window, rearrangement, layer commits)."""
        self.check_worker()
        self.state.step()
        self.binding.after_step(in_flight=self.rebalancing, where=f"on EP rank {self.ep_rank}")
        # at most one rearrangement is in flight: every one started has finished, is in
        # flight now, or was stopped early (a drain), which max() keeps counted
        in_flight = int(bool(self.model_state.rebalanced))
        self.stats.rearrangements_started = max(self.stats.rearrangements_started,
                                                self.stats.rearrangements_finished + in_flight)
        if self.placement_keeper is not None:
            self.placement_keeper.after_step(self.model_state, self.stats.rearrangements_finished, self.rebalancing)

    @property
    def rebalancing(self) -> bool:
        return bool(self.model_state.rebalanced)

    def check_worker(self) -> None:
        self.binding.check_worker(f"on EP rank {self.ep_rank}")

    def peer_lost(self, error: BaseException, *, wait_for_worker_s: float = 2.0) -> EplbPeerLostError:
        """A clear error for a collective that failed because a peer is gone.

        Waits briefly for the worker's own report (it names the peers of the failed
        transfer). Nothing half-moved is visible: a layer is committed only after all of
        its bytes arrived, and routing only ever reads committed placements.
        """
        deadline = time.monotonic() + wait_for_worker_s
        while self.binding.worker_error is None and self.rebalancing and time.monotonic() < deadline:
            time.sleep(0.05)
        worker = self.binding.worker_error
        during = "an async expert transfer" if self.rebalancing else "a forward"
        return EplbPeerLostError(
            f"EP rank {self.ep_rank}/{self.ep_size}: a peer left during {during}: {error}"
            + (f"; async worker: {worker}" if worker is not None else "")
            + f"; keeping the last committed placement ({self.stats.layers_committed} layer commits so far)"
        )

    def placements(self) -> torch.Tensor:
        return self.model_state.physical_to_logical_map.cpu().clone()

    def close(self) -> None:
        """Ends EPLB on this rank; every rank calls it at the same step (before the groups are
        destroyed). An in-flight rearrangement is drained first with upstream's ``drain_async``
        (lockstep over the EP CPU group; the layers not yet committed stay at their committed
        placement): destroying the groups while the worker is inside a transfer would pull
        them from under a running gloo operation."""
        self.check_worker()
        self.state.drain_async()
        if self.placement_keeper is not None:
            self.placement_keeper.close(self.model_state, self.stats.rearrangements_finished)
        self.release(close_layers=True)

    def release(self, *, close_layers: bool = False) -> None:
        """Without a collective (``close`` drains first; a member whose group broke cannot): the
        patches come out, an idle worker on a host device ends, and ``close_layers`` unregisters
        the layers (an elastic member keeps them for its next controller)."""
        if self.policy_process is not None:
            self.policy_process.close()
        self.binding.close()
        stop = getattr(self.state.rearrange_event, "close", None)  # HostEvent; a device event has none
        if stop is not None:
            stop()
        if close_layers:
            for layer in self.layers:
                layer.close()
