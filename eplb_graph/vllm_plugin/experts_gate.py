"""Experts the local-pairs op cannot bind, refused when vLLM builds the model, before any weight loads.

Under expert parallel on CPU each MoE layer's experts must be one of the classes
``local_experts.py`` binds (``PAIR_EXPERTS``). vLLM's quant method picks that class when the
layer is built (``experts_cls``, from its backend oracle) and instantiates it only after the
weights load, when the worker binds the layer. ``BaseModelLoader.create_model`` is wrapped: with
EPLB on, on CPU, each layer under expert parallel whose method names a class that is none of the
listed ones (vLLM 0.32's ``CPUExpertsInt8``, ``CPUExpertsFp8W8A8``, the monolithic
``CPUExpertsInt4`` of ``cpu_int4_moe``) is refused there, by layer and class, before the
checkpoint is read. A method that names no class (``experts_cls`` None) is left to the bind,
which checks the instance itself.
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType

from torch import nn

from eplb_graph.upstream import patches
from eplb_graph.upstream.adaptations import PLUGIN, adaptation

from .import_hooks import call_after_import
from .local_experts import PAIR_EXPERTS, LocalExpertsError, listed_classes

ADAPTATION = "loader.create_model"
LOADER_MODULE = adaptation(ADAPTATION).module


def unbindable_layers(model: nn.Module) -> list[str]:
    """``layer: class`` for each MoE layer under expert parallel whose quant method's experts class
    is none of ``PAIR_EXPERTS`` (matched by identity: a class of the same name elsewhere is none)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    listed = tuple(listed_classes().values())
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, RoutedExperts) or not module.use_ep:
            continue
        chosen = getattr(module.quant_method, "experts_cls", None)
        if isinstance(chosen, type) and not issubclass(chosen, listed):
            found.append(f"{getattr(module, 'layer_name', name)}: {chosen.__module__}.{chosen.__qualname__}")
    return found


def refuse_unbindable(model: nn.Module) -> None:
    found = unbindable_layers(model)
    if found:
        raise LocalExpertsError(
            f"expert parallel on CPU runs each rank's own pairs through vLLM's {', '.join(PAIR_EXPERTS)}; "
            f"{len(found)} MoE layer(s) were built with other experts (refused before loading any weight):\n  "
            + "\n  ".join(found[:8]) + (f"\n  ... and {len(found) - 8} more" if len(found) > 8 else ""))


def _wrap_create_model(module: ModuleType) -> None:
    """Called once vLLM imported the loader module, EPLB on or off (off: upstream's call only)."""
    if patches.installed(ADAPTATION):
        return
    try:
        upstream = patches.current(ADAPTATION)
    except patches.AdaptationError as error:  # an upstream refactor: the bind still refuses, after loading
        warnings.warn(f"{error}; unbindable experts are refused after the weights load", RuntimeWarning, stacklevel=2)
        return
    patches.install(ADAPTATION, checked(upstream), by=PLUGIN)


def checked(upstream_create):
    """``create_model`` followed, with EPLB on and on CPU, by ``refuse_unbindable``."""
    @functools.wraps(upstream_create)
    def create_model(self, vllm_config, *args, **kwargs):
        model = upstream_create(self, vllm_config, *args, **kwargs)
        if vllm_config.parallel_config.enable_eplb and vllm_config.device_config.device_type == "cpu":
            refuse_unbindable(model)
        return model

    return create_model


def install_experts_gate() -> None:
    """Wraps ``create_model`` once vLLM imports its module. Idempotent."""
    call_after_import(LOADER_MODULE, "eplb-graph experts gate", _wrap_create_model)
