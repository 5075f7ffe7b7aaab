"""``runtime/elastic/processes.py``: the coordinator's children as processes."""

import signal

import pytest

from eplb_reference.runtime.config import RunConfig
from eplb_reference.elastic.processes import MemberProcesses
from eplb_reference.elastic.spec import ElasticSpec
from eplb_reference.runtime.process_start import start_fork_server


def exit_at_once() -> None:
    pass


@pytest.mark.launches  # one child that exits at once
def test_a_member_that_exited_and_was_reaped_takes_no_signal_and_is_seen_exited():
    processes = MemberProcesses(ElasticSpec(RunConfig(ranks=2), 4, "127.0.0.1", 0))
    start_fork_server(processes.ctx)
    child = processes.ctx.Process(target=exit_at_once)
    child.start()
    child.join(60)
    processes.children[3] = child  # as ``start`` keeps a member; its process is gone (the fork server reaped it)
    processes.signal(3, signal.SIGSTOP)  # a fault injected into a member that just died: no error
    assert processes.exited(3) and processes.exit_code(3) == 0
    with pytest.raises(KeyError):  # a member this host never had
        processes.signal(9, signal.SIGSTOP)
