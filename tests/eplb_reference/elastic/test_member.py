"""``runtime/elastic/member.py``: every decision a member takes, from what it read, with no process.

A member's whole life in a group (join, serve, switch, leave, recover) runs with its peers in
``test_scripted.py`` and ``test_server.py``; the joiner blocked on a peer that never comes in
``test_member_process.py``.
"""

import pytest

from eplb_reference.elastic.member import (
    Act, Control, JoinView, RecoveryView, View, after_commit, decide, decide_join, decide_recovery, vote,
)
from eplb_reference.elastic.protocol import Abandoned, Release, Switched


def agree(*views: View) -> Control:
    """The MAX all-reduce of the members' votes."""
    votes = [vote(view)[0].as_list() for view in views]
    return Control.from_list([max(column) for column in zip(*votes)])


def test_rank_0_sees_the_next_generation_and_every_member_prepares_at_the_same_step():
    agreed = agree(View(rank=0, announced=True), View(rank=1), View(rank=2))
    assert decide(False, agreed) is Act.PREPARE
    assert decide(False, agree(View(rank=0), View(rank=1, announced=True))) is Act.SERVE  # only rank 0 reads it


def test_a_member_whose_group_is_not_built_holds_the_switch_for_a_step_not_the_group():
    ready = View(rank=0, pending=1, standby_built=True, released_for_s=0.5, deadline_s=30)
    assert decide(True, agree(ready, View(rank=1, pending=1, standby_built=False))) is Act.SERVE
    assert decide(True, agree(ready, View(rank=1, pending=1, standby_built=True))) is Act.SWITCH
    # a departing member builds nothing and holds nothing
    assert decide(True, agree(ready, View(rank=1, pending=1, in_pending=False))) is Act.SWITCH


def test_rank_0_waits_for_every_joiner_and_for_the_release_of_a_held_resize():
    base = dict(rank=0, pending=1, standby_built=True, deadline_s=30)
    assert decide(True, agree(View(**base, not_ready=(3,), released_for_s=1))) is Act.SERVE
    assert decide(True, agree(View(**base, held=True))) is Act.SERVE
    assert decide(True, agree(View(**base, held=False, release=Release.GO, released_for_s=0.1))) is Act.SWITCH


@pytest.mark.parametrize("view, why", [
    (View(rank=0, pending=1, outcome=Abandoned("member 3 died")), "member 3 died"),
    (View(rank=0, pending=1, held=True, release=Release.ABANDON), "the drain of requests timed out"),
    (View(rank=0, pending=1, not_ready=(2, 3), released_for_s=31, deadline_s=30),
     "not ready within the 30 s resize deadline (members 2, 3 not ready)"),
    (View(rank=1, pending=1, standby_error="connection refused"),
     "a member could not build the new group: connection refused"),
])
def test_a_resize_is_given_up_by_everyone_at_once_and_rank_0_says_why(view, why):
    mine, reason = vote(view)
    assert reason == why and mine.give_up
    assert decide(True, agree(view, View(rank=2 if view.rank == 1 else 1, pending=1, standby_built=True))) is Act.GIVE_UP


def test_the_run_ending_stops_every_member_even_with_a_resize_pending():
    assert decide(True, agree(View(rank=0, pending=1, stop=True), View(rank=1, pending=1))) is Act.STOP
    assert decide(False, agree(View(rank=0), View(rank=1, stop=True))) is Act.STOP


def test_an_idle_step_is_idle_only_where_nobody_has_work():
    assert agree(View(rank=0, work=False), View(rank=1, work=True)).work
    assert not agree(View(rank=0, work=False), View(rank=1, work=False)).work


@pytest.mark.parametrize("outcome, in_new, act", [
    (Switched(40, 2), True, Act.SWITCHED),
    (Switched(40, 4), False, Act.LEAVE),
    (Abandoned("the server's deadline"), True, Act.RESUME),  # the group is whole: it serves on at its size
    (Abandoned("member 2 lost", broken=True), True, Act.RECOVER),
])
def test_past_the_commit_point_every_member_reads_the_same_winner(outcome, in_new, act):
    assert after_commit(outcome, in_new) is act


def join_view(**fields) -> JoinView:
    return JoinView(**{"built": False, "build_error": None, "said_ready": False, "outcome": None, "waited_s": 1.0,
                       "bound_s": 90.0, **fields})


def test_a_joiner_says_ready_once_built_and_serves_once_the_switch_won():
    assert decide_join(join_view()) is Act.WAIT
    assert decide_join(join_view(built=True)) is Act.SAY_READY
    assert decide_join(join_view(built=True, said_ready=True)) is Act.WAIT
    assert decide_join(join_view(built=True, said_ready=True, outcome=Switched(40, 2))) is Act.SWITCHED
    assert decide_join(join_view(outcome=Abandoned("the drain of requests timed out"))) is Act.LEAVE


def test_a_joiner_that_times_out_gives_up_through_the_commit_point_and_is_never_left_counted_in(board):
    # past its bound the joiner gives up with a compare-and-set on the outcome: where rank 0
    # committed first, the joiner was counted in and serves; otherwise nobody can commit it
    assert decide_join(join_view(built=True, said_ready=True, waited_s=91.0)) is Act.GIVE_UP
    assert decide_join(join_view(build_error="peer 6 never came")) is Act.GIVE_UP
    board.commit(1, Switched(40, 2))
    assert board.abandon(1, "member 5 gave up joining") == Switched(40, 2)  # the joiner serves
    assert board.abandon(2, "member 5 gave up joining") == Abandoned("member 5 gave up joining")
    assert board.commit(2, Switched(80, 2)) == Abandoned("member 5 gave up joining")  # rank 0 cannot count it in


def test_a_member_whose_step_failed_recovers_where_the_coordinator_says_and_fails_otherwise():
    assert decide_recovery(RecoveryView(announced=None, tried=None, waited_s=1, bound_s=70)) is Act.WAIT
    assert decide_recovery(RecoveryView(announced=5, tried=None, waited_s=1, bound_s=70)) is Act.RECOVER
    # the one it tried was given up under it (another death): it waits for the next one
    assert decide_recovery(RecoveryView(announced=5, tried=5, waited_s=1, bound_s=70)) is Act.WAIT
    assert decide_recovery(RecoveryView(announced=6, tried=5, waited_s=1, bound_s=70)) is Act.RECOVER
    # no peer was lost: the failure was its own, and it fails rather than wait forever
    assert decide_recovery(RecoveryView(announced=None, tried=None, waited_s=71, bound_s=70)) is Act.FAIL
