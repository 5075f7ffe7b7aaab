"""Attaching eplb-graph to vLLM's model runners, without importing a runner ourselves.

``VllmEplbWorker`` must bind the MoE layers right after a runner's ``load_model``. The runner
classes live in heavy modules (the GPU runner module alone takes seconds to import) that the
frontend process never needs, and the plugin loads in every vLLM process: importing them at
plugin load would slow every engine start, EPLB on or off. So the plugin wraps
``load_model`` of each runner class when vLLM itself imports the class's module (or at once,
if it is already imported: ``import_hooks``). Only with EPLB on does the config gate import them
in the frontend, to check their adaptations before any worker starts.
"""

from __future__ import annotations

import functools
import warnings

from eplb_graph.upstream import patches
from eplb_graph.upstream.adaptations import ADAPTATIONS, PLUGIN

from .import_hooks import call_after_import

# (module, class, adaptation) of every runner whose load_model is wrapped (``runner.*`` in
# adaptations.py). The CPU runner overrides load_model without calling the GPU runner's, so each
# class is wrapped on its own.
RUNNERS = tuple((a.module, a.qualname.split(".")[0], a.key) for a in ADAPTATIONS if a.key.startswith("runner."))


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

    patches.install("worker.on_runner", VllmEplbWorker(runner), by=PLUGIN, on=runner)  # runner.eplb_graph


def wrap_load_model(key: str) -> None:
    """``load_model`` followed by ``attach_after_load``; once per class. An inherited
    ``load_model`` is wrapped too (vllm-ascend's V2 runner inherits vLLM's MRv2 one). Runs while
    vLLM imports the runner's module, EPLB on or off: a runner upstream changed is left as it is,
    with a warning (never failing vLLM's import); the config gate refuses EPLB on it by name."""
    if patches.installed(key):
        return
    try:
        upstream_load = patches.current(key)
    except patches.AdaptationError as error:
        warnings.warn(f"eplb-graph cannot bind EPLB after this runner's load: {error}", RuntimeWarning, stacklevel=2)
        return

    @functools.wraps(upstream_load)
    def load_model(self, *args, **kwargs):
        result = upstream_load(self, *args, **kwargs)
        attach_after_load(self)
        return result

    patches.install(key, load_model, by=PLUGIN)


def install_runner_hooks() -> None:
    """Wraps the runners already imported and every runner module imported from now on. Idempotent."""
    for module_name, class_name, key in RUNNERS:
        call_after_import(module_name, f"eplb-graph runner {class_name}", lambda module, key=key: wrap_load_model(key))
