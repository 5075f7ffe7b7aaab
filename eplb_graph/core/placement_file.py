"""The placement file: what EPLB learned, kept across restarts.

One format for the vLLM plugin (``EPLB_GRAPH_PLACEMENT_FILE``), ``enable()`` (``placement=``,
``handle.save_placement``) and the reference runtime (``--placement-file``): the committed
physical-to-logical map of every MoE layer, the logical load window it was computed from, and
the identity of the model and layout it fits. JSON, versioned, with a checksum over its
content (``docs/placement_file.md`` documents each field)::

    {"format": "eplb-graph placement", "version": 1,
     "identity": {"architecture", "config_hash", "num_layers", "num_logical_experts",
                  "num_physical_experts", "ep_size", "quantization"},
     "physical_to_logical": [L][P], "load_window": [L][N] or null,
     "rearrangements": int, "written_by": str, "written_at": ISO 8601, "checksum": "sha256:..."}

``save`` writes a temporary file beside the target, syncs it, then renames it over the target:
a crash mid-write leaves the previous file intact. It refuses, by name and before writing, a
directory another user can write (unless sticky and owned by us or root) and a symbolic link
another user owns (``private_files.py``); ``load`` refuses such a link too. ``load`` refuses, by name, a file that is not
one (corrupt, other format or version, checksum mismatch, a malformed placement);
``check_fits`` refuses one whose identity differs from the model it is to serve, naming each
field that differs. ``PlacementWriter`` writes off the caller's thread: serving never waits on
a disk.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import threading
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from eplb_graph.core.placement import validate_placement
from eplb_graph.core.private_files import UnsafePathError, remove_stale_temporaries, replace_file, resolve_target

FORMAT, VERSION = "eplb-graph placement", 1
logger = logging.getLogger(__name__)


class PlacementFileError(ValueError):
    """A placement file that cannot be read, or does not fit the model it is to serve."""


@dataclass(frozen=True)
class PlacementIdentity:
    """What a placement fits: the model (architecture, a hash of its config) and the layout.
    ``None`` in an identity to check against: not known where it is checked (the vLLM config
    gate knows no layer count); every field is known where a placement is applied."""

    architecture: str | None
    config_hash: str | None
    num_layers: int | None
    num_logical_experts: int | None
    num_physical_experts: int | None
    ep_size: int | None
    quantization: str | None


@dataclass(frozen=True)
class PlacementRecord:
    identity: PlacementIdentity
    physical_to_logical: torch.Tensor  # [L, P] int64
    load_window: torch.Tensor | None  # [L, N] float64: the logical load the placement was computed from
    rearrangements: int  # committed by the writer when it wrote
    written_by: str  # "vllm", "enable", "runtime"


def config_hash(config: object) -> str:
    """A stable hash of a model config: a dict, or an object with ``to_dict`` (Hugging Face's).
    Keys starting with ``_`` (the checkpoint's path) and ``transformers_version`` are left out:
    moving a checkpoint or upgrading transformers keeps its placement."""
    as_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    kept = {key: value for key, value in as_dict.items() if not key.startswith("_") and key != "transformers_version"}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=_stable).encode()).hexdigest()[:16]


def _stable(value: object) -> object:
    """What JSON cannot spell, spelled the same in every process (a set in sorted order)."""
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    return value.to_dict() if hasattr(value, "to_dict") else str(value)


def _content(record: PlacementRecord) -> dict:
    window = record.load_window
    return {
        "format": FORMAT,
        "version": VERSION,
        "identity": asdict(record.identity),
        "physical_to_logical": record.physical_to_logical.tolist(),
        "load_window": None if window is None else window.double().tolist(),
        "rearrangements": int(record.rearrangements),
        "written_by": record.written_by,
    }


def _checksum(content: dict) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def save(path: str | os.PathLike, record: PlacementRecord) -> None:
    """Writes ``record`` to ``path`` atomically (temporary file, fsync, rename, directory fsync);
    a symbolic link we own is followed, its target is what is replaced. A crashed writer's
    temporary files are removed. PlacementFileError, before anything is written, where another
    user could swap the file (``private_files.py``)."""
    try:
        path = resolve_target(path)
    except UnsafePathError as error:
        raise PlacementFileError(f"placement file {path}: {error}; nothing written") from None
    content = _content(record)
    document = {**content, "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "checksum": _checksum(content)}
    remove_stale_temporaries(path)  # one writer per file: none is in use
    replace_file(path, json.dumps(document).encode(), sync=True)
    try:  # the rename itself survives a power cut, where the filesystem can sync a directory
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError:
        pass  # the file is in place; some network filesystems refuse a directory fsync


def load(path: str | os.PathLike) -> PlacementRecord:
    """Reads a placement file; PlacementFileError naming what is wrong with it (a symbolic link
    another user owns is not followed)."""
    try:
        target = resolve_target(path, for_write=False)
    except UnsafePathError as error:
        raise PlacementFileError(f"placement file {path}: {error}") from None
    except OSError as error:
        raise PlacementFileError(f"placement file {path} cannot be read: {error}") from None
    try:
        with open(os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)) as text:  # no link swapped in since
            document = json.loads(text.read())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PlacementFileError(f"placement file {path} cannot be read: {error}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise PlacementFileError(f"{path} is not an eplb-graph placement file (format {FORMAT!r} expected)")
    if document.get("version") != VERSION:
        raise PlacementFileError(f"placement file {path} has version {document.get('version')!r}; this eplb-graph "
                                 f"reads version {VERSION}")
    content = {key: document.get(key) for key in _content_keys()}
    if document.get("checksum") != _checksum(content):
        raise PlacementFileError(f"placement file {path} is corrupt: its checksum does not match its content")
    try:
        identity = PlacementIdentity(**content["identity"])
        _check_types(identity, content)
        placements = torch.tensor(content["physical_to_logical"], dtype=torch.int64)  # [L, P]
        window = None if content["load_window"] is None else torch.tensor(content["load_window"], dtype=torch.float64)
    except (TypeError, ValueError) as error:
        raise PlacementFileError(f"placement file {path} is malformed: {error}") from None
    expected = (identity.num_layers, identity.num_physical_experts)
    if placements.dim() != 2 or tuple(placements.shape) != expected:
        raise PlacementFileError(f"placement file {path}: physical_to_logical has shape {tuple(placements.shape)}, "
                                 f"its identity says [num_layers, num_physical_experts] = {list(expected)}")
    if window is not None and tuple(window.shape) != (identity.num_layers, identity.num_logical_experts):
        raise PlacementFileError(f"placement file {path}: load_window has shape {tuple(window.shape)}, expected "
                                 f"[{identity.num_layers}, {identity.num_logical_experts}]")
    for layer, placement in enumerate(placements):
        try:
            validate_placement(placement, identity.num_logical_experts, identity.num_physical_experts,
                               identity.num_physical_experts)
        except ValueError as error:
            raise PlacementFileError(f"placement file {path}, layer {layer}: {error}") from None
    return PlacementRecord(identity, placements, window, content["rearrangements"], content["written_by"])


def _check_types(identity: PlacementIdentity, content: dict) -> None:
    """TypeError naming the first field of the wrong type (a hand-made file with a good checksum)."""
    expected = {"architecture": str, "config_hash": str, "quantization": str, "written_by": str, "num_layers": int,
                "num_logical_experts": int, "num_physical_experts": int, "ep_size": int, "rearrangements": int}
    values = {**asdict(identity), "written_by": content["written_by"], "rearrangements": content["rearrangements"]}
    for name, kind in expected.items():
        if not isinstance(values[name], kind) or isinstance(values[name], bool):
            raise TypeError(f"{name} must be {kind.__name__}, got {values[name]!r}")


def _content_keys() -> tuple[str, ...]:
    return ("format", "version", "identity", "physical_to_logical", "load_window", "rearrangements", "written_by")


def check_fits(record: PlacementRecord, here: PlacementIdentity, path: str | os.PathLike) -> None:
    """PlacementFileError naming every identity field in which the file differs from ``here``
    (fields ``here`` does not know, None, are not compared)."""
    differences = [
        f"{field.name} is {getattr(record.identity, field.name)!r} in the file, {getattr(here, field.name)!r} here"
        for field in fields(PlacementIdentity)
        if getattr(here, field.name) is not None and getattr(record.identity, field.name) != getattr(here, field.name)
    ]
    if differences:
        raise PlacementFileError(f"placement file {path} does not fit this model and layout: " + "; ".join(differences))


def check_writable(path: str | os.PathLike) -> None:
    """The file's directory exists, can be written, and no other user can swap the file (nor a link
    at it): refused at start, not at the first commit."""
    directory = Path(path).parent
    if not directory.is_dir():
        raise PlacementFileError(f"placement file {path}: directory {directory} does not exist")
    if not os.access(directory, os.W_OK):
        raise PlacementFileError(f"placement file {path}: directory {directory} is not writable")
    try:
        resolve_target(path)
    except UnsafePathError as error:
        raise PlacementFileError(f"placement file {path}: {error}") from None


def check_start_file(path: str | os.PathLike, here: PlacementIdentity) -> None:
    """At start, where the file is named: its directory can take it, and a file already there
    fits ``here`` (PlacementFileError naming why not)."""
    check_writable(path)
    if os.path.exists(path):
        check_fits(load(path), here, path)


class PlacementWriter:
    """Writes the latest submitted record on a background thread (a newer one replaces one not
    yet written); ``close`` writes what is pending and ends the thread. A failed write is
    logged and kept in ``error``; serving goes on."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.writes = 0
        self.error: BaseException | None = None
        self._pending: PlacementRecord | None = None
        self._writing = False
        self._closed = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="eplb-graph-placement-writer", daemon=True)
        self._thread.start()

    def submit(self, record: PlacementRecord) -> None:
        with self._wake:
            if self._closed:
                raise RuntimeError("the placement writer is closed")
            self._pending = record
            self._wake.notify_all()

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._pending is not None or self._closed)
                record, self._pending = self._pending, None
                if record is None:
                    return
                self._writing = True
            try:
                save(self.path, record)
                self.writes += 1
            except Exception as error:  # noqa: BLE001  (a disk fault never fails serving)
                self.error = error
                logger.warning("eplb-graph: could not write the placement file %s: %s", self.path, error)
            finally:
                with self._wake:
                    self._writing = False
                    self._wake.notify_all()

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Waits until every record submitted so far is written (or failed); False on timeout."""
        with self._wake:
            return self._wake.wait_for(lambda: self._pending is None and not self._writing, timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """Writes what is pending, then ends the thread."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout_s)
