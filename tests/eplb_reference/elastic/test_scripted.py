"""``runtime/elastic/scripted.py`` with its members: the group resized 2 -> 4 -> 2 while it serves,
and members killed, stopped or hung under it.

Real processes joined through a TCP store, real gloo groups, upstream's policy and weight
move; every step of every member checked against the one-process reference, every batch
accounted for (none lost, none served twice).
"""

import signal
import threading
import time

import pytest

from eplb_reference.runtime.config import RunConfig
from eplb_reference.elastic.recovery import save_expert_source
from eplb_reference.elastic.report import failed_elastic_invariants, summarize_elastic
from eplb_reference.elastic.scripted import ElasticRun, parse_kills, parse_scale_plan, run_elastic, spares_needed
from eplb_reference.elastic.spec import ElasticSpec


@pytest.mark.alone  # hangs are detected within bounds in seconds: a starved member would look hung
@pytest.mark.launches  # rank processes: left out by make test-fast
def test_a_compiled_group_grows_and_shrinks_with_no_recompile_and_every_output_equal():
    # upstream's EPLB rearranges every few steps, so layers commit between a joiner's prepare
    # (when it receives the placement) and the switch: the reshuffle must move from rank 0's
    cfg = RunConfig(mode="compiled", backend="aot_eager", ranks=2, steps=90, window_size=4, step_interval=4,
                    drift_every=6)
    raw = run_elastic(cfg, (2, 4, 2), 4, timeout_s=400)
    report = summarize_elastic(cfg, (2, 4, 2), 4, raw)
    assert failed_elastic_invariants(report) == []
    assert report["reconfigurations"] == 2 and report["output_mismatches"] == 0 and report["recompiles"] == 0
    up, down = report["resizes"]
    assert (up["old_size"], up["new_size"], down["old_size"], down["new_size"]) == (2, 4, 4, 2)
    for resize in (up, down):
        assert resize["reconfiguration_seconds"] is not None and resize["bytes_moved"] > 0
    members = {m["member"]: m for m in raw["members"] if "steps" in m}
    assert len(members[0]["steps"]) == len(members[1]["steps"]) == 90  # the founders served every step
    joined = [m for m in members.values() if m["member"] >= 2]
    assert len(joined) == 2 and all(m["left_at_step"] == down["first_step_at_new_size"] for m in joined)
    assert all(set(m["step_size"]) == {4} for m in joined)  # a joiner serves only at the new size
    assert report["state_bytes_sent"] > 0  # the non-expert weights went from rank 0 to both joiners
    # upstream's async EPLB ran in each of the three generations, and every member of one agreed
    for generation in ("0", "1", "2"):
        counts = {m["eplb"]["rearrangements_finished"][generation] for m in members.values()
                  if generation in m["eplb"]["rearrangements_finished"]}
        assert len(counts) == 1 and counts.pop() >= 1
    assert report["eplb_rearrangement_stalls"] == 0 and report["faults"] == []


@pytest.mark.alone  # hangs are detected within bounds in seconds: a starved member would look hung
@pytest.mark.launches
def test_a_resize_past_its_deadline_is_given_up_and_the_group_serves_on_at_its_size():
    cfg = RunConfig(mode="eager", ranks=2, steps=40)
    raw = run_elastic(cfg, (2, 4), 4, deadline_s=1e-3, timeout_s=300)
    report = summarize_elastic(cfg, (2, 4), 4, raw)
    assert report["reconfigurations"] == 0 and report["resizes_abandoned"] == 1
    assert report["resizes"][0]["why_abandoned"].startswith("not ready within the 0.001 s resize deadline")
    assert report["output_mismatches"] == 0 and report["steps_served"] == {"0": 40, "1": 40}
    joiners = [m for m in raw["members"] if m["member"] >= 2]
    assert len(joiners) == 2 and all("was given up" in m["abandoned_join"] for m in joiners)  # and left unserved
    assert failed_elastic_invariants(report) == ["0 of 1 planned resizes switched"]


@pytest.mark.alone  # hangs are detected within bounds in seconds: a starved member would look hung
@pytest.mark.launches
@pytest.mark.parametrize("killed", [3, 0], ids=["a joiner", "rank 0"])  # rank 0: the next survivor takes its place
def test_a_member_killed_mid_run_is_recovered_from_with_nothing_lost_and_later_replaced(killed):
    cfg = RunConfig(mode="eager", ranks=2, steps=90)
    raw = run_elastic(cfg, (2, 4, 4), 4, kills=((killed, 50),), timeout_s=300)
    report = summarize_elastic(cfg, (2, 4, 4), 4, raw)
    assert failed_elastic_invariants(report) == []
    assert report["members_lost"] == [killed] and report["recoveries"] == 1
    assert report["requests_lost"] == 0 and report["requests_duplicated"] == 0 and report["output_mismatches"] == 0
    kinds = [(r["kind"], r["old_size"], r["new_size"], r["outcome"]) for r in report["resizes"]]
    assert kinds == [("resize", 2, 4, "switched"), ("recovery", 4, 3, "switched"), ("resize", 3, 4, "switched")]
    recovery = report["resizes"][1]
    assert recovery["reconfiguration_seconds"] is not None and recovery["bytes_moved"] == 0  # nothing from a peer
    assert report["faults"] == [{"member": killed, "kind": "died", "role": "serving", "why": "exited with code -9, "
                                 "no report", "recovery": 2}]
    # the recovery generation and the replacement's run upstream's EPLB afresh
    survivors = [m for m in raw["members"] if "eplb" in m and "2" in m["eplb"]["rearrangements_finished"]]
    assert len(survivors) == 3 and report["eplb_rearrangements_finished"] >= 4


class Inject(ElasticRun):
    """Fault injection: ``faults`` (member, signal, step), each once the group served its step;
    ``during_recovery``: a member SIGKILLed once the first recovery's group is built."""

    def on_tick(self, events) -> None:
        coordinator = self.coordinator
        for fault in list(self.faults):
            member, signum, step = fault
            if coordinator.progress() >= step:
                coordinator.happened[member] = time.monotonic()
                coordinator.processes.signal(member, signum)
                self.faults.remove(fault)
        if events.lost and self.during_recovery is not None:
            victim, self.during_recovery = self.during_recovery, None
            board, generation = coordinator.board.clone(), coordinator.requests[-1].generation

            def kill_once_built() -> None:  # gloo's rendezvous key of the second group's rank 0: the first is built
                board.gloo_store(generation, "eplb").wait(["0/0"])
                coordinator.happened[victim] = time.monotonic()
                coordinator.processes.kill(victim)

            threading.Thread(target=kill_once_built, daemon=True).start()


def injected_run(tmp_path, faults, *, during_recovery=None, chaos=False) -> tuple[dict, dict]:
    cfg = RunConfig(mode="eager", ranks=2, steps=90)
    source = save_expert_source(cfg, tmp_path / "experts.pt")
    run = Inject(ElasticSpec(cfg, 4, "127.0.0.1", 0, hang_s=3.0, expert_source=str(source), chaos=chaos), (2, 4, 4),
                 spares=4)
    run.faults, run.during_recovery = list(faults), during_recovery
    raw = run.run(timeout_s=300)
    return raw, summarize_elastic(cfg, (2, 4, 4), 4, raw)


@pytest.mark.alone  # hangs are detected within bounds in seconds: a starved member would look hung
@pytest.mark.launches
@pytest.mark.parametrize("signum, rule, bound_s", [(signal.SIGSTOP, "silent for", 3.0),
                                                   (signal.SIGUSR1, "behind its peers", 2 * 3.0)],
                         ids=["stopped", "main thread hung"])
def test_a_member_that_hangs_is_fenced_and_recovered_from_as_a_death(tmp_path, signum, rule, bound_s):
    # SIGSTOP: the whole process stands still; SIGUSR1 (chaos hooks): only its main thread, its
    # keep-alive thread beating on -- neither would ever have been detected: the group waited forever
    raw, report = injected_run(tmp_path, [(2, signum, 50)], chaos=True)
    assert failed_elastic_invariants(report) == []
    (fault,) = report["faults"]
    assert (fault["member"], fault["kind"], fault["role"]) == (2, "hung", "serving") and fault["why"].startswith(rule)
    recovery = report["resizes"][1]
    assert (recovery["kind"], recovery["new_size"], recovery["outcome"]) == ("recovery", 3, "switched")
    assert recovery["detection_seconds"] <= bound_s + 2.0  # the rule's bound, and the coordinator's look
    assert report["requests_lost"] == 0 and report["requests_duplicated"] == 0 and report["output_mismatches"] == 0


@pytest.mark.alone  # hangs are detected within bounds in seconds: a starved member would look hung
@pytest.mark.launches
def test_a_member_killed_during_the_recovery_from_another_is_recovered_from_too(tmp_path):
    raw, report = injected_run(tmp_path, [(3, signal.SIGKILL, 50)], during_recovery=2)
    assert failed_elastic_invariants(report) == []
    assert report["members_lost"] == [2, 3] == report["members_recovered_from"]
    assert report["requests_lost"] == 0 and report["requests_duplicated"] == 0 and report["output_mismatches"] == 0
    kinds = [(r["kind"], r["new_size"], r["outcome"]) for r in report["resizes"]]
    # the first recovery (4 -> 3) is given up, or switched if it won the race; the survivors of both serve
    assert kinds[0] == ("resize", 4, "switched") and kinds[-2:] == [("recovery", 2, "switched"), ("resize", 4, "switched")]
    assert kinds[1][:2] == ("recovery", 3) and len(kinds) == 4


@pytest.mark.parametrize("text, message", [
    ("2", "needs a first size and at least one resize"),
    ("2,x", "sizes separated by commas"),
])
def test_a_plan_that_is_not_one_is_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_scale_plan(text)


@pytest.mark.parametrize("texts, message", [
    (["3"], "--kill takes MEMBER@STEP"),
    (["-1@10"], "the member must be >= 0 and the step >= 1"),
    (["2@0"], "the member must be >= 0 and the step >= 1"),
])
def test_a_kill_that_is_not_one_is_refused(texts, message):
    with pytest.raises(ValueError, match=message):
        parse_kills(texts)
    assert parse_kills(["3@150", "0@9"]) == ((3, 150), (0, 9))


def test_the_spares_kept_warm_cover_the_largest_step_up_to_come_and_a_replacement_per_kill():
    assert spares_needed([4, 2], 2, kills=0) == 2
    assert spares_needed([4, 4], 2, kills=1) == 3
    assert spares_needed([], 4, kills=0) == 0 and spares_needed([2, 3], 4, kills=0) == 1
