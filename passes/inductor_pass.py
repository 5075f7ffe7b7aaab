"""The EPLB pass as Inductor, vLLM and torchair want it.

* ``EplbPostGradPass``: an Inductor ``CustomGraphPass`` for
  ``torch._inductor.config.post_grad_custom_post_pass``. Its ``uuid()`` hashes the pass
  sources and the router specs, so Inductor's FX graph cache never serves a graph
  compiled by another version or for other layers.
* ``vllm_inductor_pass``: the same pass wrapped as vLLM's ``CallableInductorPass``.
* ``torchair_backend``: torchair's NPU backend with the pass run first (Ascend only).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .insert_routing import RoutingPassResult, insert_eplb_routing
from .router_sites import RouterSpec

_PASS_SOURCES = ("router_sites.py", "insert_routing.py", "inductor_pass.py")


def pass_source_hash() -> str:
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in _PASS_SOURCES:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()


class EplbPostGradPass(CustomGraphPass):
    def __init__(self, routers: list[RouterSpec], *, strict: bool = True) -> None:
        self.routers = list(routers)
        self.strict = strict
        self.results: list[RoutingPassResult] = []

    def __call__(self, graph: fx.Graph) -> None:
        self.results.append(insert_eplb_routing(graph, self.routers, strict=self.strict))

    def uuid(self) -> str:
        digest = hashlib.sha256(pass_source_hash().encode())
        digest.update(repr((self.routers, self.strict)).encode())
        return digest.hexdigest()


def vllm_inductor_pass(post_grad_pass: EplbPostGradPass):
    """Wraps the pass as vLLM's CallableInductorPass (for ``post_grad_custom_post_pass``)."""
    from vllm.compilation.passes.inductor_pass import CallableInductorPass

    return CallableInductorPass(post_grad_pass, post_grad_pass.uuid())


def torchair_backend(run_pass: Callable[[fx.GraphModule], object], compiler_config=None):
    """torchair's NPU backend with the EPLB pass run on the Dynamo graph first.

    torchair ships inside torch_npu and is imported only here, when called on Ascend.
    """
    import torchair  # noqa: PLC0415  (Ascend only)

    npu_backend = torchair.get_npu_backend(compiler_config=compiler_config)

    def eplb_npu_backend(graph_module: fx.GraphModule, example_inputs):
        run_pass(graph_module)
        return npu_backend(graph_module, example_inputs)

    return eplb_npu_backend
