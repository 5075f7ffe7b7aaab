"""``runtime/elastic/group.py``: a standby generation built beside the current one, switched to,
given up; the groups dropped so that a peer waiting in one of their collectives fails at once.

In one process: generations of one member need no gloo group; two members are two threads.
The multi-process switch 2 -> 4 -> 2 runs in ``test_scripted.py``.
"""

import gc
import threading
import time

import pytest
import torch
import torch.distributed as dist

from eplb_graph.custom_ops import EP_GROUPS
from eplb_reference.elastic.group import ElasticEpGroup, ElasticGroupError
from eplb_reference.elastic.protocol import Generation

pytest.importorskip("vllm")  # upstream's stateless gloo groups


def test_the_slot_serves_the_ops_and_switches_to_a_standby_generation(board):
    group = ElasticEpGroup("g-switch", board, member=7, max_size=4, timeout_s=5)
    try:
        with pytest.raises(ElasticGroupError, match="has not joined"):
            group.current()
        assert group.switch_when_built(Generation(0, (7,)), given_up=lambda: False)
        assert group.current() == (None, 0, 1) and EP_GROUPS.resolve("g-switch") is group
        assert group.counted() == (0, 1)  # what the ops entered through the slot, counted per generation
        group.build_standby(Generation(1, (7,)))
        assert group.standby.done(5) and group.standby.error is None
        assert group.switch_().index == 1 and group.generation.index == 1 and group.counted() == (1, 0)
        with pytest.raises(ElasticGroupError, match="no standby generation"):
            group.switch_()
    finally:
        group.leave()
    with pytest.raises(KeyError):
        EP_GROUPS.resolve("g-switch")


def test_a_standby_larger_than_the_maximum_fails_and_the_current_group_serves_on(board):
    group = ElasticEpGroup("g-big", board, member=0, max_size=2, timeout_s=5)
    try:
        group.switch_when_built(Generation(0, (0,)), given_up=lambda: False)
        group.build_standby(Generation(1, (0, 1, 2)))
        assert group.standby.done(5)
        assert "more than the group's maximum 2" in str(group.standby.error)
        with pytest.raises(ElasticGroupError, match="building generation 1's group failed"):
            group.switch_()
        assert group.current() == (None, 0, 1) and group.generation.index == 0
    finally:
        group.leave()


def test_a_build_switches_when_done_and_is_given_up_without_waiting_for_a_member_that_never_comes(board):
    group = ElasticEpGroup("g-when", board, member=0, max_size=2, timeout_s=60)
    looks = []

    def given_up() -> bool:  # the third look finds the resize given up
        looks.append(1)
        return len(looks) >= 3

    try:
        assert group.switch_when_built(Generation(0, (0,)), given_up=lambda: False)
        started = time.monotonic()
        assert not group.switch_when_built(Generation(1, (0, 1)), given_up=given_up)  # member 1 never comes
        assert time.monotonic() - started < 30 and len(looks) == 3  # not the build's 60 s timeout
        assert group.standby is None and group.generation.index == 0 and group.current() == (None, 0, 1)
    finally:
        group.leave()


def test_a_build_given_up_never_reaches_the_next_one(board):
    # a build given up that fails later must not make the next build look failed (the two used
    # to share one error slot on the group, written by whichever thread ended last)
    group = ElasticEpGroup("g-race", board, member=0, max_size=2, timeout_s=5)
    release = threading.Event()

    def slow_failure(generation, board):
        if generation.index == 1:
            release.wait(10)
            raise RuntimeError("the rendezvous never came")

    try:
        group.switch_when_built(Generation(0, (0,)), given_up=lambda: False)
        group._build = slow_failure  # a build blocked on a peer, failing once given up
        group.build_standby(Generation(1, (0, 1)))
        given_up = group.standby
        group.abandon_standby()
        group.build_standby(Generation(2, (0,)))
        assert group.standby.done(5)
        release.set()
        assert given_up.done(5) and "never came" in str(given_up.error)  # it failed on its own
        assert group.standby.error is None and group.switch_().index == 2
    finally:
        group.leave()


def test_solo_is_a_group_of_one_for_a_warm_up(board):
    group = ElasticEpGroup("g-solo", board, member=5, max_size=4, timeout_s=5)
    try:
        with group.solo():
            assert group.current() == (None, 0, 1)
        with pytest.raises(ElasticGroupError):
            group.current()
    finally:
        group.leave()


def test_aborting_a_group_fails_a_peer_inside_its_collective_at_once_without_a_collection(board):
    # two members as two threads; member 1 waits in an all-reduce member 0 never joins
    groups = [ElasticEpGroup(f"g-abort-{m}", board.clone(), member=m, max_size=2, timeout_s=60) for m in (0, 1)]
    built = [threading.Thread(target=g.switch_when_built, args=(Generation(0, (0, 1)), lambda: False)) for g in groups]
    for thread in built:
        thread.start()
    for thread in built:
        thread.join(60)
    failed = []

    def wait_in_a_collective() -> None:
        try:
            dist.all_reduce(torch.zeros(1), group=groups[1].process_group)
        except RuntimeError as error:
            failed.append((time.monotonic(), str(error)))

    peer = threading.Thread(target=wait_in_a_collective)
    peer.start()  # inside the collective or about to be: nothing may end it but the abort
    gc.disable()
    try:
        aborted = time.monotonic()
        groups[0].abort()
        peer.join(30)
    finally:
        gc.enable()
        for group in groups:
            group.leave()
    assert failed and failed[0][0] - aborted < 10, failed  # the collective's own timeout is 60 s
