"""Quant methods upstream refuses EPLB for, served where their expert-weight view holds.

vLLM refuses EPLB when a MoE layer is built with a quant method whose ``supports_eplb`` is
False, not for a difference in the data (its own comment) but because no move was written for
the method. eplb-graph moves through upstream's mover what ``expert_views`` proves, layer by
layer, to be the kernel's storage, so for the backends listed here the method answers True.
Upstream reads ``supports_eplb`` only with EPLB on, so EPLB off behaves as upstream (invariant 8);
a method whose ``supports_eplb`` is no longer the property expected here is left alone, with a
warning (upstream then refuses EPLB for it by name), never failing the import of vLLM's module.

* ``CompressedTensorsWNA16MoEMethod`` on vLLM's CPU backend (int4 weights, pack-quantized;
  ``CPUExpertsInt4`` runs them as W4A8, with int8 activations quantized per token): after
  loading, every tensor its kernel reads is an expert-major parameter -- the blocked int4
  weights, their scales and the zero points the method creates.
"""

from __future__ import annotations

import warnings
from types import ModuleType

from eplb_graph.upstream import patches
from eplb_graph.upstream.adaptations import PLUGIN, adaptation

from .import_hooks import call_after_import

ADAPTATION = "quant.wna16_supports_eplb"
WNA16_MODULE = adaptation(ADAPTATION).module
EPLB_BACKENDS = ("CPU",)  # WNA16MoEBackend values whose layers have a view (Triton: upstream's own)


def _serve_wna16(module: ModuleType) -> None:
    """Called once vLLM imported ``module`` (in ``sys.modules`` by then), EPLB on or off."""
    if patches.installed(ADAPTATION):
        return
    try:
        upstream = patches.current(ADAPTATION)  # the property, read off the class (its shape checked)
    except patches.AdaptationError as error:  # an upstream refactor: say so, and leave upstream's answer
        warnings.warn(f"{error}; int4 MoE checkpoints are not served with EPLB", RuntimeWarning, stacklevel=2)
        return

    def supports_eplb(self) -> bool:
        return upstream.fget(self) or self.wna16_backend.value in EPLB_BACKENDS

    patches.install(ADAPTATION, property(supports_eplb), by=PLUGIN)


def install_quant_method_hooks() -> None:
    """Answers ``supports_eplb`` for the methods above once vLLM imports them. Idempotent."""
    call_after_import(WNA16_MODULE, "eplb-graph supports_eplb", _serve_wna16)
