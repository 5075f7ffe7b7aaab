"""Builds and loads the ops' C++ CPU kernels: the routing ops (csrc/routing.cpp) and the
passes around a layer's kernel in ``local_expert_pairs`` (csrc/local_pairs.cpp).

Why C++: the ops run once per MoE layer per forward, and a Python kernel pays the
dispatcher's trip into Python and the Python around its loop at every call; the C++
kernels are reached from the dispatcher directly (benchmarks/bench_op_in_step.py measures
the difference right after a compiled forward, benchmarks/bench_local_pairs.py the local
pairs' passes against their kernel alone).

Built with ``torch.utils.cpp_extension`` (a C++ compiler and ninja) once per machine, into
a directory named by a digest of the source, torch and Python, and afterwards loaded
with ``torch.ops.load_library`` alone: a process that finds it built imports no build
machinery (vLLM's workers load this package at start). Where it cannot be built the
torch composite (custom_ops/routing.py) serves every CPU op and a warning says why;
``EPLB_GRAPH_NATIVE_KERNEL=0`` chooses the composite outright.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

LIBRARY_NAME = "eplb_graph_native"
SOURCE = Path(__file__).parent / "csrc" / "routing.cpp"  # the routing ops' CPU kernels
SOURCES = (SOURCE, Path(__file__).parent / "csrc" / "local_pairs.cpp")
SWITCH = "EPLB_GRAPH_NATIVE_KERNEL"  # "0": use the torch composite
CACHE_DIR = "EPLB_GRAPH_CACHE_DIR"  # default: $XDG_CACHE_HOME/eplb_graph or ~/.cache/eplb_graph


def build_directory() -> Path:
    """Where the library for these sources, torch and Python lives (a new one when any changes)."""
    root = os.environ.get(CACHE_DIR) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eplb_graph"
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.read_bytes())
    digest.update(f"{torch.__version__}|{sys.version}|{sys.platform}".encode())
    return Path(root) / f"{LIBRARY_NAME}-{digest.hexdigest()[:16]}"


class NativeLayerIndex:
    """The C++ kernel's index, layer key -> table tensors; ``LayerTableRegistry`` keeps it
    equal to its own (bind on register and on a rebound load buffer, unbind on close or death).

    Holds its ops and ``sys.is_finalizing``: a layer still alive when the interpreter exits
    dies during shutdown, after this module's globals are cleared, and its unbind must
    neither fail nor call into a library being torn down (the index goes with the process).
    """

    def __init__(self) -> None:
        ops = torch.ops.eplb_graph_native
        self._bind_layer, self._unbind_layer, self._layer_calls = ops.bind_layer, ops.unbind_layer, ops.layer_calls
        self._is_finalizing = sys.is_finalizing

    def bind(self, key: str, tensors: Sequence[torch.Tensor]) -> None:
        """Validates the tables (dtype, shape, one-element flags) and routes ``key`` by them."""
        self._bind_layer(key, *tensors)

    def unbind(self, key: str) -> None:
        if not self._is_finalizing():
            self._unbind_layer(key)

    def calls(self, key: str) -> int:
        """Calls the C++ kernel routed for ``key`` since it was first bound (0 if unbound)."""
        return int(self._layer_calls(key))


def _build(directory: Path) -> None:
    from torch.utils import cpp_extension  # build machinery only when there is something to build

    directory.mkdir(parents=True, exist_ok=True)
    print(f"eplb_graph: building the C++ kernels into {directory} (once per machine)", file=sys.stderr)
    cpp_extension.load(
        name=LIBRARY_NAME, sources=[str(source) for source in SOURCES], build_directory=str(directory),
        is_python_module=False, extra_cflags=["-O3"], verbose=False,
    )  # also loads it


def load_native_kernel() -> tuple[NativeLayerIndex | None, str]:
    """Loads (building first if needed) the C++ kernels, which register themselves as the CPU
    kernels of all four routing ops and define ``local_pairs_compact`` / ``local_pairs_combine``:
    (their index, ""), or (None, why) where they are switched off or cannot be had."""
    if os.environ.get(SWITCH, "1") == "0":
        return None, f"{SWITCH}=0"
    directory = build_directory()
    library = directory / f"{LIBRARY_NAME}.so"
    try:
        if library.exists():
            torch.ops.load_library(str(library))
        else:
            _build(directory)
    except Exception as error:  # no compiler, no ninja, a read-only cache: the composite serves
        last_line = (str(error).strip().splitlines() or [""])[-1]  # a build error's summary line
        why = f"the C++ kernels could not be built or loaded ({type(error).__name__}: {last_line})"
        warnings.warn(f"eplb_graph: {why}; the torch composite serves the routing and local pairs ops on CPU. Set {SWITCH}=0 to "
                      f"choose it without trying.", RuntimeWarning, stacklevel=2)
        return None, why
    return NativeLayerIndex(), ""
