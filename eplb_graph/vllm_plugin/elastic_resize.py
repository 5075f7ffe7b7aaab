"""The frontend's bounds on a resize through vLLM's ``/scale_elastic_ep`` (the API server process).

vLLM 0.32 starts the new engines of a scale-up as Ray actors and waits for each to initialize
without a bound (``CoreEngineActorManager.scale_up_elastic_ep``: ``ray.get`` on ``wait_for_init``);
a new engine that never starts (a process dying at start: Ray starts it again, forever) hangs the
resize and its request. And upstream has no abort: the existing engines have prepared the resize
(new groups half built) when it fails, so a second resize cannot be served safely.

``ResizeGuard`` (installed once per frontend by the config gate, elastic EP on):

* refuses a size the group cannot take before anything starts (``resize_problem``);
* gives the new engines ``EPLB_GRAPH_ELASTIC_START_TIMEOUT_S`` seconds to initialize, then kills
  them, so upstream's wait fails and the resize is answered with an error; what upstream recorded
  of them (actors, placement groups) is taken back, the old group serves on;
* after a resize failed part-way, refuses every later one, naming the failure (restart to resize);
* drains a scale-down first: upstream aborts the requests running on the engines it removes (their
  clients get a cut answer with status 200) unless ``VLLM_ELASTIC_EP_DRAIN_REQUESTS`` is set. New
  requests are answered vLLM's retryable 503 meanwhile (its scaling flag), the running ones finish.
"""

from __future__ import annotations

import functools
import os
import threading

from eplb_graph.upstream import patches
from eplb_graph.upstream.adaptations import PLUGIN

# A DP group of one rank has no device communicator to switch to, and vLLM picks its DP client at
# start for DP > 1 only: the smallest group served, at start and after a resize.
MIN_DP = 2
START_TIMEOUT = "EPLB_GRAPH_ELASTIC_START_TIMEOUT_S"
DEFAULT_START_TIMEOUT_S = 600.0  # vLLM's own bound on an engine's start (VLLM_ENGINE_READY_TIMEOUT_S)
# what upstream's engine manager records of each engine it starts, in step (one entry per engine)
RECORDS = ("local_engine_actors", "remote_engine_actors", "created_placement_groups", "placement_group_is_local")


def start_timeout_s(environ: dict[str, str] | os._Environ) -> float:
    """The bound on a new engine's start, from the environment; a bad value is named."""
    raw = environ.get(START_TIMEOUT, "")
    if not raw:
        return DEFAULT_START_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 24 * 3600:  # NaN fails too
        raise ValueError(f"{START_TIMEOUT}={raw!r}: a number of seconds in (0, 86400]")
    return value


def resize_problem(parallel_config, new_size: object) -> str | None:
    """Why a resize to ``new_size`` cannot be served; None where it can."""
    most = parallel_config.elastic_ep_max_dp_size
    if isinstance(new_size, bool) or not isinstance(new_size, int) or not MIN_DP <= new_size <= most:
        return (f"eplb-graph serves elastic EP on CPU from {MIN_DP} to {most} (--elastic-ep-max-dp-size) DP "
                f"ranks; new_data_parallel_size={new_size!r} is refused, the group is untouched")
    return None


class ResizeGuard:
    """The two frontend adaptations above, and what they remember (a resize that failed part-way)."""

    def __init__(self, start_timeout: float) -> None:
        self.start_timeout = start_timeout
        self.failed: str | None = None

    def install(self) -> None:
        if patches.installed("elastic_resize.scale_elastic_ep"):
            return
        upstream_scale = patches.current("elastic_resize.scale_elastic_ep")
        upstream_start = patches.current("elastic_resize.scale_up_engines")

        @functools.wraps(upstream_scale)
        async def scale_elastic_ep(engine, new_data_parallel_size, *args, **kwargs):
            return await self.scale(upstream_scale, engine, new_data_parallel_size, *args, **kwargs)

        @functools.wraps(upstream_start)
        def scale_up_elastic_ep(manager, *args, **kwargs):
            return self.start_engines(upstream_start, manager, *args, **kwargs)

        patches.install("elastic_resize.scale_elastic_ep", scale_elastic_ep, by=PLUGIN)
        patches.install("elastic_resize.scale_up_engines", scale_up_elastic_ep, by=PLUGIN)

    async def scale(self, upstream, engine, new_size, *args, **kwargs):
        parallel = engine.vllm_config.parallel_config
        if not (parallel.enable_elastic_ep and parallel.enable_eplb):
            return await upstream(engine, new_size, *args, **kwargs)
        problem = resize_problem(parallel, new_size)
        if problem is None and self.failed is not None:
            problem = (f"a resize failed part-way ({self.failed}); vLLM cannot undo what its engines prepared, so "
                       f"this server serves on at {parallel.data_parallel_size} DP ranks: restart it to resize")
        if problem:
            raise ValueError(problem)  # vLLM's route answers 400, nothing started
        if new_size < parallel.data_parallel_size:
            return await self.drained(upstream, engine, new_size, *args, **kwargs)
        return await self.guarded(upstream, engine, new_size, *args, **kwargs)

    async def drained(self, upstream, engine, new_size, *args, **kwargs):
        """A scale-down once no request runs (see the module docstring); a drain that times out
        leaves the group as it was (vLLM answers it 408)."""
        from vllm import envs
        from vllm.entrypoints.serve.elastic_ep.middleware import set_scaling_elastic_ep

        if envs.VLLM_ELASTIC_EP_DRAIN_REQUESTS:  # upstream drains itself
            return await self.guarded(upstream, engine, new_size, *args, **kwargs)
        drain_timeout = args[0] if args else kwargs.get("drain_timeout", 300)
        set_scaling_elastic_ep(True)
        try:
            await engine.wait_for_requests_to_drain(drain_timeout)
            return await self.guarded(upstream, engine, new_size, *args, **kwargs)
        finally:
            set_scaling_elastic_ep(False)

    async def guarded(self, upstream, engine, new_size, *args, **kwargs):
        """Upstream's resize; one that fails part-way is remembered."""
        try:
            return await upstream(engine, new_size, *args, **kwargs)
        except ValueError:
            raise  # refused by upstream before anything started
        except BaseException as error:
            self.failed = f"to {new_size}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            raise

    def start_engines(self, upstream, manager, *args, **kwargs):
        """Upstream's start of the new engines, which are killed if not initialized in time."""
        import ray

        before = {name: list(getattr(manager, name)) for name in RECORDS}
        started = threading.Event()

        def new_actors() -> list:
            return [actor for name in RECORDS[:2] for actor in getattr(manager, name) if actor not in before[name]]

        def give_up() -> None:
            if not started.is_set():
                for actor in new_actors():
                    ray.kill(actor, no_restart=True)  # upstream's wait on it raises

        timer = threading.Timer(self.start_timeout, give_up)
        timer.daemon = True
        timer.start()
        try:
            result = upstream(manager, *args, **kwargs)
            started.set()
            return result
        except BaseException as error:
            started.set()
            for group in manager.created_placement_groups[len(before["created_placement_groups"]):]:
                ray.util.remove_placement_group(group)
            for name, items in before.items():  # upstream's records as they were before this resize
                patches.configure(f"elastic_resize.{name}", items, on=manager)
            raise RuntimeError(f"the new engines did not start in {self.start_timeout:g} s ({START_TIMEOUT}) "
                               f"or failed: {type(error).__name__}") from error
        finally:
            timer.cancel()
