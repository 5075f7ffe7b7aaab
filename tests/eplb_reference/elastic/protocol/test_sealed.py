"""``protocol/sealed.py``: every value of the run's store sealed with the run's secret, through the
``Board`` that spells the keys; what a client without the secret writes is never acted on."""

import logging
import threading
from datetime import timedelta

import pytest

from eplb_reference.elastic.protocol import (STOP, Abandoned, Board, Generation, KeepAlive, Phase, ProtocolTimeout,
                                             Release, RunSecret, Switched)
from eplb_reference.elastic.protocol import sealed
from eplb_reference.elastic.protocol.proof import Unproven
from tests.eplb_reference.elastic.protocol.test_board import request, result


def outsider(board):
    """A client of the same store without the run's secret (any process that reaches the port)."""
    return Board(board.store.clone(), board.run, RunSecret.generate())


def test_what_a_client_without_the_secret_writes_is_never_acted_on_and_is_counted(board):
    intruder = outsider(board)
    intruder.push_result(result(3))
    intruder.push_request(1, request(3))
    intruder.offer(7, "h", 12)
    intruder.report(4, {"member": 4})
    intruder.hand_back(4, [1])
    intruder.fence(2, "forged")
    intruder.stop()
    intruder.beat(2, KeepAlive(1, 1, 0, False, Phase.SERVING, 0))
    intruder.assign(5, STOP)
    intruder.announce(Generation(3, (0, 9)))
    intruder.release(3, Release.GO)
    intruder.publish_step(99)
    intruder.served(2, 1, 0, 2)
    # sets are not acknowledged, but one client's reach the store in order: its last one there, all are
    board.store.wait([board.key("member", 2, "served")], timedelta(seconds=10))
    assert board.pop_results() == [] and board.pop_requests(1) == [] and board.offers() == []
    assert board.take_report(4) is None and board.take_handed_back(4) is None
    assert board.fenced(2) is None and not board.stopped() and board.keep_alive(2) is None
    assert board.assignment(5) is None and not board.announced(3) and board.release_of(3) is None
    assert board.step() == 0 and board.served_log(2) == []
    assert board.skipped == {f"unproven {kind}": 1 for kind in (
        "result", "request", "offer", "report", "hand-back", "fence", "stop", "keep-alive", "assignment",
        "generation", "release", "step", "served entry")}
    board.served(2, 2, 1, 2)  # the run's own entries are read past an outsider's
    assert board.served_log(2) == [[2, 1, 2]]


def test_a_sealed_value_moved_under_another_key_is_refused(board):
    board.fence(1, "hung")
    board.store.set(board.key("member", 2, "fence"), board.store.get(board.key("member", 1, "fence")))
    assert board.fenced(1) == "hung" and board.fenced(2) is None and board.skipped == {"unproven fence": 1}


def test_an_outcome_taken_first_by_an_outsider_is_replaced_by_the_runs(board):
    assert outsider(board).abandon(2, "forged") == Abandoned("forged")  # its own seal: it reads its own value
    assert board.outcome(2) is None  # the run reads none there
    assert board.commit(2, Switched(40, 2)) == Switched(40, 2) and board.wait_outcome(2, 1) == Switched(40, 2)


def test_an_outcome_key_planted_with_bytes_that_are_not_text_is_still_replaced(board):
    """compare-and-set compares the bytes stored: what was read is handed back as it was."""
    key = board.key("gen", 5, "outcome")
    board.store.compare_set(key, "", b"\xff\xfe")
    assert board.commit(5, Switched(3, 2)) == Switched(3, 2) and board.skipped == {"unproven outcome": 1}


def test_a_wait_reads_past_an_unproven_value_until_the_runs_is_written(board):
    outsider(board).announce(Generation(4, (0, 1)))
    with pytest.raises(ProtocolTimeout, match="no value of the run's under ep/gen/4/members"):
        board.generation(4, timeout_s=0.2)
    waiter = board.clone()
    seen = []
    thread = threading.Thread(target=lambda: seen.append(waiter.generation(4, timeout_s=10)))
    thread.start()
    board.announce(Generation(4, (2, 3)))
    thread.join()
    assert seen == [Generation(4, (2, 3))]


def test_a_spec_not_sealed_with_the_readers_secret_is_refused_at_once(board):
    board.publish_spec('{"name": "ep"}')
    with pytest.raises(Unproven, match="ep/run/spec"):
        outsider(board).spec_text(timeout_s=10)
    assert board.clone().spec_text(timeout_s=1) == '{"name": "ep"}'


def test_a_value_dropped_at_every_read_is_logged_ever_more_rarely(board, caplog):
    """Rank 0 reads the stop key every step: an outsider's stop sitting there must not flood the log."""
    outsider(board).stop()
    board.store.wait([board.key("run", None, "stop")], timedelta(seconds=10))
    with caplog.at_level(logging.WARNING, logger="eplb_graph.elastic"):
        assert not any(board.stopped() for _ in range(100))
    assert board.skipped == {"unproven stop": 100}
    assert [record.getMessage().split(";")[0] for record in caplog.records] == [
        f"store value dropped, unproven stop ({count} so far" for count in (1, 2, 4, 8, 16, 32, 64)]


def test_a_read_takes_a_bounded_number_of_queued_entries_and_the_next_read_the_rest(board, monkeypatch):
    """An outsider's flood costs each read at most POP_MAX store calls and seal checks."""
    monkeypatch.setattr(sealed, "POP_MAX", 3)
    intruder = outsider(board)
    for rid in range(4):
        intruder.push_result(result(rid))
    # a call that is answered comes after its client's earlier pushes: all four are queued
    assert intruder.store.queue_len(board.key("run", None, "results")) == 4
    board.push_result(result(40))
    assert board.pop_results() == [] and board.skipped["unproven result"] == 3
    assert [r["rid"] for r in board.pop_results()] == [40] and board.skipped["unproven result"] == 4
