"""vLLM's elastic EP under a worker: the EP group resized while it serves.

Our tables are sized once for upstream's slot capacity (``slot_capacity``) and bound to its
capacity rows, so a resize never replaces a tensor a graph reads; what changes is the placement,
which reaches our lookups here: a new engine's, installed by upstream's ``update_mapping``
(``follow_new_engine_mapping``), and an existing engine's after upstream's switch (``after_switch``).

A compiled graph holds no value of the group's size either: the DP dispatch reads each rank's token
count when it runs (``dp_dispatch``), the experts read the layer's live ``expert_map`` (an op
argument the graph passes through) and find the layer's experts by name (``LocalPairExperts``).
So upstream's reset of the compiled state at a switch (``_release_cuda_graphs``) is skipped on
CPU (``keeps_graphs``; ``EPLB_GRAPH_ELASTIC_KEEP_GRAPHS=0`` leaves it to upstream).

For the same reason a new engine can compile its graphs alone, before it joins (``warm_alone``):
the graph it traces communicating nothing is the one it runs in the group, so the commit's
collective warm-up, which pauses every engine, runs compiled code instead of a first compile.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from eplb_graph.upstream import patches

if TYPE_CHECKING:
    from .worker import VllmEplbWorker


KEEP_GRAPHS = "EPLB_GRAPH_ELASTIC_KEEP_GRAPHS"


def keep_graphs(environ: dict[str, str] | os._Environ) -> bool:
    """Whether a resize keeps the compiled graphs (the default) or lets upstream reset them."""
    raw = environ.get(KEEP_GRAPHS, "1")
    if raw not in ("0", "1"):
        raise ValueError(f"{KEEP_GRAPHS}={raw!r}: 1 keeps the compiled graphs across a resize (the default), "
                         f"0 leaves upstream's reset of them at each switch")
    return raw == "1"


def slot_capacity(parallel_config, model_state) -> int | None:
    """Under vLLM's elastic EP, the physical slots upstream sized its buffers for: its
    ``physical_expert_capacity`` (local slots x ``elastic_ep_max_dp_size`` x EP size // DP size, i.e.
    local slots x the most DP ranks at TP=1), the width of ``expert_load_pass_buffer`` and
    ``physical_to_logical_map_buffer``, which a resize re-views and never reallocates. None with
    elastic EP off: the tables are as wide as the slots placed."""
    if not getattr(parallel_config, "enable_elastic_ep", False):
        return None
    return int(model_state.expert_load_pass_buffer.shape[1])


def follow_new_engine_mapping(worker: VllmEplbWorker) -> None:
    """A new engine of an elastic EP group gets its placement from the existing ones through
    ``runner.setup_eplb_from_mapping`` -> ``EplbState.update_mapping``, which bypasses the
    commit functions our lookups refresh at: the lookups are refreshed right after it."""
    runner = worker.runner
    upstream_setup = runner.setup_eplb_from_mapping

    def setup_eplb_from_mapping(*args, **kwargs):
        result = upstream_setup(*args, **kwargs)
        refresh_from_upstream(worker)
        return result

    patches.install("worker.setup_eplb_from_mapping", setup_eplb_from_mapping, by=worker, on=runner)


def refresh_from_upstream(worker: VllmEplbWorker) -> None:
    """Every layer routes by upstream's placement now, checked against upstream's maps
    (``check_agrees_with_upstream``): a refresh, not a rearrangement (nothing counted)."""
    for model_state in worker.runner.eplb_state.model_states.values():
        worker.binding.refresh(model_state)


def after_switch(worker: VllmEplbWorker) -> None:
    """After upstream's ``switch_and_prepare`` (a resize of the EP group): it re-viewed its
    capacity buffers at the new slot count (``reconfigure_physical_expert_slots``) and the EP
    group is a new one. Our tables are capacity-sized and bound to the capacity rows, so their
    storage stays; they are refreshed from upstream's re-viewed placement (the slots beyond it
    empty). The EP size is read live (``VllmEplbWorker.ep_size``, the metrics). The DP dispatch
    and each layer's local experts are bound again, to upstream's new DP group and experts."""
    for model_state in worker.runner.eplb_state.model_states.values():
        layers = worker.layers_of(model_state)
        placed, capacity = model_state.physical_to_logical_map.shape[1], layers[0].tables.num_physical_experts
        if placed > capacity:
            raise ValueError(f"eplb-graph: upstream places {placed} expert slots after the resize, more than the "
                             f"{capacity} our tables hold (elastic_ep_max_dp_size)")
    refresh_from_upstream(worker)
    if worker.dp_dispatch is not None:
        from .dp_dispatch import bind_dp_dispatch

        worker.dp_dispatch.unbind()
        worker.dp_dispatch = bind_dp_dispatch(worker.runner.parallel_config, worker.moe_runners())
    worker.local_experts = {key: experts.rebind() for key, experts in worker.local_experts.items()}


def warm_alone(worker: VllmEplbWorker, warm: Callable[[], None]) -> None:
    """A new engine's ``warm`` (upstream's warm-up forward, which compiles) run before the engine
    joins, while the others serve: DP coordination skipped (upstream's own switch for a rank warming
    up alone) and the DP dispatch communicating nothing, the group's size unchanged. Any compile
    after it (at the commit, or serving) is one the compile watch reports."""
    from vllm.v1.worker.dp_utils import skip_dp_coordination

    with skip_dp_coordination(), worker.dp_dispatch.slot.alone():
        warm()
    if worker.compile_watch is not None:
        worker.compile_watch.start(after="the end of its warm-up alone")
