"""Calling back once a module has been imported, without importing it ourselves.

The plugin loads in every vLLM process; the modules it adapts (model runners, quant methods)
are heavy and many processes never need them, so each adaptation waits for vLLM's own import
of its module (or runs at once, if the module is already imported). One finder serves every
hook; a module nobody imports is never touched. Both changes to the import system are declared
adaptations (``imports.*``): the finder goes into ``sys.meta_path`` through the registry (which
takes it out again on ``uninstall``), and the hook on a waited-for module's loader comes off
as soon as that module has executed.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable
from types import ModuleType

from eplb_graph.upstream import patches
from eplb_graph.upstream.adaptations import PLUGIN


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls each of ``callbacks[name]`` with the module once it has executed; finds nothing itself."""

    def __init__(self) -> None:
        self.callbacks: dict[str, dict[str, Callable[[ModuleType], None]]] = defaultdict(dict)

    def find_spec(self, fullname, path, target=None):
        callbacks = self.callbacks.get(fullname)
        if not callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is not None and hasattr(loader, "exec_module"):
            upstream_exec = loader.exec_module  # a loader instance serves this one module

            def exec_module(module: ModuleType) -> None:
                try:
                    upstream_exec(module)
                finally:
                    patches.uninstall("imports.exec_module", on=loader)  # the loader as it was, once it ran
                for callback in list(callbacks.values()):
                    callback(module)

            try:
                patches.install("imports.exec_module", exec_module, by=self, on=loader)
            except patches.AdaptationError as error:  # never failing vLLM's import: its module as upstream's
                warnings.warn(f"eplb-graph cannot call back after importing {fullname}: {error}", RuntimeWarning,
                              stacklevel=2)
        return spec


def call_after_import(module_name: str, key: str, callback: Callable[[ModuleType], None]) -> None:
    """``callback(module)`` now if ``module_name`` is imported, else right after vLLM imports it
    (one callback per ``key``). A callback must be idempotent: for a module already imported, each
    call runs it again."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    finder = next((f for f in sys.meta_path if isinstance(f, AfterImport)), None)
    if finder is None:
        finder = AfterImport()
        patches.install("imports.after_import", finder, by=PLUGIN)
    finder.callbacks[module_name][key] = callback
