"""``runtime/elastic/recovery.py``: the survivors' placement, the experts reloaded from disk, the requests re-served.

The recovery itself (a member SIGKILLed, SIGSTOPped or hung while the group serves) runs in
``test_scripted.py``; when a member tries it, in ``test_member.py``.
"""

import pytest
import torch

from eplb_reference.runtime.config import RunConfig
from eplb_reference.elastic.recovery import (
    reload_lost_experts, requeued_requests, save_expert_source, surviving_placement,
)
from eplb_reference.elastic.stack import build_elastic_models


def test_survivors_keep_their_slots_and_the_experts_lost_with_the_dead_take_spare_replicas():
    # 3 ranks x 2 slots; rank 1 dies with the only replicas of experts 2 and 3; expert 0 has three left
    placement = torch.tensor([[0, 1, 2, 3, 0, 0, -1, -1]])
    recovered = surviving_placement(placement, [0, 2], num_local=2, num_logical=4)
    assert recovered.tolist() == [[2, 1, 3, 0, -1, -1, -1, -1]]  # expert 0's first replicas gave way, one stays


def test_an_expert_lost_with_the_dead_goes_to_an_empty_slot_before_it_displaces_a_replica():
    # 3 ranks x 2 slots, rank 2 a joiner whose experts had not arrived: rank 0 dies with experts 0 and 1
    placement = torch.tensor([[0, 1, 2, 3, -1, -1]])
    recovered = surviving_placement(placement, [1, 2], num_local=2, num_logical=4)
    assert recovered.tolist() == [[2, 3, 0, 1, -1, -1]]


def test_every_expert_keeps_a_replica_after_a_recovery():
    placement = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 0, 1]])  # 5 ranks x 2
    recovered = surviving_placement(placement, [0, 2, 4], num_local=2, num_logical=4)  # ranks 1 and 3 died
    assert sorted(set(recovered[0, :6].tolist())) == [0, 1, 2, 3] and (recovered[0, 6:] == -1).all()


def test_survivors_too_few_for_the_experts_are_refused_by_name():
    with pytest.raises(RuntimeError, match="1 survivors cannot host expert"):
        surviving_placement(torch.tensor([[0, 1, 2, 3]]), [0], num_local=2, num_logical=4)


def test_the_dead_members_in_flight_steps_and_the_failed_forwards_are_served_again():
    requests = requeued_requests({3: 48}, {3: 2}, failed_ranks=[1], resume_step=51)
    assert requests == [(49, 2), (50, 1), (50, 2)]
    assert requeued_requests({3: 50}, {3: 2}, [], 51) == []  # it had completed everything


def test_a_joiner_that_died_before_it_served_owes_only_its_generations_steps():
    # joined the generation that first served step 49, killed before it completed one
    assert requeued_requests({3: -1}, {3: 3}, [], resume_step=51, first_step=49) == [(49, 3), (50, 3)]


def test_lost_experts_come_back_from_the_source_on_disk(tmp_path):
    cfg = RunConfig(mode="eager", ranks=2, num_layers=1)
    source = save_expert_source(cfg, tmp_path / "experts.pt")
    member = build_elastic_models(cfg, member=0, founding_rank=0, max_ranks=2, group_name="recovery-ep")
    layer = member.rank_layers[0]
    before = layer.tables.physical_to_logical.clone()
    recovered = before.clone().unsqueeze(0)
    recovered[0, 3] = 15  # slot 3 of this rank now hosts expert 15, which it did not hold
    assert reload_lost_experts(member.rank_layers, recovered, 0, 0, member.num_local, source) == 1
    logical = torch.load(source, weights_only=True)[0]
    assert all(torch.equal(local[3], full[15]) for local, full in zip(layer.weight_view, logical))
    assert layer.tables.physical_to_logical[3] == 15 and not layer.tables.load.any()


class _NotWeights:
    """Any pickled object that is not tensors: loading it would run its code under weights_only=False."""


def test_an_expert_source_holding_more_than_tensors_is_refused(tmp_path):
    cfg = RunConfig(mode="eager", ranks=2, num_layers=1)
    member = build_elastic_models(cfg, member=0, founding_rank=0, max_ranks=2, group_name="recovery-unsafe")
    recovered = member.rank_layers[0].tables.physical_to_logical.clone().unsqueeze(0)
    recovered[0, 3] = 15
    source = tmp_path / "experts.pt"
    torch.save([[_NotWeights()]], source)
    with pytest.raises(Exception, match="Weights only load failed"):
        reload_lost_experts(member.rank_layers, recovered, 0, 0, member.num_local, source)
