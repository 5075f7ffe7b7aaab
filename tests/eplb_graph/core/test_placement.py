"""Placements: upstream's initial map, inversion equal to upstream's compute_logical_maps, what cannot be inverted."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from eplb_graph import build_lookup, initial_placement, logical_maps


@st.composite
def placement_batches(draw):
    """[L, P] placements as upstream commits them: any ids, -1 for empty (scaled-up) slots."""
    num_logical = draw(st.integers(1, 12))
    num_layers = draw(st.integers(1, 4))
    num_physical = draw(st.integers(1, 24))
    ids = st.integers(-1, num_logical - 1)
    rows = draw(st.lists(st.lists(ids, min_size=num_physical, max_size=num_physical), min_size=num_layers, max_size=num_layers))
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    return torch.tensor(rows, dtype=dtype), num_logical, draw(st.booleans())


def test_initial_placement_matches_upstream_vllm():
    EplbState = pytest.importorskip("vllm.distributed.eplb.eplb_state").EplbState

    for num_logical, num_redundant_experts in [(8, 0), (8, 3), (4, 9)]:
        upstream = EplbState.build_initial_global_physical_to_logical_map(num_logical, num_redundant_experts)
        assert initial_placement(num_logical, num_redundant_experts).tolist() == list(upstream)


def test_lookup_matches_upstream_compute_logical_maps():
    compute_logical_maps = pytest.importorskip("vllm.distributed.eplb.eplb_state").compute_logical_maps

    placement = torch.tensor([3, 0, 1, 2, 0, 3, 0, 1])
    lookup, replica_count = build_lookup(placement, num_logical_experts=4, max_replicas=5)
    upstream_lookup, upstream_count = compute_logical_maps(placement, 4)
    width = upstream_lookup.shape[-1]
    assert torch.equal(lookup[:, :width].long(), upstream_lookup.long())
    assert torch.all(lookup[:, width:] == -1)  # our table is padded to max_replicas, upstream's is not
    assert torch.equal(replica_count.long(), upstream_count.long())


def test_logical_maps_inverts_placements_skipping_empty_slots():
    placements = torch.tensor([[3, 0, 1, -1, 0, 3], [-1, -1, -1, -1, -1, -1]], dtype=torch.int32)
    slots, counts = logical_maps(placements, 4)
    assert slots.dtype == counts.dtype == torch.int32
    assert slots.tolist() == [[[1, 4], [2, -1], [-1, -1], [0, 5]], [[-1, -1]] * 4]
    assert counts.tolist() == [[2, 1, 0, 2], [0, 0, 0, 0]]
    one_slots, one_counts = logical_maps(placements[0].long(), 4)  # one layer: no layer dim
    assert one_slots.tolist() == slots[0].tolist() and one_counts.tolist() == counts[0].tolist()
    padded, _ = logical_maps(placements[0], 4, width=3)  # a fixed-width table, as LayerLookup keeps
    assert padded.tolist() == [[1, 4, -1], [2, -1, -1], [-1, -1, -1], [0, 5, -1]]
    with pytest.raises(ValueError, match="2 replicas, more than width=1"):
        logical_maps(placements[0], 4, width=1)


@pytest.mark.parametrize(
    "placements,match",
    [
        (torch.tensor([0, 4, 1]), "logical id 4, outside"),
        (torch.zeros(1, 2, 3, dtype=torch.long), r"\[num_layers"),
        (torch.tensor([0.0, 1.0]), "integer logical ids"),
    ],
)
def test_logical_maps_rejects_what_it_cannot_invert(placements, match):
    with pytest.raises(ValueError, match=match):
        logical_maps(placements, 4)


@settings(max_examples=60, deadline=None)
@given(placement_batches())
def test_logical_maps_equals_upstream_compute_logical_maps(case):
    """What lets the capability adaptations put logical_maps in upstream's place at every commit."""
    eplb_state = pytest.importorskip("vllm.distributed.eplb.eplb_state")
    upstream = eplb_state.compute_logical_maps
    assert upstream.__module__ == "vllm.distributed.eplb.eplb_state"  # upstream's own, not our patch
    placements, num_logical, one_layer = case
    source = placements[0] if one_layer else placements
    ours, theirs = logical_maps(source, num_logical), upstream(source, num_logical)
    for mine, reference in zip(ours, theirs):
        assert mine.dtype == reference.dtype and mine.shape == reference.shape
        assert torch.equal(mine, reference)


def test_empty_slots_are_refused_unless_allowed_and_never_count_as_replicas():
    from eplb_graph.core.placement import validate_placement

    placement = torch.tensor([0, 1, 2, -1, -1, 1])
    with pytest.raises(ValueError, match=r"slot 3 holds logical id -1, outside \[0, 3\)"):
        validate_placement(placement, 3, 6, 3)
    assert torch.equal(validate_placement(placement, 3, 6, 3, allow_empty=True), placement)
    with pytest.raises(ValueError, match=r"logical experts \[2\] have no replica"):
        validate_placement(torch.tensor([0, 1, -1, -1]), 3, 4, 3, allow_empty=True)


def test_rank_loads_split_each_experts_load_over_its_replicas_and_skip_empty_slots():
    from eplb_graph.core.placement import layer_balancedness, rank_loads

    load = torch.tensor([[3.0, 1.0, 0.0]])  # [L, num_logical]
    per_rank = rank_loads(load, torch.tensor([[0, 1, 0, -1]]), ranks=2)  # expert 0 on both ranks
    assert per_rank.tolist() == [[2.5, 1.5]]
    assert layer_balancedness(per_rank).tolist() == pytest.approx([2.0 / 2.5])
    # a fractional load is a load (no clamp to one token); nothing loaded is 0, not NaN
    assert layer_balancedness(torch.tensor([[0.25, 0.5], [0.0, 0.0]])).tolist() == pytest.approx([0.75, 0.0])
