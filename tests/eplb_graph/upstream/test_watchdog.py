"""StallWatchdog: a rearrangement in flight past its bound with no layer committed is a stall."""

import warnings

import pytest

from eplb_graph.upstream.watchdog import (
    EplbStallError,
    EplbStallWarning,
    StallBound,
    StallWatchdog,
    stall_bound_from_env,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def steps(watchdog, count, *, in_flight=True, committed=0, clock=None, seconds_per_step=0.0):
    for _ in range(count):
        if clock is not None:
            clock.now += seconds_per_step
        watchdog.observe(in_flight=in_flight, layers_committed=committed, where="on EP rank 0")


def test_a_rearrangement_that_commits_no_layer_for_longer_than_the_steps_bound_is_one_stall():
    watchdog = StallWatchdog(StallBound(max_steps=5, max_seconds=1e9), clock=Clock())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        steps(watchdog, 6)  # the first step in flight starts the clock; 5 more are within the bound
    with pytest.warns(EplbStallWarning, match="stalled: in flight for 6 steps .* last committed placement keeps serving"):
        steps(watchdog, 1)
    steps(watchdog, 20)  # the same stall is counted, and warned, once
    assert watchdog.stalls == 1


def test_progress_or_an_idle_step_resets_the_count():
    watchdog = StallWatchdog(StallBound(max_steps=5, max_seconds=1e9), clock=Clock())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for committed in range(10):  # a layer every 4 steps: slow, but progressing
            steps(watchdog, 4, committed=committed)
        steps(watchdog, 5, in_flight=False)
        steps(watchdog, 6)
    assert watchdog.stalls == 0
    with pytest.warns(EplbStallWarning):
        steps(watchdog, 1)
    steps(watchdog, 1, committed=1)  # a commit ends that stall; a later one counts again
    with pytest.warns(EplbStallWarning):
        steps(watchdog, 7, committed=1)
    assert watchdog.stalls == 2


def test_the_seconds_bound_catches_slow_steps_and_error_raises():
    clock = Clock()
    watchdog = StallWatchdog(StallBound(max_steps=1000, max_seconds=10.0, on_stall="error"), clock=clock)
    steps(watchdog, 3, clock=clock, seconds_per_step=4.0)  # 8 s in flight since the first
    with pytest.raises(EplbStallError, match="in flight for 3 steps and 12 s"):
        steps(watchdog, 1, clock=clock, seconds_per_step=4.0)


@pytest.mark.parametrize("bound, message", [
    (StallBound(max_steps=0), "stall steps must be an int >= 1, got 0"),
    (StallBound(max_seconds=0), "stall seconds must be > 0, got 0"),
    (StallBound(on_stall="ignore"), "on_stall must be one of warn, error, got 'ignore'"),
])
def test_a_bound_that_is_not_one_is_refused(bound, message):
    with pytest.raises(ValueError, match=message):
        StallWatchdog(bound)


def test_a_worker_takes_its_bound_from_the_environment_and_a_bad_one_names_the_variable():
    assert stall_bound_from_env({}) == StallBound()
    assert stall_bound_from_env({"EPLB_GRAPH_STALL_STEPS": "50", "EPLB_GRAPH_ON_STALL": "error"}) == StallBound(
        max_steps=50, on_stall="error")
    with pytest.raises(ValueError, match="EPLB_GRAPH_STALL_SECONDS must be > 0, got -1.0"):
        stall_bound_from_env({"EPLB_GRAPH_STALL_SECONDS": "-1"})
    with pytest.raises(ValueError, match="EPLB_GRAPH_STALL_STEPS / EPLB_GRAPH_STALL_SECONDS must be numbers"):
        stall_bound_from_env({"EPLB_GRAPH_STALL_STEPS": "many"})
