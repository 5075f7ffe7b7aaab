"""eplb-graph as a vLLM plugin: ``enable_eplb=True`` in graph mode, on CPU too.

The ``vllm.general_plugins`` entry point ``register`` runs in every vLLM process (engine,
engine core, workers). EPLB off: nothing but the op registration and two wrappers that
defer to upstream. EPLB on: the config gate checks the request, lifts the CPU refusal and
installs the pass; after each model runner loads its model, ``VllmEplbWorker`` binds
every MoE layer.
"""

from __future__ import annotations

import functools

_RUNNER_MARK = "__eplb_graph_runner__"


def register() -> None:
    """Entry point (``vllm.general_plugins``); idempotent."""
    import eplb_graph.custom_ops  # noqa: F401  (the ops, in every vLLM process)

    from .config_gate import install_engine_config_gate

    install_engine_config_gate()
    install_runner_hooks()


def attach_after_load(runner) -> None:
    """Binds EPLB to a runner that just loaded its model (EPLB on only)."""
    if not runner.parallel_config.enable_eplb or getattr(runner, "eplb_graph", None) is not None:
        return
    from .worker import VllmEplbWorker

    runner.eplb_graph = VllmEplbWorker(runner)


def install_runner_hooks() -> None:
    """``load_model`` of the CPU, GPU and Ascend model runners, followed by ``attach_after_load``.

    The CPU runner overrides ``load_model`` without calling the GPU runner's, so each class
    is wrapped once. Importing a runner module is cheap on the host it targets only; a
    runner that cannot be imported here is a platform this process does not run.
    """
    targets = []
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        targets.append(CPUModelRunner)
    except ImportError:
        pass
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        targets.append(GPUModelRunner)
    except ImportError:
        pass
    from .ascend import ascend_runner_classes

    targets.extend(ascend_runner_classes())
    for runner_class in targets:
        upstream_load = runner_class.__dict__.get("load_model")
        if upstream_load is None or getattr(upstream_load, _RUNNER_MARK, False):
            continue

        def make(upstream_load):
            @functools.wraps(upstream_load)
            def load_model(self, *args, **kwargs):
                result = upstream_load(self, *args, **kwargs)
                attach_after_load(self)
                return result

            setattr(load_model, _RUNNER_MARK, True)
            return load_model

        runner_class.load_model = make(upstream_load)
