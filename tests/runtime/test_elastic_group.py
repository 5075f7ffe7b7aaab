"""``runtime/elastic_group.py``: generations in a TCP store, a standby group built beside the current one.

In one process, with generations of one member (no gloo group is needed for those); the
multi-process switch 2 -> 4 -> 2 runs in ``test_elastic_run.py``.
"""

from datetime import timedelta

import pytest
import torch.distributed as dist

from eplb_graph.custom_ops import EP_GROUPS
from eplb_graph.runtime.elastic_group import (
    ElasticEpGroup, ElasticGroupError, Generation, announce_generation, generation_announced, read_generation,
)
from eplb_graph.runtime.launch import free_port


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


def test_a_generation_is_read_back_as_announced(store):
    assert not generation_announced(store, "g", 0)
    announce_generation(store, "g", Generation(0, (3, 1)))
    assert generation_announced(store, "g", 0)
    generation = read_generation(store, "g", 0, timeout_s=1)
    assert generation == Generation(0, (3, 1)) and generation.rank_of(1) == 1 and generation.size == 2


def test_a_generation_with_a_member_twice_is_refused(store):
    with pytest.raises(ValueError, match="distinct members"):
        announce_generation(store, "g", Generation(0, (1, 1)))


def test_waiting_for_a_generation_never_announced_is_bounded(store):
    with pytest.raises(ElasticGroupError, match="generation 4 of EP group 'g' was not announced within 0 s"):
        read_generation(store, "g", 4, timeout_s=0.2)


def test_the_slot_serves_the_ops_and_switches_to_a_standby_generation(store):
    group = ElasticEpGroup("g-switch", store, member=7, max_size=4, timeout_s=5)
    try:
        with pytest.raises(ElasticGroupError, match="has not joined"):
            group.current()
        announce_generation(store, "g-switch", Generation(0, (7,)))
        group.join(0)
        assert group.current() == (None, 0, 1) and EP_GROUPS.resolve("g-switch") is group
        group.build_standby(Generation(1, (7,)))
        assert group.wait_standby(5)
        assert group.standby_ready() and group.standby_failed() is None
        assert group.switch_().index == 1 and group.generation.index == 1
        with pytest.raises(ElasticGroupError, match="no standby generation"):
            group.switch_()
    finally:
        group.leave()
    with pytest.raises(KeyError):
        EP_GROUPS.resolve("g-switch")


def test_a_standby_larger_than_the_maximum_fails_and_the_current_group_serves_on(store):
    group = ElasticEpGroup("g-big", store, member=0, max_size=2, timeout_s=5)
    try:
        announce_generation(store, "g-big", Generation(0, (0,)))
        group.join(0)
        group.build_standby(Generation(1, (0, 1, 2)))
        assert group.wait_standby(5)
        assert "more than the group's maximum 2" in str(group.standby_failed())
        with pytest.raises(ElasticGroupError, match="building the standby EP group failed"):
            group.switch_()
        assert group.current() == (None, 0, 1) and group.generation.index == 0
    finally:
        group.leave()


def test_a_standby_waiting_for_a_member_that_never_comes_can_be_given_up_without_waiting(store):
    group = ElasticEpGroup("g-wait", store, member=0, max_size=2, timeout_s=60)
    try:
        announce_generation(store, "g-wait", Generation(0, (0,)))
        group.join(0)
        group.build_standby(Generation(1, (0, 1)))  # member 1 never builds its side
        assert not group.wait_standby(0.2) and not group.standby_ready()
        group.abandon_standby()  # returns at once; the build ends by its own timeout, in a thread
        with pytest.raises(ElasticGroupError, match="no standby generation being built"):
            group.wait_standby(0.1)
        assert group.current() == (None, 0, 1)
    finally:
        group.leave()


def test_a_build_switches_when_done_and_is_abandoned_once_given_up(store):
    group = ElasticEpGroup("g-when", store, member=0, max_size=2, timeout_s=60)
    calls = []

    def given_up() -> bool:  # the third look finds the resize given up
        calls.append(1)
        return len(calls) >= 3

    try:
        assert group.switch_when_built(Generation(0, (0,)), given_up=lambda: False)
        assert group.generation.index == 0
        assert not group.switch_when_built(Generation(1, (0, 1)), given_up=given_up)  # member 1 never comes
        assert len(calls) == 3 and group.generation.index == 0 and group.current() == (None, 0, 1)
        with pytest.raises(ElasticGroupError, match="more than the group's maximum 2"):
            group.switch_when_built(Generation(2, (0, 1, 2)), given_up=lambda: False)
    finally:
        group.leave()


def test_solo_is_a_group_of_one_for_a_warm_up(store):
    group = ElasticEpGroup("g-solo", store, member=5, max_size=4, timeout_s=5)
    try:
        with group.solo():
            assert group.current() == (None, 0, 1)
        with pytest.raises(ElasticGroupError):
            group.current()
    finally:
        group.leave()
