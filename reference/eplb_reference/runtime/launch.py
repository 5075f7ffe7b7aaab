"""Runs one function per EP rank in real processes on this machine, with bounded waits.

Every rank gets (rank, world_size, init_method, *args), and ``heartbeat=`` if it takes
that keyword; what it returns comes back in rank order. A rank that raises, dies or goes
silent for the timeout fails the whole launch with a message naming it; the survivors are
stopped, never left hanging. Ctrl-C in the launcher stops every rank too.

Silent means no heartbeat: a rank function that beats (once per step, say) may run as long
as it keeps beating, so a long run is not mistaken for a stuck one; one that never beats
has the timeout for its whole run. Each rank's clock starts when its process enters the
rank function: before that, spawning it and importing what it needs (seconds, and several
times that on a loaded machine) has its own bound, ``startup_timeout_s``.

A rank that reported exits on its own (its atexit handlers and finalizers run) within a
grace period, and is killed only past it.

The ranks meet through a file store in a directory only this user can open (``file://``,
which vLLM's ``init_distributed_environment`` takes as torch's ``FileStore``), not a TCP
store (torch's listens on every interface whatever host it is given), and their Gloo groups
listen on loopback (``GLOO_SOCKET_IFNAME``, unless the operator names an interface).
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import inspect
import math
import os
import queue
import shutil
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable

from eplb_reference.runtime.process_start import LauncherState, process_context, start_fork_server


class RankFailure(RuntimeError):
    def __init__(self, failures: dict[int, str], results: dict[int, object]) -> None:
        self.failures = failures
        self.results = results
        detail = "\n".join(f"rank {rank}: {message}" for rank, message in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed:\n{detail}")


class Heartbeat:
    """A rank's last sign of life, in memory shared with its launcher."""

    def __init__(self, ctx) -> None:
        # CLOCK_MONOTONIC is system-wide on Linux: the launcher compares it with its own clock
        self._last = ctx.Value("d", math.nan, lock=False)  # NaN: the rank has not started yet

    def beat(self) -> None:
        self._last.value = time.monotonic()

    @property
    def started(self) -> bool:
        return not math.isnan(self._last.value)

    def silent_for(self) -> float:
        return time.monotonic() - self._last.value


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def loopback_interface() -> str:
    """The network interface that holds 127.0.0.1 (``lo`` on Linux)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(address.family == socket.AF_INET and address.address == "127.0.0.1" for address in addresses):
            return name
    raise RuntimeError("no network interface holds 127.0.0.1: the ranks on this host meet over loopback")


def _entry(fn: Callable, rank: int, world_size: int, init_method: str, args: tuple, results,
           heartbeat: Heartbeat, pass_heartbeat: bool, launcher: LauncherState) -> None:
    launcher.apply()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())  # gloo's default: the hostname's address
    heartbeat.beat()  # started and imported: from here on silence counts
    faulthandler.enable(all_threads=True)  # a crash in native code prints every thread's Python stack
    # Ctrl-C reaches the whole process group; the launcher answers it and stops every rank, so a
    # rank does not report its own interruption as a failure first
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        kwargs = {"heartbeat": heartbeat} if pass_heartbeat else {}
        report = (rank, True, fn(rank, world_size, init_method, *args, **kwargs))
    except BaseException as error:  # reported to the launcher, then the process exits nonzero
        report = (rank, False, f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
    results.put(report)
    results.close()
    results.join_thread()  # flush the report before the process goes away
    # The exit the launcher waits for: atexit handlers and finalizers run (multiprocessing's
    # unlink and unregister this process's semaphores; a rank killed halfway through leaves
    # the launcher's resource tracker warning of leaked ones), here, as a child forked from the
    # fork server leaves through os._exit. Only the interpreter's last collection over torch's,
    # vLLM's and Inductor's objects is skipped (seconds per rank), for memory the process is
    # about to give back anyway.
    gc.freeze()
    atexit._run_exitfuncs()
    if not report[1]:
        raise SystemExit(1)


def run_ranks(fn: Callable, world_size: int, *args, timeout_s: float = 180.0,
              startup_timeout_s: float | None = None, exit_grace_s: float = 10.0) -> list:
    """``timeout_s``: how long a rank may go without a heartbeat once it runs ``fn``;
    ``startup_timeout_s`` (default: ``timeout_s``): how long its process may take to get there;
    ``exit_grace_s``: once every rank has reported, how long they have together to exit on
    their own before they are killed (after a failure the survivors are killed at once)."""
    startup_timeout_s = timeout_s if startup_timeout_s is None else startup_timeout_s
    ctx = process_context()
    start_fork_server(ctx)  # its imports, once per launcher, are bounded apart from each rank's start
    results = ctx.Queue()
    rendezvous = tempfile.mkdtemp(prefix="eplb-graph-ranks-")  # mode 700
    init_method = f"file://{rendezvous}/store"
    beats = [Heartbeat(ctx) for _ in range(world_size)]
    takes_heartbeat = "heartbeat" in inspect.signature(fn).parameters
    processes = [
        ctx.Process(target=_entry, daemon=True, args=(fn, rank, world_size, init_method, args, results, beats[rank],
                                                      takes_heartbeat, LauncherState()))
        for rank in range(world_size)
    ]
    launched = time.monotonic()
    done: dict[int, object] = {}
    failures: dict[int, str] = {}
    try:
        for process in processes:
            process.start()
        while len(done) + len(failures) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
                (done if ok else failures)[rank] = value
                continue
            except queue.Empty:
                pass
            for rank, process in enumerate(processes):
                if rank not in done and rank not in failures and not process.is_alive():
                    # give its last message a moment to arrive before declaring it dead
                    try:
                        r, ok, value = results.get(timeout=1.0)
                        (done if ok else failures)[r] = value
                    except queue.Empty:
                        failures[rank] = f"process died with exit code {process.exitcode}"
            running = [rank for rank in range(world_size) if rank not in done and rank not in failures]
            for rank in running:
                if not beats[rank].started:
                    if time.monotonic() - launched > startup_timeout_s:
                        failures[rank] = f"not started after {startup_timeout_s:.0f} s (spawning the process, imports)"
                elif beats[rank].silent_for() > timeout_s:
                    failures[rank] = (f"no heartbeat for {timeout_s:.0f} s (stuck)" if takes_heartbeat
                                      else f"still running after {timeout_s:.0f} s")
            if failures.keys() & set(running):
                break
    finally:  # also on Ctrl-C in the launcher: no rank outlives it
        try:
            if len(done) == world_size:  # every rank reported: each finishes its own exit first
                deadline = time.monotonic() + exit_grace_s
                for process in processes:
                    process.join(max(0.0, deadline - time.monotonic()))
        finally:
            for process in processes:
                if process.pid is None:  # not started: Ctrl-C while the ranks were starting
                    continue
                if process.is_alive():
                    process.kill()
                process.join(5)
            shutil.rmtree(rendezvous, ignore_errors=True)
    if failures:
        raise RankFailure(failures, done)
    return [done[rank] for rank in range(world_size)]
