"""Attaching eplb-graph to vLLM's model runners, without importing a runner ourselves.

``VllmEplbWorker`` must bind the MoE layers right after a runner's ``load_model``. The runner
classes live in heavy modules (the GPU runner module alone takes seconds to import) that the
frontend process never needs, and the plugin loads in every vLLM process: importing them at
plugin load would slow every engine start, EPLB on or off. So the plugin wraps
``load_model`` of each runner class when vLLM itself imports the class's module (or at once,
if it is already imported: ``import_hooks``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

from .ascend import ASCEND_RUNNERS
from .import_hooks import call_after_import

# (module, class) of every runner whose load_model is wrapped. The CPU runner overrides
# load_model without calling the GPU runner's, so each class is wrapped on its own.
RUNNERS = (
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    *ASCEND_RUNNERS,
)
_RUNNER_MARK = "__eplb_graph_runner__"


def attach_after_load(runner) -> None:
    """Binds EPLB to a runner that just loaded its model (EPLB on only)."""
    if not runner.parallel_config.enable_eplb or getattr(runner, "eplb_graph", None) is not None:
        return
    if not hasattr(runner, "eplb_state") and hasattr(runner, "eplb"):
        raise RuntimeError(
            f"eplb-graph does not support Model Runner V2 yet ({type(runner).__name__} keeps its EPLB state in "
            f"runner.eplb, an EPLBController, not runner.eplb_state): serve with Model Runner V1 or without "
            f"enable_eplb"
        )
    from .worker import VllmEplbWorker

    runner.eplb_graph = VllmEplbWorker(runner)


def wrap_load_model(runner_class: type) -> None:
    """``load_model`` followed by ``attach_after_load``; once per class. An inherited
    ``load_model`` is wrapped too (vllm-ascend's V2 runner inherits vLLM's MRv2 one)."""
    upstream_load = getattr(runner_class, "load_model", None)
    if upstream_load is None or getattr(upstream_load, _RUNNER_MARK, False):
        return

    @functools.wraps(upstream_load)
    def load_model(self, *args, **kwargs):
        result = upstream_load(self, *args, **kwargs)
        attach_after_load(self)
        return result

    setattr(load_model, _RUNNER_MARK, True)
    runner_class.load_model = load_model


def _wrap_class_of(class_name: str) -> Callable[[ModuleType], None]:
    def wrap(module: ModuleType) -> None:
        runner_class = getattr(module, class_name, None)
        if isinstance(runner_class, type):
            wrap_load_model(runner_class)

    return wrap


def install_runner_hooks() -> None:
    """Wraps the runners already imported and every runner module imported from now on. Idempotent."""
    for module_name, class_name in RUNNERS:
        call_after_import(module_name, f"eplb-graph runner {class_name}", _wrap_class_of(class_name))
