"""``runtime/elastic/coordinator.py`` over its store, with stand-in processes: what it does when
members die, hang or report, and what it announces.

The same coordinator drives real member processes in ``test_scripted.py`` and ``test_server.py``.
"""

import pytest

from eplb_reference.runtime.config import RunConfig
from eplb_reference.elastic.coordinator import Coordinator
from eplb_reference.elastic.records import Fault, ResizeRequest
from eplb_reference.elastic.protocol import Abandoned, KeepAlive, Phase, Switched
from eplb_reference.elastic.spec import ElasticSpec


class StandInProcesses:
    """Member processes as the coordinator sees them: started, exited (with a code), killed."""

    def __init__(self) -> None:
        self.started, self.exited_codes, self.killed, self.children = [], {}, [], {}

    def start(self, member, first_generation):
        self.started.append((member, first_generation))
        self.children[member] = object()

    def exited(self, member):
        return member in self.exited_codes

    def exit_code(self, member):
        return self.exited_codes.get(member)

    def kill(self, member):
        self.killed.append(member)
        self.exited_codes.setdefault(member, -9)
        return True

    def adopt(self, member):
        pass

    def stop_all(self, grace_s):
        pass


def coordinator(size: int, *, spares: int = 0, hang_s: float = 5.0, history: int = 1024) -> Coordinator:
    """A coordinator serving generation 0 of ``size`` stand-in members."""
    run = Coordinator(ElasticSpec(RunConfig(ranks=2), 4, "127.0.0.1", 0, timeout_s=5, hang_s=hang_s), spares=spares,
                      history=history)
    run.processes = StandInProcesses()
    run.start_first_generation(size)
    return run


def lost(member: int, role: str = "serving") -> Fault:
    return Fault(member, "died", "exited", role, detected_s=1.0)


def test_members_lost_together_are_left_out_of_one_recovery():
    run = coordinator(4)
    assert run.recover_without([lost(1), lost(2)], now=1.0) == 2
    recovery = run.requests[-1]
    assert (recovery.kind, recovery.generation, recovery.members) == ("recovery", 1, (0, 3))
    assert run.board.recovery_of(0) == 1 and run.board.generation(1, 1).members == (0, 3)
    assert run.next_index == 2  # one generation announced, not one per death


def test_a_death_the_switch_beat_is_recovered_from_in_the_new_generation():
    run = coordinator(2)
    resize = run.request(4)  # members 2 and 3 start and join
    run.board.commit(resize.generation, Switched(40, 2))  # rank 0 wrote it before member 1 was seen dead
    run.dead.update({1: 1.0, 3: 1.0})
    faults = [lost(1), lost(3, "joining")]
    run.faults.extend(faults)
    assert run.recover_without(faults, now=1.0) == 0  # nothing is given up, and nothing announced yet
    assert run.board.outcome(1) == Switched(40, 2) and len(run.requests) == 1
    events = run.tick()  # the switch is seen: the lost members of the new generation are recovered from
    assert events.switched == [(resize, ())] and run.members == (0, 1, 2, 3)
    assert run.requests[-1].members == (0, 2) and run.board.recovery_of(1) == 2


def test_a_serving_member_lost_before_the_switch_gives_the_resize_up_as_broken():
    run = coordinator(3)
    resize = run.request(4)
    run.dead[1] = 1.0
    assert run.recover_without([lost(1)], now=1.0) == 1
    assert run.board.outcome(resize.generation) == Abandoned("member 1 lost", broken=True)
    assert resize.outcome == "abandoned" and resize.why_abandoned == "member 1 lost"
    assert run.requests[-1].members == (0, 2) and run.board.recovery_of(0) == 2
    run.dead[2] = 2.0
    assert not run.recover_without([lost(2)], now=2.0) and "cannot host 16 experts" in run.failures[2]  # 1 x 10 slots


def test_a_joiner_lost_gives_its_resize_up_and_the_serving_group_is_untouched():
    run = coordinator(2)
    resize = run.request(4)
    assert run.recover_without([lost(3, "joining")], now=1.0) == 0
    assert run.board.outcome(resize.generation) == Abandoned("member 3 died")  # rank 0 reads it at its next step
    events = run.tick()
    assert events.abandoned == [resize] and run.members == (0, 1) and len(run.requests) == 1


def test_a_member_that_exits_with_no_report_is_lost_and_one_that_reports_is_done():
    run = coordinator(2)
    run.board.report(1, {"member": 1, "steps": [0, 1]})
    run.processes.exited_codes[1] = 0
    run.processes.exited_codes[0] = -9
    events = run.tick()
    assert [(f.member, f.kind, f.role) for f in events.lost] == [(0, "died", "serving")]
    assert run.reports == {1: {"member": 1, "steps": [0, 1]}} and run.settled()


def test_a_dead_spare_is_removed_from_the_pool_and_replaced():
    run = coordinator(2, spares=2)
    assert run.spares == [2, 3]
    run.processes.exited_codes[2] = -9
    events = run.tick()
    assert [(f.member, f.role) for f in events.lost] == [(2, "spare")]
    assert run.spares == [3, 4] and (4, None) in run.processes.started
    assert not run.requests  # a spare's death is no recovery


def test_a_spare_released_at_the_end_that_dies_before_it_leaves_is_no_fault_of_the_run():
    run = coordinator(2, spares=1)
    run.release_spares()
    assert run.board.assignment(2) == "stop" and run.spares == []
    run.processes.exited_codes[2] = -9  # gone before it read its stop
    events = run.tick()
    assert [(f.member, f.role) for f in events.lost] == [(2, "leaving")] and not run.requests and not run.failures


def test_a_hung_member_is_fenced_and_recovered_from_as_a_death():
    run = coordinator(3, hang_s=5.0)
    for now in (0.0, 3.0, 6.0):  # everyone beats and moves on; member 2 only at first
        for member in (0, 1, 2) if now == 0.0 else (0, 1):
            run.board.beat(member, KeepAlive(int(now) + 1, int(now) + 1, 0, False, Phase.SERVING, 0))
        events = run.tick(now=now)
    assert [(f.member, f.kind) for f in events.lost] == [(2, "hung")]  # silent for 6 s
    assert run.processes.killed == [2] and run.board.fenced(2).startswith("silent for")
    assert run.requests[-1].kind == "recovery" and run.requests[-1].members == (0, 1)


def test_the_server_giving_a_resize_up_cannot_undo_a_switch():
    run = coordinator(2)
    resize = run.request(4)
    run.board.commit(resize.generation, Switched(12, 2))
    assert not run.give_up(resize, "not switched within the server's deadline")  # the switch stands: no 500
    assert run.tick().switched == [(resize, ())] and resize.outcome == "switched"


def test_the_keys_of_generations_before_the_serving_one_go_once_nobody_reads_them():
    run = coordinator(2)
    resize = run.request(4)
    run.board.commit(resize.generation, Switched(5, 2))
    run.tick()
    assert not run.board.announced(0) and run.board.announced(1)


def test_a_resize_is_refused_while_another_is_pending_or_to_a_size_the_group_cannot_take():
    run = coordinator(2)
    run.request(4)
    with pytest.raises(RuntimeError, match="generation 1 is still pending"):
        run.request(2)
    with pytest.raises(ValueError, match="the group's maximum"):
        coordinator(2).request(5)
    assert isinstance(run.requests[0], ResizeRequest)


def test_its_records_keep_the_last_faults_and_count_every_one():
    run = coordinator(2, spares=1, history=3)
    for _ in range(5):  # the spare dies, is replaced; five times
        run.processes.exited_codes[run.spares[0]] = -9
        run.tick()
    assert run.fault_count == 5 and [f.member for f in run.faults] == [4, 5, 6]
    assert [f.member for f in run.faults_since(3)] == [5, 6] and [f.member for f in run.faults_since(0)] == [4, 5, 6]
    assert list(run.dead) == [4, 5, 6] and run.spares == [7] and run.requests.maxlen == 3  # resizes: the same bound
