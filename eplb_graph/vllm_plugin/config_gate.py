"""The engine-config gate: checks an EPLB request, lifts vLLM's CPU refusal, installs the pass.

Wraps ``EngineArgs.create_engine_config`` (the plugin loads in ``EngineArgs.__post_init__``,
before it runs). With ``enable_eplb`` off it calls upstream and changes nothing. With it
on it:

1. refuses, before any process starts, what eplb-graph cannot serve, naming it:
   synchronous EPLB, an elastic EP layout it cannot serve (``elastic_gate.py``), dual-batch overlap,
   vllm-ascend's V1-only EPLB controls mixed with ``enable_eplb``, a quantization no viewed
   method belongs to (asked for, found in the checkpoint, or built online: ``fp8`` on a checkpoint
   without FP8 weights is online per-tensor FP8), and, on CPU, TP and DP together, or prefill
   context parallel (expert parallel over TP or DP workers is served: ``local_experts.py``,
   ``dp_dispatch.py``). A quantization names a family (``compressed-tensors`` has many
   schemes): each layer's method and tensors are checked when it is built (upstream's
   ``supports_eplb``) and when the worker binds it (``expert_views``), still before serving;
2. on CPU, where ``ParallelConfig`` refuses EPLB (CUDA/ROCm/XPU only, and TP x PCP x DP > 1),
   builds the config with EPLB off (the arguments' two EPLB fields off for that call only,
   ``patches.scoped``) and then sets the user's EPLB fields on the result -- the capability
   adaptations make upstream's EPLB work there (``worker.py``);
3. puts ``VllmEplbPass`` into the post-grad pass slot, wrapping a user pass found there.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import TYPE_CHECKING

from eplb_graph.upstream import patches
from eplb_graph.upstream.adaptations import PLUGIN, adaptation, applicable
from eplb_graph.upstream.watchdog import stall_bound_from_env

from .elastic_gate import configure_elastic, elastic_off_while_building, elastic_problems
from .expert_views import SUPPORTED_QUANTIZATIONS, VIEWED_MOE_METHODS

if TYPE_CHECKING:
    from vllm.config import VllmConfig

LEGACY_EPLB_CONTROLS = (
    "dynamic_eplb",
    "expert_map_path",
    "expert_map_record_path",
    "init_redundancy_expert",
    "num_iterations_eplb_update",
    "num_wait_worker_iterations",
    "gate_eplb",
)
PASS_SLOT = adaptation("gate.post_grad_pass").shape.item  # "post_grad_custom_post_pass"


class EplbConfigError(ValueError):
    """EPLB was requested in a combination eplb-graph cannot serve."""


def check_eplb_request(engine_args, *, on_cpu: bool) -> None:
    """Raises EplbConfigError naming every unsupported part of an EPLB request."""
    problems = []
    eplb = engine_args.eplb_config
    if not eplb.use_async:
        problems.append("synchronous EPLB (eplb_config.use_async=False): eplb-graph supports asynchronous EPLB only")
    problems += elastic_problems(engine_args, on_cpu=on_cpu, environ=os.environ)
    if engine_args.enable_dbo:
        problems.append("enable_dbo=True: dual-batch overlap splits the unpadded-token count per micro-batch")
    legacy = sorted(set(engine_args.additional_config or {}) & set(LEGACY_EPLB_CONTROLS))
    if legacy:
        problems.append(
            f"additional_config {legacy}: Model Runner V1 EPLB controls cannot be mixed with enable_eplb/eplb_config"
        )
    if not engine_args.enable_expert_parallel:
        problems.append("enable_expert_parallel=False: EPLB needs expert parallel")
    if engine_args.quantization not in SUPPORTED_QUANTIZATIONS:
        problems.append(quantization_problem(engine_args.quantization))
    if on_cpu and engine_args.tensor_parallel_size > 1 and engine_args.data_parallel_size > 1 \
            and not engine_args.enable_elastic_ep:  # named there
        problems.append(
            f"tensor_parallel_size={engine_args.tensor_parallel_size} with data_parallel_size="
            f"{engine_args.data_parallel_size} on CPU: vLLM dispatches MoE tokens sequence-parallel over the EP group "
            f"there, which eplb-graph does not serve; use TP or DP for expert parallel"
        )
    if on_cpu and engine_args.prefill_context_parallel_size > 1:
        problems.append(
            f"prefill_context_parallel_size={engine_args.prefill_context_parallel_size} on CPU: eplb-graph serves "
            f"expert parallel over tensor and data parallel ranks there"
        )
    try:
        stall_bound_from_env(os.environ)  # the workers read it again; a bad value is named here, at start
    except ValueError as error:
        problems.append(f"the stall watchdog's bound: {error}")
    if problems:
        raise EplbConfigError("eplb-graph cannot serve this EPLB request:\n  " + "\n  ".join(problems))


def quantization_problem(quantization: str | None) -> str:
    supported = ", ".join("unquantized" if q is None else q for q in SUPPORTED_QUANTIZATIONS)
    return f"quantization={quantization!r} has no expert-weight view for EPLB movement (supported: {supported})"


def built_quantization_problem(config: VllmConfig) -> str | None:
    """Checks the quantization vLLM built (``VllmConfig.quant_config``): the checkpoint's own
    (``quant_method``) or an online one, whose MoE method the user's ``quantization_config`` may
    change, and which ``fp8`` becomes on a checkpoint without FP8 weights (online per-tensor)."""
    quantization = config.model_config.quantization if config.model_config is not None else None
    if quantization not in SUPPORTED_QUANTIZATIONS:  # detected from the checkpoint, not the arguments
        return quantization_problem(quantization)
    from vllm.model_executor.layers.quantization.online.base import OnlineQuantizationConfig

    online = config.quant_config
    if not isinstance(online, OnlineQuantizationConfig) or online.args.targets is not None or online.ignored_layers:
        # chosen by layer name (targets, or ignore patterns that may cover the experts): checked
        # when each layer is bound (expert_views), still before serving
        return None
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    resolved = online.resolve_quant_method_cls(RoutedExperts, "")
    if resolved is None:  # the MoE layers stay unquantized
        return None
    _source, weights, _pattern, _spec, method = resolved
    if method.__name__ in VIEWED_MOE_METHODS:
        return None
    why = " (vLLM quantizes `fp8` online when the checkpoint has no FP8 weights)" if quantization == "fp8" else ""
    viewed_online = [repr(name) for method_name, names in VIEWED_MOE_METHODS.items() if "Online" in method_name
                     for name in names]
    return (f"quantization={quantization!r} builds {method.__name__} for the MoE layers (online, weights "
            f"{weights}){why}, which has no expert-weight view for EPLB movement; online quantization with a "
            f"view: quantization={' or '.join(viewed_online)}")


def install_pass(compilation_config) -> None:
    """Our pass in the post-grad slot, wrapping (never replacing) a user pass there. Idempotent."""
    from .graph_pass import VllmEplbPass

    existing = compilation_config.inductor_compile_config.get(PASS_SLOT)
    if isinstance(existing, VllmEplbPass):
        return
    patches.configure("gate.post_grad_pass", VllmEplbPass(user_pass=existing), on=compilation_config)


def create_engine_config_with_eplb(upstream_create, engine_args, *args, **kwargs):
    from vllm.platforms import current_platform

    if not engine_args.enable_eplb:
        return upstream_create(engine_args, *args, **kwargs)  # plugin installed, EPLB off: upstream as is
    on_cpu = current_platform.is_cpu()
    check_eplb_request(engine_args, on_cpu=on_cpu)
    check_adaptations(platform_name(current_platform))
    if on_cpu:
        from vllm.config.parallel import EPLBConfig

        # ParallelConfig would refuse: build with EPLB off, then set a copy of the request on the result
        # (on the caller's arguments, not a copy: upstream's changes to their other fields reach the caller,
        # as without EPLB; the two fields are given back as they were, also when upstream refuses).
        requested = engine_args.eplb_config
        with patches.scoped("gate.args_enable_eplb", False, on=engine_args, by=PLUGIN), \
                patches.scoped("gate.args_eplb_config", EPLBConfig(), on=engine_args, by=PLUGIN), \
                elastic_off_while_building(engine_args):
            config = upstream_create(engine_args, *args, **kwargs)
        eplb = copy.deepcopy(requested)
        if eplb.communicator is None:  # upstream's auto-selection lives in the validator we skipped
            patches.configure("config.cpu_eplb_communicator", "torch_gloo", on=eplb)
        patches.configure("config.cpu_enable_eplb", True, on=config.parallel_config)
        patches.configure("config.cpu_eplb_config", eplb, on=config.parallel_config)
        if engine_args.enable_elastic_ep:
            configure_elastic(config, engine_args, os.environ)
    else:
        config = upstream_create(engine_args, *args, **kwargs)
    problem = built_quantization_problem(config)
    if problem:
        raise EplbConfigError("eplb-graph cannot serve this EPLB request:\n  " + problem)
    from eplb_graph.core.placement_file import PlacementFileError

    from .kept_placement import check_at_engine_start

    usage_context = kwargs.get("usage_context", args[0] if args else None)
    headless = kwargs.get("headless", args[1] if len(args) > 1 else False)  # a node with engines and no API server
    try:  # EPLB_GRAPH_PLACEMENT_FILE: a headless node's workers are not EP rank 0, which alone reads it
        check_at_engine_start(config, os.environ, check_file=not headless)
    except PlacementFileError as error:
        raise EplbConfigError(f"eplb-graph cannot serve this EPLB request:\n  {error}") from None
    install_pass(config.compilation_config)
    if getattr(usage_context, "name", None) == "OPENAI_API_SERVER" and not headless:  # its /metrics serves them
        from .metrics_export import MetricsDirError, export_to_server

        try:
            export_to_server()
        except MetricsDirError as error:
            raise EplbConfigError(f"eplb-graph cannot serve this EPLB request:\n  {error}") from None
    return config


def platform_name(platform) -> str:
    """vLLM's current platform as ``adaptations.When`` names platforms."""
    if platform.is_cpu():
        return "cpu"
    return "npu" if platform.device_type == "npu" else "cuda"


def check_adaptations(platform: str) -> None:
    """Refuses, naming each target, an EPLB request whose upstream adaptations do not hold here
    (``eplb-graph doctor`` reports the same checks), before any worker starts. It imports the
    modules they target, the model runners included: with EPLB on only."""
    broken = [check for check in patches.check_all(applicable(platform, PLUGIN)) if check.broken]
    if broken:
        raise EplbConfigError(
            "eplb-graph cannot serve EPLB on this vLLM: upstream changed what it adapts (run `eplb-graph doctor`):\n  "
            + "\n  ".join(f"{check.describe()}; eplb-graph adapts it for: {check.adaptation.why}" for check in broken))


def install_engine_config_gate() -> None:
    """Wraps ``EngineArgs.create_engine_config`` once per process."""
    if patches.installed("gate.create_engine_config"):
        return
    upstream_create = patches.current("gate.create_engine_config")

    @functools.wraps(upstream_create)
    def create_engine_config(self, *args, **kwargs):
        return create_engine_config_with_eplb(upstream_create, self, *args, **kwargs)

    patches.install("gate.create_engine_config", create_engine_config, by=PLUGIN)
