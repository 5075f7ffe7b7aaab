"""A private Ray head for tests and benchmarks: vLLM's Ray DP backend (``--data-parallel-backend
ray``) needs a Ray cluster, and a test must neither join nor stop anyone else's.

``PrivateRayHead`` runs ``ray start --head --block`` with its own short temp dir, every port
chosen free on 127.0.0.1, a custom resource vLLM's CPU placement can key on, a small object
store, no dashboard, no usage stats and no prestarted workers. ``--block`` keeps every Ray
process a descendant of the one started here, so on exit it stops exactly that process tree
(SIGTERM, a bounded wait, SIGKILL for stragglers) and never runs ``ray stop``, which stops every
Ray cluster of the machine's user. Clients connect with ``client_env`` (``RAY_ADDRESS`` and the
loopback switch below) in a process of their own, so that Ray stays out of the pytest process.

Ray resolves ``--node-ip-address=127.0.0.1`` to the machine's routable address
(``services.resolve_ip_for_localhost``), registers the node under that address and binds the GCS
on every interface. ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is Ray's switch for single-node
clusters (the default on macOS and Windows): the node IP then stays 127.0.0.1, every server
binds to it, and the node carries the ``node:127.0.0.1`` resource that vLLM's placement looks
up for ``--data-parallel-address 127.0.0.1``. The one thing it refuses is a second node joining,
which a private head never wants. Every client needs it too (``client_env``): without it
``ray.init`` rewrites the 127.0.0.1 of ``RAY_ADDRESS`` to the routable address, where nothing
listens, and retries the GCS there for good.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

DEFAULT_RESOURCES = {"eplb_graph_dp": 4}
READY_LINE = "Ray runtime started."
# Every process of a head's tree inherits this variable (value: the head's temp dir), so a
# process that left the tree, or renamed itself (Ray's workers and agents become ``ray::...``),
# is still found as this head's.
MARKER = "EPLB_GRAPH_PRIVATE_RAY_HEAD"
PR_SET_PDEATHSIG = 1  # prctl(2)
# Ray's settings for a small, quiet head: no idle workers started ahead of use (about num_cpus
# Python processes otherwise), no memory monitor killing workers, no usage report.
HEAD_ENV = {"RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0",
            "RAY_memory_monitor_refresh_ms": "0", "RAY_USAGE_STATS_ENABLED": "0"}
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # node IP 127.0.0.1, kept (see above)


def free_ports(count: int) -> list[int]:
    """Distinct free ports, held together while chosen: two chosen one after the other can be the
    same port, when nothing has bound the first yet."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started the head dies, so a
    killed test run does not leave a head behind (``ray start --block`` then stops its tree).
    The signal comes when the *thread* that started the head ends: start it from the thread
    that will stop it (a test's or a fixture's)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def alive(proc: psutil.Process) -> bool:
    """Running and not a zombie: a zombie has exited, only its parent has not reaped it yet."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until none of ``procs`` runs or ``timeout_s`` passed; the ones still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        still = [proc for proc in procs if alive(proc)]
        if not still or time.monotonic() >= deadline:
            return still
        time.sleep(0.05)


def _signal(procs: list[psutil.Process], signum: int) -> None:
    for proc in procs:
        try:  # psutil checks the process is still the one snapshotted (pid reuse)
            proc.send_signal(signum)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as error:
        return f"({error})"


class PrivateRayHead:
    """``with PrivateRayHead() as head:`` a Ray head on 127.0.0.1 at ``head.address``, stopped
    with its whole process tree and its temp dir on exit.

    ``resources``: the custom resources the node advertises (name -> count), ``num_cpus`` its
    logical CPUs, ``object_store_bytes`` the object store (Ray reserves 30% of RAM without it).
    """

    def __init__(self, *, resources: dict[str, float] | None = None, num_cpus: int = 4,
                 object_store_bytes: int = 256 * 2**20, start_timeout_s: float = 120.0,
                 stop_timeout_s: float = 20.0, env: dict[str, str] | None = None) -> None:
        self.extra_env = dict(env or {})  # for every process of the head's tree (Ray's workers included)
        self.resources = dict(DEFAULT_RESOURCES if resources is None else resources)
        self.num_cpus = num_cpus
        self.object_store_bytes = object_store_bytes
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.temp_dir: Path | None = None
        self.ports: dict[str, int] = {}
        self.start_s = self.stop_s = float("nan")
        self.escaped: list[str] = []  # processes of this head found outside its tree at stop
        self._proc: subprocess.Popen | None = None
        self._log: Path | None = None

    @property
    def address(self) -> str:
        """The GCS address clients pass as ``RAY_ADDRESS`` / ``ray.init(address=...)``."""
        return f"127.0.0.1:{self.ports['gcs']}"

    @property
    def client_env(self) -> dict[str, str]:
        """What a client process (a driver: a test's script, vLLM's API server) adds to its
        environment to join this head on 127.0.0.1 and nothing else."""
        return {"RAY_ADDRESS": self.address, **LOOPBACK_ENV}

    @property
    def pid(self) -> int:
        return self._proc.pid

    def processes(self) -> list[psutil.Process]:
        """The head's process tree now: the ``ray start`` process and its descendants."""
        try:
            root = psutil.Process(self._proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def command(self) -> list[str]:
        ports = self.ports
        return [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                "--node-ip-address=127.0.0.1", f"--port={ports['gcs']}",
                f"--num-cpus={self.num_cpus}", f"--resources={json.dumps(self.resources)}",
                f"--object-store-memory={self.object_store_bytes}", f"--temp-dir={self.temp_dir}",
                "--include-dashboard=false", "--disable-usage-stats",
                f"--dashboard-port={ports['dashboard']}",
                f"--ray-client-server-port={ports['client_server']}",
                f"--node-manager-port={ports['node_manager']}",
                f"--object-manager-port={ports['object_manager']}",
                f"--dashboard-agent-listen-port={ports['dashboard_agent_http']}",
                f"--dashboard-agent-grpc-port={ports['dashboard_agent_grpc']}",
                f"--runtime-env-agent-port={ports['runtime_env_agent']}",
                f"--metrics-export-port={ports['metrics_export']}",
                # 0 and 0: each worker (and each driver) binds a port the kernel picks, on the
                # node IP, instead of one from a fixed range that another program may hold
                "--min-worker-port=0", "--max-worker-port=0"]

    def __enter__(self) -> PrivateRayHead:
        names = ("gcs", "dashboard", "client_server", "node_manager", "object_manager",
                 "dashboard_agent_http", "dashboard_agent_grpc", "runtime_env_agent",
                 "metrics_export", "autoscaler_metrics", "dashboard_metrics")
        self.ports = dict(zip(names, free_ports(len(names))))
        # Short: Ray's unix sockets live under it (session_<date>_<pid>/sockets/...) and a unix
        # socket path may not exceed 107 bytes; /tmp rather than $TMPDIR, which may be long
        self.temp_dir = Path(tempfile.mkdtemp(prefix="egr", dir="/tmp"))
        self._log = self.temp_dir / "ray_start.log"
        env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
        env.update(HEAD_ENV, **LOOPBACK_ENV, **self.extra_env, **{MARKER: str(self.temp_dir)})
        # The autoscaler's and the dashboard's metrics servers take fixed ports (44217, 44227)
        # unless told otherwise: two heads on one machine would collide there
        env.update(AUTOSCALER_METRIC_PORT=str(self.ports["autoscaler_metrics"]),
                   DASHBOARD_METRIC_PORT=str(self.ports["dashboard_metrics"]))
        started = time.monotonic()
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(self.command(), env=env, stdin=subprocess.DEVNULL,
                                          stdout=log, stderr=subprocess.STDOUT, cwd=self.temp_dir,
                                          start_new_session=True, preexec_fn=_die_with_parent)
        try:
            self._wait_ready()
        except BaseException:
            self.stop(check=False)
            raise
        self.start_s = time.monotonic() - started
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop(check=exc_info[0] is None)

    def _answers(self) -> bool:
        for name in ("gcs", "node_manager"):
            try:
                socket.create_connection(("127.0.0.1", self.ports[name]), timeout=1).close()
            except OSError:
                return False
        return True

    def _wait_ready(self) -> None:
        """Until ``ray start`` says the runtime started and the GCS and the raylet accept
        connections; a clear error with the tail of Ray's logs if the head exits or does not
        answer within ``start_timeout_s``."""
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the Ray head exited with {self._proc.returncode} before it "
                                   f"answered\n{self._logs_tail()}")
            if READY_LINE in self._log.read_text(errors="replace") and self._answers():
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the Ray head did not answer on {self.address} within "
                                   f"{self.start_timeout_s:.0f} s\n{self._logs_tail()}")
            time.sleep(0.2)

    def _logs_tail(self, lines: int = 30) -> str:
        parts = [f"--- {self._log} (last {lines} lines)\n{_tail(self._log, lines)}"]
        logs = self.temp_dir / "session_latest" / "logs"
        for name in ("gcs_server.out", "raylet.out", "raylet.err"):
            if (logs / name).exists():
                parts.append(f"--- {logs / name} (last {lines} lines)\n{_tail(logs / name, lines)}")
        return "\n".join(parts)

    def _marked(self) -> list[psutil.Process]:
        """Every process, in or out of the tree, whose command line names this head's temp dir
        or whose environment carries its marker."""
        found = []
        for proc in psutil.process_iter(["cmdline", "environ"], ad_value=None):
            if proc.pid == os.getpid() or not alive(proc):
                continue
            cmdline, environ = proc.info["cmdline"] or [], proc.info["environ"] or {}
            if (any(str(self.temp_dir) in part for part in cmdline)
                    or environ.get(MARKER) == str(self.temp_dir)):
                found.append(proc)
        return found

    def stop(self, *, check: bool = True) -> None:
        """Stop this head's processes only, then remove its temp dir. The tree is snapshotted,
        sent SIGTERM, waited for (``stop_timeout_s``), and what still runs gets SIGKILL; then
        any process still carrying the head's marker (started after the snapshot, or moved out
        of the tree) is stopped the same way and recorded in ``escaped``. ``check``: raise if a
        process of the head survives all of it."""
        if self._proc is None:
            return
        started = time.monotonic()
        tree = self.processes()
        _signal(tree, signal.SIGTERM)
        stragglers = _wait_gone(tree, self.stop_timeout_s)
        _signal(stragglers, signal.SIGKILL)
        _wait_gone(stragglers, 5.0)
        try:
            self._proc.wait(timeout=5.0)  # reap the root
        except subprocess.TimeoutExpired:
            pass
        stray = self._marked()
        self.escaped = [f"{proc.pid} {' '.join(proc.info['cmdline'] or [])}" for proc in stray]
        _signal(stray, signal.SIGTERM)
        _signal(_wait_gone(stray, 5.0), signal.SIGKILL)
        survivors = _wait_gone(stray, 5.0)
        self.stop_s = time.monotonic() - started
        self._proc = None
        if not survivors:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        if check:
            assert not survivors, (f"processes of the Ray head in {self.temp_dir} survived "
                                   f"SIGKILL: {[proc.pid for proc in survivors]}")
