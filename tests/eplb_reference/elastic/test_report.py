"""``runtime/elastic/report.py``: what a resize cost, read from the group's step timeline."""

import json

from eplb_reference.runtime.config import RunConfig
from eplb_reference.elastic.report import failed_elastic_invariants, summarize_elastic, write_elastic_report

CFG = RunConfig(ranks=2, steps=8)


def member(index, ends, sizes, **extra):
    steps = list(range(len(ends)))
    return {"member": index, "step_end_s": ends, "step_size": sizes, "steps": steps, "output_mismatches": 0,
            "max_abs_diff": 0.0, "recompiles": 0, "tokens": 16 * len(ends), "resizes": [], "abandoned": [],
            "state_bytes_sent": 0, "join_prepare_s": None, "left_at_step": None, "recoveries": [], **extra}


def raw_run():
    # member 0: steps every 10 ms, a 2 -> 4 resize requested at t=1.025 that serves at 4 from t=1.30
    ends = [1.00, 1.01, 1.02, 1.03, 1.04, 1.30, 1.31, 1.32]
    sizes = [2, 2, 2, 2, 2, 4, 4, 4]
    resize = {"generation": 1, "old_size": 2, "new_size": 4, "first_step": 5, "joined": False, "switch_s": 0.2,
              "bytes_moved": 1000}
    joiner = member(2, [1.30, 1.31, 1.32], [4, 4, 4], steps=[5, 6, 7], join_prepare_s=0.05,
                    resizes=[dict(resize, joined=True, bytes_moved=500)])
    served = {str(m): [[step, rank, size] for step, size in zip(range(8), sizes)] for m, rank in ((0, 0), (1, 1))}
    served.update({"2": [[step, 2, 4] for step in (5, 6, 7)], "3": [[step, 3, 4] for step in (5, 6, 7)]})
    return {
        "requests": [{"kind": "resize", "generation": 1, "old_size": 2, "new_size": 4, "requested_s": 1.025,
                      "at_step": 3, "members": [0, 1, 2, 3], "outcome": "switched", "died_s": None}],
        "members": [member(0, ends, sizes, resizes=[resize]), member(1, ends, sizes), joiner, {"member": 9}],
        "served": served, "dead": {},
    }


def test_a_resize_is_timed_from_its_request_to_the_first_step_at_the_new_size():
    report = summarize_elastic(CFG, (2, 4), 4, raw_run())
    (resize,) = report["resizes"]
    assert resize["reconfiguration_seconds"] == 0.275 and resize["first_step_at_new_size"] == 5
    assert resize["serving_pause_seconds"] == 0.26  # 1.04 -> 1.30, no step completed
    assert resize["steps_paused"] == 1 and resize["bytes_moved"] == 1500
    assert report["reconfigurations"] == 1 and report["spares_unused"] == 1 and report["join_prepare_seconds_max"] == 0.05
    assert (report["requests_completed"], report["requests_lost"], report["requests_duplicated"]) == (22, 0, 0)
    assert failed_elastic_invariants(report) == []


def test_upstreams_eplb_is_counted_once_per_generation_and_a_stall_fails_the_run():
    raw = raw_run()
    founder = {"rearrangements_finished": {"0": 2, "1": 1}, "layers_committed": {"0": 4, "1": 3},
               "rearrangement_stalls": {"0": 0, "1": 0}}
    raw["members"][0]["eplb"] = raw["members"][1]["eplb"] = founder
    raw["members"][2]["eplb"] = {"rearrangements_finished": {"1": 1}, "layers_committed": {"1": 3},
                                 "rearrangement_stalls": {"1": 1}}  # the joiner only served generation 1
    report = summarize_elastic(CFG, (2, 4), 4, raw)
    assert (report["eplb_rearrangements_finished"], report["eplb_layers_committed"]) == (3, 7)
    assert failed_elastic_invariants(report) == ["1 stalled EPLB rearrangements"]


def test_a_batch_owed_but_never_served_is_lost_and_one_served_twice_is_duplicated():
    raw = raw_run()
    raw["served"]["3"] = [[5, 3, 4], [6, 3, 4]]  # step 7 of rank 3 never completed
    raw["served"]["1"].append([2, 1, 2])  # step 2 of rank 1 completed twice
    report = summarize_elastic(CFG, (2, 4), 4, raw)
    assert (report["requests_lost"], report["requests_duplicated"]) == (1, 1)
    assert failed_elastic_invariants(report) == ["1 requests lost", "1 requests duplicated"]


def test_a_mismatch_a_recompile_or_a_resize_that_did_not_switch_fails_the_run():
    raw = raw_run()
    raw["members"][1]["output_mismatches"] = 2
    raw["members"][2]["recompiles"] = 1
    raw["requests"][0].update(outcome="abandoned", why_abandoned="member 3 died")
    report = summarize_elastic(CFG, (2, 4), 4, raw)
    assert report["resizes"][0]["why_abandoned"] == "member 3 died"
    assert failed_elastic_invariants(report) == [
        "2 steps' outputs differ from the one-process reference", "1 recompiles on the serving path",
        "0 of 1 planned resizes switched"]


def test_the_report_and_timeline_are_written(tmp_path, capsys):
    assert write_elastic_report(tmp_path, CFG, (2, 4), 4, raw_run(), as_json=False) == 0
    assert json.loads((tmp_path / "report.json").read_text())["reconfigurations"] == 1
    assert (tmp_path / "elastic_timeline.png").stat().st_size > 0
    assert "2 -> 4 ranks at step 3: switched, serving at the new size after 0.275 s" in capsys.readouterr().out


def test_the_timeline_is_the_groups_a_step_ends_with_its_last_member_and_outlives_a_dead_rank_0():
    raw = raw_run()
    raw["members"][1]["step_end_s"] = [t + 0.001 for t in raw["members"][1]["step_end_s"]]  # member 1 ends each step later
    with_founder = summarize_elastic(CFG, (2, 4), 4, raw)["resizes"][0]
    assert with_founder["reconfiguration_seconds"] == 0.276  # 1.301 - 1.025: member 1's end of step 5
    del raw["members"][0]  # member 0 died and took its records with it: the others still have every step
    raw["dead"] = {"0": 1.35}
    report = summarize_elastic(CFG, (2, 4), 4, raw)
    assert report["resizes"][0]["reconfiguration_seconds"] == 0.276 and report["members_lost"] == [0]


def test_members_that_died_together_share_one_recovery_and_one_never_recovered_from_fails_the_run():
    raw = raw_run()
    recovery = {"generation": 2, "old_size": 4, "new_size": 2, "lost_members": [2, 3], "experts_reloaded": 4,
                "requests_requeued": 0, "recovery_s": 0.5, "resume_step": 8}
    raw["members"][0]["recoveries"] = raw["members"][1]["recoveries"] = [recovery]
    raw["dead"] = {"2": 1.33, "3": 1.33}
    report = summarize_elastic(CFG, (2, 4), 4, raw)
    assert report["recoveries"] == 1 and report["members_recovered_from"] == [2, 3] == report["members_lost"]
    assert not [p for p in failed_elastic_invariants(report) if "recovered" in p]
    raw["members"][0]["recoveries"] = raw["members"][1]["recoveries"] = [dict(recovery, lost_members=[2])]
    assert "members [3] lost and not recovered from" in failed_elastic_invariants(summarize_elastic(CFG, (2, 4), 4, raw))
