"""README.md, SECURITY.md and docs/*.md name only what the tree has. Every backticked path (and each path drawn in a
diagram, each relative link) resolves to a file or folder, from the root, a known root or a folder its
section named; a ``file.py::test`` to a test in that file; a ``folder/module.Name`` to a name the module
defines. Every backticked ``Class.member`` (a class of ours: defined in it or a base), ``module.name``,
``CamelCase`` class is in our Python source, or in vLLM / torch / transformers (prefixed, or imported so
by our code); every snake_case word is a word of our source, so a renamed one cannot linger."""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib.util
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "SECURITY.md", *sorted((ROOT / "docs").glob("*.md"))]
ROOTS = ("", "eplb_graph/", "reference/eplb_reference/", "reference/", "benchmarks/", "tests/", "docs/")
SOURCES = ("eplb_graph", "custom_ops", "passes", "reference", "benchmarks", "tests")
UPSTREAM = ("vllm", "torch", "transformers")
UPSTREAM_HOMES = {  # upstream names the docs use bare and our code names only in strings
    "CPUExpertsFp8": "vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUExpertsFp8",
    "Qwen3MoeForCausalLM": "vllm.model_executor.models.qwen3_moe.Qwen3MoeForCausalLM",
}
ALIASES = {"handle": "EplbHandle"}  # the docs' name for what enable() returns
NOT_REFERENCES = {  # backticked, looks like a reference, is not one
    "report.json": "the file `eplb-graph run` writes into its --out folder",
    "out/bench": "the folder `make bench` writes",
    "shared/reference/eplb_architecture.md": "the team's copy of vllm-ascend's design page, beside the checkout",
    "eplb_graph.elastic": "a logger's name (the elastic runtime logs under it)",
    'model.set_experts_implementation("grouped_mm")': "transformers' method: the fix enable() prints",
}
# tables a tool writes, checked where they are made: doctor (each target against the installed stack)
# and benchmarks/support_matrix.py (each family built)
GENERATED = re.compile(r"^\| (?:adaptation \| target|family \| model built) \|.*\n(?:\|.*\n)*", re.M)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SPAN, LINK = re.compile(r"`([^`\n]+)`"), re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(r"[\w.\-]+(?:/[\w.\-]*)*(?:::\w+)?")
NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+|[A-Z]\w*[a-z]\w*")
WORD = re.compile(r"_?[a-z][a-z0-9]*(?:_[a-z0-9]+)+")
DIAGRAM = re.compile(r"(?<![\w$/.:-])(?:\w+/)*(?:\w+\.py\b|(?<=/)\w+\.(?!(?:json|log|txt|png)\b)\w+|(?<=/)(?=[\s),:]))|[A-Z]\w*\.\w+")


@cache
def python_files() -> tuple[Path, ...]:
    files = (p for src in SOURCES for p in sorted((ROOT / src).rglob("*.py")) if ".venv" not in p.parts)
    return tuple(p for p in files if p != Path(__file__).resolve())  # this file's words are examples


@cache
def source_words() -> frozenset[str]:  # code, strings and comments
    return frozenset(w for p in python_files() for w in re.findall(r"\w+", p.read_text()))


parse = cache(lambda path: ast.parse(path.read_text(), str(path)))


def defined(node: ast.Module | ast.ClassDef) -> set[str]:
    """Names a module or class body defines (and, for a class, ``self.x =`` in its methods)."""
    names = set()
    for n in node.body + [s for b in node.body if isinstance(b, (ast.If, ast.Try)) for s in b.body + b.orelse]:
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in getattr(n, "targets", [getattr(n, "target", None)]):
                names |= {e.id for e in ast.walk(t) if isinstance(e, ast.Name)}
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
    if isinstance(node, ast.ClassDef):
        names |= {t.attr for t in ast.walk(node) if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store)}
    return names


@cache
def tree() -> tuple[set[str], dict[str, list[ast.ClassDef]], dict[str, list[Path]], dict[str, str]]:
    """Names defined, read as attributes, taken as arguments or imported; classes (tests' stand-ins left
    out); modules by name; where each name imported from upstream is."""
    names, classes, modules, upstream = set(), {}, {}, dict(UPSTREAM_HOMES)
    for path in python_files():
        names |= set(path.relative_to(ROOT).with_suffix("").parts)
        modules.setdefault(path.parent.name if path.stem == "__init__" else path.stem, []).append(path)
        for n in ast.walk(parse(path)):
            names |= defined(n) if isinstance(n, (ast.Module, ast.ClassDef)) else set()
            names |= {n.attr} if isinstance(n, ast.Attribute) else set()
            names |= {a.arg for a in n.args.args + n.args.kwonlyargs} if isinstance(n, ast.FunctionDef) else set()
            if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] in UPSTREAM:
                upstream.update({a.asname or a.name: f"{n.module}.{a.name}" for a in n.names})
            if isinstance(n, ast.ClassDef) and path.relative_to(ROOT).parts[0] != "tests":
                classes.setdefault(n.name, []).append(n)
    return names, classes, modules, upstream


def class_has(name: str, member: str, seen: frozenset = frozenset()) -> bool:
    names, classes, _, _ = tree()
    for cls in classes[name]:
        bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in cls.bases]
        if member in defined(cls) or any(b in classes and b not in seen and class_has(b, member, seen | {name})
                                         for b in bases) or any(b not in classes for b in bases) and member in names:
            return True  # (a base of upstream's: any name of the source)
    return False


def module_has(path: Path, member: str) -> bool:
    folder = [path.parent] + ([ROOT] if path.parent == ROOT / "eplb_graph" else []) if path.stem == "__init__" else []
    return any((f / member).exists() or (f / f"{member}.py").exists() for f in folder) or member in defined(parse(path))


def upstream_has(dotted: str) -> bool:
    with contextlib.suppress(ImportError, ValueError):
        if importlib.util.find_spec(dotted):  # a module: found, not run
            return True
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:  # noqa: BLE001 (not a module: a shorter prefix is)
            continue
        for part in parts[i:]:
            obj = getattr(obj, part, upstream_has)  # (a sentinel)
        return obj is not upstream_has
    return False


def name_exists(dotted: str) -> bool:
    names, classes, modules, upstream = tree()
    head, *rest = parts = [ALIASES.get(p, p) if not i else p for i, p in enumerate(dotted.split("."))]
    if head in UPSTREAM and upstream_has(dotted) or head in upstream and upstream_has(".".join([upstream[head], *rest])):
        return True
    if head in classes:
        return not rest or class_has(head, rest[0]) and all(p in names for p in rest[1:])
    if head in modules and rest:
        return any(module_has(m, rest[0]) for m in modules[head]) and all(p in names for p in rest[1:])
    return all(p in names for p in parts) or not rest and hasattr(builtins, head)


def path_problem(ref: str, context: set[Path]) -> str | None:
    file, _, test = (ref.removesuffix("...").removesuffix("/") or ref).partition("::")
    module, _, member = file.rpartition(".")  # `folder/module.Name`
    roots, near = [ROOT / r for r in ROOTS], sorted(context)
    for base in roots + near if "/" in ref else near + roots:  # a bare `file.py`: the section's folders first
        if (base / file).exists() and not test:
            context.add(base / file if (base / file).is_dir() else (base / file).parent)
            return None
        if test and (base / file).is_file():
            tests = {n.name for n in ast.walk(parse(base / file)) if isinstance(n, ast.FunctionDef)}
            return None if test in tests else f"{ref}: no test {test} in {file}"
        if "/" in module and (base / f"{module}.py").is_file() and module_has(base / f"{module}.py", member):
            return None
    return f"{ref}: no such file or folder"


def problem(token: str, context: set[Path]) -> str | None | bool:
    """What is wrong with one backticked token; None: nothing; False: not a reference of ours."""
    bare = re.sub(r"\([^()]*\)", "", token)  # `f(x)`: f
    if token in NOT_REFERENCES or token.startswith(("-", "/", "~", "$", ".")) or "://" in token:
        return False
    if PATH.fullmatch(token) and ("/" in token or token.endswith((".py", ".md", ".toml", ".json", ".txt"))):
        return path_problem(token, context)
    if WORD.fullmatch(bare):
        return None if bare in source_words() else f"{token}: no such word in the source"
    if NAME.fullmatch(bare) and not bare.isupper():
        return None if name_exists(bare) else f"{token}: no such name in the source"
    return False


def problems(text: str, doc_dir: Path = ROOT) -> tuple[int, list[str]]:
    """(references checked, the ones that do not resolve) in one markdown text."""
    checked, found = 0, []
    for section in re.split(r"^(?=#+ )", text, flags=re.M):
        context: set[Path] = set()  # the folders the section named so far
        prose = GENERATED.sub("", FENCE.sub("", section))
        spans = [(s.strip(), context) for s in SPAN.findall(prose)] + [  # a path in a drawing: in full
            (t.rstrip("."), set()) for lang, body in FENCE.findall(section) if not lang for t in DIAGRAM.findall(body)]
        for span, near in spans:
            words = span.split()  # a span that is not one reference: its words, but no flag's value
            tokens = [w.rstrip(":,;") for i, w in enumerate(words) if not (i and words[i - 1].startswith("--"))]
            for result in [r for r in [problem(span, near)] if r is not False] or [problem(t, near) for t in tokens]:
                checked += result is not False
                found += [result] if result else []
        for link in [link for link in LINK.findall(prose) if "://" not in link and not link.startswith("#")]:
            checked += 1
            found += [] if (doc_dir / link.split("#")[0]).exists() else [f"{link}: broken link"]
    return checked, found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_reference_in_the_docs_resolves(doc: Path):
    checked, found = problems(doc.read_text(), doc.parent)
    assert checked > 0 and found == [], "\n".join(found)


def test_the_checker_catches_a_wrong_reference():
    text = """# A
`vllm_plugin/worker.py`, `runtime/controller.py`, `tests/test_import_layers.py`, `LayerLookup.refresh_`,
`placement.logical_maps`, `torch.library.custom_op`, `eplb-graph run --out out/x`, `EPLB_GRAPH_STALL_STEPS`,
[the map](docs/architecture.md), `vllm_plugin/no_such.py`, `mover.py`, `LayerLookup.no_such_method`,
`tests/test_import_layers.py::test_no_such_test`, `NoSuchClass`, `torch.no_such_function`, [x](nowhere.md),
`num_redundant_experts + 1`, `num_redundant + 1`
# B (`eplb_graph/movement/`)
`mover.py`, `weight_views.check_weight_view`, `vllm_plugin/expert_views.ExpertWeightView`
"""
    checked, found = problems(text)
    assert checked == 20
    assert [f.split(":")[0] for f in found] == [
        "vllm_plugin/no_such.py", "mover.py", "LayerLookup.no_such_method", "tests/test_import_layers.py",
        "NoSuchClass", "torch.no_such_function", "num_redundant", "nowhere.md"]
