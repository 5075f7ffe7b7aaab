import json
from dataclasses import asdict

import torch

from eplb_reference.runtime.config import RunConfig
from eplb_reference.runtime.rank import RankResult
from eplb_reference.runtime.report import (
    failed_invariants,
    first_mismatch,
    summarize,
    trailing_balancedness,
    windowed_balancedness,
    without_eplb_rank_load,
)


def test_windowed_balancedness_is_mean_over_max_of_summed_rank_load():
    # 4 steps, 1 layer, 2 ranks: windows of 2 steps -> [3+1, 1+3] = balanced, [4+0, 4+0] -> 0.5
    steps = torch.tensor([[[3, 1]], [[1, 3]], [[4, 0]], [[4, 0]]])
    assert windowed_balancedness(steps, 2) == [1.0, 0.5]
    # trailing windows end at each step: [3,1] -> 2/3, [4,4] -> 1, [5,3] -> 0.8, [8,0] -> 0.5
    assert trailing_balancedness(steps, 2) == [2 / 3, 1.0, 0.8, 0.5]


def test_without_eplb_places_logical_experts_contiguously():
    logical = torch.tensor([[[5, 1, 0, 2]]])  # 1 step, 1 layer, 4 experts
    assert without_eplb_rank_load(logical, 2).tolist() == [[[6, 2]]]


def test_failed_invariants_name_each_problem():
    report = {"output_mismatches": 2, "first_mismatch_step": 41, "first_mismatch_during_rearrangement": True,
              "nonfinite_output_steps": 1, "recompiles": 1, "recaptures": 0, "verifier_ok": False, "mode": "compiled",
              "num_physical_experts": 20, "eplb": True, "routers_mapped": 1, "num_layers": 2, "rearrangement_stalls": 1}
    problems = failed_invariants(report)
    assert ("2 step(s) whose output differs from the no-EPLB reference (first at step 41, during a rearrangement); "
            "1 of them with NaN/Inf where the reference is finite") in problems
    steady = failed_invariants(dict(report, first_mismatch_during_rearrangement=False, nonfinite_output_steps=0))
    assert "2 step(s) whose output differs from the no-EPLB reference (first at step 41, no rearrangement in flight)" in steady
    assert any("1 recompile(s)" in p for p in problems)
    assert any("verifier failed" in p for p in problems)
    assert any("mapped 1 of 2 routers" in p for p in problems)
    assert any("1 rearrangement(s) stalled" in p for p in problems)
    clean = dict(report, output_mismatches=0, recompiles=0, verifier_ok=True, routers_mapped=2, rearrangement_stalls=0)
    assert failed_invariants(clean) == []


def test_a_run_shorter_than_one_window_reports_json_numbers():
    """3 steps against a 20-step window and no rearrangement finished: every balancedness is a
    number or null, never NaN (which strict JSON readers refuse)."""
    cfg = RunConfig(ranks=2, steps=3)
    rank_load = [[[5, 3], [4, 4]]] * 3  # [steps][layers][ranks]
    logical_load = [[[2] * 16, [1] * 16]] * 3  # [steps][layers][experts]
    results = [asdict(RankResult(rank, step_ms=[1.0, 1.0], kinds=["decode"] * 2, rebalancing=[False] * 2,
                                 rank_load=rank_load, logical_load=logical_load, tokens=48))
               for rank in range(2)]
    report = summarize(cfg, results)
    assert report["balancedness_without_eplb"] == 1.0  # 16 experts spread evenly over 2 ranks
    assert report["balancedness_before"] == round((4 / 5 + 1.0) / 2, 4) and report["balancedness_after"] is None
    json.dumps(report, allow_nan=False)


def test_one_rank_reports_no_balancedness():
    """On one rank mean / max of the rank load is 1.0 whatever EPLB does: nothing is reported."""
    cfg = RunConfig(ranks=1, steps=3)
    rank_load = [[[8], [8]]] * 3  # [steps][layers][ranks]
    logical_load = [[[1] * 8 + [0] * 8, [0] * 8 + [1] * 8]] * 3
    results = [asdict(RankResult(0, step_ms=[1.0, 1.0], kinds=["decode"] * 2, rebalancing=[False] * 2,
                                 rank_load=rank_load, logical_load=logical_load, tokens=48))]
    report = summarize(cfg, results)
    assert report["balancedness_without_eplb"] is report["balancedness_before"] is report["balancedness_after"] is None
    assert report["cuda_kernel"] is None  # no CUDA in this run


def test_first_mismatch_is_the_earliest_over_ranks():
    rank0 = {"first_mismatch_step": 12, "first_mismatch_during_rearrangement": False}
    rank1 = {"first_mismatch_step": 9, "first_mismatch_during_rearrangement": True}
    clean = {"first_mismatch_step": None, "first_mismatch_during_rearrangement": None}
    assert first_mismatch([rank0, clean, rank1]) == {"first_mismatch_step": 9, "first_mismatch_during_rearrangement": True}
    assert first_mismatch([clean, clean]) == {"first_mismatch_step": None, "first_mismatch_during_rearrangement": None}
