"""``runtime/elastic_run.py`` with its members: the group resized 2 -> 4 -> 2 while it serves.

Real processes joined through a TCP store, real gloo groups, upstream's policy and weight
move; every step of every member checked against the one-process reference. The coordinator's
bookkeeping of deaths is also read alone, over its store, with no process started.
"""

import threading
import time
from datetime import timedelta

import pytest

from eplb_graph.runtime.config import RunConfig
from eplb_graph.runtime.elastic_report import failed_elastic_invariants, summarize_elastic
from eplb_graph.runtime.elastic_group import read_generation
from eplb_graph.runtime.elastic_recovery import save_expert_source
from eplb_graph.runtime.elastic_run import ElasticRun, ResizeRequest, parse_scale_plan, run_elastic
from eplb_graph.runtime.elastic_spec import ABANDONED, ElasticSpec
from eplb_graph.runtime.launch import free_port


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
    assert report["eplb_rearrangement_stalls"] == 0


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
    # the recovery generation and the replacement's run upstream's EPLB afresh
    survivors = [m for m in raw["members"] if "eplb" in m and "2" in m["eplb"]["rearrangements_finished"]]
    assert len(survivors) == 3 and report["eplb_rearrangements_finished"] >= 4


class _KillDuringRecovery(ElasticRun):
    """Fault injection: member ``second`` is killed inside the first recovery, once every survivor
    (it among them) built the recovery generation's group: rank 0 went on to its second group."""

    second: int | None = None

    def recover_without(self, members: list[int]) -> int:
        recovered = super().recover_without(members)
        if recovered and self.second is not None:
            victim, self.second = self.second, None
            built = f"{self.spec.name}/gen{self.requests[-1].generation}/eplb//0/0"  # gloo's rendezvous key of rank 0

            def kill_once_built() -> None:
                self.spec.connect().wait([built], timedelta(seconds=120))
                self.killed_s[victim] = time.monotonic()
                self.processes[victim].kill()

            threading.Thread(target=kill_once_built, daemon=True).start()
        return recovered


@pytest.mark.launches
def test_a_member_killed_during_the_recovery_from_another_is_recovered_from_too(tmp_path):
    cfg = RunConfig(mode="eager", ranks=2, steps=90)
    source = save_expert_source(cfg, tmp_path / "experts.pt")
    run = _KillDuringRecovery(ElasticSpec(cfg, 4, "127.0.0.1", free_port(), expert_source=str(source)), (2, 4, 4),
                              kill_plan=((3, 50),))
    run.second = 2
    raw = run.run(spares=4, timeout_s=300)
    report = summarize_elastic(cfg, (2, 4, 4), 4, raw)
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


def _coordinator(members: tuple[int, ...]) -> ElasticRun:
    """A coordinator serving generation 0 of ``members``, none of them a process."""
    run = ElasticRun(ElasticSpec(RunConfig(ranks=2), 4, "127.0.0.1", free_port(), timeout_s=5), (2, 4))
    run.members = members
    return run


def test_members_that_die_together_are_left_out_of_one_recovery():
    run = _coordinator((0, 1, 2, 3))
    assert run.recover_without([1, 2]) == 2
    recovery = run.requests[-1]
    assert (recovery.kind, recovery.generation, recovery.members) == ("recovery", 1, (0, 3))
    assert int(run.store.get(run.spec.key("recovery", 0))) == 1
    assert read_generation(run.store, run.spec.name, 1, 5).members == (0, 3)
    assert run.next_index == 2  # one generation announced, not one per death


def test_a_death_the_switch_beat_is_recovered_from_in_the_new_generation():
    run = _coordinator((0, 1))
    resize = ResizeRequest(1, 2, 4, 0.0, 40, (0, 1, 2, 3))
    run.requests.append(resize)
    run.next_index = 2
    run.store.set(run.spec.key("gen", 1, "switch"), "40,2")  # rank 0 wrote it before member 1 was seen dead
    assert not run.recover_without([1, 3])  # the resize is not given up, and nothing is announced yet
    assert run.store.get(run.spec.key("gen", 1, "switch")) == b"40,2" and len(run.requests) == 1
    resize.outcome = run.outcome(resize)
    run.members, run.current = resize.members, resize.generation
    assert run.dead_members(resize) == [1, 3]
    assert run.recover_without(run.dead_members(resize))
    assert run.requests[-1].members == (0, 2) and int(run.store.get(run.spec.key("recovery", 1))) == 2


def test_a_serving_member_that_dies_before_the_switch_gives_the_resize_up():
    run = _coordinator((0, 1, 2))
    resize = ResizeRequest(1, 3, 4, 0.0, 40, (0, 1, 2, 3))
    run.requests.append(resize)
    run.next_index = 2
    assert run.recover_without([1])
    assert resize.outcome == "abandoned" and run.store.get(run.spec.key("gen", 1, "switch")) == ABANDONED.encode()
    assert resize.why_abandoned == "member 1 died"
    assert run.requests[-1].members == (0, 2) and int(run.store.get(run.spec.key("recovery", 0))) == 2
    assert not run.recover_without([2]) and "cannot host 16 experts" in run.failures[2]  # 1 x 10 slots left
