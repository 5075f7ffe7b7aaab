"""The EPLB pass in vLLM's post-grad pass slot, composed with whatever pass the user put there.

vLLM runs one user pass from ``inductor_compile_config["post_grad_custom_post_pass"]``
inside its ``PostGradPassManager`` (``CompilationConfig.inductor_passes`` entries end up in
the same slot). ``VllmEplbPass`` takes that slot and runs the user's pass after ours, so
installing eplb-graph never displaces it.

The pass is configured in the engine process, before any model exists, and is pickled to
the workers; it finds its layers at compile time: the ``VllmMoELayer``s of this process
that are mapped by the graph pass. Each compiled graph is checked by the verifier.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from torch import fx
from vllm.compilation.passes.inductor_pass import InductorPass

from eplb_graph.custom_ops import LAYER_TABLES
from eplb_graph.passes.inductor_pass import pass_source_hash
from eplb_graph.passes.insert_routing import insert_eplb_routing
from eplb_graph.passes.router_sites import RouterSpec
from eplb_graph.passes.verify import verify

from .layers import GRAPH_PASS, VllmMoELayer


def graph_pass_layers() -> list[VllmMoELayer]:
    return [layer for layer in LAYER_TABLES.live() if isinstance(layer, VllmMoELayer) and layer.mapped_by == GRAPH_PASS]


class VllmEplbPass(InductorPass):
    """Inserts ``map_and_record_layer`` after every graph-pass layer's top-k, then the user's pass."""

    def __init__(self, user_pass: InductorPass | None = None) -> None:
        if isinstance(user_pass, VllmEplbPass):
            raise ValueError("the EPLB pass is already installed in this slot")
        self.user_pass = user_pass

    def __call__(self, graph: fx.Graph) -> None:
        layers = {layer.key: layer for layer in graph_pass_layers()}
        routers = [layer.router_spec() for layer in layers.values()]
        if routers:
            result = insert_eplb_routing(graph, routers, strict=True)
            verify(graph, routers, live_tables=LAYER_TABLES.resolve, strict=True)
            for site in result.mapped_sites:
                layers[site.router.key].graph_mappings += 1
        if self.user_pass is not None:
            self.user_pass(graph)

    def routers(self) -> list[RouterSpec]:
        return [layer.router_spec() for layer in graph_pass_layers()]

    def uuid(self) -> str:
        """Inductor's cache key: our pass sources, this file, the layers it maps, the user's pass."""
        digest = hashlib.sha256(pass_source_hash().encode())
        digest.update(Path(__file__).read_bytes())
        digest.update(repr(self.routers()).encode())
        if self.user_pass is not None:
            digest.update(str(self.user_pass.uuid()).encode())
        return digest.hexdigest()
