"""Per-instance router hook: vLLM's router EPLB hook bound to our op, class untouched.

Where a layer's top-k never reaches a graph our pass sees (eager mode, or inside the opaque
``torch.ops.vllm.moe_forward`` on CUDA and Ascend), the router's own template method still
calls ``self._apply_eplb_mapping(topk_ids)`` after selection (vLLM ``BaseRouter``). We set
that one name on the router *instance*: other routers, the class and its subclasses keep
upstream behaviour, and unbinding restores it by deleting the instance attribute.
"""

from __future__ import annotations

import torch

from eplb_graph.upstream import patches
from eplb_graph.upstream.adaptations import adaptation

ADAPTATION = "router.apply_eplb_mapping"
HOOK = adaptation(ADAPTATION).attribute


def hook_router(router: object, layer_key: str) -> None:
    if patches.installed(ADAPTATION, on=router):
        raise RuntimeError(f"the router of {layer_key} is already bound to an EPLB mapping")
    map_and_record_layer = torch.ops.eplb_graph.map_and_record_layer

    def apply_eplb_mapping(topk_ids: torch.Tensor) -> torch.Tensor:
        return map_and_record_layer(topk_ids, layer_key)  # [T, K] logical -> [T, K] physical

    patches.install(ADAPTATION, apply_eplb_mapping, by=layer_key, on=router)


def unhook_router(router: object) -> None:
    patches.uninstall(ADAPTATION, on=router)


def is_bound(router: object) -> bool:
    return patches.installed(ADAPTATION, on=router)
