"""``runtime/elastic/reshuffle.py``: which sizes a group may take, and upstream's policy for a new size.

The weight move itself runs between processes in ``test_scripted.py``.
"""

import pytest
import torch

from eplb_graph.core.placement import validate_placement
from eplb_reference.elastic.reshuffle import check_new_size, new_placement


@pytest.mark.parametrize("size, message", [
    (0, "must be a positive integer, got 0"),
    (True, "must be a positive integer, got True"),
    ("4", "must be a positive integer, got '4'"),
    (5, "the group's maximum \\(--max-ranks\\) is 4"),
    (1, "1 x 10 expert slots cannot host 16 logical experts \\(at least 2 ranks\\)"),
])
def test_a_size_the_group_cannot_take_is_refused_by_name(size, message):
    with pytest.raises(ValueError, match=message):
        check_new_size(size, num_logical=16, num_local=10, max_size=4)


@pytest.mark.parametrize("new_size", [2, 3, 4])
def test_the_policy_places_every_expert_on_the_new_size(new_size):
    load = torch.zeros(2, 16, dtype=torch.int64)
    load[:, 3] = 100  # one hot expert
    placement = new_placement(load, num_local=10, new_size=new_size)
    assert placement.shape == (2, 10 * new_size)
    for layer in placement:
        validate_placement(layer, 16, 10 * new_size, 10 * new_size - 16 + 1)
    assert (placement[0] == 3).sum() > 1  # the hot expert got replicas


def test_with_nothing_recorded_the_policy_still_places_every_expert():
    placement = new_placement(torch.zeros(1, 16, dtype=torch.int64), num_local=10, new_size=2)
    assert set(placement[0].tolist()) == set(range(16))
