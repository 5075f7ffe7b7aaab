"""Calling back after an import: through the registry, the loader given back once its module ran."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from eplb_graph.upstream import patches
from eplb_graph.vllm_plugin.import_hooks import AfterImport, call_after_import


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for finder in sys.meta_path:
        if isinstance(finder, AfterImport):
            for name in ("later_hooked_module", "later_failing_module"):
                finder.callbacks.pop(name, None)
    for name in ("later_hooked_module", "later_failing_module"):
        sys.modules.pop(name, None)


def test_the_finder_is_the_registrys_and_the_loader_is_given_back_once_its_module_ran(module_dir):
    (module_dir / "later_hooked_module.py").write_text("VALUE = 1\n")
    seen = []
    call_after_import("later_hooked_module", "test", lambda module: seen.append(module.VALUE))
    assert patches.installed("imports.after_import")
    finder, = [f for f in sys.meta_path if isinstance(f, AfterImport)]
    import later_hooked_module

    assert seen == [1]
    loader = later_hooked_module.__loader__
    assert "exec_module" not in vars(loader) and patches.LEDGER not in vars(loader)  # upstream's loader as it was
    assert not patches.installed("imports.exec_module", on=loader)
    assert finder in sys.meta_path  # it serves later imports (its key stays registered)


def test_a_module_that_fails_leaves_its_loader_as_it_was_and_calls_nothing(module_dir):
    (module_dir / "later_failing_module.py").write_text("raise RuntimeError('broken module')\n")
    seen = []
    call_after_import("later_failing_module", "test", seen.append)
    finder, = [f for f in sys.meta_path if isinstance(f, AfterImport)]
    spec = finder.find_spec("later_failing_module", None)  # as the import system asks it
    assert patches.installed("imports.exec_module", on=spec.loader)
    module = importlib.util.module_from_spec(spec)
    with pytest.raises(RuntimeError, match="broken module"):
        spec.loader.exec_module(module)
    assert seen == [] and "exec_module" not in vars(spec.loader)
    assert not patches.installed("imports.exec_module", on=spec.loader)
