"""How the runtime starts its rank and member processes.

Each one is forked from multiprocessing's fork server, which imports torch, vLLM and the runtime
once: a rank then starts in a fraction of a second instead of importing them afresh, which took
seconds of CPU per process (more on a loaded machine) and set how fast a joiner could serve.
Where the platform has no fork server, or ``EPLB_GRAPH_START_METHOD=spawn`` asks for it, processes
are spawned as before. The fork server imports modules only: CUDA (or any device) is first touched
in the child, as in a spawned one.

A forked child inherits the fork server's environment and standard streams, those of the moment
the server started. ``LauncherState`` carries the launcher's current ones over, applied first
thing in the child's target, so from there on a child sees what a spawned one would. Before it,
under the server's environment and streams: unpickling the target and its arguments (importing a
module the server has not), and what the preloaded modules read at import (``OMP_*`` when torch
loads its thread pool, ``TORCH_DEVICE_BACKEND_AUTOLOAD``), fixed by the first launch in a process.
"""

from __future__ import annotations

import os
import threading
from multiprocessing import reduction
from multiprocessing.context import BaseContext

import torch.multiprocessing as mp

# what a rank or a member imports before its first step; a module missing here is skipped by
# the fork server and imported by the child as usual
PRELOAD = (
    "eplb_reference.runtime.rank",
    "eplb_reference.elastic.member_process",
    "eplb_reference.elastic.serving",
    "eplb_reference.elastic.scripted_member",
    "vllm.distributed.eplb.eplb_state",
    "vllm.distributed.eplb.rebalance_execute",
    "vllm.distributed.eplb.async_worker",
)
STANDARD_STREAMS = (1, 2)
START_METHOD_ENV = "EPLB_GRAPH_START_METHOD"
# the fork server's one start, its imports included, on a loaded machine
FORK_SERVER_START_S = 300.0


def process_context() -> BaseContext:
    """The context rank and member processes start from."""
    method = os.environ.get(START_METHOD_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_METHOD_ENV}={method!r}: expected 'forkserver' or 'spawn'")
    if method == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts; later calls change nothing
    return ctx


def start_fork_server(ctx: BaseContext, timeout_s: float = FORK_SERVER_START_S) -> None:
    """Starts the fork server (once per launcher process) and waits for its imports, bounded.

    Done before any rank starts: the first start blocks until the server has imported its
    modules, and a Ctrl-C or a timeout then would leave a rank the server forks later, unknown
    to its launcher. Here only a child that does nothing can be left."""
    if ctx.get_start_method() != "forkserver":
        return
    outcome: list[BaseException | None] = []

    def start_one_that_does_nothing() -> None:
        try:
            child = ctx.Process(target=_do_nothing, daemon=True)
            child.start()
            child.join()
            outcome.append(None)
        except BaseException as error:  # the server died importing, say
            outcome.append(error)

    starter = threading.Thread(target=start_one_that_does_nothing, daemon=True, name="eplb-graph-fork-server-start")
    starter.start()
    starter.join(timeout_s)
    if not outcome:
        raise TimeoutError(f"multiprocessing's fork server not ready after {timeout_s:.0f} s (importing "
                           f"{', '.join(PRELOAD)}); {START_METHOD_ENV}=spawn starts processes without it")
    if outcome[0] is not None:
        raise RuntimeError(f"multiprocessing's fork server failed to start: {outcome[0]!r}; "
                           f"{START_METHOD_ENV}=spawn starts processes without it") from outcome[0]


def _do_nothing() -> None:
    pass


class LauncherState:
    """The launcher's environment and standard streams when a child starts; ``apply`` in the child."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self._streams: list = []

    def __getstate__(self) -> dict:
        # pickled while the child starts: that is when multiprocessing can hand it a descriptor
        streams = [(target, reduction.DupFd(target)) for target in STANDARD_STREAMS if _is_open(target)]
        return {"environ": self.environ, "_streams": streams}

    def apply(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        for target, handle in self._streams:
            fd = handle.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
        self._streams = []


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
