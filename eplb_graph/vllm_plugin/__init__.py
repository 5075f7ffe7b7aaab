"""eplb-graph as a vLLM plugin: ``enable_eplb=True`` in graph mode, on CPU too.

The ``vllm.general_plugins`` entry point ``register`` runs in every vLLM process (engine, engine
core, workers). EPLB off: nothing but the op registration and wrappers that defer to upstream
(the runners' ``load_model``, the engine config, one quant method's ``supports_eplb``). EPLB on:
the config gate checks the request, lifts the CPU refusal and installs the pass; after each
model runner loads its model, ``VllmEplbWorker`` binds every MoE layer (``runner_hooks.py``);
quant methods upstream refuses EPLB for but whose experts have a view are served
(``quant_methods.py``)."""

from __future__ import annotations

from .runner_hooks import attach_after_load, install_runner_hooks

__all__ = ["attach_after_load", "install_runner_hooks", "register"]


def register() -> None:
    """Entry point (``vllm.general_plugins``); idempotent."""
    import eplb_graph.custom_ops  # noqa: F401  (the ops, in every vLLM process)

    from .config_gate import install_engine_config_gate
    from .quant_methods import install_quant_method_hooks

    install_engine_config_gate()
    install_runner_hooks()
    install_quant_method_hooks()
