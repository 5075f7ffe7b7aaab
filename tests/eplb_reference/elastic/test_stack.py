"""``runtime/elastic/stack.py``: a member's models sized for the group's maximum."""

import torch

from eplb_reference.runtime.config import RunConfig
from eplb_reference.elastic.group import ElasticEpGroup
from eplb_reference.elastic.stack import build_elastic_models, max_placement, non_expert_tensors

CFG = RunConfig(mode="eager", ranks=2, num_layers=1)


def test_the_placement_spans_the_maximum_with_the_absent_ranks_empty():
    placement = max_placement(CFG, max_ranks=4)  # 20 physical over 2 ranks: 10 slots per rank
    assert placement.shape == (40,)
    assert sorted(set(placement[:20].tolist())) == list(range(16)) and (placement[20:] == -1).all()


def test_a_founding_member_serves_the_reference_alone_and_a_joiner_holds_placeholders(board):
    one_rank = RunConfig(mode="eager", ranks=1, num_layers=1)
    founder = build_elastic_models(one_rank, member=0, founding_rank=0, max_ranks=2, group_name="stack-ep")
    joiner = build_elastic_models(one_rank, member=1, founding_rank=None, max_ranks=2, group_name="stack-ep")
    group = ElasticEpGroup("stack-ep", board, member=0, max_size=2)
    try:
        tokens = torch.randint(0, one_rank.vocab_size, (1, 16))
        with torch.no_grad(), group.solo():
            assert torch.equal(founder.model(tokens), founder.reference(tokens))
        assert founder.rank_layers[0].tables.num_physical_experts == 40
        assert all(not t.any() for t in joiner.rank_layers[0].weight_view)  # placeholder experts
        experts = {id(t) for t in founder.rank_layers[0].weight_view}
        assert not experts & {id(t) for t in non_expert_tensors(founder)}
        shapes = [t.shape for t in non_expert_tensors(founder)]
        assert shapes == [t.shape for t in non_expert_tensors(joiner)]  # what send_state / receive_state pair up
    finally:
        group.leave()
