"""Rank bodies for the launcher's tests (module level, so spawned processes can import them)."""

import os
import time


def beat_for(rank, world_size, init_method, seconds, every_s, heartbeat):
    """Runs `seconds` in all, beating every `every_s`: a long run that is never silent."""
    end = time.monotonic() + seconds
    beats = 0
    while time.monotonic() < end:
        time.sleep(every_s)
        heartbeat.beat()
        beats += 1
    return beats


def beat_then_hang(rank, world_size, init_method, hang_rank, heartbeat):
    """Every rank beats for a while; `hang_rank` then stops beating (stuck), the others finish
    and return when they started (the monotonic clock is system-wide)."""
    started = time.monotonic()
    for _ in range(5):
        time.sleep(0.1)
        heartbeat.beat()
    if rank == hang_rank:
        time.sleep(3600)
    return started


def never_beat(rank, world_size, init_method, seconds):
    """Takes no heartbeat: the timeout bounds its whole run."""
    time.sleep(seconds)
    return rank


class CountingHeartbeat:
    def __init__(self) -> None:
        self.beats = 0

    def beat(self) -> None:
        self.beats += 1


def beats_of(rank, world_size, init_method, fn, *args):
    """How often a rank body beats over its run."""
    heartbeat = CountingHeartbeat()
    fn(rank, world_size, init_method, *args, heartbeat=heartbeat)
    return heartbeat.beats


def exit_writes_after(rank, world_size, init_method, directory, delay_s):
    """Reports at once; at exit (an atexit handler, as torch's and multiprocessing's are) waits
    `delay_s`, then writes `rank<N>`: the file exists only if the process finished its own exit."""
    import atexit
    from pathlib import Path

    def write() -> None:
        time.sleep(delay_s)
        (Path(directory) / f"rank{rank}").write_text("exited")

    atexit.register(write)
    return rank


def exit_hangs(rank, world_size, init_method):
    """Reports, but never exits: a non-daemon thread that sleeps for an hour keeps it alive."""
    import threading

    threading.Thread(target=time.sleep, args=(3600,)).start()
    return rank


def listening_after_groups(rank, world_size, init_method):
    """vLLM's groups as a rank of ``eplb-graph run`` builds them (EP = world_size): the rendezvous
    it met through, and every TCP socket this rank's process listens on, read from the kernel."""
    import psutil

    from eplb_reference.runtime.groups import init_expert_parallel, shutdown_expert_parallel

    init_expert_parallel(rank, world_size, init_method, num_redundant_experts=0)
    try:
        sockets = [(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
                   if c.status == psutil.CONN_LISTEN]
    finally:
        shutdown_expert_parallel()
    return init_method.split(":", 1)[0], sockets, os.environ.get("GLOO_SOCKET_IFNAME")
