"""Engine runs (engine_run.py) forked from one process that has imported vLLM already.

Each run is still a process of its own, started from a clean vLLM that no engine has touched
(vLLM keeps global state), but it no longer imports torch and vLLM afresh: that import is paid
once per ``EngineServer``, not once per engine. The server imports modules only, before any
engine exists, so what an engine reads from its environment it reads in the run, as a spawned
process would; the exception is what torch reads at import (``TORCHINDUCTOR_*`` caches), fixed
for every run by the environment the server starts with.

Protocol (run as a script): one JSON request per line on stdin, ``{"name", "argv", "log",
"cwd"}``; the server forks, the child writes everything to ``log`` and runs engine_run.py as
its ``__main__`` with ``argv``; one JSON line ``{"name", "returncode"}`` on stdout when that child ends.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).parents[3]
ENGINE_RUN = Path(__file__).with_name("engine_run.py")
PR_SET_PDEATHSIG = 1  # prctl(2)


def serve() -> int:
    importlib.import_module("vllm.entrypoints.llm")  # the import each run saves
    importlib.import_module("tests.eplb_graph.vllm_plugin.engine_run")  # and what the script imports beside it

    children: dict[int, tuple[str, int]] = {}  # pidfd -> (name, pid)
    stdin, pending = sys.stdin.fileno(), b""
    while True:
        ready, _, _ = select.select([stdin, *children], [], [])
        for fd in ready:
            if fd != stdin:
                name, pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                print(json.dumps({"name": name, "returncode": os.waitstatus_to_exitcode(status)}), flush=True)
                continue
            chunk = os.read(stdin, 1 << 16)
            if not chunk:  # the client closed: end every run still going
                for _, pid in children.values():
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:  # killed before it made its own group
                        os.kill(pid, signal.SIGKILL)
                return 0
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:  # leaves through the interpreter's own exit, as a fresh process would
                    sys.exit(run_in_child(request))
                try:
                    os.setpgid(pid, pid)  # as the child does itself: whichever runs first
                except OSError:  # the child is already past it, or gone
                    pass
                children[os.pidfd_open(pid)] = (request["name"], pid)


def run_in_child(request: dict) -> int:
    """engine_run.py run as ``python engine_run.py ARGV`` would run it, in a forked child: its own
    process group (TP workers included, so a stuck run can be killed whole), writing to its log,
    ended if the server dies. It runs as ``__main__`` from its path, so the TP workers vLLM spawns
    import it again, as they import a fresh process's script."""
    os.setpgid(0, 0)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.chdir(request["cwd"])
    sys.argv = [str(ENGINE_RUN), *request["argv"]]
    try:
        runpy.run_path(str(ENGINE_RUN), run_name="__main__")
        code = 0
    except SystemExit as done:
        code = 0 if done.code is None else done.code if isinstance(done.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


class EngineServer:
    """The test side: ``run`` blocks until its engine has ended, so two threads run two engines."""

    def __init__(self, env: dict[str, str], workdir: Path) -> None:
        self.workdir = workdir
        self._log = (workdir / "engine_server.log").open("w")
        self.process = subprocess.Popen(
            [sys.executable, __file__], env=env, cwd=workdir, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True,
        )
        self._ended: dict[str, int] = {}
        self._changed = threading.Condition()
        self._server_gone = False  # its stdout ended: no run ends after that
        self._reader = threading.Thread(target=self._read, daemon=True, name="engine-server-reader")
        self._reader.start()

    def run(self, name: str, argv: list[str], timeout_s: float) -> tuple[int, str]:
        """One engine run: its return code and everything it wrote."""
        log = self.workdir / f"{name}.log"
        with self._changed:
            self.process.stdin.write(json.dumps({"name": name, "argv": argv, "log": str(log),
                                                 "cwd": str(self.workdir)}) + "\n")
            self.process.stdin.flush()
            if not self._changed.wait_for(lambda: name in self._ended or self._server_gone, timeout_s):
                self.process.stdin.close()  # the server kills every run still going
                raise TimeoutError(f"engine run {name} not done in {timeout_s:.0f} s:\n{log.read_text()[-6000:]}")
            if name not in self._ended:
                raise RuntimeError(f"the engine server exited ({self.process.wait()}) during {name}: "
                                   f"{(self.workdir / 'engine_server.log').read_text()[-3000:]}")
            return self._ended.pop(name), log.read_text()

    def _read(self) -> None:
        for line in self.process.stdout:
            ended = json.loads(line)
            with self._changed:
                self._ended[ended["name"]] = ended["returncode"]
                self._changed.notify_all()
        with self._changed:
            self._server_gone = True
            self._changed.notify_all()

    def close(self) -> None:
        if not self.process.stdin.closed:
            self.process.stdin.close()  # the server kills what still runs and exits
        self.process.wait(timeout=60)
        self._reader.join(timeout=60)
        self._log.close()


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    sys.exit(serve())
