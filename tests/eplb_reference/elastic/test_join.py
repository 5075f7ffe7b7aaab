"""``runtime/elastic/join.py``: a member started outside the server's process tree, as a second
machine would start it (here on localhost), joins a resize and serves. Every socket the serving
tree listens on is on loopback, gloo's default device pointed at a public interface meanwhile."""

import subprocess
import sys
import time

import pytest

from eplb_reference.runtime.config import RunConfig
from eplb_reference.elastic.server import ElasticServer
from tests.eplb_reference.elastic.test_group import public_interface

psutil = pytest.importorskip("psutil")


def listening(processes) -> set[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket ``processes`` listen on, read from the kernel."""
    return {(p.pid, c.laddr.ip, c.laddr.port) for p in processes for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


@pytest.mark.alone  # hangs are detected within bounds in seconds: a starved member would look hung
@pytest.mark.launches
def test_a_member_joined_from_outside_serves_after_a_resize_and_is_fenced_like_any_other(monkeypatch):
    public = public_interface()
    if public is not None:  # where gloo's default device would listen, in every member the test starts
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", public[0])
    server = ElasticServer(RunConfig(mode="eager", ranks=2), 3, spares=0, deadline_s=120, hang_s=5.0).start()
    address = f"{server.spec.store_host}:{server.spec.store_port}"
    outside = subprocess.Popen([sys.executable, "-m", "eplb_reference.cli", "join", "--store", address],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not server.coordinator.spares:  # it offers itself once warm
            assert outside.poll() is None and time.monotonic() < deadline, outside.stdout.read()
            time.sleep(0.1)
        (member,) = server.coordinator.spares
        assert member not in server.coordinator.processes.children  # not one of the server's processes
        assert server.scale(3) == "Scaled to 3 data parallel engines" and member in server.coordinator.members
        answers = [server.generate([5 + i, 6], 3) for i in range(6)]  # round robin: some on the outside member
        assert all(a["matches_reference"] for a in answers) and member in {a["member"] for a in answers}
        tree = [psutil.Process(), *psutil.Process().children(recursive=True), psutil.Process(outside.pid)]
        sockets = listening(tree)
        assert len({pid for pid, _, _ in sockets}) >= 3  # the store's process and two members' gloo at least
        assert all(host in ("127.0.0.1", "::1") for _, host, _ in sockets), sockets
        # malformed values in the queues the server's watch thread reads: dropped, counted, serving goes on
        board = server.coordinator.board.clone()
        board.store.queue_push(board.key("run", None, "results"), '{"rid": "x"}')
        board.store.queue_push(board.key("run", None, "offers"), "not json")
        deadline = time.monotonic() + 60
        while server.stats.store_values_dropped < 2:
            assert time.monotonic() < deadline and server.error is None
            time.sleep(0.1)
        assert server.generate([9, 10], 2)["matches_reference"] and server.error is None
        assert server.coordinator.processes.kill(member) is False  # never signalled by the coordinator
        outside.kill()  # its death, by the test that started it: detected as any member's
        deadline = time.monotonic() + 120
        while member in server.coordinator.members:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert server.ranks == 2 and server.generate([7, 8], 2)["matches_reference"]
    finally:
        server.shutdown()
        outside.kill()
        outside.wait(30)
