"""The registry of upstream adaptations: complete, consistent, and the only place that sets
an attribute of upstream."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from eplb_graph.upstream.adaptations import ADAPTATIONS, BY_KEY, HOW, PLUGIN, adaptation, applicable

ROOT = Path(__file__).resolve().parents[3]
PRODUCT = [ROOT / "eplb_graph", ROOT / "custom_ops", ROOT / "passes"]  # what `import eplb_graph` ships
UPSTREAM_ROOTS = ("vllm", "torch", "transformers", "vllm_ascend", "torch_npu", "triton")
REGISTRY = ROOT / "eplb_graph" / "upstream" / "patches.py"
# setattr on objects that are not upstream's: the user's model under enable() (its expert
# parameters in the physical layout, and our mark on it)
NOT_UPSTREAM = {ROOT / "eplb_graph" / "pytorch" / "enable.py"}


def test_every_entry_is_well_formed_and_wraps_only_a_declared_entry_on_the_same_target():
    assert len(BY_KEY) == len(ADAPTATIONS)  # keys are unique
    for entry in ADAPTATIONS:
        assert entry.how in HOW, entry.key
        assert entry.why and entry.when.platforms and entry.when.component, entry.key
        if entry.wraps is not None:
            inner = adaptation(entry.wraps)
            assert inner.target == entry.target and inner.wraps is None, entry.key
        if entry.how == "hook":
            assert entry.shape.kind in ("callable", "instance"), entry.key
    targets = [(a.target, a.wraps) for a in ADAPTATIONS]
    assert len(set(targets)) == len(targets)  # one adaptation per target and layer


def test_an_undeclared_key_is_named():
    with pytest.raises(KeyError, match="no adaptation 'capability.nothing' is declared"):
        adaptation("capability.nothing")


def test_applicable_filters_by_platform_component_and_eplb():
    on_cpu = {a.key for a in applicable("cpu", PLUGIN)}
    assert {"gate.create_engine_config", "capability.state_event", "local_experts.fp8", "dp_dispatch.all_gatherv"} <= on_cpu
    assert "runner.ascend_v1_load_model" not in on_cpu and "elastic.ep_group" not in on_cpu  # NPU's; elastic's
    on_cuda = {a.key for a in applicable("cuda", PLUGIN)}
    assert "capability.state_event" not in on_cuda and "capability.commit_layer" in on_cuda
    assert "runner.cpu_load_model" not in on_cuda and "runner.gpu_load_model" in on_cuda
    eplb_off = {a.key for a in applicable("cpu", PLUGIN, eplb_on=False)}
    assert eplb_off == {"gate.create_engine_config", "runner.cpu_load_model", "runner.gpu_load_model",
                        "quant.wna16_supports_eplb"}  # what the plugin installs in every process that imports them
    assert {a.key for a in applicable("cpu", "runtime")} == set()  # a component is named whole, never in part


def _upstream_names(tree: ast.Module) -> set[str]:
    """Names a module binds to upstream modules or objects (``import vllm...``, ``from torch... import x``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names
                      if alias.name.split(".")[0] in UPSTREAM_ROOTS}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in UPSTREAM_ROOTS:
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def upstream_edits(source: str, *, setattr_allowed: bool = False) -> list[str]:
    """Where ``source`` sets or deletes an attribute of upstream by itself: any ``setattr`` /
    ``delattr`` (unless allowed), any assignment or ``del`` whose target hangs off a name bound to
    an upstream module or object, and any ``vars(x)[...] =`` / ``x.__dict__[...] =``."""
    tree = ast.parse(source)
    upstream = _upstream_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            if not setattr_allowed:
                found.append(f"{node.lineno} {node.func.id}")
        targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            text = ast.unparse(target)
            if isinstance(target, ast.Attribute) and _root(target) in upstream:
                found.append(f"{node.lineno} {text}")
            elif isinstance(target, ast.Subscript) and (text.startswith("vars(") or ".__dict__[" in text):
                found.append(f"{node.lineno} {text}")
    return sorted(found, key=lambda edit: int(edit.split()[0]))


def test_nothing_but_the_registry_sets_an_attribute_of_upstream():
    """Instance attributes of upstream objects the tree is handed (a runner, a config) are set
    through the registry too: they are ``hook`` and ``config`` entries."""
    found = []
    for path in sorted(p for root in PRODUCT for p in root.rglob("*.py")):
        if path != REGISTRY:
            found += [f"{path.relative_to(ROOT)}:{edit}" for edit in
                      upstream_edits(path.read_text(), setattr_allowed=path in NOT_UPSTREAM)]
    assert found == []


def test_the_scan_finds_each_form_it_looks_for():
    source = ("from vllm.distributed import parallel_state\nimport torch\n"
              "parallel_state._EP = None\ntorch._dynamo.config.x = 1\nlocal.y = 2\ndel parallel_state._EPLB\n"
              "setattr(thing, 'a', 1)\nvars(runner)['eplb_step'] = f\nrunner.__dict__['x'] = 1\n")
    assert upstream_edits(source) == ["3 parallel_state._EP", "4 torch._dynamo.config.x", "6 parallel_state._EPLB",
                                      "7 setattr", "8 vars(runner)['eplb_step']", "9 runner.__dict__['x']"]
