"""``runtime/elastic/member_process.py`` alone: a joining member whose resize is given up under it.

The member's whole life in a group (join, serve, switch, leave, recover) runs with its peers in
``test_scripted.py`` and ``test_server.py``; its decisions, with no process, in ``test_member.py``.
"""

import time
from datetime import timedelta

import pytest

from eplb_reference.runtime.config import RunConfig
from eplb_reference.elastic.coordinator import Coordinator
from eplb_reference.elastic.protocol import Generation
from eplb_reference.elastic.spec import ElasticSpec


@pytest.mark.launches  # a member process
def test_a_joiner_blocked_on_a_peer_that_never_comes_leaves_once_its_resize_is_given_up():
    # member 6 never starts: member 5's group build would wait for it the whole collective
    # timeout (600 s here); the give-up written meanwhile must end the join long before
    coordinator = Coordinator(ElasticSpec(RunConfig(mode="eager", ranks=2), 2, "127.0.0.1", 0, timeout_s=600.0))
    board = coordinator.board
    try:
        coordinator.processes.start(5, 1)
        board.announce(Generation(1, (5, 6)))
        board.gloo_store(1, "pg").wait(["0/0"], timedelta(seconds=300))  # gloo's rendezvous key of rank 0: inside the build
        board.abandon(1, "member 6 died")
        deadline = time.monotonic() + 120
        while (report := board.take_report(5)) is None:
            assert time.monotonic() < deadline, "the joiner did not leave"
            time.sleep(0.1)
        assert report == {"member": 5, "abandoned_join": "member 5: the resize to generation 1 was given up"}
        coordinator.processes.children[5].join(60)
        assert coordinator.processes.exit_code(5) == 0
    finally:
        coordinator.processes.stop_all(0)
