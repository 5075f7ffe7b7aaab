"""The placement file of a model under ``enable()``: what it fits, and a file checked against it.

``handle.save_placement(path)`` writes the placement routed now (``placement_file.py``'s format,
the one the vLLM plugin and the runtime write); ``enable(model, placement=path)`` checks it here,
before any weight is touched, and starts each layer from it instead of the initial placement.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from torch import nn

from eplb_graph.pytorch.adapters import MoELayerSpec
from eplb_graph.core.placement import validate_placement
from eplb_graph.core.placement_file import PlacementFileError, PlacementIdentity, PlacementRecord, check_fits, config_hash, load

if TYPE_CHECKING:
    from eplb_graph.pytorch.enable import EplbOptions


def model_identity(model: nn.Module, specs: list[MoELayerSpec], options: EplbOptions) -> PlacementIdentity:
    """What a placement file of this model fits: its class, a hash of its config (a Hugging Face
    model's) or else of its MoE layers' shapes, the expert counts and ``ep_size``."""
    counts = {spec.num_experts for spec in specs}
    if len(counts) != 1:
        raise PlacementFileError(f"a placement file holds one expert count for all layers; this model's MoE layers "
                                 f"have {sorted(counts)}")
    (num_logical,) = counts
    config = getattr(model, "config", None)
    if not hasattr(config, "to_dict"):
        config = {spec.name: [spec.top_k, *(list(getattr(spec.experts, name).shape[1:]) for name in spec.expert_param_names)]
                  for spec in specs}
    return PlacementIdentity(type(model).__name__, config_hash(config), len(specs), num_logical,
                             num_logical + options.num_redundant_experts, options.ep_size, "none")


def kept_placement(path: str | os.PathLike, identity: PlacementIdentity) -> PlacementRecord:
    """A placement file that fits ``identity``, each layer's placement checked as its lookup
    will hold it (at most num_redundant_experts + 1 replicas of an expert); PlacementFileError naming why not."""
    record = load(path)
    check_fits(record, identity, path)
    max_replicas = identity.num_physical_experts - identity.num_logical_experts + 1  # LayerLookup's default
    for layer, row in enumerate(record.physical_to_logical):
        try:
            validate_placement(row, identity.num_logical_experts, identity.num_physical_experts, max_replicas)
        except ValueError as error:
            raise PlacementFileError(f"placement file {path}, layer {layer}: {error}") from None
    return record
