"""The rank launcher: a rank is declared stuck when it goes silent, not when a long run is long."""

import time

import pytest

from eplb_reference.bench.capture_vs_eager import idle_vs_off_rank
from eplb_reference.runtime.launch import RankFailure, loopback_interface, run_ranks
from eplb_reference.runtime.config import RunConfig
from eplb_reference.runtime.rank import run_rank_and_shut_down
from tests.eplb_reference.runtime import launch_cases

pytestmark = pytest.mark.launches  # rank processes or an engine: left out by make test-fast

TIMEOUT_S = 5
# spawning a rank and importing eplb_graph takes ~2.3 s on two idle cores and 5-8 s while other
# tests load them (this bound once made these tests flaky): start-up gets a bound of its own
STARTUP_S = 120


def test_a_rank_that_keeps_beating_runs_past_the_timeout():
    start = time.monotonic()
    beats = run_ranks(launch_cases.beat_for, 2, 2.2 * TIMEOUT_S, 0.2, timeout_s=TIMEOUT_S, startup_timeout_s=STARTUP_S)
    assert all(count >= 40 for count in beats) and time.monotonic() - start > 2 * TIMEOUT_S


def test_a_rank_that_stops_beating_is_named_stuck_within_the_timeout():
    with pytest.raises(RankFailure) as failure:
        run_ranks(launch_cases.beat_then_hang, 2, 1, timeout_s=TIMEOUT_S, startup_timeout_s=STARTUP_S)
    assert failure.value.failures == {1: f"no heartbeat for {TIMEOUT_S} s (stuck)"}
    assert list(failure.value.results) == [0]  # the healthy rank finished and reported
    assert time.monotonic() - failure.value.results[0] < 3 * TIMEOUT_S  # since the ranks started


def test_a_rank_that_does_not_start_in_time_is_named():
    """Spawning and importing is bounded too: a rank body whose module takes 4 s to import."""
    from tests.eplb_reference.runtime import launch_slow_import_cases

    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_ranks(launch_slow_import_cases.body, 1, timeout_s=60, startup_timeout_s=1)
    assert failure.value.failures == {0: "not started after 1 s (spawning the process, imports)"}
    assert time.monotonic() - start < launch_slow_import_cases.IMPORT_S  # stopped while it was still importing


def test_a_rank_body_without_heartbeat_has_the_timeout_for_its_whole_run():
    with pytest.raises(RankFailure) as failure:
        run_ranks(launch_cases.never_beat, 1, 30, timeout_s=TIMEOUT_S, startup_timeout_s=STARTUP_S)
    assert failure.value.failures == {0: f"still running after {TIMEOUT_S} s"}


def test_ranks_that_reported_finish_their_own_exit(tmp_path):
    """Not killed on reporting: their atexit handlers run (a killed rank's unfinished exit left
    the resource tracker warning of leaked semaphores after 2 of 10 `eplb-graph run`s)."""
    assert run_ranks(launch_cases.exit_writes_after, 2, str(tmp_path), 0.5, timeout_s=TIMEOUT_S,
                     startup_timeout_s=STARTUP_S) == [0, 1]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["rank0", "rank1"]


def test_a_rank_that_does_not_exit_after_reporting_is_killed_after_the_grace():
    start = time.monotonic()
    assert run_ranks(launch_cases.exit_hangs, 2, timeout_s=TIMEOUT_S, startup_timeout_s=STARTUP_S,
                     exit_grace_s=1.0) == [0, 1]
    assert time.monotonic() - start < STARTUP_S  # not the hour its thread sleeps


@pytest.mark.parametrize("body", [run_rank_and_shut_down, idle_vs_off_rank], ids=["run", "bench"])
def test_the_runtime_beats_once_per_step(body):
    """`eplb-graph run` and `bench` beat after every step, so --timeout bounds a step, not a run."""
    cfg = RunConfig(mode="eager", ranks=1, steps=12, check_outputs=False)
    assert run_ranks(launch_cases.beats_of, 1, body, cfg, timeout_s=300) == [12]


def test_the_ranks_listen_on_loopback_only_and_meet_through_a_private_file():
    """``eplb-graph run``'s ranks: no TCP store (torch's listens on every interface), and vLLM's Gloo
    groups on loopback however the host name resolves."""
    results = run_ranks(launch_cases.listening_after_groups, 2, timeout_s=120, startup_timeout_s=STARTUP_S)
    for scheme, sockets, gloo_interface in results:
        assert scheme == "file" and sockets, sockets  # Gloo's listener, at least
        assert gloo_interface == loopback_interface()  # whatever the host name resolves to
        assert all(host in ("127.0.0.1", "::1") for host, _ in sockets), sockets
