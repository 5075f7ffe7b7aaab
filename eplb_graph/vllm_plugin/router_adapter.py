"""Per-instance router adapter: vLLM's router EPLB hook bound to our op, class untouched.

Where a layer's top-k never reaches a graph our pass sees (eager mode, or inside the opaque
``torch.ops.vllm.moe_forward`` on CUDA and Ascend), the router's own template method still
calls ``self._apply_eplb_mapping(topk_ids)`` after selection (vLLM ``BaseRouter``). We set
that one name on the router *instance*: other routers, the class and its subclasses keep
upstream behaviour, and unbinding restores it by deleting the instance attribute.
"""

from __future__ import annotations

import torch

HOOK = "_apply_eplb_mapping"


def bind_router(router: object, layer_key: str) -> None:
    if not hasattr(type(router), HOOK):
        raise RuntimeError(
            f"{type(router).__name__} has no {HOOK}(); upstream vLLM changed its router EPLB hook and the "
            f"eplb-graph router adapter must be updated"
        )
    if HOOK in vars(router):
        raise RuntimeError(f"the router of {layer_key} is already bound to an EPLB mapping")
    map_and_record_layer = torch.ops.eplb_graph.map_and_record_layer

    def apply_eplb_mapping(topk_ids: torch.Tensor) -> torch.Tensor:
        return map_and_record_layer(topk_ids, layer_key)  # [T, K] logical -> [T, K] physical

    setattr(router, HOOK, apply_eplb_mapping)


def unbind_router(router: object) -> None:
    vars(router).pop(HOOK, None)


def is_bound(router: object) -> bool:
    return HOOK in vars(router)
