"""Where one rank's step time goes: probes around a step, for ``eplb-graph bench``'s breakdown.

``StepProbes`` installs on a rank's ``EplbController`` and gives, per step, one record
(``end_step``) whose parts the bench combines over ranks (``eplb_reference.bench.breakdown``):

* ``eplb_ours_ms`` / ``eplb_upstream_ms``: the main thread's EPLB work (``begin_batch`` +
  ``end_batch``, what ``timed_step`` calls ``eplb_host_s``) split by who owns the code.
  Ours: the controller's own work around ``EplbState.step`` and, inside it, the binding's
  commit hook (placement commit, lookup refresh), our placement inversion
  (``compute_logical_maps`` as the capability adaptations replaced it) and the staging ack
  (what ``_move_to_workspace`` does after our hook). Upstream: the rest of ``EplbState.step``
  (window update, weight install ``move_from_buffer``: ``upstream_install_ms``, its map
  copies ``_commit_eplb_maps_for_layer`` less our parts in it: ``upstream_commit_ms``,
  ``rearrange``: ``upstream_rearrange_ms``), of which ``upstream_ready_sync_ms`` is
  its ready all-reduce ``_all_ranks_result_ready``, a collective over the EP CPU group, so
  it includes waiting there for the slower rank; its entry instant (``ready_sync_entry_ns``,
  CLOCK_MONOTONIC as below) lets the bench tell that wait from the all-reduce's own time.
  Measured with ``time.perf_counter_ns`` around instance-level wrappers (upstream's code
  itself is not changed); only main-thread calls count.
* ``ready_ns``: ``CLOCK_MONOTONIC`` when the rank is ready to enter the step. On one host
  this clock is shared by the rank processes (``perf_counter`` is not promised to be), so
  the bench derives the wait at the step's first collective: max over ranks - this rank's.
  It cannot see waits at later collectives inside the forward, nor say why a rank was late.
* ``worker_cpu_ms``: CPU time (user + system) of upstream's async worker thread during the
  step, read on the main thread from the worker's own CPU clock
  (``time.pthread_getcpuclockid``). It counts the worker's Python and its native work with
  the GIL released alike; it does not count torch's intra-op threads or gloo's threads
  working for it.
* ``gil_wait_ms`` and its bounds ``gil_wait_worker_bound_ms`` / ``gil_wait_main_bound_ms``,
  from ``GilProbe``: a daemon thread that sleeps a short interval, over and over. Each
  wake-up must retake the GIL; how late it comes back, less the time the kernel kept it
  runnable but off a core (``/proc/thread-self/schedstat``'s run delay), is time the GIL was
  held by another thread when a thread wanted it. The main thread pays such waits too, each
  time it comes back from a native call (torch ops release the GIL) while another thread
  runs Python. Which thread held it cannot be read from Python (a sampler holds the GIL
  itself while it looks; a thread caught in ``sys._current_frames`` mid-loop sits at the
  same instruction each time it is made to drop the GIL, so "its frame moved" does not tell
  either). What is sound is a bound: a holder runs on a core, so over each wait the worker
  can have held the GIL at most as long as its CPU clock ran (likewise the main thread).
  The bounds over-count a thread that ran native code with the GIL released meanwhile, and
  miss a holder blocked in a system call with the GIL kept.

Cost: the probe thread wakes about once per ``GIL_PROBE_INTERVAL_S`` in rearranging and
steady steps alike and takes the GIL each time for microseconds; a wake-up that finds the
GIL held waits up to the switch interval and then makes the holder drop it, so the probe
adds GIL hand-offs of its own. The wrappers add a few ``perf_counter_ns`` calls per step. Runs compared against each other should all carry
the probes, or say that they do not.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from eplb_graph.upstream import patches

GIL_PROBE_INTERVAL_S = 1e-3  # a few wake-ups per decode step; each costs microseconds of GIL


def monotonic_ns() -> int:
    """CLOCK_MONOTONIC: the one clock the rank processes on a host share."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class PhaseClock:
    """Nanoseconds per named phase, accumulated by wrapped calls on one thread, taken per step."""

    def __init__(self) -> None:
        self._thread = threading.get_ident()  # the serving thread: the worker's calls are not ours to count
        self._ns: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if threading.get_ident() != self._thread:
                return fn(*args, **kwargs)
            start = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self._ns[name] += time.perf_counter_ns() - start

        return timed

    def mark(self, name: str, start_ns: int) -> None:
        """Adds perf_counter_ns() - start_ns to ``name`` (for a phase that no one call spans)."""
        if threading.get_ident() == self._thread:
            self._ns[name] += time.perf_counter_ns() - start_ns

    def take(self) -> dict[str, float]:
        """Milliseconds per phase since the last take; resets."""
        taken = {name: ns / 1e6 for name, ns in self._ns.items()}
        self._ns.clear()
        return taken


def thread_cpu_clock(thread: threading.Thread) -> int:
    """The CPU-time clock id of a running thread (Linux: readable from any thread of the process)."""
    if thread.ident is None or not thread.is_alive():
        raise ValueError(f"thread {thread.name!r} is not running")
    return time.pthread_getcpuclockid(thread.ident)


@dataclass(frozen=True)
class GilSample:
    woke_ns: int  # CLOCK_MONOTONIC, once the probe holds the GIL again
    gil_wait_ns: int  # how late the wake-up came, less its run-queue delay (the timer's own slack stays in)
    ran_ns: dict[str, int]  # each watched thread's CPU time from the probe's sleep to its wake-up

    def could_hold_ns(self, name: str) -> int:
        """Of this wait, at most how much the watched thread ``name`` can have held the GIL:
        a holder runs on a core, so it cannot have held it for longer than it ran."""
        return min(self.gil_wait_ns, self.ran_ns[name])


class GilProbe:
    """A daemon thread sampling GIL waits and what the watched threads ran meanwhile (module docstring)."""

    def __init__(self, watched: dict[str, threading.Thread], interval_s: float = GIL_PROBE_INTERVAL_S) -> None:
        if interval_s <= 0:
            raise ValueError(f"GIL probe interval must be > 0 s, got {interval_s}")
        self.interval_s = interval_s
        self._clocks = {name: thread_cpu_clock(thread) for name, thread in watched.items()}
        self.samples: list[GilSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eplb-gil-probe", daemon=True)

    def start(self) -> GilProbe:
        self._thread.start()
        return self

    def _cpu(self) -> dict[str, int]:
        return {name: time.clock_gettime_ns(clock) for name, clock in self._clocks.items()}

    def _run(self) -> None:
        schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY)  # this thread's: opened on it
        try:
            interval_ns = int(self.interval_s * 1e9)
            while not self._stop.is_set():
                run_delay, cpu, asked = _run_delay_ns(schedstat), self._cpu(), monotonic_ns()
                time.sleep(self.interval_s)  # releases the GIL; waking up retakes it
                woke = monotonic_ns()
                after, delay = self._cpu(), _run_delay_ns(schedstat)
                late = woke - asked - interval_ns - (delay - run_delay)
                self.samples.append(GilSample(woke, max(0, late), {name: after[name] - cpu[name] for name in cpu}))
        except OSError:
            return  # a watched thread ended (its CPU clock is gone): nothing more to sample
        finally:
            os.close(schedstat)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)

    def between(self, start_ns: int, end_ns: int) -> list[GilSample]:
        """The samples whose wake-up fell in [start_ns, end_ns) (CLOCK_MONOTONIC)."""
        return [s for s in self.samples[-4096:] if start_ns <= s.woke_ns < end_ns]  # a step is short: look back a little


def _run_delay_ns(fd: int) -> int:
    """Second field of schedstat: nanoseconds this thread waited runnable on a run queue."""
    return int(os.pread(fd, 128, 0).split()[1])


# EplbState's methods the probes time, by phase: the step, its ready all-reduce, and the
# rearrangement it starts (its load all-reduce, the worker's kick-off); the adaptation of each
_STATE_METHODS = {"step": ("upstream_step", "probes.state_step"),
                  "_all_ranks_result_ready": ("upstream_ready_sync", "probes.state_ready_sync"),
                  "rearrange": ("upstream_rearrange", "probes.state_rearrange")}


class StepProbes:
    """The probes of one rank's steps, on its controller; ``begin_step`` / ``end_step`` per step.
    Installed over the capability adaptations (``adaptations.py``: ``probes.*``), taken back by ``close``
    before the adapter is."""

    def __init__(self, controller, interval_s: float = GIL_PROBE_INTERVAL_S) -> None:
        state = controller.state
        worker = getattr(state, "async_worker", None)
        if not isinstance(worker, threading.Thread):
            raise ValueError("step probes need upstream's async worker running (EplbState.async_worker)")
        self.clock = PhaseClock()
        self._state, self._capabilities = state, controller.binding.capabilities
        self._upstream_commit_hook = self._capabilities.commit_hook
        self._installed: list[tuple[str, object | None]] = []  # (key, instance or None), in order
        try:
            self._install(state, main=threading.get_ident())
        except BaseException:
            self._take_back()
            raise
        self._worker_clock = thread_cpu_clock(worker)
        self.gil = GilProbe({"worker": worker, "main": threading.current_thread()}, interval_s).start()
        self._start: tuple[int, int] = (0, 0)

    def _wrap(self, key: str, replacement, on: object | None = None) -> None:
        patches.install(key, replacement, by=self, on=on)
        self._installed.append((key, on))

    def _install(self, state, main: int) -> None:
        """Instance wrappers shadow EplbState's methods (the controller and step() look them up on
        the instance); the module functions upstream's step calls are wrapped where they live."""
        self._sync_entry_ns: int | None = None
        for name, (phase, key) in _STATE_METHODS.items():
            timed = self.clock.wrap(phase, getattr(state, name))
            if name == "_all_ranks_result_ready":
                timed = self._noting_sync_entry(timed, main)
            self._wrap(key, timed, on=state)
        hook = self.clock.wrap("ours_commit_hook", self._upstream_commit_hook)
        self._hook_end: int | None = None

        def commit_hook(model_state, layer_index):
            hook(model_state, layer_index)
            self._hook_end = time.perf_counter_ns()  # what follows until _move_to_workspace returns: the ack

        upstream_move = patches.current("probes.move_to_workspace")

        def move_to_workspace(*args, **kwargs):
            self._hook_end = None
            upstream_move(*args, **kwargs)
            if self._hook_end is not None:
                self.clock.mark("ours_ack", self._hook_end)

        self._capabilities.commit_hook = commit_hook  # our own adaptations' hook, not upstream's
        self._wrap("probes.logical_maps", self.clock.wrap("ours_inversion", patches.current("probes.logical_maps")))
        self._wrap("probes.move_to_workspace", move_to_workspace)
        self._wrap("probes.move_from_buffer", self.clock.wrap("upstream_install", patches.current("probes.move_from_buffer")))
        # the capability adaptations' commit wrapper: upstream's map commit, then our hook inside it
        self._wrap("probes.commit_layer", self.clock.wrap("commit_layer", patches.current("probes.commit_layer")))

    def _noting_sync_entry(self, timed_ready, main: int):
        def all_ranks_result_ready(model_state):
            if self._sync_entry_ns is None and threading.get_ident() == main:
                self._sync_entry_ns = monotonic_ns()  # this rank at upstream's ready all-reduce
            return timed_ready(model_state)

        return all_ranks_result_ready

    def begin_step(self) -> None:
        self.clock.take()  # what ran between steps is no step's
        self._sync_entry_ns = None
        self._start = (time.clock_gettime_ns(self._worker_clock), monotonic_ns())

    def end_step(self, step: int, seconds: float, eplb_host_s: float) -> dict:
        """This step's record; ``seconds`` and ``eplb_host_s``: its ``TimedStep``'s."""
        end = monotonic_ns()
        worker_cpu = time.clock_gettime_ns(self._worker_clock) - self._start[0]
        phases = self.clock.take()
        in_step = phases.get("upstream_step", 0.0)
        ours_inside = sum(phases.get(name, 0.0) for name in ("ours_commit_hook", "ours_inversion", "ours_ack"))
        samples = self.gil.between(self._start[1], end)
        return {
            "step": step,
            "ready_ns": self._start[1],
            "ready_sync_entry_ns": self._sync_entry_ns,  # None: no ready all-reduce in this step
            "step_ms": seconds * 1e3,
            "eplb_ours_ms": eplb_host_s * 1e3 - in_step + ours_inside,
            "eplb_upstream_ms": in_step - ours_inside,
            "upstream_ready_sync_ms": phases.get("upstream_ready_sync", 0.0),
            "upstream_install_ms": phases.get("upstream_install", 0.0),
            "upstream_rearrange_ms": phases.get("upstream_rearrange", 0.0),
            "upstream_commit_ms": phases.get("commit_layer", 0.0) - phases.get("ours_commit_hook", 0.0)
            - phases.get("ours_inversion", 0.0),
            "worker_cpu_ms": worker_cpu / 1e6,
            "gil_wait_ms": sum(s.gil_wait_ns for s in samples) / 1e6,
            "gil_wait_worker_bound_ms": sum(s.could_hold_ns("worker") for s in samples) / 1e6,
            "gil_wait_main_bound_ms": sum(s.could_hold_ns("main") for s in samples) / 1e6,
            "gil_samples": len(samples),
        }

    def close(self) -> None:
        """Stops the probe thread and takes the wrappers out (before the controller closes)."""
        self.gil.stop()
        self._take_back()

    def _take_back(self) -> None:
        for key, on in reversed(self._installed):
            patches.uninstall(key, on=on)
        self._installed.clear()
        self._capabilities.commit_hook = self._upstream_commit_hook
