"""VllmMoELayer and the router hook against upstream's EplbLayerState (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.eplb.eplb_state import EplbLayerState  # noqa: E402
from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter  # noqa: E402

from eplb_graph.core.placement import build_lookup  # noqa: E402
from eplb_graph.vllm_plugin import router_hook  # noqa: E402
from eplb_graph.vllm_plugin.layers import (  # noqa: E402
    GRAPH_PASS,
    ROUTER_HOOK,
    EplbStateDivergedError,
    VllmMoELayer,
)

NUM_LOGICAL, NUM_PHYSICAL = 4, 6


def upstream_tables(placement: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's per-layer logical->physical map [num_logical, 1024] and replica counts."""
    lookup, counts = build_lookup(torch.tensor(placement), NUM_LOGICAL, NUM_PHYSICAL - NUM_LOGICAL + 1)
    full = torch.full((NUM_LOGICAL, 1024), -1, dtype=torch.int64)
    full[:, : lookup.shape[1]] = lookup
    return full, counts.to(torch.int64)


def moe_runner(name: str, placement: list[int]) -> SimpleNamespace:
    state = EplbLayerState()
    state.logical_to_physical_map, state.logical_replica_count = upstream_tables(placement)
    state.expert_load_view = torch.zeros(NUM_PHYSICAL, dtype=torch.int32)
    state.should_record_tensor = torch.ones((), dtype=torch.bool)
    state.num_unpadded_tokens_tensors = [torch.tensor(0, dtype=torch.int32)]
    router = CPURouter(top_k=2, global_num_experts=NUM_LOGICAL, eplb_state=state)
    return SimpleNamespace(layer_name=name, eplb_state=state, router=router)


def make_layer(name: str, placement: list[int], mapped_by: str = ROUTER_HOOK) -> tuple[VllmMoELayer, SimpleNamespace]:
    runner = moe_runner(name, placement)
    layer = VllmMoELayer(
        runner, num_logical_experts=NUM_LOGICAL, num_physical_experts=NUM_PHYSICAL,
        placement=torch.tensor(placement), mapped_by=mapped_by, router_path="layers.0.mlp.experts",
    )
    return layer, runner


def test_layer_records_into_upstreams_load_row_with_upstreams_flags():
    layer, runner = make_layer("t.records", [0, 1, 2, 3, 0, 1])
    state = runner.eplb_state
    state.num_unpadded_tokens_tensors[0].fill_(3)  # the 4th row is padding
    physical = torch.ops.eplb_graph.map_and_record_layer(torch.tensor([[0, 3], [2, 1], [0, 0], [3, 3]]), layer.key)
    assert physical[1].tolist() == [2, layer.lookup[1, int(1 * 2654435769 & 0xFFFFFFFF) % 2].item()]
    assert int(state.expert_load_view.sum()) == 6  # 3 unpadded rows x top-2, in upstream's own buffer
    state.should_record_tensor.fill_(False)  # upstream's window says: not this batch
    torch.ops.eplb_graph.map_and_record_layer(torch.tensor([[0, 1]]), layer.key)
    assert int(state.expert_load_view.sum()) == 6
    layer.close()


def test_refresh_follows_upstreams_commit_and_agrees_with_its_maps():
    layer, runner = make_layer("t.refresh", [0, 1, 2, 3, 0, 1])
    new = [3, 1, 2, 0, 3, 3]
    runner.eplb_state.logical_to_physical_map.copy_(upstream_tables(new)[0])  # upstream commits in place
    runner.eplb_state.logical_replica_count.copy_(upstream_tables(new)[1])
    lookup_before = layer.lookup.data_ptr()
    assert layer.commit_placement_(torch.tensor(new)) is True
    assert layer.tables.physical_to_logical.tolist() == new and layer.lookup.data_ptr() == lookup_before
    assert layer.commit_placement_(torch.tensor(new)) is False  # same placement: no change
    layer.close()


def test_divergence_from_upstream_is_an_error_naming_the_layer():
    layer, runner = make_layer("t.diverge", [0, 1, 2, 3, 0, 1])
    with pytest.raises(EplbStateDivergedError, match="t.diverge: our lookup and upstream's EplbLayerState disagree"):
        layer.commit_placement_(torch.tensor([3, 1, 2, 0, 3, 3]))  # upstream did not commit this
    layer.close()


def test_router_hook_binds_one_instance_and_leaves_the_class_alone():
    layer, runner = make_layer("t.hook", [0, 1, 2, 3, 0, 1])
    _, other = make_layer("t.other", [0, 1, 2, 3, 0, 1], mapped_by=GRAPH_PASS)
    router_hook.hook_router(runner.router, layer.key)
    logits = torch.tensor([[0.0, 0.0, 0.0, 9.0, 8.0, 7.0][:NUM_LOGICAL]] * 3)
    logits[:, 0] = 5.0  # experts 3 then 0 per token
    _, physical = runner.router._select_experts(torch.zeros(3, 2), logits, torch.int32)
    expected = torch.ops.eplb_graph.map_to_physical(torch.tensor([[3, 0]] * 3, dtype=torch.int32), layer.lookup,
                                                    layer.replica_count)
    assert torch.equal(physical, expected) and layer.host_calls == 1
    _, untouched = other.router._select_experts(torch.zeros(3, 2), logits, torch.int32)
    assert untouched.tolist() == [[3, 0]] * 3  # another instance keeps upstream's (CPU: pass-through) hook
    assert router_hook.HOOK not in vars(CPURouter)
    with pytest.raises(RuntimeError, match="already bound"):
        router_hook.hook_router(runner.router, layer.key)
    router_hook.unhook_router(runner.router)
    assert not router_hook.is_bound(runner.router)
    layer.close()


def test_layer_without_upstream_state_is_refused():
    runner = moe_runner("t.missing", [0, 1, 2, 3, 0, 1])
    runner.eplb_state.expert_load_view = None
    with pytest.raises(RuntimeError, match="t.missing: upstream EPLB state lacks expert_load_view"):
        VllmMoELayer(runner, num_logical_experts=NUM_LOGICAL, num_physical_experts=NUM_PHYSICAL,
                     placement=torch.tensor([0, 1, 2, 3, 0, 1]), mapped_by=GRAPH_PASS, router_path="x")
