"""Where this process's ``npu`` device comes from, and whether it can serve graph mode.

On an Ascend host the device is torch_npu's (imported here only when asked for, never at
package import: without CANN it breaks ``import torch``). ``EPLB_GRAPH_NPU_MODULE`` names
another module that registers PrivateUse1 as ``npu`` with the same ``torch.npu`` API
(``NPUGraph``, ``graph``, ``set_device``, ``synchronize``); the rank processes of a run
import the same module, since they inherit the environment.
"""

from __future__ import annotations

import importlib
import os

import torch

NPU_MODULE_ENV = "EPLB_GRAPH_NPU_MODULE"
DEFAULT_NPU_MODULE = "torch_npu"
# What graph mode calls on torch.npu: the ACL graph runner and the device controls around it.
GRAPH_MODE_API = ("NPUGraph", "graph", "set_device", "synchronize", "current_stream", "Stream")


def npu_module_name() -> str:
    return os.environ.get(NPU_MODULE_ENV, DEFAULT_NPU_MODULE)


def _npu_registered() -> bool:
    return torch._C._get_privateuse1_backend_name() == "npu" and hasattr(torch, "npu")


def npu_unavailable() -> str | None:
    """None where this process has an ``npu`` device that graph mode can run on (importing
    the module that provides it if need be); else what is missing, in words."""
    if not _npu_registered():
        name = npu_module_name()
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name is not None and name.startswith(error.name):
                return f"{name} is not installed"
            return f"importing {name} failed: {type(error).__name__}: {error}"
        except Exception as error:  # torch_npu without CANN raises at import, not ImportError only
            return f"importing {name} failed: {type(error).__name__}: {error}"
        if not _npu_registered():
            return f"{name} imported but registered no 'npu' device"
    missing = [name for name in GRAPH_MODE_API if not hasattr(torch.npu, name)]
    if missing:
        return f"torch.npu has no {', '.join(missing)} (the ACL graph runner)"
    if not torch.npu.is_available():
        return "torch.npu.is_available() is False"
    return None


def require_npu() -> None:
    """Makes the ``npu`` device ready in this process, or raises naming what is missing."""
    why = npu_unavailable()
    if why is not None:
        raise RuntimeError(f"device 'npu': the NPU runtime needs torch_npu and an ACL graph runner: {why}")
