"""Installing, checking and taking back the adaptations declared in ``adaptations.py``.

One concept, every kind of change (replace, wrap, hook, global, scoped, insert, config, read), kept
together on purpose: the rules below hold across kinds, so they are read in one place. That is
why it runs past one reading: split by kind, each file would restate the ledger and the rules.

The one place in the tree that sets an attribute of upstream's modules, classes, instances and
configuration. What is installed is recorded on the target's owner itself (the module, class or
instance: ``LEDGER``), one stack per attribute, so installing is idempotent across the whole
process whoever asks, and the record goes with the object it describes. The rules:

* an adaptation goes onto upstream's attribute, or onto exactly the adaptation it declares it
  ``wraps``; another adaptation of ours on the target is an ``AdaptationError`` naming both (a
  change made outside this registry is not seen: the scan in ``tests/eplb_graph/upstream`` keeps the tree
  free of them);
* the same adaptation installed again by the same installer (``by``) with the same replacement is
  a no-op; by another installer, or with another replacement, an error (two bindings would
  chain on each other);
* the target is checked against its declared shape before anything is set, so an upstream
  change is refused by name where it is installed, never as an ``AttributeError`` later;
* ``uninstall`` takes back the top of a stack only, restoring exactly what was there (an
  attribute the owner inherited, or one of ours it never had, is deleted again, not copied
  down); an ``insert`` is taken out of its list again. ``scoped`` sets a field of one object
  for the body of a ``with`` and takes it back there, whatever the body raised. ``configure``
  values are set, not taken back: they belong to one config or state object.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .adaptations import ADAPTATIONS, Adaptation, adaptation

LEDGER = "__eplb_graph_adaptations__"
# installs and take-backs read and write the ledgers: one at a time in the process
_LOCK = threading.RLock()

ON_INSTANCE = ("hook", "scoped")  # set on the instance ``on``, not on the declared owner
OK, MISSING, CHANGED, NOT_HERE, IMPORT_FAILED = "ok", "target missing", "signature changed", "not here", "import failed"
BROKEN = (MISSING, CHANGED, IMPORT_FAILED)


class AdaptationError(RuntimeError):
    """An adaptation cannot be installed or taken back as declared."""


@dataclass(frozen=True)
class Check:
    """An adaptation against the stack installed here: ``status`` one of ok, target missing,
    signature changed, import failed, not here (its optional distribution is absent)."""

    adaptation: Adaptation
    status: str
    detail: str = ""

    @property
    def broken(self) -> bool:
        return self.status in BROKEN

    def describe(self) -> str:
        return f"{self.adaptation.target}: {self.status}{f' ({self.detail})' if self.detail else ''}"


@dataclass
class _Layer:
    key: str
    by: object
    replacement: object
    original: object
    had_own: bool  # the owner held the attribute itself (else it inherited it, or had none)


def _owner(entry: Adaptation, *, import_module: bool = True) -> object | None:
    """The module or class holding the target's attribute; None where its module is not imported
    (``import_module=False``) or an enclosing name is gone."""
    owner = importlib.import_module(entry.module) if import_module else sys.modules.get(entry.module)
    for part in entry.qualname.split(".")[:-1]:
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner


def _stack(owner: object, name: str) -> list[_Layer]:
    ledger = getattr(owner, "__dict__", {}).get(LEDGER)  # an object without one holds nothing of ours
    return [] if ledger is None else ledger.get(name, [])


def _shape_problem(entry: Adaptation, value: object) -> str | None:
    """What differs from the declared shape, or None."""
    kind = entry.shape.kind
    if kind == "class" and not isinstance(value, type):
        return f"expected a class, found {type(value).__name__}"
    if kind == "property" and not isinstance(value, property):
        return f"expected a property, found {type(value).__name__}"
    if kind == "list" and not isinstance(value, list):
        return f"expected a list, found {type(value).__name__}"
    if kind == "callable":
        if not callable(value):
            return f"expected a callable, found {type(value).__name__}"
        try:
            params = tuple(inspect.signature(value).parameters)
        except (TypeError, ValueError):
            return None  # a builtin without a signature: nothing to compare
        expected = entry.shape.params
        if params[: len(expected)] != expected:
            return f"expected parameters ({', '.join(expected)}, ...), found ({', '.join(params)})"
    return None


def _upstream_value(owner: object, name: str) -> object:
    """The attribute as upstream defines it, under whatever we installed on it or on a base class."""
    stack = _stack(owner, name)
    if stack and stack[0].had_own:
        return stack[0].original
    if stack or (isinstance(owner, type) and name not in vars(owner)):
        for base in getattr(owner, "__mro__", ())[1:]:  # what it inherits, as upstream defined it there
            if name in vars(base):
                return _upstream_value(base, name)
        raise AttributeError(name)
    try:
        return inspect.getattr_static(owner, name)
    except AttributeError:
        if inspect.ismodule(owner):  # a module serving names by __getattr__ (torch's config modules)
            return getattr(owner, name)
        raise


def _sets_on_instances(cls: type, name: str) -> bool:
    """Whether the code of ``cls`` or a base (its constructor, mostly) names attribute ``name``."""
    for klass in cls.__mro__[:-1]:
        for member in vars(klass).values():
            code = getattr(inspect.unwrap(member), "__code__", None) if callable(member) else None
            if code is not None and name in code.co_names:
                return True
    return False


def _target_problem(entry: Adaptation, owner: object) -> tuple[str, str] | None:
    """(status, detail) where ``owner`` (the declared module or class, or for a hook the
    instance) does not hold the target in its declared shape; None where it does."""
    name, kind = entry.attribute, entry.shape.kind
    cls = owner if isinstance(owner, type) or inspect.ismodule(owner) else type(owner)
    if kind == "field":
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if name not in fields:
            return MISSING, f"{getattr(cls, '__name__', cls)} has no field {name}"
        return None
    if kind == "instance":
        present = hasattr(owner, name) if cls is not owner else _sets_on_instances(cls, name)
        return None if present else (MISSING, f"no code of {cls.__name__} sets it")
    if kind == "absent":  # ours to add: upstream having one of that name is a clash
        if hasattr(owner, name) or _sets_on_instances(cls, name):
            return CHANGED, f"{cls.__name__} has an attribute {name} of its own"
        return None
    try:
        value = _upstream_value(cls, name)
    except AttributeError:
        return MISSING, ""
    problem = _shape_problem(entry, value)
    return None if problem is None else (CHANGED, problem)


def check(entry: Adaptation) -> Check:
    """``entry`` against what is installed here: imports its module (never an optional
    distribution that is absent), reads the target as upstream defines it, compares its shape."""
    if entry.when.requires and importlib.util.find_spec(entry.when.requires) is None:
        return Check(entry, NOT_HERE, f"{entry.when.requires} is not installed")
    try:
        owner = _owner(entry)
    except Exception as error:  # an ImportError, or a module failing at import on this machine
        return Check(entry, IMPORT_FAILED, f"{entry.module}: {type(error).__name__}: {error}")
    if owner is None:
        return Check(entry, MISSING, f"{entry.module} has no {entry.qualname.rsplit('.', 1)[0]}")
    problem = _target_problem(entry, owner)
    return Check(entry, OK) if problem is None else Check(entry, *problem)


def check_all(entries: Iterable[Adaptation] = ADAPTATIONS) -> list[Check]:
    return [check(entry) for entry in entries]


def _refuse_if_changed(entry: Adaptation, owner: object | None) -> None:
    problem = (MISSING, "") if owner is None else _target_problem(entry, owner)
    if problem is not None:
        status, detail = problem
        raise AdaptationError(f"{entry.target}: {status}{f' ({detail})' if detail else ''}; eplb-graph adapts it "
                              f"for: {entry.why}")


def require(key: str) -> None:
    """Refuses, by name, a target upstream no longer has in the declared shape."""
    entry = adaptation(key)
    _refuse_if_changed(entry, _owner(entry))


def current(key: str) -> object:
    """What the target holds now (upstream's, or the adaptation installed on it last): what a
    wrapper installed next wraps. A target upstream no longer has is refused by name."""
    entry = adaptation(key)
    owner = _owner(entry)
    _refuse_if_changed(entry, owner)
    return getattr(owner, entry.attribute)


def _placed(entry: Adaptation, on: object | None, *, importing: bool = True) -> object | None:
    """The object the adaptation sets its attribute on: the instance ``on`` for a hook or a
    scoped value, else the declared owner."""
    if (entry.how in ON_INSTANCE) != (on is not None):
        raise AdaptationError(f"{entry.key} is a {entry.how}: it goes {'on an instance' if on is None else 'on its target'}")
    return on if on is not None else _owner(entry, import_module=importing)


def install(key: str, replacement: object, *, by: object, on: object | None = None) -> None:
    """Sets ``replacement`` on the target of ``key`` (on the instance ``on`` for a hook; for an
    ``insert``, puts it first in the target list). Idempotent for the same installer ``by``; see
    the module docstring for the rules."""
    entry = adaptation(key)
    if entry.how in ("config", "read", "scoped"):
        raise AdaptationError(f"{key} is a {entry.how}: "
                              f"{dict(config='configure()', read='require()', scoped='scoped()')[entry.how]} it")
    _install(entry, replacement, by=by, on=on)


def _install(entry: Adaptation, replacement: object, *, by: object, on: object | None) -> None:
    key = entry.key
    # Resolved (imported) before the lock: the import hooks install while a module's import lock
    # is held, so nothing may wait on an import while holding _LOCK.
    owner = _placed(entry, on)
    with _LOCK:
        if owner is None:
            _refuse_if_changed(entry, owner)
        name = entry.attribute
        stack = _stack(owner, name)
        mine = next((layer for layer in stack if layer.key == key), None)
        if mine is not None:
            if mine.by is by and mine.replacement is replacement:
                return
            raise AdaptationError(f"{entry.target} already carries {key}, installed by {type(mine.by).__name__} "
                                  f"{'with another replacement' if mine.by is by else 'another installer'}")
        top = stack[-1].key if stack else None
        if top != entry.wraps:
            raise AdaptationError(f"{entry.target} carries {top or 'upstream'} where {key} expects "
                                  f"{entry.wraps or 'upstream'}" + ("" if top is None else f": take {top} back first"))
        if not stack:
            _refuse_if_changed(entry, owner)
        if LEDGER not in vars(owner):  # its own, never a base class's
            setattr(owner, LEDGER, {})
        vars(owner)[LEDGER].setdefault(name, []).append(
            _Layer(key, by, replacement, vars(owner).get(name), name in vars(owner)))
        if entry.how == "insert":
            getattr(owner, name).insert(0, replacement)
        else:
            setattr(owner, name, replacement)


@contextlib.contextmanager
def scoped(key: str, value: object, *, on: object, by: object) -> Iterator[None]:
    """Sets the declared ``scoped`` field of the upstream object ``on`` to ``value`` for the body
    of the ``with``, and puts ``on``'s own value back after it, also when the body raised."""
    entry = adaptation(key)
    if entry.how != "scoped":
        raise AdaptationError(f"{key} is a {entry.how}, not a scoped value")
    _install(entry, value, by=by, on=on)
    try:
        yield
    finally:
        uninstall(key, on=on)


def configure(key: str, value: object, *, on: object) -> None:
    """Sets a declared ``config`` value on the upstream object ``on`` (or ``on``'s item named by
    the entry's shape), after checking it has that field; configuration is not taken back."""
    entry = adaptation(key)
    if entry.how != "config":
        raise AdaptationError(f"{key} is a {entry.how}, not a configuration value")
    _refuse_if_changed(entry, on)
    if entry.shape.item is not None:
        getattr(on, entry.attribute)[entry.shape.item] = value
    else:
        setattr(on, entry.attribute, value)


def uninstall(key: str, *, on: object | None = None) -> None:
    """Takes ``key`` back (from ``on`` for a hook): a no-op where it is not installed; an error
    where another adaptation is installed over it."""
    entry = adaptation(key)
    with _LOCK:
        owner = _placed(entry, on, importing=False)
        if owner is None:
            return
        name = entry.attribute
        stack = _stack(owner, name)
        if not any(layer.key == key for layer in stack):
            return
        if stack[-1].key != key:
            raise AdaptationError(f"{entry.target}: {stack[-1].key} is installed over {key}; take it back first")
        layer = stack.pop()
        if entry.how == "insert":
            items = getattr(owner, name)
            for index, item in enumerate(items):
                if item is layer.replacement:
                    del items[index]
                    break
        elif layer.had_own:
            setattr(owner, name, layer.original)
        else:
            delattr(owner, name)
        if not stack:
            ledger = vars(owner)[LEDGER]
            ledger.pop(name, None)
            if not ledger:
                delattr(owner, LEDGER)


def installed(key: str, *, on: object | None = None) -> bool:
    entry = adaptation(key)
    owner = _placed(entry, on, importing=False)
    return owner is not None and any(layer.key == key for layer in _stack(owner, entry.attribute))


def installed_keys() -> list[str]:
    """Every adaptation installed on a module or class in this process (hooks and scoped values
    live on instances and are not listed), in the table's order; imports nothing."""
    return [entry.key for entry in ADAPTATIONS
            if entry.how in ("replace", "wrap", "global", "insert") and installed(entry.key)]


def uninstall_all(keys: Iterable[str] | None = None) -> list[str]:
    """Takes back the module and class adaptations ``keys`` (default: every one installed),
    outermost first; returns the keys taken back."""
    taken = [key for key in installed_keys() if keys is None or key in set(keys)]
    for key in sorted(taken, key=lambda k: adaptation(k).wraps is None):  # wrappers of ours first
        uninstall(key)
    return taken
