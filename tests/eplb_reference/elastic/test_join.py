"""``runtime/elastic/join.py``: a member started outside the server's process tree, as a second
machine would start it (here on localhost), joins a resize and serves, with the run's secret only
(a wrong one is refused by name). Every socket the serving tree listens on is on loopback, gloo's
default device pointed at a public interface meanwhile. A process that reaches the store without
the secret steers nothing: its offer, result, stop and fence are dropped and serving goes on."""

import os
import subprocess
import sys
import time

import pytest

from eplb_reference.runtime.config import RunConfig
from eplb_reference.elastic.protocol import Board, RunSecret
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
    join = [sys.executable, "-m", "eplb_reference.cli", "join", "--store", address]
    wrong = subprocess.run(join, env={**os.environ, **RunSecret.generate().environment()}, capture_output=True,
                           text=True, timeout=120)
    assert wrong.returncode == 2 and "not sealed with the secret given: a wrong secret" in wrong.stderr, wrong.stderr
    outside = subprocess.Popen(join, env={**os.environ, **server.coordinator.secret.environment()},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
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
        attacked = intruder_attacks(server, sleeper)
        # a member's malformed values in the queues the server's watch thread reads: dropped, counted
        board = server.coordinator.board.clone()
        for queue, text in (("results", '{"rid": "x"}'), ("offers", "not json")):
            key = board.key("run", None, queue)
            board.store.queue_push(key, board.secret.seal(key, text))
        deadline = time.monotonic() + 60
        while server.stats.store_values_dropped < 4:
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
        for process in (outside, sleeper):
            process.kill()
            process.wait(30)
    dropped = server.coordinator.reports[attacked]["store_values_dropped"]  # rank 0's last word
    assert dropped.get("unproven fence", 0) >= 1 and dropped.get("unproven stop", 0) >= 1, dropped


def intruder_attacks(server, sleeper) -> int:
    """A client of the store without the secret: an offer naming the sleeper's pid, a forged result,
    a stop and a fence of rank 0. Nothing joins or dies; answers stay the reference's. Returns rank 0."""
    coordinator = server.coordinator
    intruder = Board(coordinator.board.store.clone(), coordinator.spec.name, RunSecret.generate())
    serving, spares, dropped = coordinator.members, list(coordinator.spares), server.stats.store_values_dropped
    fenced = serving[0]
    intruder.offer(intruder.new_member_id(), "localhost", sleeper.pid)
    intruder.push_result({"rid": server.next_rid, "token_ids": [1], "matches_reference": True, "member": fenced})
    intruder.fence(fenced, "forged")
    intruder.stop()
    step, beat = server.progress(), coordinator.board.keep_alive(fenced).beat
    deadline = time.monotonic() + 60  # the member read its fence key twice since, rank 0 the stop key each step
    while server.progress() < step + 4 or coordinator.board.keep_alive(fenced).beat < beat + 2:
        assert time.monotonic() < deadline and server.error is None
        time.sleep(0.05)
    answer = server.generate([11, 12], 3)
    assert answer["matches_reference"] and answer["token_ids"] != [1]
    assert coordinator.members == serving and coordinator.spares == spares and sleeper.poll() is None
    assert not coordinator.processes.exited(fenced)
    deadline = time.monotonic() + 60
    while server.stats.store_values_dropped < dropped + 2:  # the offer and the result, in the server's stats
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return fenced
