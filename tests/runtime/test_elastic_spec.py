"""``runtime/elastic_spec.py``: the store keys members meet under, a client per caller, and the
switch every member of the serving group settles the same way."""

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from eplb_graph.runtime.config import RunConfig
from eplb_graph.runtime.elastic_spec import ABANDONED, ElasticSpec, LostPeer, settle_switch
from eplb_graph.runtime.launch import free_port


def test_keys_are_named_under_the_run_and_each_connect_is_a_client_of_its_own():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    spec = ElasticSpec(RunConfig(ranks=2), 4, "127.0.0.1", port, name="ep-test", timeout_s=10)
    assert spec.key("gen", 3, "switch") == "ep-test/gen/3/switch"
    first, second = spec.connect(), spec.connect()
    first.set(spec.key("step"), "7")
    assert first is not second and second.get(spec.key("step")) == b"7" and master.check([spec.key("step")])



def _store(timeout_s: float = 10) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def test_rank_0_switches_unless_the_coordinator_gave_the_resize_up_first():
    store = _store()
    settle_switch(store, "ep/gen/1/switch", "40,2", commit=True, timeout_s=10)
    assert store.get("ep/gen/1/switch") == b"40,2"
    store.set("ep/gen/2/switch", ABANDONED)  # a member died before rank 0 got there
    with pytest.raises(LostPeer, match="given up"):
        settle_switch(store, "ep/gen/2/switch", "80,4", commit=True, timeout_s=10)
    assert store.get("ep/gen/2/switch") == ABANDONED.encode()


@pytest.mark.parametrize("winner", ["40,2", ABANDONED])
def test_the_other_members_wait_for_rank_0_and_learn_the_same_outcome(winner):
    store = _store()
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))  # the member's own
    outcome = []

    def member() -> None:  # blocks until the key is written, as a member does right after the control all-reduce
        try:
            settle_switch(client, "ep/gen/1/switch", "40,2", commit=False, timeout_s=10)
            outcome.append("switched")
        except LostPeer as error:
            outcome.append(str(error))

    thread = threading.Thread(target=member)
    thread.start()
    store.compare_set("ep/gen/1/switch", "", winner)  # rank 0's commit, or the coordinator's give-up
    thread.join()
    assert outcome == (["switched"] if winner != ABANDONED else ["the resize was given up (ep/gen/1/switch): "
                                                                  "a member of the serving group died"])


def test_a_member_that_never_reads_a_switch_treats_it_as_a_lost_peer():
    with pytest.raises(LostPeer, match="no switch was written under ep/gen/1/switch"):
        settle_switch(_store(), "ep/gen/1/switch", "40,2", commit=False, timeout_s=0.2)
