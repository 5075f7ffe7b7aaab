"""``runtime/elastic/group.py``: a standby generation built beside the current one, switched to,
given up; the groups dropped so that a peer waiting in one of their collectives fails at once.

In one process: generations of one member need no gloo group; two members are two threads.
The multi-process switch 2 -> 4 -> 2 runs in ``test_scripted.py``.
"""

import gc
import threading
import time
from datetime import timedelta

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


def listening(address_family=None) -> set[tuple[str, int]]:
    """This process's listening TCP sockets, read from the kernel (psutil), not assumed."""
    import psutil

    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def public_interface() -> tuple[str, str] | None:
    """(name, IPv4 address) of an interface that is not loopback, where this machine has one."""
    import ipaddress

    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family.name == "AF_INET" and not ipaddress.ip_address(address.address).is_loopback:
                return name, address.address
    return None


def build_two(board, prefix: str, **kwargs) -> list[ElasticEpGroup]:
    groups = [ElasticEpGroup(f"{prefix}-{m}", board.clone(), member=m, max_size=2, timeout_s=60, **kwargs)
              for m in (0, 1)]
    built = [threading.Thread(target=g.switch_when_built, args=(Generation(0, (0, 1)), lambda: False)) for g in groups]
    for thread in built:
        thread.start()
    for thread in built:
        thread.join(60)
    return groups


def test_the_groups_listen_on_the_members_host_alone_where_gloos_default_would_expose_them(board, monkeypatch):
    """gloo's default device listens where the hostname resolves or ``GLOO_SOCKET_IFNAME`` points:
    pointed at a public interface here, upstream's stateless group listens there, ours on loopback."""
    public = public_interface()
    if public is None:
        pytest.skip("this machine has no interface but loopback to point gloo's default at")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", public[0])
    before = listening()
    groups = build_two(board, "g-listen")
    try:
        opened = listening() - before
        assert opened and all(host == "127.0.0.1" for host, _ in opened), opened
        total = torch.ones(1)
        done = threading.Thread(target=lambda: dist.all_reduce(total, group=groups[1].process_group))
        done.start()
        dist.all_reduce(torch.ones(1), group=groups[0].process_group)
        done.join(30)
        assert total.item() == 2.0  # the members reach each other there
    finally:
        for group in groups:
            group.leave()
    from vllm.distributed.utils import init_gloo_process_group  # what the group would get by default

    before = listening()
    stores = [board.clone().gloo_store(9, "default") for _ in (0, 1)]
    defaults = [None, None]

    def build(rank: int) -> None:
        defaults[rank] = init_gloo_process_group(stores[rank], rank, 2, timedelta(seconds=60))

    threads = [threading.Thread(target=build, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert any(host == public[1] for host, _ in listening() - before)  # the test can tell the difference
