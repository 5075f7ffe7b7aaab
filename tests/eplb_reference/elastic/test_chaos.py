"""``runtime/elastic/chaos.py``: the schedule a seed draws, the independent output check, and one
seed played against a serving group under traffic (``eplb-graph run --chaos`` plays more)."""

import pytest
import torch

from eplb_reference.models.reference import build_reference_model
from eplb_reference.runtime.config import RunConfig
from eplb_reference.elastic.chaos import ACTIONS, FAULTS_PER_ACTION, chaos_failures, not_greedy, run_chaos, schedule
from eplb_reference.elastic.server import ElasticServer


def test_a_seed_draws_every_action_and_as_many_faults_as_asked():
    actions = schedule(seed=3, faults=20)
    assert set(actions) == set(ACTIONS) and schedule(3, 20) == actions  # the same seed, the same schedule
    assert sum(FAULTS_PER_ACTION.get(a, 1) for a in actions) >= 20
    assert schedule(4, 20) != actions


def test_a_token_that_is_not_the_references_greedy_choice_is_caught():
    cfg = RunConfig(mode="eager", num_layers=1)
    reference = build_reference_model(cfg.model_config(), seed=0).eval()
    prompt = [5, 17, 40]
    tokens = []
    with torch.no_grad():
        for _ in range(3):
            tokens.append(int(reference(torch.tensor([prompt + tokens]))[0, -1].argmax()))
    assert not_greedy(reference, {1: (prompt, 3)}, {1: {"token_ids": tokens}}) == []
    wrong = tokens[:2] + [(tokens[2] + 1) % cfg.vocab_size]
    assert not_greedy(reference, {1: (prompt, 3)}, {1: {"token_ids": wrong}}) == [1]
    assert not_greedy(reference, {1: (prompt, 3)}, {1: {"token_ids": tokens[:2]}}) == [1]  # one token short


def test_a_run_fails_on_anything_lost_twice_wrong_or_late():
    clean = {"requests_unanswered": 0, "requests_duplicated": 0, "output_mismatches": 0, "recompiles": 0,
             "members_reported": 4, "members_lost_not_injected": [], "records": [{"within_bounds": True}]}
    assert chaos_failures(clean) == []
    assert chaos_failures({**clean, "requests_duplicated": 2}) == ["2 requests duplicated"]
    assert chaos_failures({**clean, "members_lost_not_injected": [5]}) == ["members [5] lost that no fault touched"]
    assert len(chaos_failures({**clean, "records": [{"within_bounds": False}]})) == 1
    assert chaos_failures({**clean, "members_reported": 0}) == ["no member reported at the end"]


@pytest.mark.alone  # hangs are detected within bounds in seconds: a starved member would look hung
@pytest.mark.launches
def test_one_seed_of_chaos_under_traffic_loses_and_duplicates_nothing():
    server = ElasticServer(RunConfig(mode="compiled", backend="aot_eager", ranks=2), 4, deadline_s=120, hang_s=5.0,
                           chaos=True)
    report = run_chaos(server, seed=1, faults=len(ACTIONS) - 1)
    assert report["failed"] == [], report
    assert report["faults"] >= len(ACTIONS) - 1 and report["requests_answered"] > 0
    assert report["members_reported"] >= 2 and report["recompiles"] == 0  # the serving ones, compiled
    kinds = {record["detected_as"] for record in report["records"]}
    assert kinds == {"died", "hung"}  # kills seen as deaths; SIGSTOPs and hung main threads found by the detector
    assert all(record["injected"] for record in report["records"])
