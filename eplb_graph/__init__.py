"""eplb-graph: graph-mode Expert Parallel Load Balancing for MoE inference on vLLM.

Importing the package registers the ``torch.ops.eplb_graph`` routing ops.
"""

from eplb_graph import custom_ops
from eplb_graph.layer_lookup import BatchFlags, LayerLookup, build_lookup, initial_placement, validate_placement

__all__ = [
    "BatchFlags",
    "LayerLookup",
    "build_lookup",
    "custom_ops",
    "initial_placement",
    "validate_placement",
]
