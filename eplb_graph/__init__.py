"""eplb-graph: graph-mode Expert Parallel Load Balancing for MoE inference on vLLM.

Importing the package registers the ``torch.ops.eplb_graph`` routing ops.
"""

from eplb_graph import custom_ops
from eplb_graph.pytorch.enable import EplbHandle, EplbLayer, EplbOptions, enable
from eplb_graph.core.layer_lookup import BatchFlags, LayerLookup, RoutedLayer
from eplb_graph.core.placement import build_lookup, initial_placement, logical_maps, validate_placement
from eplb_graph.passes.verify import verify

__version__ = "0.1.0"

__all__ = [
    "BatchFlags",
    "EplbHandle",
    "EplbLayer",
    "EplbOptions",
    "LayerLookup",
    "RoutedLayer",
    "build_lookup",
    "custom_ops",
    "enable",
    "initial_placement",
    "logical_maps",
    "validate_placement",
    "verify",
]
