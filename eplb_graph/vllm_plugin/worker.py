"""eplb-graph inside one vLLM worker: binds every MoE layer of the runner's model after load.

Upstream owns the EPLB state machine; the runner steps it (``prepare_forward`` before each
forward, ``eplb_step`` after). This object only connects the boundaries:

* on a platform where upstream's runner builds no ``EplbState`` (the CPU model runner),
  it builds one exactly as the GPU runner does (``add_model``, then the async loop);
* ``UpstreamBinding`` (the same one our runtime's controller uses) installs the capability
  adaptations, checks each policy placement, and refreshes our lookups between upstream's commit
  of a layer and its acknowledgement, so they never route by an uncommitted placement
  (invariants 3, 6);
* every MoE layer becomes a ``VllmMoELayer`` mapped by exactly one mechanism, and its experts'
  storage is proven to be what upstream moves (``expert_views``: quantized kernels included);
* ``verify_mapping`` checks after warm-up that each layer was routed by its mechanism, and
  ``CompileWatch`` warns of any model graph compiled after it (``compile_watch``);
* a dead async worker is raised on the runner's next EPLB step instead of silently
  leaving EPLB off.
"""

from __future__ import annotations

import os
import time

import torch

from eplb_graph.upstream import patches
from eplb_graph.upstream.binding import UpstreamBinding
from eplb_graph.upstream.watchdog import stall_bound_from_env

from . import elastic_follow, kept_placement, router_hook
from .compile_watch import CompileWatch
from .dp_dispatch import bind_dp_dispatch
from .expert_views import ExpertWeightView, complete_move_list
from .layers import (GRAPH_PASS, ROUTER_HOOK, VllmMoELayer, compiled_roots, mapping_mechanism, relative_path,
                     verify_mapping)
from .active_line import log_active, vllm_logger
from .local_experts import LocalPairExperts
from .metrics import WorkerMetrics
from .metrics_export import METRICS_DIR


def use_gloo_staged_communicator(eplb_state) -> None:
    """On CPU, where upstream's EP group is gloo too, its gloo choice moves through our
    ``GlooStagedCommunicator``: ours reserves no buffer with a profile-time all_gather over that
    group, which gloo cannot run on float8 (FP8 checkpoints' weights)."""
    from vllm.distributed.parallel_state import get_eplb_group

    from eplb_graph.movement.mover import GlooStagedCommunicator

    for model_state in eplb_state.model_states.values():  # the model's, and a drafter's
        patches.configure("worker.gloo_communicator", GlooStagedCommunicator(get_eplb_group().cpu_group), on=model_state)


class VllmEplbWorker:
    """EPLB of one model runner in graph mode; created by the plugin after ``load_model``."""

    def __init__(self, runner) -> None:
        from vllm.distributed.eplb.eplb_state import EplbState
        from vllm.model_executor.models.interfaces import get_mixture_of_experts_model

        from vllm.distributed.parallel_state import get_ep_group

        self.runner = runner
        parallel_config = runner.parallel_config
        self.ep_rank = get_ep_group().rank_in_group  # kept by a survivor of an elastic resize (the highest ranks leave)
        # before EplbState (it constructs events and starts the worker); the bound was checked at engine start
        self.binding = UpstreamBinding(runner.device, stall_bound_from_env(os.environ))
        self.built_upstream_state = runner.eplb_state is None
        if self.built_upstream_state:
            moe_model = get_mixture_of_experts_model(runner.model)
            if moe_model is None:
                raise ValueError(f"enable_eplb=True but {type(runner.model).__name__} has no EPLB-capable MoE layers")
            patches.install("worker.cpu_eplb_state", EplbState(parallel_config, runner.device), by=self, on=runner)
            patches.install("worker.cpu_moe_model", moe_model, by=self, on=runner)
            runner.eplb_state.add_model(moe_model, runner.model_config)
        if torch.device(runner.device).type == "cpu" and parallel_config.eplb_config.communicator == "torch_gloo":
            use_gloo_staged_communicator(runner.eplb_state)

        paths = {id(module): name for name, module in runner.model.named_modules()}
        roots = compiled_roots(runner.model)
        compilation_config = runner.vllm_config.compilation_config
        # on CPU under DP, vLLM's token dispatch gets the collectives its communicator lacks (dp_dispatch.py)
        self.dp_dispatch = (bind_dp_dispatch(parallel_config, self.moe_runners())
                            if torch.device(runner.device).type == "cpu" else None)
        # under vLLM's elastic EP, a resize keeps the compiled graphs: the DP dispatch reads no count from them
        self.keeps_graphs = (self.dp_dispatch is not None and bool(parallel_config.enable_elastic_ep)
                             and elastic_follow.keep_graphs(os.environ))
        self.expert_views: dict[str, ExpertWeightView] = {}
        # on CPU under expert parallel, each layer's experts run this rank's pairs only (local_experts.py)
        self.local_experts: dict[str, LocalPairExperts] = {}
        for model_state in runner.eplb_state.model_states.values():
            model = model_state.model
            views = [
                ExpertWeightView(moe_runner.layer_name, moe_runner.routed_experts, model.expert_weights[index])
                for index, moe_runner in enumerate(model.moe_layers)
            ]
            complete_move_list(views, model_state)
            self.expert_views.update((view.layer_name, view) for view in views)
            committed = model_state.physical_to_logical_map.cpu()  # [L, num_physical]
            capacity = elastic_follow.slot_capacity(parallel_config, model_state)  # None: elastic EP off
            layers = []
            for index, moe_runner in enumerate(model.moe_layers):
                traced_path = relative_path(paths.get(id(moe_runner), ""), roots)
                mapped_by = mapping_mechanism(moe_runner, compilation_config, traced_path)
                layer = VllmMoELayer(
                    moe_runner,
                    num_logical_experts=model.num_logical_experts,
                    num_physical_experts=model.num_physical_experts,
                    placement=committed[index],
                    mapped_by=mapped_by,
                    router_path=traced_path,
                    capacity=capacity,
                )
                if mapped_by == ROUTER_HOOK:
                    router_hook.hook_router(moe_runner.router, layer.key)
                if torch.device(runner.device).type == "cpu" and moe_runner.routed_experts.use_ep:
                    self.local_experts[layer.key] = LocalPairExperts(moe_runner.routed_experts, layer.key)
                layers.append(layer)
            self.binding.bind(model, layers)
        # it counts our pass's mappings: nothing to watch where no layer is mapped by the pass
        watched = [layer for layer in self.layers if layer.mapped_by == GRAPH_PASS]
        self.compile_watch: CompileWatch | None = None
        if watched:
            self.compile_watch = CompileWatch(lambda: sum(layer.graph_mappings for layer in watched), vllm_logger())
        self.rearrangements_logged = 0
        self.movers: dict[int, object] = {}  # every EPLB communicator this worker had, by identity
        self.metrics_failed = False  # logged once
        self.metrics = WorkerMetrics(
            {"model_name": str(runner.model_config.served_model_name), "engine": str(parallel_config.data_parallel_rank),
             "ep_rank": str(self.ep_rank)}, ep_size=self.current_ep_size, publish_dir=os.environ.get(METRICS_DIR))
        self._wrap_runner_steps()
        self.placement_keeper = kept_placement.start(self, os.environ)  # before the async loop and any forward
        if self.built_upstream_state and runner.eplb_state.is_async:
            runner.eplb_state.start_async_loop()
        log_active(self)

    def before_switch(self) -> None:
        """vLLM's elastic EP is about to switch this worker's groups (``elastic_scaling``)."""
        self.bytes_moved()  # the mover being replaced is counted

    def after_switch(self) -> None:
        """vLLM's elastic EP switched this worker to a resized group (``elastic_scaling``)."""
        elastic_follow.after_switch(self)

    @staticmethod
    def current_ep_size() -> int:
        """The EP group's size now: vLLM's elastic EP replaces the group at a resize
        (``switch_and_prepare``), so nothing keeps the size it had at bind."""
        from vllm.distributed.parallel_state import get_ep_group

        return get_ep_group().world_size

    @property
    def ep_size(self) -> int:
        return self.current_ep_size()

    @property
    def layers(self) -> list[VllmMoELayer]:
        return self.binding.layers

    def layers_of(self, model_state) -> list[VllmMoELayer]:
        return self.binding.layers_of(model_state)

    def moe_runners(self) -> list:
        """Every MoE layer's runner (vLLM's ``MoERunner``) of the models EPLB balances."""
        return [moe_runner for model_state in self.runner.eplb_state.model_states.values()
                for moe_runner in model_state.model.moe_layers]

    @property
    def stats(self):
        return self.binding.stats

    # -- runner integration -------------------------------------------------------------

    def _wrap_runner_steps(self) -> None:
        """Instance attributes on this runner only: the worker's health after each EPLB step,
        the mapping check after warm-up (the first forwards through the compiled graph)."""
        runner = self.runner
        upstream_step = runner.eplb_step
        upstream_warm_up = getattr(runner, "warming_up_model", None)

        def eplb_step(*args, **kwargs):
            start = time.perf_counter()
            upstream_step(*args, **kwargs)
            step_seconds = time.perf_counter() - start
            in_flight = any(state.rebalanced for state in runner.eplb_state.model_states.values())
            try:
                self.check_worker()
                if self.compile_watch is not None:
                    is_dummy = kwargs.get("is_dummy", args[0] if args else False)  # eplb_step(is_dummy, is_profile)
                    if not is_dummy:
                        self.compile_watch.start(after="the first real step")  # where no warm-up hook started it
                    self.compile_watch.check()
                self.binding.after_step(in_flight=in_flight, where=f"of vLLM runner on {runner.device}")
                if self.placement_keeper is not None:
                    self.placement_keeper.after_step(self.model_state, self.stats.rearrangements_finished, in_flight)
                if self.stats.rearrangements_finished > self.rearrangements_logged:
                    self.log_rearrangement()
            finally:  # a dead worker or a stall raised here is published first
                self.publish_metrics(step_seconds, in_flight)

        patches.install("worker.eplb_step", eplb_step, by=self, on=runner)
        if upstream_warm_up is not None:
            def warming_up_model(*args, **kwargs):
                result = upstream_warm_up(*args, **kwargs)
                self.verify_mapping(require_calls=True)  # warm-up ran the compiled graph
                if self.compile_watch is not None:
                    self.compile_watch.start(after="the end of warm-up")
                return result

            patches.install("worker.warming_up_model", warming_up_model, by=self, on=runner)
        if getattr(runner.parallel_config, "enable_elastic_ep", False):
            elastic_follow.follow_new_engine_mapping(self)

    def publish_metrics(self, step_seconds: float, in_flight: bool) -> None:
        """This step's EPLB metrics, from what upstream's step left on the host (``metrics.py``).
        Called in a ``finally``: it raises nothing (a metrics fault is logged once)."""
        try:
            self._publish_metrics(step_seconds, in_flight)
        except Exception:  # noqa: BLE001  (it would hide the step's own error, or fail serving)
            if not self.metrics_failed:
                self.metrics_failed = True
                vllm_logger().exception("eplb-graph: EPLB metrics could not be updated; serving goes on")

    def _publish_metrics(self, step_seconds: float, in_flight: bool) -> None:
        self.metrics.after_step(
            step_seconds=step_seconds, in_flight=in_flight, layers_committed=self.stats.layers_committed,
            finished=self.stats.rearrangements_finished, stalls=self.binding.rearrangement_stalls,
            bytes_moved=self.bytes_moved(), worker_alive=self.binding.worker_error is None,
            graphs_compiled=self.compile_watch and self.compile_watch.since_start(),
            model_state=self.model_state, local_work=self.local_work())

    def local_work(self) -> tuple[int, float]:
        """Pairs this rank's expert kernels computed so far, and their seconds (``local_experts.py``)."""
        return (sum(experts.counts.pairs for experts in self.local_experts.values()),
                sum(experts.counts.seconds for experts in self.local_experts.values()))

    @property
    def model_state(self):
        """Upstream's state of the served model (a drafter's comes after it)."""
        return next(iter(self.runner.eplb_state.model_states.values()))

    def log_rearrangement(self) -> None:
        """One line per rearrangement fully committed on this worker: what it moved, so far."""
        self.rearrangements_logged = self.stats.rearrangements_finished
        sent, received = self.bytes_moved()
        vllm_logger().info(
            "eplb-graph: rearrangement %d committed on EP rank %d of %d (%d layer commits so far); expert bytes "
            "sent %d, received %d so far", self.rearrangements_logged, self.ep_rank, self.ep_size,
            self.stats.layers_committed, sent, received)

    def check_worker(self) -> None:
        self.binding.check_worker(f"of vLLM runner on {self.runner.device}")

    def verify_mapping(self, *, require_calls: bool) -> dict[str, str]:
        """Each layer is routed by exactly its mechanism; returns {layer: mechanism}."""
        return verify_mapping(self.layers, require_calls=require_calls)

    def summary(self) -> dict:
        return {
            "layers": {layer.key: layer.summary() for layer in self.layers},
            "layers_committed": self.stats.layers_committed,
            "rearrangements_committed": self.stats.rearrangements_finished,
            "layers_committed_in_flight": self.stats.layers_committed_in_flight,
            "placement_changes": self.stats.placement_changes,
            "rejected_placements": list(self.binding.rejected_placements),
            "rearrangement_stalls": self.binding.rearrangement_stalls,
            "worker_error": None if self.binding.worker_error is None else repr(self.binding.worker_error),
            "built_upstream_state": self.built_upstream_state,
            "placements_restored": self.stats.placements_restored,  # from EPLB_GRAPH_PLACEMENT_FILE, at start
            # None: no layer mapped by the pass, or not started
            "graphs_compiled_while_serving": self.compile_watch and self.compile_watch.since_start(),
            "expert_views": {name: view.summary() for name, view in self.expert_views.items()},
            # (token, k) pairs this rank's experts computed, per layer (only its own: local_experts.py)
            "local_pairs_computed": {key: experts.counts.pairs for key, experts in self.local_experts.items()},
            "pairs_seen": {key: experts.counts.seen for key, experts in self.local_experts.items()},
            "local_expert_seconds": self.local_work()[1],
            # tokens per physical expert upstream holds in its window (what the policy sees)
            "load_window_total": sum(int(s.expert_load_window.sum()) for s in self.runner.eplb_state.model_states.values()),
            "ep_rank": self.ep_rank,
            "ep_size": self.ep_size,
            # expert bytes this rank's mover sent to and received from other EP ranks
            **dict(zip(("bytes_sent", "bytes_received"), self.bytes_moved())),
        }

    def bytes_moved(self) -> tuple[int, int]:
        """Expert bytes this rank's movers sent to and received from other EP ranks (our mover counts
        them), over every mover it has had: vLLM's elastic EP gives each resized group a new one."""
        for state in self.runner.eplb_state.model_states.values():
            self.movers.setdefault(id(state.communicator), state.communicator)
        return (sum(getattr(mover, "bytes_sent", 0) for mover in self.movers.values()),
                sum(getattr(mover, "bytes_received", 0) for mover in self.movers.values()))

    def slot_digests(self) -> dict[str, list[str]]:
        """Per layer, a digest of each local slot's expert storage (all it moves), for checking
        that every slot holds the expert its committed placement names. Reads every expert byte."""
        return {name: view.slot_digests() for name, view in self.expert_views.items()}
