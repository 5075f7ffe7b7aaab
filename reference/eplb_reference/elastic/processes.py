"""Member processes: the ones the coordinator starts, and the ones that offer themselves from outside.

Every member, wherever it runs, reports through the run's store (``Board.report``): its
``MemberResult``, ``abandoned_join`` where it left without serving, or ``error`` with its
traceback. The coordinator's own children are also watched as processes (an exit with no
report is a death) and can be killed; a member started elsewhere (``eplb-graph join``) is
known only by its keep-alive, and a fence reaches it through the store: the coordinator never
signals a process it did not start, whatever pid a member's offer names.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict
from multiprocessing.process import BaseProcess

import torch

from eplb_reference.elastic.member_faults import install_member_faults
from eplb_reference.elastic.protocol import Board, RunSecret
from eplb_reference.elastic.spec import ElasticSpec
from eplb_reference.runtime.process_start import LauncherState, process_context, start_fork_server

log = logging.getLogger("eplb_graph.elastic.processes")


def member_main(member: int, spec: ElasticSpec, first_generation: int | None, board: Board, *,
                offer: bool = False) -> int:
    """A member's whole life in this process; returns the exit code (0: reported, 1: failed).
    ``board``: its client of the run's store, with the run's secret. ``offer``: a spare started
    from outside the coordinator's process tree (``join.py``)."""
    from eplb_reference.elastic.eplb import elastic_eplb_session
    from eplb_reference.elastic.member_process import Leaving
    from eplb_reference.elastic.scripted_member import ScriptedMember
    from eplb_reference.elastic.serving import ServingMember

    faulthandler.enable(all_threads=True)  # a crash in native code prints every thread's Python stack
    if spec.chaos:
        install_member_faults()
    torch.set_num_threads(1)
    try:
        with torch.no_grad(), elastic_eplb_session(spec.cfg, spec.group_name, spec.max_ranks):
            kind = ServingMember if spec.serve is not None else ScriptedMember
            report = asdict(kind(member, spec, first_generation, board, offer=offer).run())
    except Leaving as leaving:
        report = {"member": member, "abandoned_join": str(leaving)}
    except BaseException as error:  # reported to the coordinator, then the process exits nonzero
        board.report(member, {"member": member, "error": f"{type(error).__name__}: {error}\n{traceback.format_exc()}"})
        return 1
    board.report(member, report)
    return 0


def _child(member: int, spec: ElasticSpec, first_generation: int | None, launcher: LauncherState,
           secret: RunSecret) -> None:
    launcher.apply()
    # Ctrl-C reaches the whole process group; the coordinator answers it and stops every member
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = member_main(member, spec, first_generation, spec.connect(secret))
    # the interpreter's exit handlers (multiprocessing's unregister this process's semaphores), then
    # out: not the teardown of native threads a group given up may still block in (it aborts the
    # process), nor the last collection over torch's and vLLM's objects
    atexit._run_exitfuncs()  # logging's shutdown is one of them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class MemberProcesses:
    """The coordinator's children, by member id."""

    def __init__(self, spec: ElasticSpec, secret: RunSecret) -> None:
        self.spec, self.secret = spec, secret  # the secret reaches a child through its arguments (a pipe)
        self.ctx = process_context()
        self.children: dict[int, BaseProcess] = {}
        # members that offered themselves from outside: never signalled (the pid an offer names is
        # only its word, and could be any process), fenced through the store alone
        self.outside: set[int] = set()

    def adopt(self, member: int) -> None:
        """A member that offered itself from outside (``eplb-graph join``)."""
        self.outside.add(member)

    def start(self, member: int, first_generation: int | None) -> None:
        if not self.children:  # before the first member: the fork server's imports, once, bounded
            start_fork_server(self.ctx)
        process = self.ctx.Process(target=_child, args=(member, self.spec, first_generation, LauncherState(),
                                                        self.secret),
                                   daemon=True, name=f"eplb-graph-member-{member}")
        process.start()
        self.children[member] = process

    def exited(self, member: int) -> bool:
        """A child of ours that is gone (an outside member never is: its keep-alive tells)."""
        process = self.children.get(member)
        return process is not None and not process.is_alive()

    def exit_code(self, member: int) -> int | None:
        process = self.children.get(member)
        return None if process is None else process.exitcode

    def kill(self, member: int) -> bool:
        """SIGKILL one of our children (a stopped one too); False for any other member, which its
        fence in the store makes exit at its next beat (``liveness.py``)."""
        process = self.children.get(member)
        if process is None:
            return False
        if process.is_alive():
            process.kill()
        return True

    def signal(self, member: int, signum: int) -> bool:
        """A signal to one of our children; False for any other member (never signalled). A child
        that has exited (and was reaped) takes none: its death is detected as any other."""
        process = self.children.get(member)
        if process is None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signum)
        return True

    def stop_all(self, grace_s: float) -> None:
        """Every child that has not exited by ``grace_s`` (in all) is killed."""
        deadline = time.monotonic() + grace_s
        for process in self.children.values():
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.children.values():
            if process.is_alive():
                process.kill()
            process.join(5)
