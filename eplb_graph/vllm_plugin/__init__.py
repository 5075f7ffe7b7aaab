"""eplb-graph as a vLLM plugin: ``enable_eplb=True`` in graph mode, on CPU too.

The ``vllm.general_plugins`` entry point ``register`` runs in every vLLM process (engine, engine
core, workers). EPLB off: nothing but the op registration and wrappers that defer to upstream
(the runners' ``load_model``, the engine config, one quant method's ``supports_eplb``, the model
loader's ``create_model``). EPLB on: the config gate checks the request, lifts the CPU refusal
and installs the pass; after each model runner loads its model, ``VllmEplbWorker`` binds every
MoE layer (``runner_hooks.py``);
quant methods upstream refuses EPLB for but whose experts have a view are served
(``quant_methods.py``); under expert parallel on CPU, experts the local-pairs op cannot bind are
refused when the model is built (``experts_gate.py``)."""

from __future__ import annotations

from eplb_graph.upstream.adaptations import PLUGIN, adaptation

from .import_hooks import call_after_import
from .runner_hooks import attach_after_load, install_runner_hooks

STATELESS_CPU = ("stateless_cpu.coordinator_init", "stateless_cpu.eplb_communicator")  # stateless_cpu.INSTALLED
__all__ = ["attach_after_load", "install_runner_hooks", "register"]


def register() -> None:
    """Entry point (``vllm.general_plugins``); idempotent."""
    import eplb_graph.custom_ops  # noqa: F401  (the ops, in every vLLM process)

    from .config_gate import install_engine_config_gate
    from .experts_gate import install_experts_gate
    from .quant_methods import install_quant_method_hooks

    install_engine_config_gate()
    install_runner_hooks()
    install_quant_method_hooks()
    install_experts_gate()
    # vLLM's elastic EP groups on CPU (stateless_cpu.py), each adaptation once vLLM imports its module
    for key in STATELESS_CPU:
        call_after_import(adaptation(key).module, f"eplb-graph {key}", lambda module, key=key: install_stateless_cpu(key))
    call_after_import(adaptation("elastic_scaling.load_model").module, "eplb-graph elastic scaling",
                      lambda module: install_elastic_scaling())


def install_elastic_scaling() -> None:
    from .elastic_scaling import ElasticCpuScaling

    ElasticCpuScaling.install(PLUGIN)


def install_stateless_cpu(key: str) -> None:
    from .stateless_cpu import install_for_plugin

    install_for_plugin(key)
