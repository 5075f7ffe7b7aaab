"""The frontend's bounds on a resize (``elastic_resize.py``), on stand-ins for vLLM's engine client
and its Ray engine manager: sizes refused before anything starts, new engines that never start
killed at the bound with upstream's records taken back, every resize refused after one failed."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from eplb_graph.vllm_plugin.elastic_resize import (
    DEFAULT_START_TIMEOUT_S, START_TIMEOUT, ResizeGuard, resize_problem, start_timeout_s)

ray = pytest.importorskip("ray")


def engine(dp: int = 2) -> SimpleNamespace:
    return SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(
        enable_elastic_ep=True, enable_eplb=True, elastic_ep_max_dp_size=4, data_parallel_size=dp)))


@pytest.mark.parametrize(("raw", "value"), [("", DEFAULT_START_TIMEOUT_S), ("90", 90.0), ("0.5", 0.5)])
def test_the_start_bound_is_read_from_the_environment(raw, value):
    assert start_timeout_s({START_TIMEOUT: raw} if raw else {}) == value


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "1e9", "soon"])
def test_a_start_bound_that_is_not_one_is_named(raw):
    with pytest.raises(ValueError, match=START_TIMEOUT):
        start_timeout_s({START_TIMEOUT: raw})


@pytest.mark.parametrize("size", [1, 0, 5, True, "3", 2.5, None])
def test_a_resize_outside_two_to_the_maximum_is_named(size):
    problem = resize_problem(SimpleNamespace(elastic_ep_max_dp_size=4), size)
    assert problem is not None and "from 2 to 4" in problem and repr(size) in problem


@pytest.mark.parametrize("size", [2, 3, 4])
def test_a_resize_within_the_range_is_served(size):
    assert resize_problem(SimpleNamespace(elastic_ep_max_dp_size=4), size) is None


def test_a_failed_resize_refuses_every_later_one_and_a_refusal_by_upstream_does_not():
    guard, calls = ResizeGuard(60.0), []

    async def upstream(client, size, *args):
        calls.append(size)
        if size == 4:
            raise ValueError("refused by upstream before it started anything")
        if size == 3:
            raise RuntimeError("Scale failed\nwith details")

    with pytest.raises(ValueError, match="new_data_parallel_size=1 is refused"):
        asyncio.run(guard.scale(upstream, engine(), 1))
    with pytest.raises(ValueError, match="refused by upstream"):
        asyncio.run(guard.scale(upstream, engine(), 4))
    assert guard.failed is None
    with pytest.raises(RuntimeError):
        asyncio.run(guard.scale(upstream, engine(), 3))
    assert guard.failed == "to 3: RuntimeError: Scale failed"
    with pytest.raises(ValueError, match="a resize failed part-way .to 3: RuntimeError: Scale failed.*restart it"):
        asyncio.run(guard.scale(upstream, engine(), 2))
    assert calls == [4, 3]  # nothing reached upstream after the failure


class Manager:
    """What vLLM's Ray engine manager records per engine."""

    def __init__(self) -> None:
        self.local_engine_actors, self.remote_engine_actors = ["a0", "a1"], []
        self.created_placement_groups, self.placement_group_is_local = ["pg0", "pg1"], [True, True]


def test_new_engines_that_never_start_are_killed_at_the_bound_and_upstreams_records_restored(monkeypatch):
    killed, removed, waiting = [], [], threading.Event()
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: (killed.append(actor), waiting.set()))
    monkeypatch.setattr(ray.util, "remove_placement_group", removed.append)

    def upstream(manager, config, size, redundant):  # starts one engine, then waits for it (ray.get)
        manager.local_engine_actors.append("new")
        manager.created_placement_groups.append("pg-new")
        manager.placement_group_is_local.append(True)
        waiting.wait(30)
        raise RuntimeError("actor died")  # what ray.get raises once the actor is killed

    manager = Manager()
    with pytest.raises(RuntimeError, match="did not start in 0.2 s"):
        ResizeGuard(0.2).start_engines(upstream, manager, None, 3, 2)
    assert killed == ["new"] and removed == ["pg-new"]
    assert vars(manager) == vars(Manager())


def test_engines_that_start_in_time_are_left_alone(monkeypatch):
    killed = []
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: killed.append(actor))

    def upstream(manager, config, size, redundant):
        manager.local_engine_actors.append("new")
        return "started"

    manager = Manager()
    assert ResizeGuard(0.05).start_engines(upstream, manager, None, 3, 2) == "started"
    threading.Event().wait(0.2)  # past the bound: the timer was cancelled
    assert killed == [] and manager.local_engine_actors == ["a0", "a1", "new"]


class Draining(SimpleNamespace):
    """The engine client's drain as upstream's ``wait_for_requests_to_drain``: returns once no
    request runs, raises ``TimeoutError`` at the bound; records vLLM's scaling flag meanwhile."""

    async def wait_for_requests_to_drain(self, drain_timeout: int = 300) -> None:
        from vllm.entrypoints.serve.elastic_ep.middleware import get_scaling_elastic_ep

        self.flag_while_draining = get_scaling_elastic_ep()
        self.drain_timeouts.append(drain_timeout)
        if self.running:
            raise TimeoutError(f"Timeout reached after {drain_timeout} seconds waiting for requests to drain.")


def draining_engine(dp: int, running: bool) -> Draining:
    return Draining(vllm_config=engine(dp).vllm_config, running=running, drain_timeouts=[])


def test_a_scale_down_drains_first_with_new_requests_refused_and_a_scale_up_does_not(monkeypatch):
    pytest.importorskip("vllm")
    from vllm import envs
    from vllm.entrypoints.serve.elastic_ep.middleware import get_scaling_elastic_ep

    monkeypatch.delenv("VLLM_ELASTIC_EP_DRAIN_REQUESTS", raising=False)
    monkeypatch.setattr(envs, "VLLM_ELASTIC_EP_DRAIN_REQUESTS", False, raising=False)
    guard, flags = ResizeGuard(60.0), []

    async def upstream(client, size, *args):
        flags.append(get_scaling_elastic_ep())

    down = draining_engine(3, running=False)
    asyncio.run(guard.scale(upstream, down, 2, 45))
    assert down.drain_timeouts == [45] and down.flag_while_draining and flags == [True]  # upstream after the drain
    assert not get_scaling_elastic_ep()  # serving again
    up = draining_engine(2, running=False)
    asyncio.run(guard.scale(upstream, up, 3))
    assert up.drain_timeouts == [] and flags == [True, False]  # upstream keeps a scale-up's requests


def test_a_drain_that_times_out_leaves_the_group_and_the_next_resize_alone(monkeypatch):
    pytest.importorskip("vllm")
    from vllm import envs
    from vllm.entrypoints.serve.elastic_ep.middleware import get_scaling_elastic_ep

    monkeypatch.setattr(envs, "VLLM_ELASTIC_EP_DRAIN_REQUESTS", False, raising=False)
    guard, calls = ResizeGuard(60.0), []

    async def upstream(client, size, *args):
        calls.append(size)

    with pytest.raises(TimeoutError):  # vLLM's route answers it 408
        asyncio.run(guard.scale(upstream, draining_engine(3, running=True), 2))
    assert calls == [] and guard.failed is None and not get_scaling_elastic_ep()
    asyncio.run(guard.scale(upstream, draining_engine(3, running=False), 2))
    assert calls == [2]
