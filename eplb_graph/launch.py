"""Runs one function per EP rank in real processes on this machine, with bounded waits.

Every rank gets (rank, world_size, init_method, *args); what it returns comes back in
rank order. A rank that raises, dies or overruns the deadline fails the whole launch with
a message naming it; the survivors are stopped, never left hanging. Ctrl-C in the launcher
stops every rank too.
"""

from __future__ import annotations

import faulthandler
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable

import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    def __init__(self, failures: dict[int, str], results: dict[int, object]) -> None:
        self.failures = failures
        self.results = results
        detail = "\n".join(f"rank {rank}: {message}" for rank, message in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed:\n{detail}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(fn: Callable, rank: int, world_size: int, init_method: str, args: tuple, results) -> None:
    faulthandler.enable(all_threads=True)  # a crash in native code prints every thread's Python stack
    # Ctrl-C reaches the whole process group; the launcher answers it and stops every rank, so a
    # rank does not report its own interruption as a failure first
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        results.put((rank, True, fn(rank, world_size, init_method, *args)))
    except BaseException as error:  # reported to the launcher, then the process exits nonzero
        results.put((rank, False, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
        results.close()
        results.join_thread()  # flush the report before the process goes away
        raise SystemExit(1) from None


def run_ranks(fn: Callable, world_size: int, *args, timeout_s: float = 180.0) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    processes = [
        ctx.Process(target=_entry, args=(fn, rank, world_size, init_method, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    done: dict[int, object] = {}
    failures: dict[int, str] = {}
    try:
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
            if time.monotonic() > deadline:
                for rank in range(world_size):
                    if rank not in done and rank not in failures:
                        failures[rank] = f"still running after {timeout_s:.0f} s"
                break
    finally:  # also on Ctrl-C in the launcher: no rank outlives it
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(5)
    if failures:
        raise RankFailure(failures, done)
    return [done[rank] for rank in range(world_size)]
