"""``runtime/elastic/server.py`` with serving members: requests under traffic across 2 -> 4 -> 2,
members killed under it, and a store that does not grow with the requests served.

Real member processes; every finished request's tokens were checked against the one-process
reference as they were generated (``matches_reference``); every request is answered once.
"""

import random
import threading
import time

import openai
import pytest
from fastapi.testclient import TestClient

from eplb_reference.runtime.config import RunConfig
from eplb_reference.elastic.completions import SERVED_MODEL, TinyText
from eplb_reference.elastic.http import make_app
from eplb_reference.elastic.server import ElasticServer, ScaleError

# a resize right after one given up waits for spares started then (imported, built and warmed up
# beside the serving group on two shared cores): the deadline bounds that, not the switch under test
SPARES_WARM_S = 120.0


@pytest.mark.alone  # hangs are detected within bounds in seconds: a starved member would look hung
@pytest.mark.launches
def test_requests_complete_exactly_once_through_resizes_under_traffic():
    server = ElasticServer(RunConfig(mode="eager", ranks=2), 4, deadline_s=SPARES_WARM_S).start()
    results, stop, clients = start_clients(server)
    try:
        # the store holds the same keys however many requests go through it
        wait_until(lambda: server.stats.requests_completed >= 10)
        keys, served = server.coordinator.board.size(), server.stats.requests_completed
        wait_until(lambda: server.stats.requests_completed >= served + 40)
        board = server.coordinator.board
        assert board.size() == keys
        queued = [board.store.queue_len(board.key("member", m, "inbox")) for m in server.coordinator.members]
        queued.append(board.store.queue_len(board.key("run", None, "results")))
        assert sum(queued) <= 3  # at most the clients' requests in flight: nothing consumed stays queued
        long_one = server.submit([1], 15)  # in flight for 15 steps: the drain below cannot finish in time
        with pytest.raises(ScaleError) as drained:
            server.scale(4, drain_timeout=0.001)
        assert drained.value.status == 408 and "was abandoned" in str(drained.value) and server.ranks == 2
        given_up = server.coordinator.requests[-1]
        joiners = [server.coordinator.processes.children[m] for m in given_up.members if m >= 2]
        wait_until(lambda: not any(p.is_alive() for p in joiners))  # what the resize prepared is released
        assert server.scale(4) == "Scaled to 4 data parallel engines" and server.ranks == 4
        with pytest.raises(ScaleError) as refused:
            server.scale(9)
        assert refused.value.status == 400
        assert server.generate([5, 6], 3, timeout_s=120)["matches_reference"]
        # a standard OpenAI client, over the HTTP layer of `eplb-graph serve`, gets the same greedy tokens
        api = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=TestClient(make_app(server)))
        answer = api.completions.create(model=SERVED_MODEL, prompt="w5 w6", max_tokens=3, temperature=0)
        assert answer.choices[0].text == TinyText(server.cfg.vocab_size).decode(server.generate([5, 6], 3)["token_ids"])
        # drained: the requests in flight finish first, those submitted meanwhile wait for the new group
        assert server.scale(2, drain_timeout=60) == "Scaled to 2 data parallel engines" and server.ranks == 2
        assert server.result(long_one)["matches_reference"]
        # upstream's async EPLB rearranges between resizes, and rank 0 publishes it for /metrics
        wait_until(lambda: server.eplb_rearrangements() >= 1)
        assert 0 < server.balancedness() <= 1 and server.last_step_ms() > 0
    finally:
        stop_clients(server, stop, clients)
    assert results and all(r["matches_reference"] for r in results)
    assert server.stats.reconfigurations == 2 and server.stats.requests_duplicated == 0
    assert server.stats.requests_submitted == len(results) + 4  # every one came back, once
    assert server.stats.members_fenced == 0 and server.stats.member_failures == 0


@pytest.mark.alone  # hangs are detected within bounds in seconds: a starved member would look hung
@pytest.mark.launches
def test_a_member_killed_under_traffic_loses_no_request_and_is_replaced(monkeypatch):
    server = ElasticServer(RunConfig(mode="eager", ranks=2), 4, deadline_s=SPARES_WARM_S).start()
    results, stop, clients = start_clients(server)
    board = server.coordinator.board
    try:
        # a joiner killed while its resize is held by a drain (one that lasts until the death is seen), at once
        # and once it said ready: the resize is given up (500, naming it), never switched onto a group
        # with a dead member, and the other joiner leaves without an error; the group serves on at 2
        for once_ready in (False, True):
            killed, in_flight = threading.Event(), server.in_flight
            monkeypatch.setattr(server, "in_flight", lambda: not killed.is_set() or in_flight())
            long_one = server.submit([1], 15)
            scaling, outcome = scale_in_background(server, 4, drain_timeout=60)
            wait_until(lambda: server.coordinator.pending() is not None)
            resize = server.coordinator.pending()
            joiner = resize.members[-1]
            wait_until(lambda: not once_ready or not board.not_ready(resize.generation, [joiner]))
            server.coordinator.processes.kill(joiner)
            wait_until(lambda: joiner in server.coordinator.dead)  # the coordinator saw it before the drain ends
            killed.set()
            scaling.join(120)
            monkeypatch.undo()
            assert outcome == [(500, f"Scale failed: the resize to 4 ranks was abandoned: member {joiner} died")]
            assert server.ranks == 2 and server.result(long_one)["matches_reference"]
            other_joiner = server.coordinator.processes.children[resize.members[-2]]
            wait_until(lambda: not other_joiner.is_alive())  # nothing the resize prepared is kept
        assert server.scale(4) == "Scaled to 4 data parallel engines"
        # rank 0, at once: the joiners may still be taking their experts over the new group
        server.coordinator.processes.kill(server.coordinator.members[0])
        assert server.generate([5, 6], 3, timeout_s=120)["matches_reference"]
        wait_until(lambda: server.ranks == 3 and not server.in_flight_on(0))
        assert 0 not in server.coordinator.members
        assert server.scale(4) == "Scaled to 4 data parallel engines" and server.ranks == 4  # a replacement
    finally:
        stop_clients(server, stop, clients)
    assert results and all(r["matches_reference"] for r in results)
    assert server.stats.recoveries == 1 and server.stats.reconfigurations == 3
    assert server.stats.member_failures == 0 and server.stats.requests_duplicated == 0
    assert server.stats.requests_submitted == len(results) + 3  # every one came back, once


def scale_in_background(server, size, **kwargs):
    """``server.scale`` on a thread; (the thread, [its outcome: 200, or (status, message)])."""
    outcome = []

    def scale():
        try:
            server.scale(size, **kwargs)
            outcome.append(200)
        except ScaleError as error:
            outcome.append((error.status, str(error)))

    thread = threading.Thread(target=scale)
    thread.start()
    return thread, outcome


def wait_until(condition, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def start_clients(server, count=3):
    """``count`` client threads generating random requests until told to stop; (results, stop, threads)."""
    results, stop = [], threading.Event()

    def client(seed):
        rng = random.Random(seed)
        while not stop.is_set():
            prompt = [rng.randrange(256) for _ in range(rng.randrange(1, 8))]
            results.append(server.generate(prompt, rng.randrange(1, 8), timeout_s=120))

    clients = [threading.Thread(target=client, args=(seed,)) for seed in range(count)]
    for thread in clients:
        thread.start()
    return results, stop, clients


def stop_clients(server, stop, clients):
    stop.set()
    for thread in clients:
        thread.join(150)
    server.shutdown()
