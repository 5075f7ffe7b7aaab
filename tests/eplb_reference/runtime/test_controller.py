"""Multi-rank movement plane: real processes, gloo on loopback, bounded timeouts."""

import pytest
import torch

from eplb_reference.runtime.launch import RankFailure, run_ranks
from tests.eplb_reference.runtime import multirank_cases

pytestmark = pytest.mark.launches  # rank processes or an engine: left out by make test-fast


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


def test_a_worker_that_stalls_is_surfaced_while_the_committed_placement_serves():
    """The worker blocks in its first transfer (it stalls, it does not die): after the bound the
    watchdog warns once per rank and counts it; outputs stay exact on the committed placement;
    released, the rearrangement commits."""
    results = run_ranks(multirank_cases.stalled_worker, 2, 10, 40, timeout_s=240)
    for result in results:
        assert result["committed_before_release"] == 0 and result["stalls_before_release"] == 1
        [warning] = result["stall_warnings"]
        assert "stalled: in flight for 11 steps" in warning and "last committed placement keeps serving" in warning
        assert result["max_abs_diff"] == 0.0 and result["weights_match_lookup"]
        assert result["committed_after_release"] >= 2  # released, the layers committed



def kept_file(path, cfg_overrides=None, placements=None):
    from eplb_graph.core.placement_file import PlacementRecord, save
    from eplb_reference.runtime.config import RunConfig

    cfg = RunConfig(**{**multirank_cases.MOVEMENT, "ranks": 2, **(cfg_overrides or {})})
    save(path, PlacementRecord(cfg.placement_identity(), torch.tensor(placements or KEPT), None, 3, "runtime"))
    return path


KEPT = [[7, 6, 5, 4, 3, 2, 1, 0, 7, 7, 6, 5], [0, 0, 1, 2, 3, 4, 5, 6, 7, 1, 1, 2]]


def test_every_rank_starts_from_a_kept_placement_with_its_slots_holding_their_experts(tmp_path):
    path = str(kept_file(tmp_path / "p.json"))
    results = run_ranks(multirank_cases.start_from_placement_file, 2, [path, path], timeout_s=120)
    for rank, result in enumerate(results):
        assert result["start"] == KEPT, rank  # the first forward routes by the file
        assert result["weights_match"] and result["max_abs_diff"] == 0.0, rank
        assert result["stats"]["placements_restored"] == 1 and result["stats"]["rearrangements_finished"] == 0


def test_only_ep_rank_0_reads_the_file_the_others_start_from_what_it_sent(tmp_path):
    """Ranks on another node without the file (here: rank 1 names a path that does not exist)."""
    path = str(kept_file(tmp_path / "p.json"))
    results = run_ranks(multirank_cases.start_from_placement_file, 2, [path, str(tmp_path / "elsewhere.json")],
                        timeout_s=120)
    assert [result["start"] for result in results] == [KEPT, KEPT]
    assert all(result["weights_match"] and result["max_abs_diff"] == 0.0 for result in results)


def test_a_file_ep_rank_0_cannot_use_is_refused_on_every_rank(tmp_path):
    good = kept_file(tmp_path / "p.json")
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text(good.read_text().replace('"written_by": "runtime"', '"written_by": "vllm"'))
    results = run_ranks(multirank_cases.start_from_placement_file, 2, [str(corrupt), str(good)], timeout_s=120)
    for result in results:
        assert result["error"].startswith("EP rank 0: placement file") and "is corrupt" in result["error"], result
