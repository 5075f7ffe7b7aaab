"""UpstreamBinding: the one commit contract with upstream's EplbState, driven through its hooks.

Upstream's commit points and policy call are the capability adaptations' patches; here they are
called as upstream calls them, with a stand-in for a model's state, so each rule is seen on
its own: a commit refreshes exactly the committed layers from upstream's placement, a bad
policy placement moves nothing, a commit for an unbound model is an error, ``close`` puts
upstream back. The multi-rank tests (tests/eplb_reference/runtime/test_controller.py) run the same binding
under upstream's real async worker.
"""

from types import SimpleNamespace

import pytest
import torch

from eplb_graph import BatchFlags, LayerLookup, RoutedLayer

eplb_state = pytest.importorskip("vllm.distributed.eplb.eplb_state")
async_worker = pytest.importorskip("vllm.distributed.eplb.async_worker")

from eplb_graph.upstream.binding import UpstreamBinding  # noqa: E402


@pytest.fixture
def bound():
    """A binding over two layers of 4 logical + 2 redundant experts, and upstream's view of them."""
    flags = BatchFlags()
    layers = [RoutedLayer(f"binding-test.{i}", LayerLookup(4, 6), flags) for i in range(2)]
    model = SimpleNamespace(num_moe_layers=2)
    placement = torch.stack([layer.tables.physical_to_logical for layer in layers])  # [L, P]
    model_state = SimpleNamespace(  # the fields upstream's commit functions write
        model=model, physical_to_logical_map=placement.clone(),
        logical_to_physical_map=torch.full((2, 4, 3), -1, dtype=torch.int64),  # [L, N, width]
        logical_replica_count=torch.zeros(2, 4, dtype=torch.int64),  # [L, N]
    )
    binding = UpstreamBinding("cpu")
    binding.bind(model, layers)
    try:
        yield binding, layers, model_state
    finally:
        binding.close()
        for layer in layers:
            layer.close()


def test_a_layer_commit_refreshes_that_layer_from_upstreams_placement(bound):
    binding, layers, model_state = bound
    new = torch.tensor([3, 2, 1, 0, 3, 3])
    pointer = layers[0].tables.lookup.data_ptr()
    eplb_state._commit_eplb_maps_for_layer(model_state, new_physical_to_logical_map=new, layer=0)
    assert layers[0].tables.physical_to_logical.tolist() == new.tolist()
    assert layers[0].tables.lookup.data_ptr() == pointer  # refreshed in place
    assert layers[1].tables.physical_to_logical.tolist() == [0, 1, 2, 3, 0, 1]  # not committed: untouched
    assert (binding.stats.layers_committed, binding.stats.placement_changes, binding.stats.rearrangements_finished) == (1, 1, 0)
    assert binding.stats.layers_committed_in_flight == 1
    unchanged = model_state.physical_to_logical_map[1].clone()
    eplb_state._commit_eplb_maps_for_layer(model_state, new_physical_to_logical_map=unchanged, layer=1)  # the last layer
    assert (binding.stats.layers_committed, binding.stats.placement_changes, binding.stats.rearrangements_finished) == (2, 1, 1)
    assert binding.stats.layers_committed_in_flight == 0


def test_an_elastic_layer_wider_than_upstreams_placement_takes_it_with_empty_slots_after():
    """An elastic member's tables have the maximum size's slots; upstream places the current size's."""
    flags = BatchFlags()
    layers = [RoutedLayer("binding-test.wide", LayerLookup(4, 12, placement=torch.tensor([0, 1, 2, 3, 0, 1] + [-1] * 6),
                                                           allow_empty_slots=True), flags)]
    model = SimpleNamespace(num_moe_layers=1)
    model_state = SimpleNamespace(model=model, physical_to_logical_map=torch.tensor([[0, 1, 2, 3, 0, 1]]),
                                  logical_to_physical_map=torch.full((1, 4, 3), -1, dtype=torch.int64),
                                  logical_replica_count=torch.zeros(1, 4, dtype=torch.int64))
    binding = UpstreamBinding("cpu")
    binding.bind(model, layers)
    try:
        new = torch.tensor([3, 2, 1, 0, 2, 2])
        eplb_state._commit_eplb_maps_for_layer(model_state, new_physical_to_logical_map=new, layer=0)
        assert layers[0].tables.physical_to_logical.tolist() == new.tolist() + [-1] * 6
        binding.check_placements(model_state, torch.tensor([[0, 1, 2, 3, 3, 3]]))  # checked padded: valid
        with pytest.raises(ValueError, match="logical experts \\[1\\] have no replica"):
            binding.check_placements(model_state, torch.tensor([[0, 0, 2, 3, 3, 3]]))
    finally:
        binding.close()
        layers[0].close()


def test_a_synchronous_commit_refreshes_every_layer(bound):
    binding, layers, model_state = bound
    eplb_state._commit_eplb_maps(model_state, new_physical_to_logical_map=torch.tensor([[1, 0, 3, 2, 1, 1]] * 2))
    assert all(layer.tables.physical_to_logical.tolist() == [1, 0, 3, 2, 1, 1] for layer in layers)
    assert binding.stats.layers_committed == 2 and binding.stats.rearrangements_finished == 1


def test_a_bad_policy_placement_is_replaced_by_the_current_one_and_reported(bound):
    binding, layers, model_state = bound
    current = model_state.physical_to_logical_map.clone()
    good = torch.tensor([[2, 3, 0, 1, 2, 2]] * 2)
    bad = good.clone()
    bad[1, 4] = 9  # a logical id that does not exist
    for proposed, expected in ((good, good), (bad, current)):
        policy = binding.capabilities._checked_policy(lambda *args, proposed=proposed: proposed.clone())
        assert policy(model_state, None, current, None).tolist() == expected.tolist()
    [rejected] = binding.rejected_placements
    assert "slot 4 holds logical id 9" in rejected
    assert all(layer.tables.physical_to_logical.tolist() == [0, 1, 2, 3, 0, 1] for layer in layers)  # nothing moved


def test_a_commit_for_a_model_it_did_not_bind_is_an_error(bound):
    binding, _, model_state = bound
    stranger = SimpleNamespace(model=SimpleNamespace(num_moe_layers=2), physical_to_logical_map=model_state.physical_to_logical_map)
    with pytest.raises(ValueError, match="a model eplb-graph did not bind"):
        binding._after_commit(stranger, 0)
    # on the policy path the same is a rejected placement: nothing moves, the worker lives on
    policy = binding.capabilities._checked_policy(lambda *args: torch.tensor([[1, 0, 3, 2, 1, 1]] * 2))
    assert torch.equal(policy(stranger, None, model_state.physical_to_logical_map, None), model_state.physical_to_logical_map)
    assert "did not bind" in binding.rejected_placements[-1]


def test_a_dead_worker_is_raised_on_the_main_thread(bound):
    binding, _, _ = bound
    binding.check_worker("here")  # alive: nothing
    binding.capabilities.health.error = ConnectionError("peer gone")
    with pytest.raises(Exception, match="async EPLB worker here died: ConnectionError"):
        binding.check_worker("here")


def test_close_puts_upstream_back():
    originals = {name: getattr(eplb_state, name) for name in ("_commit_eplb_maps_for_layer", "compute_logical_maps")}
    policy = async_worker.run_rebalance_experts
    binding = UpstreamBinding("cpu")
    assert eplb_state._commit_eplb_maps_for_layer is not originals["_commit_eplb_maps_for_layer"]
    binding.close()
    assert all(getattr(eplb_state, name) is original for name, original in originals.items())
    assert async_worker.run_rebalance_experts is policy
