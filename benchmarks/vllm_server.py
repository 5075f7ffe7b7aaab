"""vLLM's OpenAI server for the benchmarks that drive it as a client: started on 127.0.0.1 in its
own process group and stopped with it, its readiness, its endpoints, its ``/metrics`` read back.

``served`` starts ``python -m vllm.entrypoints.openai.api_server`` with the arguments given and
stops the group it started (the engine cores with it), whatever the body raised. ``scrape``
parses ``/metrics`` with prometheus_client; ``sample``, ``per_rank`` and ``counted_since`` read
the plugin's series out of it (``eplb_graph/vllm_plugin/metrics.py`` names them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# No compile caches: each run compiles as a fresh server does (a cache hit would skip the pass and the recompiles measured)
NO_CACHES = {"VLLM_DISABLE_COMPILE_CACHE": "1", "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
SERVER = "vllm.entrypoints.openai.api_server"


@contextmanager
def served(args: list[str], env: dict[str, str], log: Path, port: int, ready_timeout_s: float = 600) -> Iterator[
        subprocess.Popen]:
    """The server with ``args`` on 127.0.0.1:``port`` (vLLM's default host is every interface),
    its output in ``log``, ready; stopped (its whole process group) on the way out."""
    argv = [sys.executable, "-m", SERVER, "--host", "127.0.0.1", "--port", str(port), *args]
    with log.open("w") as out:
        process = subprocess.Popen(argv, env={**os.environ, **NO_CACHES, **env}, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            wait_ready(process, port, log, ready_timeout_s)
            yield process
        finally:
            os.killpg(process.pid, 15)
            try:
                process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)  # the group this run started
                process.wait()


def wait_ready(process: subprocess.Popen, port: int, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)  # polling the health endpoint
    raise SystemExit(f"server not ready in {timeout_s} s")


def post(port: int, path: str, body: dict, timeout: float) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def complete(port: int, model: str, prompt: list[int], max_tokens: int, timeout: float = 600) -> dict:
    """One greedy completion of token ids ``prompt``, ``max_tokens`` long whatever it generates."""
    status, answer = post(port, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                    "temperature": 0, "ignore_eos": True}, timeout)
    if status != 200:
        raise SystemExit(f"completion answered {status}: {answer[:500]}")
    return json.loads(answer)


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
        return parse_metrics(response.read().decode())


def parse_metrics(text: str) -> dict[str, list]:
    """Family name -> its samples, from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def per_rank(families: dict, family: str) -> dict[str, float]:
    """``ep_rank`` -> a counter's value."""
    return {s.labels["ep_rank"]: s.value for s in families.get(family, []) if s.name.endswith("_total")}


def counted_since(before: dict, after: dict, family: str) -> float:
    """What a counter grew by over every rank there after (a rank the resize added counts from 0)."""
    was, now = per_rank(before, family), per_rank(after, family)
    return sum(value - was.get(rank, 0.0) for rank, value in now.items())


def sample(families: dict, family: str, **labels: str) -> float | None:
    """The family's sample (a counter's ``_total``) with ``labels``; None if it has none yet."""
    for each in families.get(family, []):
        if not each.name.endswith(("_created", "_bucket", "_count", "_sum")) \
                and all(each.labels.get(k) == v for k, v in labels.items()):
            return each.value
    return None
