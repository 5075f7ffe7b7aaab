"""Multi-rank movement plane: real processes, gloo on loopback, bounded timeouts."""

import pytest
import torch

from eplb_graph.launch import RankFailure, run_ranks
from eplb_graph.weight_views import (
    UNSUPPORTED_FORMATS,
    W4A8Experts,
    check_weight_view,
    expert_format,
    pack_int4,
    unpack_int4,
)
from tests.eplb_graph import multirank_cases


@pytest.mark.parametrize(
    "weight_format,ranks", [("unquantized", 2), ("w8a8_dynamic", 2), ("w4a8", 2), ("unquantized", 4)]
)
def test_async_rearrangement_commits_layers_between_forwards(weight_format, ranks):
    results = run_ranks(multirank_cases.live_rebalancing, ranks, weight_format, 34, "decode", timeout_s=240)
    for rank, result in enumerate(results):
        # exact: each (token, k) pair runs the same expert weights; k=2 sums associate identically
        assert result["max_abs_diff"] == 0.0, rank
        assert result["mismatched_steps"] == [], rank
        assert result["stats"]["rearrangements_finished"] >= 2, result["stats"]
        stats = result["stats"]  # 2 layers per rearrangement; the last may still be in flight
        assert 2 * stats["rearrangements_finished"] <= stats["layers_committed"] <= 2 * stats["rearrangements_started"]
        assert result["distinct_placements"] >= 2
        assert result["bytes_received"] > 0  # experts really crossed ranks
        assert result["rejected"] == []
        assert "eplb_state.compute_logical_maps" in result["patches"]  # commits ran logical_maps
        # and the worker planned each layer's transfer with ranks_with_experts
        assert "rebalance_execute.get_ep_ranks_with_experts_batch" in result["patches"]
        # phase "decode": a prefill batch never records, whatever its rank's neighbours do
        assert all(not record for is_prefill, record in result["recorded"] if is_prefill)
        assert any(record for is_prefill, record in result["recorded"] if not is_prefill)
    assert len({r["upstream_step"] for r in results}) == 1  # every rank stepped the same state machine


def test_rebalancing_with_the_policy_in_a_helper_process():
    results = run_ranks(multirank_cases.live_rebalancing, 2, "unquantized", 34, "all", True, timeout_s=240)
    for rank, result in enumerate(results):
        assert result["policy"] == "PolicyProcess"
        assert result["policy_pid"] not in (None, result["pid"])  # each rank's own helper
        assert result["max_abs_diff"] == 0.0 and result["mismatched_steps"] == [], rank
        assert result["stats"]["rearrangements_finished"] >= 2, result["stats"]
        assert result["distinct_placements"] >= 2 and result["rejected"] == []
    assert results[0]["policy_pid"] != results[1]["policy_pid"]


def test_a_controller_that_fails_to_start_takes_its_patches_back():
    result, = run_ranks(multirank_cases.failed_controller_leaves_upstream_unpatched, 1, timeout_s=120)
    assert result["message"] == "helper refused to start"
    assert result["restored"] and result["worker_event_restored"]


def test_upstream_rearrange_with_gloo_staged_communicator_matches_direct_layout():
    results = run_ranks(multirank_cases.upstream_rearrange_with_our_communicator, 2, timeout_s=120)
    assert all(r["equal"] for r in results)
    assert sum(r["bytes_received"] for r in results) > 0


def test_peer_killed_mid_transfer_survivor_errors_and_keeps_committed_state():
    with pytest.raises(RankFailure) as failure:
        run_ranks(multirank_cases.peer_dies_mid_transfer, 2, timeout_s=120)
    assert failure.value.failures == {1: "process died with exit code 17"}
    survivor = failure.value.results[0]
    assert survivor["error_type"] in ("EplbPeerLostError", "EplbWorkerError")
    assert "EP rank 0" in survivor["message"] and "peer" in survivor["message"]
    assert survivor["seconds_after_death"] < 20  # bounded by the group / transfer timeouts
    assert survivor["weights_match_lookup"] and survivor["lookup_is_committed"]


def test_closing_mid_rearrangement_drains_the_worker_first():
    """No transfer may be under way when the groups are destroyed after close()."""
    results = run_ranks(multirank_cases.close_mid_rearrangement, 2, timeout_s=120)
    assert len({r["closed_at_step"] for r in results}) == 1
    for result in results:
        assert result["committed_before_close"] == 0  # closed before the first layer committed
        assert not result["rebalanced_after_close"] and not result["pending_after_close"]
        # drained, not applied: weights and lookup stay at the committed placement
        assert result["weights_match_lookup"] and result["lookup_is_committed"]


def test_invalid_policy_output_is_rejected_before_any_byte_moves():
    results = run_ranks(multirank_cases.invalid_policy_output_is_rejected, 2, timeout_s=120)
    for result in results:
        assert result["rejected"] and "holds logical id 999" in result["rejected"][0]
        assert result["unchanged"]
        assert result["bytes_moved"] == 0
        assert result["max_abs_diff"] == 0.0


@pytest.mark.parametrize("name", ["unquantized", "w8a8_dynamic", "w4a8"])
def test_weight_views_expose_exactly_the_kernel_storage(name):
    fmt = expert_format(name)
    gen = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(4, 8, 6, generator=gen), torch.randn(4, 6, 4, generator=gen)
    experts = fmt.from_float(w13, w2)
    check_weight_view(experts, 4)
    x, ids = torch.randn(5, 6, generator=gen), torch.tensor([0, 3, 3, 1, 2])
    x[0] = x[1]  # pairs 0 and 1 differ only in the slot they read
    before_pairs, before = experts(x, ids), experts(x)  # [S, H] per pair; [E, N, H] every slot, every token
    assert before.shape == (4, 5, 6) and not torch.equal(before[0], before[3])
    assert not torch.equal(before_pairs[0], before_pairs[1])
    # moving slot 3's tensors into slot 0 through the view changes what either kernel computes
    for tensor in experts.weight_view():
        tensor[0].copy_(tensor[3])
    after_pairs, after = experts(x, ids), experts(x)
    assert torch.equal(after[0], before[3]) and torch.equal(after[1:], before[1:])
    assert torch.equal(after_pairs[0], before_pairs[1]) and torch.equal(after_pairs[1:], before_pairs[1:])
    dq13, dq2 = experts.dequantized()
    tolerance = {"unquantized": 0, "w8a8_dynamic": 0.02, "w4a8": 0.35}[name]
    assert (dq13[1:] - w13[1:]).abs().max() <= tolerance


@pytest.mark.parametrize("name", ["unquantized", "w8a8_dynamic", "w4a8"])
def test_a_token_s_expert_output_does_not_depend_on_the_other_tokens(name):
    """The EP model runs the experts over every rank's tokens, the one-process reference over
    its own: eager equality needs each token's row to be the same whatever else is in the
    batch (the row count, padding rows, the rows around it), with either kernel: pairs (one
    matvec each) and dense (batched GEMMs, padded below 4 rows). The two kernels compute the
    same function."""
    gen = torch.Generator().manual_seed(1)
    experts = expert_format(name).from_float(torch.randn(10, 128, 64, generator=gen), torch.randn(10, 64, 64, generator=gen))
    tokens = torch.randn(128, 64, generator=gen)  # the widest gathered batch: 2 ranks x capture size 64
    ids = torch.randint(0, 10, (128,), generator=gen)
    everyone, every_pair = experts(tokens), experts(tokens, ids)  # [E, 128, H], [128, H]
    for rows in (slice(0, 16), slice(16, 32), slice(64, 112), slice(5, 6), slice(7, 9), slice(9, 12), slice(0, 4)):
        assert torch.equal(experts(tokens[rows]), everyone[:, rows]), rows
        assert torch.equal(experts(tokens[rows], ids[rows]), every_pair[rows]), rows
    picked = everyone[ids, torch.arange(128)]  # what the dense kernel's caller keeps
    assert torch.allclose(picked, every_pair, rtol=1e-5, atol=1e-5 * float(every_pair.abs().max()))


def test_int4_packing_round_trips():
    q = torch.randint(-8, 8, (3, 5, 10), dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_FORMATS) + ["nf4"])
def test_unsupported_formats_are_rejected_naming_them(name):
    with pytest.raises(ValueError, match=f"quantization format '{name}' is not supported by EPLB"):
        expert_format(name)


def test_a_view_missing_coupled_metadata_is_rejected():
    experts = W4A8Experts.from_float(torch.randn(4, 8, 6), torch.randn(4, 6, 4))
    experts.view_names = experts.view_names[:-1]  # the w2 scale bias would be left behind
    with pytest.raises(ValueError, match=r"\['w2_scale_bias'\] are outside the weight view"):
        check_weight_view(experts, 4)
