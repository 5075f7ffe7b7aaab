"""Every change eplb-graph makes to upstream vLLM and torch at run time, declared in one table.

The plugin and the runtime adapt upstream in a few narrow places: a module function swapped for
one with the same contract, an upstream callable wrapped, a hook set on one instance (or an
attribute of ours added to one), a module global set for a scope, a field of the caller's object
set around one upstream call, a configuration value upstream would not choose, an object of ours
in an upstream list (the import system's finders). Each is an
``Adaptation`` here: its target (``module`` + ``qualname``), why it exists, when it applies, the
shape it expects of the target, and the adaptation it is layered on (a wrapper of a wrapper is
declared, never discovered). ``patches.py`` installs them (nothing else in the tree sets an
upstream attribute), ``eplb-graph doctor`` checks them against the installed stack, and the
config gate refuses at engine start, by name, an EPLB request whose adaptations do not hold.

Longer than one reading on purpose (about 400 lines): the table is read whole, one entry a few
lines, and splitting it would hide an adaptation from the one place that lists them all (the doctor
and the import-scan tests read this one list).
"""

from __future__ import annotations

from dataclasses import dataclass

# The stack every entry was last checked against (``eplb-graph doctor`` names a difference).
CHECKED_AGAINST = (("vllm", "0.32.0"), ("torch", "2.13.0"))

# How an adaptation changes its target:
HOW = {
    "replace": "the attribute is ours, with upstream's contract",
    "wrap": "upstream's callable runs inside ours",
    "hook": "set on one instance (shadowing its class's attribute, replacing what upstream's constructor set "
            "there, or adding one of ours upstream does not have): the class and other instances keep upstream's",
    "global": "a module global set for a scope, restored after",
    "scoped": "a field of one upstream object set around one upstream call, its own value restored after",
    "insert": "an object of ours put into an upstream list, taken out again on uninstall",
    "config": "a value (a configuration or state field, or an item of one) set on one upstream object where "
              "upstream would not set it; not taken back",
    "read": "nothing changed: our code relies on it as it is",
}
ALL_PLATFORMS = ("cpu", "cuda", "npu")
HOST = ("cpu",)
PLUGIN, RUNTIME, ELASTIC, PROBES = "vllm plugin", "reference runtime", "elastic runtime", "step breakdown"


@dataclass(frozen=True)
class Shape:
    """What the target must be: ``callable`` (taking ``params`` first, by name), ``class``,
    ``property``, ``attribute`` (exists), ``field`` (a dataclass field), ``instance`` (an
    attribute the class's own code sets on its instances), ``absent`` (an attribute of ours:
    upstream's class has none and none of its code sets one, so one it gains is a clash, named),
    or ``list`` (what an ``insert`` goes into); ``item``: the key a ``config`` sets in the (dict)
    field."""

    kind: str
    params: tuple[str, ...] = ()
    item: str | None = None


@dataclass(frozen=True)
class When:
    """Where an adaptation applies: the components that install it, on which platforms, whether
    only with EPLB on, and a further condition in words; ``requires``: an optional distribution
    without which it does not apply (vllm-ascend)."""

    component: tuple[str, ...]
    platforms: tuple[str, ...] = ALL_PLATFORMS
    eplb_only: bool = True
    condition: str = ""
    requires: str | None = None


@dataclass(frozen=True)
class Adaptation:
    key: str
    module: str
    qualname: str
    how: str
    why: str
    when: When
    shape: Shape
    wraps: str | None = None  # the adaptation this one is installed over, on the same target

    @property
    def target(self) -> str:
        return f"{self.module}.{self.qualname}"

    @property
    def attribute(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]


def _fn(*params: str) -> Shape:
    return Shape("callable", params)


EPLB_STATE = "vllm.distributed.eplb.eplb_state"
ASYNC_WORKER = "vllm.distributed.eplb.async_worker"
REBALANCE = "vllm.distributed.eplb.rebalance_execute"
COMMUNICATOR = "vllm.distributed.eplb.eplb_communicator"
CPU_RUNNER = "vllm.v1.worker.cpu_model_runner"
GPU_RUNNER = "vllm.v1.worker.gpu_model_runner"
CPU_MOE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"
WNA16 = ("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
         "compressed_tensors_moe_wna16")
CPU_COMMUNICATOR = "vllm.distributed.device_communicators.cpu_communicator"
ARG_UTILS = "vllm.engine.arg_utils"
PARALLEL_STATE = "vllm.distributed.parallel_state"
STATELESS = "vllm.distributed.stateless_coordinator"
ELASTIC_EXECUTE = "vllm.distributed.elastic_ep.elastic_execute"
ENGINE_UTILS = "vllm.v1.engine.utils"

_plugin, _plugin_cpu = When((PLUGIN,)), When((PLUGIN,), HOST)
_EVERY_IMPORT = "in every vLLM process that imports it; with EPLB off it defers to upstream"
_any_eplb = When((PLUGIN,), eplb_only=False, condition=_EVERY_IMPORT)
_any_cpu = When((PLUGIN,), HOST, eplb_only=False, condition=_EVERY_IMPORT)
_imports = When((PLUGIN,), eplb_only=False, condition="in every vLLM process, while a module adapted above (a runner, "
                "a quant method, the metrics registry) is not imported yet")
_capability = When((PLUGIN, RUNTIME, ELASTIC))
_capability_host = When((PLUGIN, RUNTIME, ELASTIC), HOST)
_runtime = When((RUNTIME, ELASTIC), HOST)
_probes = When((PROBES,), HOST, condition="eplb-graph bench --step-breakdown")
_elastic = When((ELASTIC,), HOST, condition="each elastic member's EPLB session")
_vllm_elastic = When((PLUGIN,), HOST, eplb_only=False, condition="every vLLM process on CPU that imports it: "
                     "upstream's own path there fails (it asserts CUDA), so only elastic EP groups reach it")
_gate_elastic = When((PLUGIN,), HOST, condition="enable_elastic_ep (vLLM's elastic EP served)")

ADAPTATIONS: tuple[Adaptation, ...] = (
    # -- the vLLM plugin's entry points (vllm_plugin/config_gate.py, runner_hooks.py, quant_methods.py)
    Adaptation("gate.create_engine_config", ARG_UTILS, "EngineArgs.create_engine_config", "wrap",
               "refuses what eplb-graph cannot serve before any process starts, lifts the CPU refusal, installs the pass",
               _any_eplb, _fn("self", "usage_context")),
    Adaptation("gate.args_enable_eplb", ARG_UTILS, "EngineArgs.enable_eplb", "scoped",
               "off on the caller's arguments while upstream builds their config: ParallelConfig refuses EPLB on CPU",
               _plugin_cpu, Shape("field")),
    Adaptation("gate.args_eplb_config", ARG_UTILS, "EngineArgs.eplb_config", "scoped",
               "upstream's default on the caller's arguments while upstream builds their config with EPLB off; the "
               "request is set on the config built", _plugin_cpu, Shape("field")),
    Adaptation("gate.args_enable_elastic_ep", ARG_UTILS, "EngineArgs.enable_elastic_ep", "scoped",
               "off on the caller's arguments while upstream builds their config: its validator refuses elastic EP "
               "with EPLB off (as the CPU build runs) and async EPLB without NIXL; the request is set on the config "
               "built", _gate_elastic, Shape("field")),
    Adaptation("gate.args_executor_backend", ARG_UTILS, "EngineArgs.distributed_executor_backend", "scoped",
               "'mp' while upstream builds the config of an elastic request that names no executor: with the Ray DP "
               "backend upstream picks Ray's executor, which places workers by a GPU resource CPU has not",
               _gate_elastic, Shape("field")),
    Adaptation("gate.post_grad_pass", "vllm.config.compilation", "CompilationConfig.inductor_compile_config", "config",
               "puts VllmEplbPass in Inductor's post-grad slot, wrapping a user pass found there", _plugin,
               Shape("field", item="post_grad_custom_post_pass")),
    Adaptation("config.cpu_enable_eplb", "vllm.config.parallel", "ParallelConfig.enable_eplb", "config",
               "sets EPLB on a config built with it off: ParallelConfig refuses it on CPU",
               When((PLUGIN, RUNTIME, ELASTIC), HOST), Shape("field")),
    Adaptation("config.cpu_eplb_config", "vllm.config.parallel", "ParallelConfig.eplb_config", "config",
               "sets the requested EPLB config (gloo communicator) on a config built with EPLB off",
               When((PLUGIN, RUNTIME, ELASTIC), HOST), Shape("field")),
    Adaptation("config.cpu_eplb_communicator", "vllm.config.parallel", "EPLBConfig.communicator", "config",
               "names torch_gloo on the copy of the request set on a CPU config: upstream's auto-selection lives in "
               "the validator that config skipped", When((PLUGIN,), HOST, condition="no communicator requested"),
               Shape("field")),
    Adaptation("config.cpu_enable_elastic_ep", "vllm.config.parallel", "ParallelConfig.enable_elastic_ep", "config",
               "sets elastic EP on a config built with it off (gate.args_enable_elastic_ep)", _gate_elastic,
               Shape("field")),
    Adaptation("config.cpu_elastic_ep_max_dp_size", "vllm.config.parallel", "ParallelConfig.elastic_ep_max_dp_size",
               "config", "the most DP ranks requested (upstream's default: the start size), on a config built with "
               "elastic EP off, where upstream set the start size", _gate_elastic, Shape("field")),
    Adaptation("platform.cpu_ray_device_key", "vllm.platforms.cpu", "CpuPlatform.ray_device_key", "config",
               "vLLM's Ray DP placement counts engines by the platform's Ray device key, empty on CPU: the resource "
               "the operator's Ray head declares per engine (elastic_gate.RAY_RESOURCE)", _gate_elastic,
               Shape("attribute")),
    Adaptation("runner.cpu_load_model", CPU_RUNNER, "CPUModelRunner.load_model", "wrap",
               "binds every MoE layer right after the runner loads its model", _any_cpu, _fn("self")),
    Adaptation("runner.gpu_load_model", GPU_RUNNER, "GPUModelRunner.load_model", "wrap",
               "binds every MoE layer right after the runner loads its model (the CPU runner's module imports it)",
               _any_eplb, _fn("self")),
    Adaptation("runner.ascend_v1_load_model", "vllm_ascend.worker.model_runner_v1", "NPUModelRunner.load_model",
               "wrap", "binds every MoE layer right after the runner loads its model",
               When((PLUGIN,), ("npu",), eplb_only=False, requires="vllm_ascend"), _fn("self")),
    Adaptation("runner.ascend_v2_load_model", "vllm_ascend.worker.v2.model_runner", "NPUModelRunner.load_model",
               "wrap", "refuses Model Runner V2 with EPLB on, by name, after load",
               When((PLUGIN,), ("npu",), eplb_only=False, requires="vllm_ascend"), _fn("self")),
    Adaptation("loader.create_model", "vllm.model_executor.model_loader.base_loader", "BaseModelLoader.create_model",
               "wrap", "under expert parallel on CPU, experts the local-pairs op cannot bind are refused when the model "
               "is built, before any weight loads", _any_cpu, _fn("self", "vllm_config")),
    Adaptation("quant.wna16_supports_eplb", WNA16, "CompressedTensorsWNA16MoEMethod.supports_eplb", "wrap",
               "int4 (WNA16) MoE layers on vLLM's CPU backend are served: their expert view is proven at bind",
               When((PLUGIN,), eplb_only=False, condition=f"{_EVERY_IMPORT}; the answer changes for its CPU backend only"),
               Shape("property")),
    Adaptation("metrics.registry", "vllm.entrypoints.serve.instrumentator.metrics", "get_prometheus_registry", "wrap",
               "adds the workers' EPLB metrics to the registry vLLM's /metrics serves",
               When((PLUGIN,), condition="vLLM's OpenAI server"), _fn()),
    # -- calling back after vLLM imports an adapted module (vllm_plugin/import_hooks.py)
    Adaptation("imports.after_import", "sys", "meta_path", "insert",
               "one finder of ours, first: it finds nothing itself, it hooks the loader of a module a callback "
               "waits for", _imports, Shape("list")),
    Adaptation("imports.exec_module", "importlib.machinery", "SourceFileLoader.exec_module", "hook",
               "on the loader of a module a callback waits for: upstream's exec_module, then the callbacks; "
               "taken back once it ran", _imports, _fn("self", "module")),
    # -- the capability adaptations (upstream/capability.py): upstream's async EPLB on host devices
    Adaptation("capability.state_event", EPLB_STATE, "CpuGpuEvent", "replace",
               "the staging handshake without device events (HostEvent)", _capability_host, Shape("class")),
    Adaptation("capability.state_timing_event", EPLB_STATE, "torch", "replace",
               "rearrange() times itself with torch.Event, which the CPU platform lacks", _capability_host,
               Shape("attribute")),
    Adaptation("capability.worker_event", ASYNC_WORKER, "CpuGpuEvent", "replace",
               "the staging handshake without device events (HostEvent)", _capability_host, Shape("class")),
    Adaptation("capability.worker_stream", ASYNC_WORKER, "device_stream", "replace",
               "the async worker's stream switch tolerates host streams", _capability_host, _fn("stream")),
    Adaptation("capability.execute_stream", REBALANCE, "device_stream", "replace",
               "the transfer's stream switch tolerates host streams", _capability_host, _fn("stream")),
    Adaptation("capability.communicator_stream", COMMUNICATOR, "device_stream", "replace",
               "the communicator's stream switch tolerates host streams", _capability_host, _fn("stream")),
    Adaptation("capability.start_async_worker", EPLB_STATE, "start_async_worker", "replace",
               "starts upstream's worker loop on any device and surfaces its death instead of a log line",
               _capability, _fn("state", "is_profile")),
    Adaptation("capability.commit_layer", EPLB_STATE, "_commit_eplb_maps_for_layer", "wrap",
               "refreshes our lookups after upstream commits a layer, before it acks the staging buffer "
               "(invariants 3, 6)", _capability, _fn("model_state", "new_physical_to_logical_map", "layer")),
    Adaptation("capability.commit_all", EPLB_STATE, "_commit_eplb_maps", "wrap",
               "refreshes our lookups after a synchronous commit of every layer", _capability,
               _fn("model_state", "new_physical_to_logical_map")),
    Adaptation("capability.checked_policy", ASYNC_WORKER, "run_rebalance_experts", "wrap",
               "a policy placement our tables cannot hold is replaced by the current one before any byte moves",
               _capability, _fn("model_state", "eplb_state", "physical_to_logical_map_cpu", "stream")),
    Adaptation("capability.logical_maps", EPLB_STATE, "compute_logical_maps", "replace",
               "the placement inversion at every commit, vectorized (bench_commit.py)", _capability,
               _fn("physical_to_logical_map", "num_logical_experts")),
    Adaptation("capability.transfer_peers", REBALANCE, "get_ep_ranks_with_experts_batch", "replace",
               "the worker's transfer planning without a per-expert loop (bench_transfer_planning.py)", _capability,
               _fn("expert_ids", "num_local_experts", "old_indices", "new_indices")),
    Adaptation("restore.move_weights", REBALANCE, "rearrange_expert_weights_inplace", "read",
               "moves the experts to a kept placement at start, synchronously, before upstream commits all layers",
               When((PLUGIN, RUNTIME), condition="a placement file to start from"),
               _fn("old_global_expert_indices", "new_global_expert_indices", "expert_weights", "expert_buffer",
                   "ep_group", "communicator")),
    Adaptation("restore.full_first_interval", EPLB_STATE, "EplbState.expert_rearrangement_step", "config",
               "after a restore the first rearrangement waits a full interval: upstream starts at three quarters of "
               "one, to leave its initial placement early", When((PLUGIN, RUNTIME), condition="a placement file to "
               "start from"), Shape("instance")),
    Adaptation("capability.record_flag", EPLB_STATE, "EplbState._should_record_current_step", "read",
               "the controller decides a batch's record flag on the host with upstream's rule", _capability,
               _fn("self", "log_stats")),
    # -- one vLLM worker's instances (vllm_plugin/worker.py and the mappings it binds)
    Adaptation("worker.on_runner", GPU_RUNNER, "GPUModelRunner.eplb_graph", "hook",
               "the runner carries its VllmEplbWorker, which lives as long as it (the metrics and the engine tests "
               "read it there): an attribute of ours upstream does not have", _plugin, Shape("absent")),
    Adaptation("worker.cpu_eplb_state", GPU_RUNNER, "GPUModelRunner.eplb_state", "hook",
               "the CPU runner builds no EplbState: the worker builds it as the GPU runner does", _plugin_cpu,
               Shape("instance")),
    Adaptation("worker.cpu_moe_model", GPU_RUNNER, "GPUModelRunner._moe_model", "hook",
               "the MoE model the GPU runner's eplb_step reads, kept beside the EplbState the worker builds",
               _plugin_cpu, Shape("instance")),
    Adaptation("worker.gloo_communicator", EPLB_STATE, "EplbModelState.communicator", "config",
               "moves experts through GlooStagedCommunicator, which needs no profile-time all_gather (gloo has "
               "none for float8)", When((PLUGIN,), HOST, condition="communicator torch_gloo"), Shape("field")),
    Adaptation("worker.eplb_step", GPU_RUNNER, "GPUModelRunner.eplb_step", "hook",
               "after each EPLB step: the async worker's health, the compile watch, the stall watchdog", _plugin,
               _fn("self", "is_dummy", "is_profile")),
    Adaptation("worker.shutdown", GPU_RUNNER, "GPUModelRunner.shutdown", "hook",
               "writes the placement file a last time at a clean shutdown, then upstream's shutdown",
               When((PLUGIN,), condition="EPLB_GRAPH_PLACEMENT_FILE set"), _fn("self")),
    Adaptation("worker.warming_up_model", CPU_RUNNER, "CPUModelRunner.warming_up_model", "hook",
               "checks each layer's mapping once warm-up ran the compiled graph, then starts the compile watch",
               _plugin_cpu, _fn("self")),
    Adaptation("worker.setup_eplb_from_mapping", GPU_RUNNER, "GPUModelRunner.setup_eplb_from_mapping", "hook",
               "a new engine of an elastic EP group installs its placement with EplbState.update_mapping, past the "
               "commit functions: our lookups are refreshed from it (a refresh, not a rearrangement)",
               When((PLUGIN,), HOST, condition="enable_elastic_ep (vLLM's elastic EP served)"),
               _fn("self", "expanded_physical_to_logical")),
    Adaptation("router.apply_eplb_mapping", "vllm.model_executor.layers.fused_moe.router.base_router",
               "BaseRouter._apply_eplb_mapping", "hook",
               "maps layers whose top-k no graph of ours sees (eager, opaque moe_forward) through our op",
               When((PLUGIN,), condition="layers mapped by the router hook"), _fn("self", "topk_ids")),
    *(Adaptation(f"local_experts.{name}", CPU_MOE, f"{cls}.apply", "hook",
                 "under expert parallel on CPU, this rank's experts compute only the (token, k) pairs routed to it",
                 When((PLUGIN,), HOST, condition="expert parallel over TP or DP workers"),
                 _fn("self", "output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "activation",
                     "global_num_experts", "expert_map", "a1q_scale", "a2_scale", "workspace13", "workspace2",
                     "expert_tokens_meta", "apply_router_weight_on_input"))
      for name, cls in (("unquantized", "CPUUnquantizedExperts"), ("fp8", "CPUExpertsFp8"),
                        ("int4", "CPUExpertsInt4"))),
    *(Adaptation(f"dp_dispatch.{name}", CPU_COMMUNICATOR, f"CpuCommunicator.{name}", "hook",
                 "vLLM's DP token dispatch on CPU calls it and the CPU communicator leaves it unimplemented",
                 When((PLUGIN,), HOST, condition="data parallel > 1"), _fn("self", "input_", "dim", "sizes"))
      for name in ("all_gatherv", "reduce_scatterv")),
    Adaptation("dp_dispatch.get_sizes", "vllm.distributed.device_communicators.all2all", "AgRsAll2AllManager._get_sizes",
               "hook", "on the DP group the list only meets upstream's own rank check: the dispatch ops read each "
               "rank's token count when they run, so a compiled graph holds no value of the DP size",
               When((PLUGIN,), HOST, condition="data parallel > 1"), _fn("self", "num_local_tokens", "comm_group")),
    Adaptation("dp_dispatch.sequence_parallel_context", "vllm.model_executor.layers.fused_moe.runner.moe_runner",
               "MoERunner._sequence_parallel_context", "hook",
               "no DP token counts read into the traced graph (a list as long as the DP group), the dispatch ops "
               "read them when they run", When((PLUGIN,), HOST, condition="data parallel > 1"), _fn("self")),
    # -- the reference runtime (runtime/controller.py, runtime/groups.py)
    Adaptation("runtime.policy_process", EPLB_STATE, "EplbState.policy", "hook",
               "upstream's policy run in a helper process: the worker thread's GIL stays free",
               When((RUNTIME,), HOST, condition="--policy-process"), Shape("instance")),
    Adaptation("runtime.load_buffer", EPLB_STATE, "EplbModelState.expert_load_pass_buffer", "config",
               "upstream records into the elastic member's load buffer, sized for the most ranks", _runtime,
               Shape("field")),
    Adaptation("runtime.load_pass", EPLB_STATE, "EplbModelState.expert_load_pass", "config",
               "upstream's view of that buffer, the current size's slots", _runtime, Shape("field")),
    Adaptation("runtime.compile_threads", "torch._inductor.config", "compile_threads", "config",
               "decided again after vLLM's import sets TORCHINDUCTOR_COMPILE_THREADS=1 for its own engines",
               When((RUNTIME, ELASTIC), HOST, eplb_only=False), Shape("attribute")),
    # -- the elastic runtime's session (runtime/elastic/eplb.py)
    Adaptation("elastic.ep_group", PARALLEL_STATE, "_EP", "global",
               "upstream's EP group getter answers with the current generation's elastic group", _elastic,
               Shape("attribute")),
    Adaptation("elastic.eplb_group", PARALLEL_STATE, "_EPLB", "global",
               "upstream's EPLB group getter answers with the current generation's elastic group", _elastic,
               Shape("attribute")),
    Adaptation("elastic.node_count", PARALLEL_STATE, "_NODE_COUNT", "global",
               "the policy's hierarchy: one node, as the resizes' reshuffle assumes", _elastic, Shape("attribute")),
    # -- vLLM's elastic EP groups on CPU (vllm_plugin/stateless_cpu.py)
    Adaptation("stateless_cpu.coordinator_init", STATELESS, "StatelessGroupCoordinator.__init__", "wrap",
               "upstream asserts CudaCommunicator for each stateless (elastic) DP / EP / EPLB group: on CPU it builds "
               "the group without one, then sets StatelessCpuCommunicator where one was asked for", _vllm_elastic,
               _fn("self", "group_ranks", "local_rank", "torch_distributed_backend", "use_device_communicator",
                   "coord_store")),
    Adaptation("stateless_cpu.device_communicator", STATELESS, "StatelessGroupCoordinator.device_communicator",
               "config", "StatelessCpuCommunicator: vLLM's CpuCommunicator given the group's global ranks, point to "
               "point in group ranks, vLLM's all-gather / reduce-scatter all2all manager on the EP group",
               _vllm_elastic, Shape("instance")),
    Adaptation("stateless_cpu.uses_device_communicator", STATELESS,
               "StatelessGroupCoordinator.use_device_communicator", "config",
               "on again, as asked, after upstream's constructor ran with it off", _vllm_elastic, Shape("instance")),
    Adaptation("stateless_cpu.eplb_communicator", EPLB_STATE, "create_eplb_communicator", "wrap",
               "on a stateless group upstream takes only nixl / pynccl / torch_nccl, and pynccl refuses host "
               "tensors: host experts with torch_gloo move through GlooStagedCommunicator over the group's gloo "
               "group", _vllm_elastic, _fn("group_coordinator", "backend", "expert_weights", "expert_buffer")),
    # -- the frontend's bounds on a resize (vllm_plugin/elastic_resize.py)
    Adaptation("elastic_resize.scale_elastic_ep", "vllm.v1.engine.async_llm", "AsyncLLM.scale_elastic_ep", "wrap",
               "a resize below 2 DP ranks or above elastic_ep_max_dp_size, or after one failed part-way, is refused "
               "before anything starts (vLLM answers the ValueError with 400): upstream hangs shrinking to one rank "
               "at TP=1 and cannot undo a prepared resize; a scale-down drains first (upstream aborts the requests "
               "of the engines it removes)", _gate_elastic, _fn("self", "new_data_parallel_size")),
    Adaptation("elastic_resize.scale_up_engines", ENGINE_UTILS, "CoreEngineActorManager.scale_up_elastic_ep", "wrap",
               "the new engines are killed if not initialized in EPLB_GRAPH_ELASTIC_START_TIMEOUT_S: upstream waits "
               "for them without a bound", _gate_elastic,
               _fn("self", "cur_vllm_config", "new_data_parallel_size", "num_redundant_experts")),
    *(Adaptation(f"elastic_resize.{name}", ENGINE_UTILS, f"CoreEngineActorManager.{name}", "config",
                 "what upstream recorded of new engines that failed to start is taken back (each list as before the "
                 "resize): a later scale-up counts the engines by these lists", _gate_elastic, Shape("instance"))
      for name in ("local_engine_actors", "remote_engine_actors", "created_placement_groups",
                   "placement_group_is_local")),
    # -- vLLM's elastic EP scaling steps on CPU (vllm_plugin/elastic_scaling.py)
    Adaptation("elastic_scaling.load_model", ELASTIC_EXECUTE, "ElasticEPScalingExecutor.load_model", "wrap",
               "a new engine loads the checkpoint: the CPU runner refuses dummy weights, and the non-expert transfer "
               "that would fill them sends nothing for the linear weights the CPU build packs into oneDNN handles",
               _vllm_elastic, _fn("self")),
    Adaptation("elastic_scaling.batch_transfer_weights", ELASTIC_EXECUTE, "batch_transfer_weights", "replace",
               "neither side transfers the non-expert weights (the new engine loaded them; the CPU communicator has "
               "no batch_isend_irecv)", _vllm_elastic,
               _fn("model", "is_sender", "peer_rank", "dp_group", "expert_weights")),
    Adaptation("elastic_scaling.warm_target_groups", ELASTIC_EXECUTE, "ElasticEPScalingExecutor._warm_target_groups",
               "replace", "the new groups' warm-up all-reduce on each group's own process group: c10d never registered "
               "a stateless group", _vllm_elastic, _fn("self", "dp_group", "ep_group")),
    Adaptation("elastic_scaling.warmup_new_worker", ELASTIC_EXECUTE, "ElasticEPScalingExecutor.warmup_new_worker",
               "replace", "a new engine skips upstream's kernel warm-up, as the CPU worker does at start (it imports "
               "CUDA models' warm-ups); where graphs are kept it compiles alone before joining, not at the commit "
               "while every engine waits", _vllm_elastic, _fn("self")),
    Adaptation("elastic_scaling.warm_and_capture", ELASTIC_EXECUTE, "ElasticEPScalingExecutor.warm_and_capture",
               "wrap", "creates upstream's (empty) workspace manager the re-warm unlocks and locks: the CPU worker never "
               "creates one", _vllm_elastic, _fn("self")),
    Adaptation("elastic_scaling.switch_and_prepare", ELASTIC_EXECUTE, "ElasticEPScalingExecutor.switch_and_prepare",
               "wrap", "after upstream's switch to the new groups, the worker's eplb-graph follows the new EP group, "
               "DP dispatch, experts and placement (VllmEplbWorker.after_switch)", _vllm_elastic, _fn("self")),
    Adaptation("elastic_scaling.release_cuda_graphs", ELASTIC_EXECUTE, "ElasticEPScalingExecutor._release_cuda_graphs",
               "wrap", "keeps the compiled model across a switch where the worker's graphs hold no value of the group "
               "size (the CPU engine captures no CUDA graph); upstream resets torch.compile and recompiles while the "
               "scheduler waits", _vllm_elastic, _fn("self")),
    # -- the step breakdown's probes (runtime/step_probes.py), over the capability adaptations
    *(Adaptation(f"probes.state_{name}", EPLB_STATE, f"EplbState.{method}", "hook",
                 "times upstream's EPLB step phases on the serving thread", _probes, _fn(*params))
      for name, method, params in (("step", "step", ("self", "is_dummy")),
                                   ("ready_sync", "_all_ranks_result_ready", ("self", "model_state")),
                                   ("rearrange", "rearrange", ("self", "is_profile")))),
    Adaptation("probes.logical_maps", EPLB_STATE, "compute_logical_maps", "wrap",
               "times our placement inversion", _probes, _fn("physical_to_logical_map", "num_logical_experts"),
               wraps="capability.logical_maps"),
    Adaptation("probes.commit_layer", EPLB_STATE, "_commit_eplb_maps_for_layer", "wrap",
               "times upstream's map commit with our hook inside it", _probes,
               _fn("model_state", "new_physical_to_logical_map", "layer"), wraps="capability.commit_layer"),
    Adaptation("probes.move_to_workspace", EPLB_STATE, "_move_to_workspace", "wrap",
               "tells our staging ack from upstream's install", _probes, _fn("model_state", "ep_rank")),
    Adaptation("probes.move_from_buffer", EPLB_STATE, "move_from_buffer", "wrap",
               "times upstream's weight install", _probes,
               _fn("expert_weights", "expert_weights_buffers", "transfer_metadata", "new_indices", "ep_rank")),
)

BY_KEY = {adaptation.key: adaptation for adaptation in ADAPTATIONS}


def adaptation(key: str) -> Adaptation:
    """The declared adaptation ``key``; a key not declared here is a programming error, named."""
    try:
        return BY_KEY[key]
    except KeyError:
        raise KeyError(f"no adaptation {key!r} is declared in eplb_graph/upstream/adaptations.py") from None


def applicable(platform: str, component: str, *, eplb_on: bool = True) -> list[Adaptation]:
    """The adaptations ``component`` installs on ``platform`` (EPLB on or off)."""
    return [a for a in ADAPTATIONS if platform in a.when.platforms and component in a.when.component
            and (eplb_on or not a.when.eplb_only)]
