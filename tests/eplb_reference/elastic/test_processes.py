"""``elastic/processes.py``: the coordinator's children as processes, and nothing else."""

import signal
import subprocess
import sys

import pytest

from eplb_reference.runtime.config import RunConfig
from eplb_reference.elastic.processes import MemberProcesses
from eplb_reference.elastic.protocol import RunSecret
from eplb_reference.elastic.spec import ElasticSpec
from eplb_reference.runtime.process_start import start_fork_server


def exit_at_once() -> None:
    pass


@pytest.mark.launches  # one child that exits at once
def test_a_member_that_exited_and_was_reaped_takes_no_signal_and_is_seen_exited():
    processes = MemberProcesses(ElasticSpec(RunConfig(ranks=2), 4, "127.0.0.1", 0), RunSecret.generate())
    start_fork_server(processes.ctx)
    child = processes.ctx.Process(target=exit_at_once)
    child.start()
    child.join(60)
    processes.children[3] = child  # as ``start`` keeps a member; its process is gone (the fork server reaped it)
    processes.signal(3, signal.SIGSTOP)  # a fault injected into a member that just died: no error
    assert processes.exited(3) and processes.exit_code(3) == 0
    assert processes.signal(9, signal.SIGSTOP) is False  # a member this host never had


def test_a_member_offered_from_outside_is_never_signalled_whatever_pid_it_names():
    """An offer names a pid (a sleeper this test owns, standing for any process on the host): the
    coordinator adopts the member, and neither kills nor signals that process."""
    processes = MemberProcesses(ElasticSpec(RunConfig(ranks=2), 4, "127.0.0.1", 0), RunSecret.generate())
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        processes.adopt(5)
        assert processes.kill(5) is False and processes.signal(5, signal.SIGKILL) is False
        assert sleeper.poll() is None and 5 in processes.outside and not processes.exited(5)
    finally:
        sleeper.kill()
        sleeper.wait(30)
