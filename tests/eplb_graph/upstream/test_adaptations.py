"""The registry of upstream adaptations: complete, consistent, and the only place that sets
an attribute of upstream; the benchmarks take back what they change."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from eplb_graph.upstream.adaptations import ADAPTATIONS, BY_KEY, HOW, PLUGIN, adaptation, applicable

ROOT = Path(__file__).resolve().parents[3]
PRODUCT = [ROOT / "eplb_graph", ROOT / "custom_ops", ROOT / "passes"]  # what `import eplb_graph` ships
UPSTREAM_ROOTS = ("vllm", "torch", "transformers", "vllm_ascend", "torch_npu", "triton")
BENCHMARKS = ROOT / "benchmarks"
REGISTRY = ROOT / "eplb_graph" / "upstream" / "patches.py"
# Where the user's model is changed, and nowhere else: enable() (its expert parameters in the
# physical layout, our mark on each experts module) and the adapter hook it calls for the experts'
# count (``MoEAdapter.set_num_physical``). The model was handed to enable() to be changed,
# whatever library its classes come from, so these edits are not adaptations of upstream; they
# are allowed here (setattr, and assignments through a handed parameter: ``spec.experts.x = ...``)
# and flagged anywhere else.
USER_MODEL = {ROOT / "eplb_graph" / "pytorch" / "enable.py", ROOT / "eplb_graph" / "pytorch" / "adapter_base.py"}
# Parameter names that mean an object a function is handed and does not own: upstream's (a model
# runner, engine arguments, a config, a layer, module or router, an EPLB state) or the user's
# model (``model``, ``experts``, ``spec``: a ``MoELayerSpec``, whose ``experts`` is the user's module).
HANDED = frozenset({
    "runner", "model_runner", "engine_args", "config", "vllm_config", "parallel_config", "compilation_config",
    "model_config", "eplb_config", "eplb_state", "model_state", "layer", "module", "router", "moe_runner",
    "quant_method", "loader", "model", "experts", "spec",
})
# The import system's hooks: attributes of a loader or finder, and the lists of finders
IMPORT_HOOKS = frozenset({"exec_module", "create_module", "load_module", "find_spec", "find_module"})
IMPORT_LISTS = ("meta_path", "path_hooks")  # of sys
LIST_CHANGES = frozenset({"insert", "append", "extend", "remove", "pop", "clear", "__setitem__", "__delitem__",
                          "__iadd__"})


def test_every_entry_is_well_formed_and_wraps_only_a_declared_entry_on_the_same_target():
    assert len(BY_KEY) == len(ADAPTATIONS)  # keys are unique
    for entry in ADAPTATIONS:
        assert entry.how in HOW, entry.key
        assert entry.why and entry.when.platforms and entry.when.component, entry.key
        if entry.wraps is not None:
            inner = adaptation(entry.wraps)
            assert inner.target == entry.target and inner.wraps is None, entry.key
        if entry.how == "hook":
            assert entry.shape.kind in ("callable", "instance", "absent"), entry.key
        assert (entry.shape.kind == "absent") <= (entry.how == "hook"), entry.key  # ours, on one instance
        assert (entry.how == "scoped") <= (entry.shape.kind == "field"), entry.key
        assert (entry.how == "insert") == (entry.shape.kind == "list"), entry.key
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
                        "quant.wna16_supports_eplb", "loader.create_model",  # what the plugin installs in every
                        # process that imports them
                        "imports.after_import", "imports.exec_module",  # and how it waits for those imports
                        # vLLM's elastic EP on CPU, whose upstream path there fails (it asserts CUDA)
                        *(a.key for a in ADAPTATIONS if a.key.startswith(("stateless_cpu.", "elastic_scaling.")))}
    assert {a.key for a in applicable("cpu", "runtime")} == set()  # a component is named whole, never in part


def _names_bound_by_imports(tree: ast.Module, *, upstream_only: bool = True) -> set[str]:
    """Names a module binds by its imports, anywhere in it (``import vllm...``, ``from torch...
    import x``, inside a function too): upstream's only, or every one (``upstream_only=False``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names
                      if not upstream_only or alias.name.split(".")[0] in UPSTREAM_ROOTS}
        elif isinstance(node, ast.ImportFrom) and (not upstream_only or (
                node.module and node.level == 0 and node.module.split(".")[0] in UPSTREAM_ROOTS)):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def _import_lists(tree: ast.Module) -> set[str]:
    """How a module names ``sys.meta_path`` and ``sys.path_hooks`` (``sys.meta_path``, or
    ``meta_path`` after ``from sys import meta_path``, ``_sys.meta_path`` after ``import sys as _sys``)."""
    names = {f"sys.{name}" for name in IMPORT_LISTS}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {f"{alias.asname}.{name}" for alias in node.names if alias.name == "sys" and alias.asname
                      for name in IMPORT_LISTS}
        elif isinstance(node, ast.ImportFrom) and node.module == "sys":
            names |= {alias.asname or alias.name for alias in node.names if alias.name in IMPORT_LISTS}
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _flat(targets: list[ast.expr]) -> list[ast.expr]:
    """Assignment targets with tuples and starred names unpacked (``a.x, b.y = ...``)."""
    flat = []
    for target in targets:
        if isinstance(target, (ast.Tuple, ast.List)):
            flat += _flat(target.elts)
        elif isinstance(target, ast.Starred):
            flat += _flat([target.value])
        else:
            flat.append(target)
    return flat


def _annotation_names(annotation: ast.expr | None) -> set[str]:
    """The root names an annotation mentions, string annotations (``"VllmConfig"``) parsed."""
    if annotation is None:
        return set()
    names = set()
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                names |= _annotation_names(ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                pass
    return names


class _EditScan(ast.NodeVisitor):
    """One module's edits of objects it does not own (``upstream_edits`` states the rules)."""

    def __init__(self, roots: set[str], upstream: set[str], import_lists: set[str], *, user_model: bool,
                 patch_blocks: bool) -> None:
        self.roots, self.upstream, self.import_lists = roots, upstream, import_lists
        self.user_model, self.patch_blocks = user_model, patch_blocks
        self.handed: list[set[str]] = [set()]  # the marked parameters in scope, innermost last
        self.scopes: list[str] = ["module"]
        self.managed: set[int] = set()  # calls that are a `with` item or a decorator
        self.found: list[str] = []

    def _add(self, node: ast.AST, what: str) -> None:
        self.found.append(f"{node.lineno} {what}")

    def _marked(self, arg: ast.arg, first: bool) -> bool:
        if arg.arg in HANDED or first and arg.arg == "self" and self.scopes[-1] == "function":
            return True  # by its name; or the ``self`` of a method we define inside a function to install
        names = _annotation_names(arg.annotation)
        return bool(names & self.upstream) or bool(names & set(UPSTREAM_ROOTS))

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        for decorator in getattr(node, "decorator_list", []):
            self.managed.add(id(decorator))
        args = node.args
        params = [*args.posonlyargs, *args.args, *([args.vararg] if args.vararg else []), *args.kwonlyargs,
                  *([args.kwarg] if args.kwarg else [])]
        inherited = self.handed[-1] - {a.arg for a in params}
        self.handed.append(inherited | {a.arg for i, a in enumerate(params) if self._marked(a, i == 0)})
        self.scopes.append("function")
        self.generic_visit(node)
        self.scopes.pop()
        self.handed.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for decorator in node.decorator_list:
            self.managed.add(id(decorator))
        self.handed.append(set())  # a class body sees no function's parameters by name
        self.scopes.append("class")
        self.generic_visit(node)
        self.scopes.pop()
        self.handed.pop()

    def visit_With(self, node: ast.With | ast.AsyncWith) -> None:
        self.managed |= {id(item.context_expr) for item in node.items}
        self.generic_visit(node)

    visit_AsyncWith = visit_With

    def _targets(self, node: ast.AST, targets: list[ast.expr]) -> None:
        for target in _flat(targets):
            text = ast.unparse(target)
            root = _root(target)
            if text in self.import_lists or (isinstance(target, ast.Subscript)
                                             and ast.unparse(target.value) in self.import_lists):
                self._add(node, text)
            elif isinstance(target, ast.Attribute) and target.attr in IMPORT_HOOKS:
                self._add(node, text)
            elif isinstance(target, ast.Attribute) and root in self.roots:
                self._add(node, text)
            elif isinstance(target, ast.Attribute) and root in self.handed[-1] and not self.user_model:
                self._add(node, text)
            elif isinstance(target, ast.Subscript) and (text.startswith("vars(") or ".__dict__[" in text):
                self._add(node, text)

    def visit_Assign(self, node: ast.Assign) -> None:
        self._targets(node, node.targets)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        self._targets(node, node.targets)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign | ast.AnnAssign) -> None:
        self._targets(node, [node.target])
        self.generic_visit(node)

    visit_AnnAssign = visit_AugAssign

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = ast.unparse(func)
        if name in ("setattr", "delattr") or isinstance(func, ast.Attribute) and func.attr in ("__setattr__",
                                                                                                "__delattr__"):
            if not self.user_model:
                self._add(node, name)
        elif (isinstance(func, ast.Attribute) and func.attr in LIST_CHANGES
              and ast.unparse(func.value) in self.import_lists):
            self._add(node, name)
        elif self.patch_blocks and _is_patch(name) and id(node) not in self.managed:
            self._add(node, f"{name} outside a with or a decorator")
        self.generic_visit(node)


def _is_patch(name: str) -> bool:
    """A ``unittest.mock`` patcher: ``patch``, ``patch.object``, ``mock.patch.dict``..."""
    parts = name.split(".")
    return "patch" in parts and parts[0] in ("patch", "mock", "unittest") and parts[-1] in (
        "patch", "object", "dict", "multiple")


def upstream_edits(source: str, *, user_model: bool = False, benchmark: bool = False) -> list[str]:
    """Where ``source`` sets or deletes an attribute of an object it does not own, by itself
    (``patches.py``, which does it for the registry, is not scanned). Found:

    * any ``setattr`` / ``delattr`` / ``x.__setattr__`` / ``x.__delattr__`` call;
    * an assignment, augmented assignment or ``del`` (tuple targets unpacked) whose target is an
      attribute hanging off (a) a name the module binds to an upstream module or object by an
      import, or (b) a parameter marked as handed to the function: named in ``HANDED``
      (``runner``, ``engine_args``, ``config``, ``layer``, ``module``, ``model``, ``spec``...), or
      annotated with an upstream name (``nn.Module``, ``"VllmConfig"``, ``torch.fx.GraphModule``),
      or the ``self`` of a function defined in a function (a method made to be installed on
      someone else's class). A nested function sees the marked names of the functions around it,
      unless a parameter of its own takes the name; a parameter stays marked when the body
      rebinds it (the scan follows no values: a function that means one of our own objects by
      such a name names it otherwise);
    * ``vars(x)[...] =`` and ``x.__dict__[...] =``;
    * the import system changed: an assignment to an attribute named ``exec_module``,
      ``create_module``, ``load_module``, ``find_spec`` or ``find_module`` (off any object), and
      ``sys.meta_path`` / ``sys.path_hooks`` assigned, item-assigned, or changed by ``insert``,
      ``append``, ``extend``, ``remove``, ``pop``, ``clear``.

    ``user_model`` (the modules in ``USER_MODEL``): setattr and assignments through handed
    parameters are the user's model's edits there, not found; the rest is.
    ``benchmark`` (``benchmarks/``): (a) covers every name bound by an import, ours too (a
    benchmark that replaces a class's method must put it back), and a ``unittest.mock`` patcher
    called anywhere but as a ``with`` item or a decorator is found too (one started by hand may
    never be stopped): ``with mock.patch.object(Class, "name", new):`` is the way to replace.

    Not seen: objects reached through locals (``x = runner.cache; x.y = 1``), other containers'
    items, and anything done by a call the scan cannot read (``functools.partial(setattr, ...)``).
    """
    tree = ast.parse(source)
    upstream = _names_bound_by_imports(tree)
    roots = _names_bound_by_imports(tree, upstream_only=False) if benchmark else upstream
    scan = _EditScan(roots, upstream, _import_lists(tree), user_model=user_model, patch_blocks=benchmark)
    scan.visit(tree)
    return sorted(set(scan.found), key=lambda edit: (int(edit.split()[0]), edit))


def test_nothing_but_the_registry_sets_an_attribute_of_upstream():
    """Instance attributes of upstream objects the tree is handed (a runner, a config) are set
    through the registry too: they are ``hook``, ``scoped`` and ``config`` entries."""
    found = []
    for path in sorted(p for root in PRODUCT for p in root.rglob("*.py")):
        if path != REGISTRY:
            found += [f"{path.relative_to(ROOT)}:{edit}" for edit in
                      upstream_edits(path.read_text(), user_model=path in USER_MODEL)]
    assert found == []


def test_the_user_model_is_changed_only_where_it_is_allowed():
    """Each module allowed to change the user's model does, and only through what it was handed
    (without the allowance its edits are found); the allowance names no module that does not."""
    for path in sorted(USER_MODEL):
        source = path.read_text()
        assert upstream_edits(source, user_model=True) == []
        assert upstream_edits(source), path.relative_to(ROOT)


def test_a_benchmark_takes_back_what_it_changes():
    """A benchmark leaves every module and class as it found them: no attribute set on anything
    imported (ours included), no setattr, mock patchers as context managers or decorators."""
    found = []
    for path in sorted(BENCHMARKS.rglob("*.py")):
        found += [f"{path.relative_to(ROOT)}:{edit}" for edit in upstream_edits(path.read_text(), benchmark=True)]
    assert found == []


def test_the_scan_finds_each_form_it_looks_for():
    source = ("from vllm.distributed import parallel_state\nimport torch\n"
              "parallel_state._EP = None\ntorch._dynamo.config.x = 1\nlocal.y = 2\ndel parallel_state._EPLB\n"
              "setattr(thing, 'a', 1)\nvars(runner)['eplb_step'] = f\nrunner.__dict__['x'] = 1\n"
              "parallel_state.a, torch.b = 1, 2\n")
    assert upstream_edits(source) == ["3 parallel_state._EP", "4 torch._dynamo.config.x", "6 parallel_state._EPLB",
                                      "7 setattr", "8 vars(runner)['eplb_step']", "9 runner.__dict__['x']",
                                      "10 parallel_state.a", "10 torch.b"]


def test_the_scan_finds_edits_through_what_a_function_is_handed():
    source = """\
from torch import nn
from vllm.config import VllmConfig


def attach(runner, worker):
    runner.eplb_graph = worker  # named as upstream's
    worker.runner = runner  # ours (not a handed name): not found


def gate(engine_args, *args):
    engine_args.enable_eplb, engine_args.eplb_config = False, None  # tuple targets unpacked
    del engine_args.x


def typed(thing: nn.Module, cfg: "VllmConfig", other: int):
    thing.num_experts = 4  # annotated with an upstream name
    cfg.parallel_config.enable_eplb = True  # a string annotation
    other.x = 1  # not found
    thing.__setattr__("y", 1)


def outer(layer, cfg: "VllmConfig"):
    def inner():
        layer.router.x = 1  # the closure's handed name
    def shadowed(cfg: int):
        cfg.x = 1  # a parameter of its own, not handed: not found
    def method(self, x):
        self.calls = x  # a method made inside a function, for someone else's class
    class Local:
        def method(self):
            self.y = 1  # a class's own method: not found


def imports(spec, finder):
    import sys
    from sys import path_hooks
    spec.loader.exec_module = finder  # a loader's hook, off any object
    sys.meta_path.insert(0, finder)
    sys.meta_path.append(finder)
    path_hooks[0] = finder
    sys.meta_path = [finder]
    sys.meta_path += [finder]
    meta_path = finder.path  # a local of that name: not found
"""
    assert upstream_edits(source) == [
        "6 runner.eplb_graph", "11 engine_args.enable_eplb", "11 engine_args.eplb_config", "12 engine_args.x",
        "16 thing.num_experts", "17 cfg.parallel_config.enable_eplb", "19 thing.__setattr__",
        "24 layer.router.x", "28 self.calls", "37 spec.loader.exec_module", "38 sys.meta_path.insert",
        "39 sys.meta_path.append", "40 path_hooks[0]", "41 sys.meta_path", "42 sys.meta_path"]
    # a module allowed to change the user's model: its handed objects and setattr are its own to change
    assert upstream_edits(source, user_model=True) == [
        "37 spec.loader.exec_module", "38 sys.meta_path.insert", "39 sys.meta_path.append", "40 path_hooks[0]",
        "41 sys.meta_path", "42 sys.meta_path"]


def test_the_benchmark_scan_finds_what_is_not_taken_back():
    source = """\
from unittest import mock
from unittest.mock import patch

from eplb_graph.movement import mover


def run():
    mover.GlooStagedCommunicator.execute = timed     # 8: ours, replaced and never restored
    patcher = mock.patch.object(mover, "x", 1)       # 9: started by hand, maybe never stopped
    with mock.patch.object(mover.GlooStagedCommunicator, "execute", timed), patch("a.b", 1):
        pass                                         # taken back at the block's end


@patch.object(mover, "y", 2)
def decorated():
    pass
"""
    assert upstream_edits(source) == []  # the product's scan: nothing upstream
    assert upstream_edits(source, benchmark=True) == [
        "8 mover.GlooStagedCommunicator.execute", "9 mock.patch.object outside a with or a decorator"]
