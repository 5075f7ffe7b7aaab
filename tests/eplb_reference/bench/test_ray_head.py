"""The private Ray head (ray_head.py) that vLLM's Ray DP backend runs on in these tests: a client
process joins it at ``head.address``, sees the caller's custom resource and the node as
127.0.0.1, and runs a task; every socket the head's processes (and the client) listen on is on
127.0.0.1; on exit no process of its tree runs and its temp dir is gone. Ray stays out of the
pytest process: the client is a process of its own. What Ray imports in the client and in its
worker is pinned in requirements/cpu.txt (make installs it with --no-deps)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from eplb_reference.bench.ray_head import PrivateRayHead, alive

pytestmark = pytest.mark.launches  # a Ray head: left out by make test-fast

REPO_ROOT = Path(__file__).parents[3]
RESOURCES = {"eplb_graph_test": 3}
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1"}
RESULT_TIMEOUT_S, EXIT_TIMEOUT_S = 60, 30

# The client: joins through RAY_ADDRESS, runs a task, writes what it saw to argv[1], then stays
# connected until its stdin closes (the test inspects the head meanwhile; if the test dies, the
# pipe closes and so does the client).
CLIENT = r"""
import importlib.metadata, json, os, sys
import ray

def distributions():
    # the distributions of the top-level modules imported, Ray's own and its vendored ones aside
    owners, ray_dir = importlib.metadata.packages_distributions(), os.path.dirname(ray.__file__)
    found = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if "." not in name and path and not path.startswith(ray_dir):
            found.update(owners.get(name, ()))
    return sorted(found)

ray.init()
worker = ray.get(ray.remote(lambda: {"sum": 1 + 1, "distributions": distributions()}).remote(), timeout=60)
result = {"resources": ray.cluster_resources(), "worker": worker, "driver": distributions()}
with open(sys.argv[1] + ".part", "w") as out:
    json.dump(result, out)
os.rename(sys.argv[1] + ".part", sys.argv[1])
sys.stdin.read()
ray.shutdown()
"""


def pinned() -> set[str]:
    lines = (REPO_ROOT / "requirements" / "cpu.txt").read_text().splitlines()
    return {canonical(line.split("==")[0]) for line in lines if "==" in line and not line.startswith("#")}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def listening(procs: list[psutil.Process]) -> list[tuple[int, str, str, int]]:
    """(pid, name, ip, port) of each TCP socket in LISTEN of these processes."""
    found = []
    for proc in procs:
        try:
            found += [(proc.pid, proc.name(), conn.laddr.ip, conn.laddr.port)
                      for conn in proc.net_connections(kind="inet") if conn.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:  # a worker that exited meanwhile
            pass
    return found


def wait_result(client: subprocess.Popen, path: Path, log: Path) -> dict:
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while not path.exists():
        assert client.poll() is None, f"the client exited with {client.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no result from the client in {RESULT_TIMEOUT_S} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)
    return json.loads(path.read_text())


def rss_mib(procs: list[psutil.Process]) -> float:
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def test_a_private_ray_head_serves_a_client_on_loopback_and_leaves_nothing(tmp_path):
    result_path, log = tmp_path / "result.json", tmp_path / "client.log"
    with PrivateRayHead(resources=RESOURCES, num_cpus=2, start_timeout_s=60) as head:
        temp_dir = head.temp_dir
        env = {**os.environ, **head.client_env}
        with open(log, "wb") as out:
            client = subprocess.Popen([sys.executable, "-c", CLIENT, str(result_path)], env=env,
                                      stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT)
        try:
            result = wait_result(client, result_path, log)
            tree = head.processes()  # with the client connected: its workers included
            sockets = listening(tree)
            client_sockets = listening([psutil.Process(client.pid)])
            print(f"Ray head: started in {head.start_s:.1f} s, {len(tree)} processes, "
                  f"RSS {rss_mib(tree):.0f} MiB with a client connected")
        finally:
            client.stdin.close()  # the client disconnects and exits
            try:
                client.wait(timeout=EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                client.kill()  # a Ray driver can ignore SIGTERM while it retries the GCS
                client.wait()
        assert client.returncode == 0, log.read_text()[-3000:]
    print(f"Ray head: stopped in {head.stop_s:.1f} s")

    resources = result["resources"]
    assert resources["eplb_graph_test"] == 3 and resources["CPU"] == 2
    # the node is 127.0.0.1: what vLLM's placement looks up for --data-parallel-address 127.0.0.1
    assert resources.get("node:127.0.0.1") == 1, resources
    assert result["worker"]["sum"] == 2

    # every listening socket on 127.0.0.1: the GCS, the raylet, the agents, the workers, the client
    assert ("gcs_server" in {name for _, name, _, _ in sockets}
            and head.ports["gcs"] in {port for *_, port in sockets}), sockets
    assert {ip for _, _, ip, _ in sockets + client_sockets} <= LOOPBACK, sockets + client_sockets

    # what Ray imported in the driver and in its worker is in the pinned stack
    imported = {canonical(name) for name in result["driver"] + result["worker"]["distributions"]}
    assert "msgpack" in imported and imported <= pinned(), sorted(imported - pinned())
    assert "ray" in pinned()

    # stopped: no process of the tree, none found outside it, the temp dir removed
    assert [proc.pid for proc in tree if alive(proc)] == []
    assert head.escaped == []
    assert not temp_dir.exists()
    assert not [proc.pid for proc in psutil.process_iter(["cmdline"], ad_value=None)
                if str(temp_dir) in " ".join(proc.info["cmdline"] or [])]
