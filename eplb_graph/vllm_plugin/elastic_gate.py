"""The config gate's part for vLLM's elastic EP (``--enable-elastic-ep``) on CPU.

vLLM 0.32 resizes a DP group through ``POST /scale_elastic_ep``: its Ray DP backend starts or
stops engines and every engine switches to new stateless groups. eplb-graph serves that on CPU at
TP=1, with asynchronous EPLB over gloo (our staged mover), from DP=2 up to
``--elastic-ep-max-dp-size``. This module says, before any process starts, what it refuses
(``elastic_problems``), and builds the config: upstream's validator refuses elastic EP without
EPLB (which the CPU build turns off for that call) and async EPLB without NIXL, so the config is
built with elastic EP off and the request set on it afterwards (``configure_elastic``). It also
gives Ray's placement a resource to count engines by on CPU (``RAY_RESOURCE``, which the Ray
cluster declares), the engine processes the plugin's environment, picks the ``mp`` executor
inside each engine (the Ray executor places workers by a GPU key CPU has not), and turns vLLM's
compile cache off for them (``bench_vllm_elastic.py`` saw engines die when, after a scale-down back
to the start size, one engine loaded that size's cached graph and the other failed to and compiled).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from eplb_graph.upstream import patches
from eplb_graph.upstream.adaptations import PLUGIN

from .active_line import vllm_logger
from .elastic_follow import keep_graphs
from .elastic_resize import MIN_DP, ResizeGuard, start_timeout_s

# The Ray resource vLLM's DP placement counts engines by on CPU (one unit per engine at TP=1): the
# operator's Ray head declares as many as the most engines (``ray start --resources``).
RAY_RESOURCE = "eplb_graph_dp"
# Our settings (metrics dir, placement file, the watchdog's bound) reach the engines Ray starts.
ENV_PREFIX = "EPLB_GRAPH_"
NO_COMPILE_CACHE = "VLLM_DISABLE_COMPILE_CACHE"
RAY_PREFIXES = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"


def elastic_problems(engine_args, *, on_cpu: bool, environ: dict[str, str]) -> list[str]:
    """Why this elastic EP request cannot be served, one line each; [] where it can (or elastic is off)."""
    if not engine_args.enable_elastic_ep:
        return []
    if not on_cpu:
        return ["enable_elastic_ep=True off CPU: eplb-graph serves vLLM's elastic EP on its CPU engine only "
                "(upstream runs it with synchronous EPLB elsewhere unless NIXL is installed)"]
    problems = []
    dp, tp = engine_args.data_parallel_size, engine_args.tensor_parallel_size
    if dp < MIN_DP:
        problems.append(f"enable_elastic_ep=True with data_parallel_size={dp}: start at {MIN_DP} or more (vLLM "
                        f"chooses its DP client at start, and a group of one rank cannot switch groups)")
    if tp > 1:
        problems.append(f"enable_elastic_ep=True with tensor_parallel_size={tp}: on CPU eplb-graph serves elastic "
                        f"EP over DP ranks of one worker each (TP=1)")
    if engine_args.data_parallel_backend != "ray":
        problems.append(f"enable_elastic_ep=True with data_parallel_backend={engine_args.data_parallel_backend!r}: "
                        f"vLLM starts and stops engines at a resize through Ray only (--data-parallel-backend ray)")
    if engine_args.distributed_executor_backend not in (None, "mp"):
        problems.append(f"enable_elastic_ep=True with distributed_executor_backend="
                        f"{engine_args.distributed_executor_backend!r}: on CPU each engine runs its one worker with "
                        f"the 'mp' executor (Ray's executor places workers by a GPU resource)")
    most = engine_args.elastic_ep_max_dp_size
    if most is not None and most < dp:
        problems.append(f"elastic_ep_max_dp_size={most} below data_parallel_size={dp}")
    try:
        start_timeout_s(environ)
    except ValueError as error:
        problems.append(f"the new engines' start bound: {error}")
    try:
        keep_graphs(environ)
    except ValueError as error:
        problems.append(str(error))
    if environ.get("EPLB_GRAPH_PLACEMENT_FILE"):
        problems.append("EPLB_GRAPH_PLACEMENT_FILE with enable_elastic_ep=True: a kept placement names the slots "
                        "of one group size, which a resize changes")
    return problems


@contextlib.contextmanager
def elastic_off_while_building(engine_args) -> Iterator[None]:
    """Elastic EP off on the caller's arguments while upstream builds their config (its validator
    refuses elastic EP with EPLB off, and async EPLB without NIXL), each engine's executor ``mp``."""
    if not engine_args.enable_elastic_ep:
        yield
        return
    executor = engine_args.distributed_executor_backend or "mp"
    with patches.scoped("gate.args_enable_elastic_ep", False, on=engine_args, by=PLUGIN), \
            patches.scoped("gate.args_executor_backend", executor, on=engine_args, by=PLUGIN):
        yield


def configure_elastic(config, engine_args, environ: dict[str, str] | os._Environ) -> None:
    """Sets the elastic request on a config built with it off, and prepares the frontend to start
    engines through Ray on CPU. Call after ``elastic_off_while_building``, elastic EP on only."""
    from vllm.platforms import current_platform

    parallel = config.parallel_config
    patches.configure("config.cpu_enable_elastic_ep", True, on=parallel)
    most = engine_args.elastic_ep_max_dp_size or parallel.data_parallel_size  # upstream's default
    patches.configure("config.cpu_elastic_ep_max_dp_size", most, on=parallel)
    patches.configure("platform.cpu_ray_device_key", RAY_RESOURCE, on=type(current_platform))
    ResizeGuard(start_timeout_s(environ)).install()  # checked at start (elastic_problems)
    if environ.get(NO_COMPILE_CACHE) != "1":  # read by each engine Ray starts (vLLM copies its variables)
        environ[NO_COMPILE_CACHE] = "1"
        vllm_logger().warning(
            "eplb-graph: vLLM's compile cache is off under elastic EP (%s=1): after a resize back to a size it "
            "served before, some engines load that size's cached graph and others cannot, and engines running "
            "different graphs break each other's collectives", NO_COMPILE_CACHE)
    prefixes = [p for p in environ.get(RAY_PREFIXES, "").split(",") if p.strip()]
    if ENV_PREFIX not in prefixes:  # read by vLLM when it starts each engine actor, in this process
        environ[RAY_PREFIXES] = ",".join([*prefixes, ENV_PREFIX])

