"""Upstream's asynchronous EPLB between resizes, in an elastic member: one controller per generation.

Upstream's elastic EP keeps one ``EplbState`` across a resize and re-views it
(``reconfigure_physical_expert_slots``, a new communicator); a worker that joins builds its
state from the mapping it receives (``EplbState.from_mapping``). Here every generation of two
or more members starts a fresh ``EplbController`` from the layers' current placement, the
joiners' way, so one path serves founding members, joiners, resizes and recoveries:

* *start* (after a switch and its reshuffle, every member at the same step): upstream places
  the current size's ``num_local x size`` slots; the tables keep the maximum size's width and
  load rows (``ElasticModels.load``), so no graph sees a new address;
* *stop* (before the next switch, every member at the same step): upstream's ``drain_async``
  in lockstep; the layers of an unfinished rearrangement stay at their committed placement;
  the window's load, folded onto logical experts, is what the resize rebalances by;
* *discard* (a peer died: the group is broken): no collective; the recovery starts the next.

What upstream reads as its groups (``get_ep_group()``, ``get_eplb_group()``) resolves the
member's current generation by name at each call, as the EP ops do (``GenerationCoordinator``):
the forwards' group for the main thread's collectives, the generation's second group for the
worker's. The window restarts at each generation: the resize itself just rebalanced with the
last one's load.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
import torch.distributed as dist

from eplb_graph.custom_ops import EP_GROUPS
from eplb_graph.core.placement import rank_loads
from eplb_reference.runtime.config import RunConfig
from eplb_reference.runtime.controller import EplbController
from eplb_reference.elastic.group import ElasticEpGroup
from eplb_reference.elastic.stack import ElasticModels
from eplb_reference.runtime.report import balancedness
from eplb_graph.upstream import patches


class GenerationCoordinator:
    """What upstream's EPLB reads of a ``GroupCoordinator``, for the elastic group ``name``'s current
    generation: its forwards' group (``kind`` "ep") or its EPLB worker's ("eplb")."""

    def __init__(self, name: str, kind: str) -> None:
        self.name, self.kind = name, kind

    def _group(self) -> ElasticEpGroup:
        return EP_GROUPS.resolve(self.name)

    @property
    def cpu_group(self) -> dist.ProcessGroup:
        """Upstream reads it right before its collectives: on the main thread's ("ep") that goes through
        the slot's ``current``, which counts the collectives the keep-alive reports (every member reads
        it on the same paths); the worker thread's ("eplb") are not the main thread's to count."""
        group = self._group()
        pg = group.current()[0] if self.kind == "ep" else group.eplb_process_group
        if pg is None:
            raise RuntimeError(f"elastic EP group {self.name!r} has no {self.kind} group in generation "
                               f"{group.generation.index if group.generation else None}")
        return pg

    device_group = cpu_group  # on the host the activations' group is the CPU group

    @property
    def rank_in_group(self) -> int:
        return self._group().rank

    rank = rank_in_group

    @property
    def world_size(self) -> int:
        return self._group().size


@contextlib.contextmanager
def elastic_eplb_session(cfg: RunConfig, name: str, max_ranks: int) -> Iterator[None]:
    """For a member process's life: upstream's EPLB config current (the run's window and interval)
    and its group getters on the elastic group ``name``."""
    from vllm.config import set_current_vllm_config

    from eplb_reference.runtime.groups import eplb_vllm_config, inductor_compile_threads_kept

    if not cfg.eplb:
        yield
        return
    with inductor_compile_threads_kept():
        config = eplb_vllm_config(max_ranks, num_redundant_experts=cfg.num_physical - cfg.num_experts,
                                  window_size=cfg.window_size, step_interval=cfg.step_interval)
    # upstream's group getters on this generation's elastic groups (adaptations.py: elastic.*)
    session = object()
    values = {"elastic.ep_group": GenerationCoordinator(name, "ep"), "elastic.eplb_group": GenerationCoordinator(name, "eplb"),
              "elastic.node_count": 1}  # the policy's hierarchy: one node, as the resizes' reshuffle assumes
    try:
        for key, value in values.items():
            patches.install(key, value, by=session)
        with set_current_vllm_config(config):
            yield
    finally:
        for key in reversed(values):
            patches.uninstall(key)


def placement_balancedness(load: torch.Tensor, placement: torch.Tensor, ranks: int) -> float:
    """mean / max over ranks of the load [L, num_logical] a placement [L, ranks x num_local]
    puts on each rank, each expert's load split evenly over its replicas; averaged over layers."""
    return balancedness(rank_loads(load, placement, ranks))


class ElasticEplb:
    """This member's EPLB for the generation it serves; between generations, none."""

    def __init__(self, models: ElasticModels, cfg: RunConfig, *, timeout_s: float) -> None:
        self.models, self.cfg, self.timeout_s = models, cfg, timeout_s
        self.controller: EplbController | None = None
        self.generation: int | None = None
        # per generation index, what its controller committed on this member
        self.rearrangements: Counter[int] = Counter()
        self.layers_committed: Counter[int] = Counter()
        self.stalls: Counter[int] = Counter()

    @property
    def running(self) -> bool:
        return self.controller is not None

    def start(self, group: ElasticEpGroup) -> None:
        """A controller over ``group``'s current generation (none for one member, or EPLB off)."""
        if self.controller is not None:
            raise RuntimeError("an elastic member's EPLB controller is already running")
        if not self.cfg.eplb or group.size < 2:
            return
        self.generation = group.generation.index
        self.controller = EplbController(
            self.models.rank_layers, transfer_timeout_s=self.timeout_s, stall_bound=self.cfg.stall_bound(),
            num_physical=self.models.num_local * group.size, load_buffer=self.models.load,
            model_name=f"elastic-gen{self.generation}")

    # -- per batch ----------------------------------------------------------------------

    def begin_batch(self, *, num_unpadded_tokens: int, is_prefill: bool, record: bool = True) -> None:
        """Before a forward: upstream's window decides what a running controller records; without
        one, the tables record everything (what a resize rebalances by)."""
        if self.controller is not None and record:
            self.controller.begin_batch(num_unpadded_tokens=num_unpadded_tokens, is_prefill=is_prefill)
        else:
            self.models.flags.set_(record=record and self.controller is None, num_unpadded_tokens=num_unpadded_tokens)

    def end_batch(self) -> bool:
        """After a forward every member of the generation made: upstream's step (window, layer
        commits). Returns whether a rearrangement finished at it."""
        if self.controller is None:
            return False
        finished = self.controller.stats.rearrangements_finished
        self.controller.end_batch()
        self._count()
        return self.controller.stats.rearrangements_finished > finished

    def balancedness(self) -> float | None:
        """What the placement serving now balances: mean / max of the per-rank load it expects
        under upstream's last global load window (replicas share their expert's load evenly)."""
        if self.controller is None:
            return None
        num_physical = self.controller.model_view.num_physical_experts
        placement = torch.stack([layer.tables.physical_to_logical[:num_physical] for layer in self.models.rank_layers])
        return placement_balancedness(self.controller.model_state.last_expert_load.cpu(), placement,
                                      num_physical // self.models.num_local)

    # -- generations ----------------------------------------------------------------------

    def stop(self) -> torch.Tensor:
        """Every member of the generation, at the same step: drains the controller (lockstep) and
        returns this member's recorded load [L, num_logical], what the next placement balances."""
        load = self.logical_load()
        if self.controller is not None:
            controller, self.controller = self.controller, None
            try:  # a peer lost inside the drain: the recovery follows, with no controller left behind
                controller.check_worker()
                controller.state.drain_async()
            finally:
                self._count(controller)
                controller.release()
        return load

    def discard(self) -> None:
        """The generation broke (a peer died): the controller goes without a collective."""
        controller, self.controller = self.controller, None
        if controller is not None:
            self._count(controller)
            controller.release()

    def logical_load(self) -> torch.Tensor:
        """[L, num_logical] this member's load: upstream's window and the pass not folded into it yet
        with a controller running, else what the tables recorded since the last reshuffle."""
        layers = self.models.rank_layers
        if self.controller is None:
            return torch.stack([layer.tables.logical_load() for layer in layers])
        model_state = self.controller.model_state
        physical = (model_state.expert_load_window.sum(dim=0) + model_state.expert_load_pass).to(torch.int64)  # [L, P]
        placement = torch.stack([layer.tables.physical_to_logical[: physical.shape[1]] for layer in layers])  # [L, P]
        num_logical = layers[0].tables.num_logical_experts
        logical = torch.zeros(len(layers), num_logical + 1, dtype=torch.int64)  # the last column: empty slots
        logical.scatter_add_(1, placement.masked_fill(placement < 0, num_logical), physical)
        return logical[:, :num_logical]

    def _count(self, controller: EplbController | None = None) -> None:
        controller = controller or self.controller
        stats = controller.stats
        self.rearrangements[self.generation] = stats.rearrangements_finished
        self.layers_committed[self.generation] = stats.layers_committed
        self.stalls[self.generation] = controller.binding.rearrangement_stalls

    def summary(self) -> dict:
        """Per generation (index as a string, as JSON keys are): what this member's controllers did."""
        return {"rearrangements_finished": {str(g): n for g, n in sorted(self.rearrangements.items())},
                "layers_committed": {str(g): n for g, n in sorted(self.layers_committed.items())},
                "rearrangement_stalls": {str(g): n for g, n in sorted(self.stalls.items())}}
