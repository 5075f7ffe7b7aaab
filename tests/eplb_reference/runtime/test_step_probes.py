"""The step probes: the phase clock, the worker's CPU clock, the GIL probe, StepProbes on a stand-in controller."""

import threading
import time
from types import SimpleNamespace

import pytest

from eplb_reference.runtime.step_probes import GilProbe, PhaseClock, StepProbes, monotonic_ns, thread_cpu_clock
from eplb_graph.upstream import patches


def spin(seconds: float) -> None:
    """Python bytecode for at least ``seconds`` of wall time (holds the GIL but at switches)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Worker:
    """A thread that spins in Python or sleeps until stopped."""

    def __init__(self, busy: bool) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(busy,), daemon=True)
        self.thread.start()

    def _run(self, busy: bool) -> None:
        while not self.stop.is_set():
            spin(0.01) if busy else self.stop.wait(1.0)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


@pytest.mark.alone  # another process on the cores stretches the spins and the GIL waits
def test_the_phase_clock_counts_its_own_threads_calls_only_and_resets_when_taken():
    clock = PhaseClock()
    timed = clock.wrap("work", lambda x: spin(x) or x)
    assert timed(0.002) == 0.002
    other = threading.Thread(target=timed, args=(0.002,))
    other.start()
    other.join()  # another thread's call is not this thread's phase
    start = time.perf_counter_ns()
    spin(0.001)
    clock.mark("tail", start)
    taken = clock.take()
    assert set(taken) == {"work", "tail"} and 2.0 <= taken["work"] < 4.0 - 0.001 + 2.0 and taken["tail"] >= 1.0
    assert clock.take() == {}


@pytest.mark.alone  # another process on the cores stretches the spins and the GIL waits
def test_the_cpu_clock_of_a_busy_thread_runs_and_a_sleeping_ones_does_not():
    busy, idle = Worker(busy=True), Worker(busy=False)
    try:
        clocks = [thread_cpu_clock(w.thread) for w in (busy, idle)]
        before = [time.clock_gettime_ns(c) for c in clocks]
        time.sleep(0.2)
        used = [time.clock_gettime_ns(c) - b for c, b in zip(clocks, before)]
        assert used[0] > 10 * max(used[1], 1_000)  # the sleeper took a few microseconds at most
    finally:
        busy.close(), idle.close()
    with pytest.raises(ValueError, match="not running"):
        thread_cpu_clock(threading.Thread(target=lambda: None))


@pytest.mark.alone  # another process on the cores stretches the spins and the GIL waits
def test_the_gil_probe_bounds_a_python_busy_threads_hold_and_a_sleeping_ones_by_nothing():
    busy, idle = Worker(busy=True), Worker(busy=False)
    probe = GilProbe({"busy": busy.thread, "idle": idle.thread}, interval_s=0.001).start()
    start = monotonic_ns()
    try:
        time.sleep(0.3)
    finally:
        probe.stop(), busy.close(), idle.close()
    samples = probe.between(start, monotonic_ns())
    assert len(samples) >= 10
    waited = sum(s.gil_wait_ns for s in samples)
    assert waited > 0  # the spinning thread kept the GIL from the probe's wake-ups
    # it ran while it held it, so it accounts for the waits; the sleeper ran for none of them
    assert sum(s.could_hold_ns("busy") for s in samples) >= 0.5 * waited
    assert sum(s.could_hold_ns("idle") for s in samples) <= 0.01 * waited


def test_the_gil_probe_refuses_a_non_positive_interval():
    with pytest.raises(ValueError, match="interval"):
        GilProbe({"main": threading.current_thread()}, interval_s=0)


def test_step_probes_split_the_eplb_host_work_into_ours_and_upstreams(monkeypatch):
    """Upstream's functions are stand-ins with its signatures; the capability adaptations' two
    layers the probes wrap are installed under them as the capability adaptations would (by another installer)."""
    from vllm.distributed.eplb import eplb_state

    worker = Worker(busy=False)
    capabilities = SimpleNamespace(commit_hook=lambda model_state, layer: spin(0.002))  # ours: commit + refresh

    def inversion(physical_to_logical_map, num_logical_experts):  # ours: the inversion
        spin(0.001)

    def move_to_workspace(model_state, ep_rank):  # upstream's: install, commit (which inverts), our hook, ack
        eplb_state.move_from_buffer()
        eplb_state._commit_eplb_maps_for_layer(model_state, None, 0)

    def commit_layer(model_state, new_physical_to_logical_map, layer):  # the capability adaptations': upstream's, then our hook
        spin(0.001)
        eplb_state.compute_logical_maps(None, 0)
        capabilities.commit_hook(model_state, layer)

    def install(expert_weights=None, expert_weights_buffers=None, transfer_metadata=None, new_indices=None,
                ep_rank=None):
        spin(0.002)

    monkeypatch.setattr(eplb_state, "_move_to_workspace", move_to_workspace)
    monkeypatch.setattr(eplb_state, "move_from_buffer", install)
    as_the_capabilities = object()
    patches.install("capability.logical_maps", inversion, by=as_the_capabilities)
    patches.install("capability.commit_layer", commit_layer, by=as_the_capabilities)

    class State:
        async_worker = worker.thread

        def _all_ranks_result_ready(self, model_state):
            spin(0.001)
            return True

        def rearrange(self, is_profile=False):
            spin(0.001)

        def step(self, is_dummy=False, is_profile=False, log_stats=False):
            if self._all_ranks_result_ready(None):
                eplb_state._move_to_workspace(model_state=None, ep_rank=0)
            self.rearrange()

    state = State()
    controller = SimpleNamespace(state=state, binding=SimpleNamespace(capabilities=capabilities))
    original_hook = capabilities.commit_hook
    try:
        probes = StepProbes(controller)
        try:
            probes.begin_step()
            start = time.perf_counter()
            spin(0.001)  # the controller's own work before upstream's step
            state.step()
            host = time.perf_counter() - start
            record = probes.end_step(7, seconds=host + 0.005, eplb_host_s=host)
            probes.begin_step()
            other = threading.Thread(target=state.step)  # the worker's calls are not the step's
            other.start()
            other.join()
            quiet = probes.end_step(8, seconds=0.001, eplb_host_s=0.0)
        finally:
            probes.close()
            worker.close()
        # closed: every wrapper taken out, the capability adaptations' layers left as they were
        assert not {"step", "_all_ranks_result_ready", "rearrange"} & set(vars(state))
        assert capabilities.commit_hook is original_hook and eplb_state._move_to_workspace is move_to_workspace
        assert eplb_state.move_from_buffer is install and eplb_state._commit_eplb_maps_for_layer is commit_layer
        assert eplb_state.compute_logical_maps is inversion
    finally:
        patches.uninstall("capability.commit_layer")
        patches.uninstall("capability.logical_maps")
    assert record["step"] == 7 and 0 < record["ready_ns"] < record["ready_sync_entry_ns"]
    assert quiet["ready_sync_entry_ns"] is None  # no ready all-reduce on the main thread in that step
    assert record["eplb_ours_ms"] + record["eplb_upstream_ms"] == pytest.approx(host * 1e3)
    assert record["eplb_ours_ms"] >= 2 + 1 + 1  # hook, inversion, the controller's own
    assert record["eplb_upstream_ms"] >= 2 + 1 + 1 + 1  # install, the rest of it, the ready all-reduce, rearrange
    assert record["upstream_ready_sync_ms"] >= 1 and record["upstream_install_ms"] >= 2
    assert record["upstream_rearrange_ms"] >= 1 and 1 <= record["upstream_commit_ms"] < record["eplb_upstream_ms"]
    assert record["worker_cpu_ms"] >= 0 and record["gil_samples"] >= 0
    assert record["gil_wait_worker_bound_ms"] < 0.05  # the sleeping worker can have held none of it
    assert quiet["eplb_upstream_ms"] == 0 and quiet["upstream_ready_sync_ms"] == 0


def test_step_probes_go_over_the_capability_adaptations_only():
    """Declared, not discovered: without the capability adaptations' inversion under it, nothing is installed."""
    from vllm.distributed.eplb import eplb_state

    worker = Worker(busy=False)

    class State:
        async_worker = worker.thread

        def _all_ranks_result_ready(self, model_state):
            return True

        def rearrange(self, is_profile=False):
            return None

        def step(self, is_dummy=False, is_profile=False, log_stats=False):
            return None

    state, upstream_inversion = State(), eplb_state.compute_logical_maps
    controller = SimpleNamespace(state=state, binding=SimpleNamespace(capabilities=SimpleNamespace(commit_hook=None)))
    try:
        with pytest.raises(patches.AdaptationError, match="carries upstream where probes.logical_maps expects "
                                                          "capability.logical_maps"):
            StepProbes(controller)
    finally:
        worker.close()
    assert not set(vars(state)) and eplb_state.compute_logical_maps is upstream_inversion  # nothing half-applied


def test_step_probes_need_a_running_async_worker():
    controller = SimpleNamespace(state=SimpleNamespace(async_worker=None), binding=None)
    with pytest.raises(ValueError, match="async worker"):
        StepProbes(controller)
