"""The `eplb-graph active` line (the engine and server tests read it from real workers)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")


def test_the_active_line_names_each_layer_and_mechanism():
    from eplb_graph.vllm_plugin.active_line import log_active

    eplb = SimpleNamespace(window_size=10, step_interval=30, num_redundant_experts=2, use_async=True)
    state = SimpleNamespace(communicator=SimpleNamespace())
    runner = SimpleNamespace(device="cpu", parallel_config=SimpleNamespace(eplb_config=eplb),
                             eplb_state=SimpleNamespace(model_states={"m": state}))
    layers = [SimpleNamespace(key="model.layers.0.mlp.experts", mapped_by="graph_pass"),
              SimpleNamespace(key="model.layers.1.mlp.experts", mapped_by="router_hook")]
    views = {layer.key: SimpleNamespace(moved={"w13_weight": 0, "w2_weight": 0}, derived={"w1_alphas": 0})
             for layer in layers}
    from eplb_graph.upstream.capability import CapabilityAdaptations

    adapter = CapabilityAdaptations("cpu", commit_hook=lambda state, layer: None).install()  # as a worker's binding
    try:
        line = log_active(SimpleNamespace(runner=runner, layers=layers, expert_views=views, local_experts={},
                                          dp_dispatch=None))
    finally:
        adapter.uninstall()
    assert "capability.state_event, " in line and "capability.commit_layer, " in line and "probes." not in line
    assert line.startswith("eplb-graph active on cpu: 2 MoE layers bound (model.layers.0.mlp.experts: graph_pass, "
                           "model.layers.1.mlp.experts: router_hook)")
    assert "last 10 steps before each rearrangement, every 30 steps" in line
    assert "2 redundant experts, async EPLB through SimpleNamespace;" in line
    assert "each expert moves with w13_weight, w2_weight, w1_alphas;" in line
    in_force = re.search(r"upstream adaptations in force: (\d+) \((.*); checked against vllm 0.32.0, torch 2.13.0\)$",
                         line)
    assert in_force and int(in_force[1]) == len(in_force[2].split(", ")) >= 10


def test_the_active_line_names_the_expert_parallel_adaptations():
    from eplb_graph.vllm_plugin.active_line import log_active

    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import X86CPUUnquantizedExperts

    experts = X86CPUUnquantizedExperts.__new__(X86CPUUnquantizedExperts)  # upstream's class (matched by identity)
    eplb = SimpleNamespace(window_size=10, step_interval=30, num_redundant_experts=2, use_async=True)
    runner = SimpleNamespace(device="cpu", parallel_config=SimpleNamespace(eplb_config=eplb),
                             eplb_state=SimpleNamespace(model_states={"m": SimpleNamespace(communicator=object())}))
    worker = SimpleNamespace(runner=runner, layers=[], expert_views={}, ep_rank=1, ep_size=2,
                             local_experts={"layer": SimpleNamespace(experts=experts)},
                             dp_dispatch=SimpleNamespace(slot=SimpleNamespace(max_size=2)))
    line = log_active(worker)
    assert line.split("; upstream adaptations in force")[0].endswith("; expert parallel rank 1 of 2: each layer's CPUUnquantizedExperts compute this rank's "
                         "(token, k) pairs only (eplb_graph::local_expert_pairs); DP tokens dispatched over 2 ranks "
                         "by eplb_graph::ep_all_gatherv / ep_reduce_scatterv")
