"""vLLM's elastic EP through the plugin: the OpenAI server of docs/quickstart-hf.md's elastic
section, on a private Ray head, resized 2 -> 3 -> 2 through ``POST /scale_elastic_ep`` while a
client keeps sending requests. Every request is answered with the tokens a one-process EPLB-off
server gives, each with its log-probability within ``LOGPROB_TOLERANCE`` of that server's (the tiny
checkpoint's greedy text varies little; its log-probabilities show a wrong expert), a request
refused during the switch retried; EPLB moves experts to the new
engine (its bytes received on ``/metrics``) and keeps rearranging after each resize; no engine
compiles a model graph while serving, through both resizes (the graphs are kept: each engine's
compile watch on ``/metrics``, Inductor's caches off in the engines so a compile is never a cache
hit the watch cannot see); sizes the group cannot take are answered 400 at once and serving goes on.

A scale-up whose new engine never starts is answered with an error after the start bound
(``EPLB_GRAPH_ELASTIC_START_TIMEOUT_S``; upstream would wait for it for good), the group serves on
at its old size, and a later resize is refused naming the failure.

Not proven here: DP 2 -> 4 (four engines beside the reference server do not fit this machine's
two cores in the test's time); that the compile watch counts upstream's recompiles where the graphs
are not kept (``bench_vllm_elastic.py``'s reset arm does)."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.benchmarks.scripts import load_benchmark
from tests.docs.quickstart_blocks import quickstart_blocks
from eplb_reference.bench.ray_head import PrivateRayHead
from tests.eplb_graph.vllm_plugin.test_server import (
    SECTION, completion, free_ports, start_server, stop, wait_until_ready, write_quickstart_checkpoint)

pytest.importorskip("vllm")
prometheus = pytest.importorskip("prometheus_client.parser")
post = load_benchmark("vllm_server").post  # the benchmarks' client: one implementation

pytestmark = [pytest.mark.launches, pytest.mark.alone]  # a Ray head, three engines, a reference server

ELASTIC_SECTION = "vLLM: elastic expert parallel (`/scale_elastic_ep`)"
PROMPTS = ["The quick brown fox", "Mixture of experts", "hello world", "graph mode", "one two three",
           "expert parallel load balancing", "a b c d e f", "CPU only"]
MAX_TOKENS = 6
RESIZE_TIMEOUT_S = 420
RETRYABLE = (503,)  # vLLM's answer while the engines switch groups
# float32 everywhere; DP and EP only change the order experts' outputs are summed in
LOGPROB_TOLERANCE = 1e-3


# Python runs ``sitecustomize`` in every process it starts (Ray's workers: the head's environment puts
# this directory first on their path). While the marker file exists, an engine vLLM launches for a
# scale-up (``VLLM_ELASTIC_EP_SCALE_UP_LAUNCH``) dies at start, every time Ray starts it again.
FAILING_NEW_ENGINES = """
import os
if os.environ.get("VLLM_ELASTIC_EP_SCALE_UP_LAUNCH") == "1" and os.path.exists({marker!r}):
    os._exit(17)
"""
START_TIMEOUT_S = 120  # a new engine here starts (loads, compiles) in well under a minute


def answer(port: str, model_dir: str, prompt: str) -> tuple[int, object]:
    """(status, (text, each token's log-probability)) of a greedy completion, or (status, the error)."""
    body = {"model": model_dir, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 1}
    status, raw = post(port, "/v1/completions", body, timeout=RESIZE_TIMEOUT_S)
    if status != 200:
        return status, raw
    choice = json.loads(raw)["choices"][0]
    return status, (choice["text"], choice["logprobs"]["token_logprobs"])


def same_answer(got: object, reference: tuple[str, list[float]]) -> bool:
    return (isinstance(got, tuple) and got[0] == reference[0]
            and all(abs(a - b) <= LOGPROB_TOLERANCE for a, b in zip(got[1], reference[1], strict=True)))


def metric_samples(port: str, family: str) -> list:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
        families = {f.name: f.samples for f in prometheus.text_string_to_metric_families(response.read().decode())}
    return families.get(family, [])


def per_rank(port: str, family: str) -> dict[str, float]:
    """``ep_rank`` -> value of a counter family (layer-less) on the server's /metrics."""
    return {s.labels["ep_rank"]: s.value for s in metric_samples(port, family) if s.name.endswith("_total")}


def watch_started(log: Path, after: str) -> str:
    """The server log's lines (Ray forwards the engines') where a worker's compile watch started ``after``."""
    return "\n".join(line for line in log.read_text(errors="replace").splitlines()
                     if f"watching for compiles from {after} on" in line)


class Traffic(threading.Thread):
    """Sends the prompts round and round until stopped, retrying a retryable refusal; keeps every outcome."""

    def __init__(self, port: str, model_dir: Path) -> None:
        super().__init__(daemon=True)
        self.port, self.model_dir = port, str(model_dir)
        self.stopping = threading.Event()
        self.outcomes: list[tuple[str, int, object, int]] = []  # prompt, status, answer or error, retries

    def one(self, prompt: str) -> tuple[int, object, int]:
        for retries in range(600):
            status, got = answer(self.port, self.model_dir, prompt)
            if status not in RETRYABLE:
                return status, got, retries
            self.stopping.wait(0.5)  # the switch is under way: vLLM asks to retry
        return status, got, retries

    def run(self) -> None:
        index = 0
        while not self.stopping.is_set():
            prompt = PROMPTS[index % len(PROMPTS)]
            self.outcomes.append((prompt, *self.one(prompt)))
            index += 1


@pytest.fixture(scope="module")
def elastic(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("elastic_server")
    write_checkpoint, = quickstart_blocks(SECTION, "python")
    model_dir = write_quickstart_checkpoint(write_checkpoint, SECTION, workdir)
    off_command = quickstart_blocks(SECTION, "bash")[0]  # the server (a curl follows)
    _head_command, server_command, _resize = quickstart_blocks(ELASTIC_SECTION, "bash")
    off_port, port = free_ports(2)
    site, marker = workdir / "site", workdir / "fail-new-engines"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAILING_NEW_ENGINES.format(marker=str(marker)))
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    with PrivateRayHead(num_cpus=5, resources={"eplb_graph_dp": 4}, env={"PYTHONPATH": path}) as head:
        off = start_server(off_command, model_dir, workdir / "off.log", off_port, eplb=False)
        server = start_server(server_command, model_dir, workdir / "elastic.log", port, eplb=True,
                              env_extra={**head.client_env,  # the private head's address over the quickstart's
                                         "EPLB_GRAPH_ELASTIC_START_TIMEOUT_S": str(START_TIMEOUT_S),
                                         # Ray copies vLLM's variables and these prefixes only
                                         "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY": "TORCHINDUCTOR_"})
        try:
            wait_until_ready(off)
            reference = {prompt: answer(off.port, str(model_dir), prompt)[1] for prompt in PROMPTS}
            stop(off)
            wait_until_ready(server)
            yield SimpleNamespace(server=server, model_dir=model_dir, reference=reference, port=server.port,
                                  log=workdir / "elastic.log",
                                  fail_new_engines=marker)
        finally:
            stop(off)
            stop(server)


def test_resizes_under_traffic_lose_nothing_and_eplb_follows_the_group(elastic):
    port = elastic.port
    traffic = Traffic(port, elastic.model_dir)
    traffic.start()
    try:
        status, reply = post(port, "/scale_elastic_ep", {"new_data_parallel_size": 3}, RESIZE_TIMEOUT_S)
        assert status == 200, reply
        received = {}
        deadline = time.monotonic() + RESIZE_TIMEOUT_S
        while time.monotonic() < deadline and not received.get("2"):  # EPLB's reshuffle after the switch
            received = per_rank(port, "eplb_graph:expert_bytes_received")
            traffic.stopping.wait(1.0)
        assert received.get("2", 0) > 0, f"the new engine received no expert: {received}"
        # the new engine compiled alone before it joined: none at the commit, none since (its watch's start)
        assert "Worker_DP2_EP2" in watch_started(elastic.log, "the end of its warm-up alone")
        compiled = per_rank(port, "eplb_graph:graphs_compiled_while_serving")
        assert compiled.get("2") == 0, f"graphs compiled while serving: {compiled}"
        status, reply = post(port, "/scale_elastic_ep", {"new_data_parallel_size": 2}, RESIZE_TIMEOUT_S)
        assert status == 200, reply
        served_after = len(traffic.outcomes)
        deadline = time.monotonic() + RESIZE_TIMEOUT_S
        while time.monotonic() < deadline and len(traffic.outcomes) < served_after + len(PROMPTS):
            traffic.stopping.wait(0.5)
    finally:
        traffic.stopping.set()
        traffic.join(timeout=RESIZE_TIMEOUT_S)
    wrong = [(prompt, status, got) for prompt, status, got, _ in traffic.outcomes
             if status != 200 or not same_answer(got, elastic.reference[prompt])]
    assert not wrong, f"{len(wrong)} of {len(traffic.outcomes)} requests answered wrong or not at all: {wrong[:4]}"
    assert len(traffic.outcomes) >= 2 * len(PROMPTS)
    started = per_rank(port, "eplb_graph:rearrangements_started")
    deadline = time.monotonic() + RESIZE_TIMEOUT_S
    while time.monotonic() < deadline and per_rank(port, "eplb_graph:rearrangements_started").get("0", 0) \
            <= started.get("0", 0):  # EPLB goes on in the resized group
        completion(elastic.server, elastic.model_dir, PROMPTS[1], MAX_TOKENS)
    assert per_rank(port, "eplb_graph:rearrangements_started")["0"] > started.get("0", 0)
    compiled = per_rank(port, "eplb_graph:graphs_compiled_while_serving")
    assert {"0", "1"} <= set(compiled) and not any(compiled.values()), f"graphs compiled while serving: {compiled}"


def test_a_size_the_group_cannot_take_is_refused_at_once_and_serving_goes_on(elastic):
    for size in (1, 5):
        status, refusal = post(elastic.port, "/scale_elastic_ep", {"new_data_parallel_size": size}, 60)
        assert status == 400 and "from 2 to 4" in refusal, (size, status, refusal)
    prompt = PROMPTS[0]
    assert same_answer(answer(elastic.port, str(elastic.model_dir), prompt)[1], elastic.reference[prompt])



def test_a_scale_up_whose_new_engine_never_starts_fails_in_bound_and_the_group_serves_on(elastic):
    """Last: after it, the server refuses every resize (upstream cannot undo a prepared one)."""
    elastic.fail_new_engines.touch()
    try:
        status, reply = post(elastic.port, "/scale_elastic_ep", {"new_data_parallel_size": 3}, 4 * START_TIMEOUT_S)
    finally:
        elastic.fail_new_engines.unlink()
    assert status == 500, (status, reply)  # vLLM's answer to a failed resize, after our bound
    for prompt in PROMPTS[:3]:
        assert same_answer(answer(elastic.port, str(elastic.model_dir), prompt)[1], elastic.reference[prompt])
    status, reply = post(elastic.port, "/scale_elastic_ep", {"new_data_parallel_size": 3}, 60)
    assert status == 400 and "a resize failed part-way" in reply and "restart it" in reply, (status, reply)
