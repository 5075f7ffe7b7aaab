"""The one line each vLLM worker logs when eplb-graph took effect (``eplb-graph active``).

It says how each MoE layer is mapped, what records load and when, what moves with each expert,
the expert-parallel adaptations bound, and the upstream adaptations in force as the registry
records them (``upstream/patches.py``: what ``eplb-graph doctor`` checks).
"""

from __future__ import annotations

import logging

from eplb_graph.upstream import patches
from eplb_graph.upstream.adaptations import CHECKED_AGAINST

from .local_experts import pair_experts_class


def vllm_logger() -> logging.Logger:
    from vllm.logger import init_logger

    return init_logger("vllm.eplb_graph")  # under "vllm.": vLLM's handler and format


def adaptations_line() -> str:
    """What the registry says is in force in this process (``eplb-graph doctor`` checks the same)."""
    keys = patches.installed_keys()
    checked = ", ".join(f"{name} {version}" for name, version in CHECKED_AGAINST)
    return f"upstream adaptations in force: {len(keys)} ({', '.join(keys) or 'none'}; checked against {checked})"


def log_active(worker) -> str:
    """One line in vLLM's log per worker: eplb-graph took effect, how each layer is mapped, what records load."""
    eplb = worker.runner.parallel_config.eplb_config
    mechanisms = ", ".join(f"{layer.key}: {layer.mapped_by}" for layer in worker.layers)
    moved = {", ".join([*view.moved, *view.derived]) for view in worker.expert_views.values()}
    movers = {type(state.communicator).__name__ for state in worker.runner.eplb_state.model_states.values()}
    line = (
        f"eplb-graph active on {worker.runner.device}: {len(worker.layers)} MoE layers bound ({mechanisms}); "
        f"load phase: every batch of the last {eplb.window_size} steps before each rearrangement, every "
        f"{eplb.step_interval} steps (upstream's window); {eplb.num_redundant_experts} redundant experts, "
        f"{'async' if eplb.use_async else 'sync'} EPLB through {', '.join(sorted(movers))}; each expert moves with "
        f"{' | '.join(sorted(moved))}"
    )
    if worker.local_experts:
        classes = sorted({pair_experts_class(experts.experts) for experts in worker.local_experts.values()})
        line += (f"; expert parallel rank {worker.ep_rank} of {worker.ep_size}: each layer's {', '.join(classes)} "
                 f"compute this rank's (token, k) pairs only (eplb_graph::local_expert_pairs)")
    if worker.dp_dispatch is not None:
        line += (f"; DP tokens dispatched over {worker.dp_dispatch.slot.max_size} ranks by "
                 f"eplb_graph::ep_all_gatherv / ep_reduce_scatterv")
    line += f"; {adaptations_line()}"
    vllm_logger().info(line)
    return line
