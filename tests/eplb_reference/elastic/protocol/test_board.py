"""``runtime/elastic/protocol/board.py``: one key format, typed values, the commit point's
compare-and-set, queues as inboxes, and a store that stays bounded."""

import json
import math
import threading

import pytest

from eplb_reference.elastic.protocol import STOP, Abandoned, Generation, KeepAlive, Phase, ProtocolTimeout, Release, Switched
from tests.eplb_reference.elastic.conftest import new_board


def test_every_key_has_one_format(board):
    assert board.key("gen", 3, "outcome") == "ep/gen/3/outcome"
    assert board.key("gen", 3, "ready", 7) == "ep/gen/3/ready/7"
    assert board.key("member", 5, "alive") == "ep/member/5/alive"
    assert board.key("run", None, "step") == "ep/run/step"


def test_a_generation_is_read_back_as_announced_and_a_wait_for_one_is_bounded(board):
    assert not board.announced(0)
    board.announce(Generation(0, (3, 1)))
    generation = board.generation(0, timeout_s=1)
    assert generation == Generation(0, (3, 1)) and generation.rank_of(1) == 1 and generation.size == 2
    with pytest.raises(ValueError, match="distinct members"):
        board.announce(Generation(1, (1, 1)))
    with pytest.raises(ProtocolTimeout, match="generation 4's members: nothing written under ep/gen/4/members"):
        board.generation(4, timeout_s=0.2)


def test_the_first_writer_of_an_outcome_wins_and_everyone_reads_it(board):
    assert board.commit(1, Switched(40, 2)) == Switched(40, 2)
    assert board.abandon(1, "too late") == Switched(40, 2)  # a give-up after the switch changes nothing
    assert board.abandon(2, "member 3 died", broken=True) == Abandoned("member 3 died", broken=True)
    assert board.commit(2, Switched(80, 4)) == Abandoned("member 3 died", broken=True)  # rank 0 learns it lost
    assert board.outcome(3) is None


def test_a_member_waiting_at_the_commit_point_reads_the_winner():
    board = new_board()
    member = board.clone()  # another process's client
    seen = []
    thread = threading.Thread(target=lambda: seen.append(member.wait_outcome(1, timeout_s=10)))
    thread.start()
    board.abandon(1, "the drain of requests timed out")
    thread.join()
    assert seen == [Abandoned("the drain of requests timed out")]


def test_a_drain_holds_a_resize_until_it_is_released(board):
    assert not board.held(1) and board.release_of(1) is None
    board.hold(1)
    board.release(1, Release.GO)
    assert board.held(1) and board.release_of(1) is Release.GO
    board.say_ready(1, 2)
    assert board.not_ready(1, [2, 3]) == [3]


def test_a_spare_reads_its_assignment_or_stop(board):
    assert board.assignment(4) is None
    board.assign(4, 3)
    assert board.assignment(4) == 3
    board.assign(5, STOP)
    assert board.assignment(5) == STOP


def sealed_set(board, key: str, text: str) -> None:
    """A value with the run's seal, as a member with a fault could write it."""
    board.store.set(key, board.secret.seal(key, text))


def request(rid: int) -> dict:
    return {"rid": rid, "prompt_token_ids": [1, 2], "max_new_tokens": 3}


def result(rid: int) -> dict:
    return {"rid": rid, "token_ids": [5], "matches_reference": True, "member": 0}


def test_an_inbox_is_a_queue_popped_once(board):
    for rid in range(3):
        board.push_request(2, request(rid))
    assert [r["rid"] for r in board.pop_requests(2)] == [0, 1, 2]
    assert board.pop_requests(2) == [] and board.store.queue_len(board.key("member", 2, "inbox")) == 0
    board.push_result(result(9))
    assert board.pop_results() == [result(9)] and board.pop_results() == []


@pytest.mark.parametrize("queue", ["result", "request", "offer"])
def test_a_malformed_queued_value_is_dropped_and_counted_and_the_good_ones_pass(board, queue):
    key = {"result": board.key("run", None, "results"), "request": board.key("member", 1, "inbox"),
           "offer": board.key("run", None, "offers")}[queue]
    pop = {"result": board.pop_results, "request": lambda: board.pop_requests(1), "offer": board.offers}[queue]
    good = {"result": result(3), "request": request(3), "offer": {"member": 7, "host": "h", "pid": 12}}[queue]
    bad = ["not json", "[1, 2]", json.dumps({**good, "rid": "x"} if "rid" in good else {**good, "pid": -1}),
           json.dumps({**good, "extra": 1}), json.dumps({k: v for k, v in list(good.items())[1:]})]
    for text in [*bad[:2], json.dumps(good), *bad[2:]]:  # sealed: a member's malformed value, not an outsider's
        board.store.queue_push(key, board.secret.seal(key, text))
    assert pop() == [good] and board.skipped == {queue: len(bad)}


def test_a_malformed_report_or_hand_back_reads_as_none_and_is_counted(board):
    sealed_set(board, board.key("member", 4, "report"), "{not json")
    sealed_set(board, board.key("member", 4, "returned"), json.dumps(["a"]))
    assert board.take_report(4) is None and board.take_handed_back(4) is None
    assert board.skipped == {"report": 1, "hand-back": 1}
    board.report(4, {"error": "boom"})
    board.hand_back(4, [1, 2])
    assert board.take_report(4) == {"error": "boom"} and board.take_handed_back(4) == [1, 2]


def test_the_store_holds_the_same_keys_after_a_thousand_requests(board):
    board.publish_step(1)
    before = board.size()
    for rid in range(1000):
        board.push_request(rid % 4, request(rid))
        board.pop_requests(rid % 4)
        board.push_result(result(rid))
        board.pop_results()
        board.publish_step(rid + 2, 1.5)
    assert board.size() == before + 1  # the step's latency, written once
    # queues do not count as keys: what is left in them is what was never taken
    assert [board.store.queue_len(board.key(scope, m, field)) for scope, m, field in
            [("member", m, "inbox") for m in range(4)] + [("run", None, "results")]] == [0] * 5


def test_a_generation_older_than_the_serving_one_is_forgotten_with_gloo_keys(board):
    board.announce(Generation(1, (0, 1, 2)))
    board.say_ready(1, 2)
    board.commit(1, Switched(10, 2))
    board.gloo_store(1, "pg").set("0/0", "rendezvous")  # what gloo writes under the generation's prefix
    board.announce(Generation(2, (0, 1)))
    board.forget_generation(1)
    assert sorted(board.store.list_keys()) == ["ep/gen/2/members"]


def test_a_member_is_forgotten_but_its_fence_stays(board):
    board.beat(3, KeepAlive(1, 1, 0, False, Phase.SERVING, 0))
    board.assign(3, 2)
    board.fence(3, "silent for 12 s")
    board.push_request(3, {"rid": 1})
    board.forget_member(3)
    assert board.keep_alive(3) is None and board.assignment(3) is None
    assert board.store.queue_len(board.key("member", 3, "inbox")) == 0  # its inbox emptied
    assert board.fenced(3) == "silent for 12 s"


def test_member_ids_are_shared_with_members_joining_from_outside(board):
    board.reserve_member_ids(2)
    assert [board.new_member_id(), board.clone().new_member_id()] == [2, 3]
    board.offer(4, "host-a", 123)
    assert board.offers() == [{"member": 4, "host": "host-a", "pid": 123}] and board.offers() == []


def test_a_malformed_keep_alive_or_figure_reads_as_none_or_the_default_and_is_counted(board):
    sealed_set(board, board.key("member", 2, "alive"), '{"beat": "x"}')
    sealed_set(board, board.key("run", None, "step"), "many")
    sealed_set(board, board.key("run", None, "step_ms"), "[]")
    assert board.keep_alive(2) is None and board.step() == 0 and math.isnan(board.step_ms())
    assert board.skipped == {"keep-alive": 1, "step": 1, "step_ms": 1}



def test_what_the_coordinator_writes_malformed_is_counted_and_never_acted_on(board):
    """Sealed, so a fault of the run's own: an assignment, a release, a recovery or an outcome reads as
    none; a waited-for generation or outcome ends the wait as a timeout, naming the value."""
    sealed_set(board, board.key("member", 5, "assign"), "soon")
    sealed_set(board, board.key("gen", 3, "release"), "later")
    sealed_set(board, board.key("gen", 3, "recovery"), "x")
    sealed_set(board, board.key("gen", 3, "outcome"), "moved:1:2")
    sealed_set(board, board.key("gen", 3, "members"), "[1, 1]")
    assert board.assignment(5) is None and board.release_of(3) is None and board.recovery_of(3) is None
    assert board.outcome(3) is None
    with pytest.raises(ProtocolTimeout, match="generation 3's members: the value written is malformed"):
        board.generation(3, timeout_s=1)
    assert board.skipped == {"assignment": 1, "release": 1, "recovery": 1, "outcome": 1, "generation": 1}
    assert board.commit(3, Switched(9, 2)) == Switched(9, 2)  # the malformed outcome is replaced
