"""Imports flow one way: the reference runtime stands on the product, never the product on it.

Every ``.py`` file of the product (``eplb_graph/``, with ``custom_ops/`` and ``passes/`` under the
names they install as) and of the reference (``reference/eplb_reference/``) is parsed, not imported:
importing would execute only the imports a test happens to reach, and a lazy import inside a
function is the one a circular-import failure hides behind. Every import statement counts, at
module level or in a function body, except those under ``if TYPE_CHECKING:`` (never executed).

How an import becomes an edge of the module graph: ``import a.b.c`` and ``from a.b.c import name``
are edges to ``a.b.c`` only, though Python also runs ``a/__init__`` and ``a/b/__init__``: counting
those parents too would join every module of a package to its ``__init__`` and make everything one
cycle. ``from a.b import c``, where ``a.b.c`` is a module, is an edge to ``a.b.c`` (the name is the
submodule); a package's ``__init__`` importing its own submodules is counted the same way.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = {"eplb_graph": "eplb_graph", "custom_ops": "eplb_graph.custom_ops", "passes": "eplb_graph.passes"}
REFERENCE = {"reference/eplb_reference": "eplb_reference"}
NOT_FOR_THE_PRODUCT = ("eplb_reference", "tests", "benchmarks")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the module imported (resolved to a known module where the name is one)
    name: str | None  # the name taken from ``target`` (None: the module itself)
    where: str  # file:line

    def __str__(self) -> str:
        return f"{self.where}: {self.source} -> {self.target}" + (f" ({self.name})" if self.name else "")


def modules_under(roots: dict[str, str]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under the roots (a package's ``__init__``
    is named after the package)."""
    found = {}
    for folder, package in roots.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            found[".".join((package, *parts)).removesuffix(".__init__")] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


BLOCK_PARTS = ast.stmt | ast.excepthandler | ast.match_case  # what a statement's blocks hold


def _executed(nodes: list[ast.stmt]) -> list[ast.stmt]:
    """Every statement under ``nodes``, at any depth, except the bodies of ``if TYPE_CHECKING:``."""
    out, stack = [], list(reversed(nodes))
    while stack:
        node = stack.pop()
        out.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            children = node.orelse
        else:
            children = [c for c in ast.iter_child_nodes(node) if isinstance(c, BLOCK_PARTS)]
        stack.extend(reversed(children))
    return out


def imports_of(source: str, module: str, *, package: bool, known: set[str], where: str) -> list[Import]:
    """The imports a module's source executes, relative ones resolved against ``module``."""
    found = []
    for node in _executed(ast.parse(source).body):
        at = f"{where}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [Import(module, alias.name, None, at) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = module if package else module.rpartition(".")[0]
            if node.level:
                base = ".".join(base.split(".")[:len(base.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(module, sub, None, at) if sub in known else Import(module, base, alias.name, at))
    return found


def scan(roots: dict[str, str]) -> list[Import]:
    """Every import of the modules under ``roots``, resolved against the product's and the reference's."""
    known = set(modules_under(PRODUCT | REFERENCE))
    return [i for name, path in modules_under(roots).items()
            for i in imports_of(path.read_text(), name, package=path.name == "__init__.py", known=known,
                                where=str(path.relative_to(ROOT)))]


def cycles(imports: list[Import], known: set[str]) -> list[list[Import]]:
    """The imports inside each strongly-connected component of more than one module, or of one that
    imports itself (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {m: set() for m in known}
    for i in imports:
        if i.source in known and i.target in known:
            graph[i.source].add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = {stack.pop()}
            while node not in component:
                component.add(stack.pop())
            if len(component) > 1 or node in graph[node]:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [[i for i in imports if i.source in c and i.target in c] for c in components]


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _report(problems: list[Import]) -> str:
    return "\n" + "\n".join(map(str, problems))


def test_the_scan_sees_the_whole_tree():
    assert len(modules_under(PRODUCT)) > 50
    assert len(modules_under(REFERENCE)) > 50
    assert any(_under(i.target, "eplb_graph") for i in scan(REFERENCE))  # the reference's imports are resolved


def test_the_product_never_imports_the_reference_tests_or_benchmarks():
    wrong = [i for i in scan(PRODUCT) if any(_under(i.target, p) for p in NOT_FOR_THE_PRODUCT)]
    assert not wrong, _report(wrong)


def test_the_reference_never_imports_the_tests_or_benchmarks():
    """It is installed on its own (``pip install -e reference``), where neither exists."""
    wrong = [i for i in scan(REFERENCE) if any(_under(i.target, p) for p in ("tests", "benchmarks"))]
    assert not wrong, _report(wrong)


def test_the_reference_uses_only_the_products_public_names():
    wrong = [i for i in scan(REFERENCE) if _under(i.target, "eplb_graph")
             and ((i.name or "").startswith("_") or any(part.startswith("_") for part in i.target.split(".")))]
    assert not wrong, _report(wrong)


def test_no_import_cycle():
    known = set(modules_under(PRODUCT | REFERENCE))
    found = cycles(scan(PRODUCT) + scan(REFERENCE), known)
    assert not found, "\n".join(_report(c) for c in found)


def _scan_sources(sources: dict[str, str]) -> list[Import]:
    known = set(sources) | {m.rpartition(".")[0] for m in sources}
    return [i for name, text in sources.items() for i in imports_of(text, name, package=False, known=known, where=name)]


def test_the_scanner_finds_a_lazy_import_and_resolves_relative_ones():
    found = _scan_sources({"p.a": "import os\ndef f():\n    from .b import g\n    from . import b\n", "p.b": ""})
    assert [(i.target, i.name) for i in found] == [("os", None), ("p.b", "g"), ("p.b", None)]
    assert found[1].where == "p.a:3"


def test_the_scanner_leaves_out_type_checking_imports_only():
    source = "import typing\nif typing.TYPE_CHECKING:\n    import p.b\nelse:\n    import p.c\n"
    assert [i.target for i in _scan_sources({"p.a": source})] == ["typing", "p.c"]


def test_the_scanner_finds_a_two_module_cycle_and_a_self_import():
    sources = {"p.a": "from p import b\n", "p.b": "def f():\n    import p.a\n", "p.c": "import p.a\nimport p.c\n"}
    found = cycles(_scan_sources(sources), set(sources))
    assert sorted(sorted(str(i) for i in c) for c in found) == [["p.a:1: p.a -> p.b", "p.b:2: p.b -> p.a"],
                                                                ["p.c:2: p.c -> p.c"]]
