"""vLLM's OpenAI server with the plugin, started exactly as docs/quickstart-hf.md says, on a local
random checkpoint with a tokenizer: completions equal EPLB off, each worker logs that graph-mode
EPLB is active, and no model graph is compiled while serving. Two servers (EPLB on and off) start
side by side; then two more on the quickstart's FP8 checkpoint and two on its int4 one, through
``lifted_api_server`` (vLLM's quantized CPU experts admitted on this AMX-less CPU, on the
kernels' stand-ins where vLLM's build lacks them: cpu_quantized_experts.py) at
EXACT_TOKENS_PER_EXPERT tokens a step."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from eplb_reference.bench.ray_head import free_ports
from eplb_reference.models.tiny_checkpoint import TINY_QWEN3_MOE
from tests.docs.quickstart_blocks import quickstart_blocks
from tests.eplb_graph.vllm_plugin.cpu_quantized_experts import EXACT_TOKENS_PER_EXPERT, LIFT_ENV

pytest.importorskip("vllm")

pytestmark = pytest.mark.launches  # servers: left out by make test-fast

SECTION, FP8_SECTION = "vLLM: the OpenAI-compatible server", "vLLM: an FP8 checkpoint"
EP2_SECTION = "vLLM: expert parallel over two workers"
REPO_ROOT = Path(__file__).parents[3]
FP8_WRITER, INT4_WRITER = "write_tiny_qwen3_moe_fp8_checkpoint", "write_tiny_qwen3_moe_int4_checkpoint"
UPSTREAM_SERVER, LIFTED_SERVER = "vllm.entrypoints.openai.api_server", "tests.eplb_graph.vllm_plugin.lifted_api_server"
EPLB_FLAGS = ("--enable-expert-parallel", "--enable-eplb", "--eplb-config")
BIND = "VLLM_CPU_OMP_THREADS_BIND"
START_TIMEOUT_S = 480
# No compile caches: a cache hit would serve a graph without running the pass (see test_engine.py).
NO_CACHES = {"VLLM_DISABLE_COMPILE_CACHE": "1", "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}


def repo_on_pythonpath() -> dict[str, str]:
    """PYTHONPATH with this repository first: vLLM's processes import the tests' helpers from it."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


def server_argv(command: str, *, eplb: bool) -> tuple[dict[str, str], list[str]]:
    """The quickstart's server command as (leading VAR=value assignments, argv); EPLB flags dropped for off."""
    tokens = shlex.split(command.replace("\\\n", " "))
    env = {}
    while "=" in tokens[0] and not tokens[0].startswith("-"):
        name, value = tokens.pop(0).split("=", 1)
        env[name] = value
    argv = []
    skip_value = False
    for token in tokens:
        if skip_value:
            skip_value = False
            continue
        if not eplb and token in EPLB_FLAGS:
            skip_value = token == "--eplb-config"
            continue
        argv.append(token)
    return env, argv


def expand(argv: list[str], values: dict[str, str]) -> list[str]:
    out = []
    for token in argv:
        for name, value in values.items():
            token = token.replace(f"${name}", value)
        out.append(sys.executable if token == "python" else token)
    return out


def start_server(command: str, model_dir: Path, log: Path, port: int, *, eplb: bool,
                 env_extra: dict | None = None) -> SimpleNamespace:
    port = str(port)
    env_assignments, argv = server_argv(command, eplb=eplb)
    env = {**os.environ, **NO_CACHES, **env_assignments, **(env_extra or {}), "MODEL_DIR": str(model_dir), "PORT": port}
    handle = log.open("w")
    process = subprocess.Popen(
        expand(argv, {"MODEL_DIR": str(model_dir), "PORT": port}), env=env, stdout=handle, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return SimpleNamespace(process=process, port=port, log=log, log_handle=handle, env=env)


def wait_until_ready(server: SimpleNamespace) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"server exited with {server.process.returncode}:\n{server.log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)  # polling the health endpoint, not waiting for a fixed time
    pytest.fail(f"server not ready in {START_TIMEOUT_S} s:\n{server.log.read_text()[-6000:]}")


def stop(server: SimpleNamespace) -> None:
    if server.process.poll() is None:
        os.killpg(server.process.pid, 15)  # the group this test started (vLLM's engine-core child included)
        try:
            server.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, 9)
            server.process.wait()
    server.log_handle.close()


def completion(server: SimpleNamespace, model_dir: Path, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"model": str(model_dir), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def serve_quickstart(section: str, workdir: Path, *, quantized: bool = False, writer: str | None = None) -> dict:
    """The section's checkpoint written (by ``writer`` instead of the FP8 one, as the section says
    one may), its server started with EPLB on and off, queried, stopped."""
    write_checkpoint, = quickstart_blocks(section, "python")
    if writer:
        assert FP8_WRITER in write_checkpoint
        write_checkpoint = write_checkpoint.replace(FP8_WRITER, writer)
    serve, = quickstart_blocks(section, "bash")[:1]
    curl = quickstart_blocks(SECTION, "bash")[1]
    env_extra = None
    if quantized:
        serve = serve.replace(f"-m {UPSTREAM_SERVER}", f"-m {LIFTED_SERVER}") + (
            f" --max-num-batched-tokens {EXACT_TOKENS_PER_EXPERT}")
        env_extra = {LIFT_ENV: "1", **repo_on_pythonpath()}
    model_dir = write_quickstart_checkpoint(write_checkpoint, section, workdir)
    commands = {name: (serve, name == "on") for name in ("on", "off")}
    return serve_and_query(commands, model_dir, workdir, curl, env_extra)


def write_quickstart_checkpoint(write_checkpoint: str, section: str, workdir: Path) -> Path:
    """The quickstart's checkpoint-writing block run as the quickstart says, into ``workdir``."""
    model_dir = workdir / "tiny-qwen3-moe"
    argv = sys.argv
    sys.argv = ["quickstart", str(model_dir)]
    try:
        exec(compile(write_checkpoint, f"quickstart-hf.md[{section}]", "exec"), {"__name__": "quickstart"})
    finally:
        sys.argv = argv
    return model_dir


def core_of(command: str, index: int) -> dict[str, str]:
    """Where the index-th of two servers side by side runs its one worker: vLLM's automatic CPU
    binding puts every single-worker server's on core 0, so the second goes to core 1 (a command
    that binds its workers itself keeps its binding)."""
    return {} if index == 0 or BIND in command else {BIND: "1"}


def serve_and_query(commands: dict[str, tuple[str, bool]], model_dir: Path, workdir: Path, curl: str,
                    env_extra: dict | None = None) -> dict:
    """Each (server command, EPLB on) started side by side, queried as the quickstart does, with
    three longer prompts one after the other and with a long and a short one at once, stopped; its
    answers and its log."""
    ports = free_ports(len(commands))
    started = {name: start_server(command, model_dir, workdir / f"{name}.log", ports[index], eplb=eplb,
                                  env_extra={**(env_extra or {}), **core_of(command, index)})
               for index, (name, (command, eplb)) in enumerate(commands.items())}
    try:
        for server in started.values():
            wait_until_ready(server)
        results = {}
        for name, server in started.items():
            quick = subprocess.run(["bash", "-c", curl], env=server.env, capture_output=True, text=True, timeout=300)
            assert quick.returncode == 0, quick.stderr
            longer = [completion(server, model_dir, f"w{5 + i} w{17 * i % 500 + 3} w{40 + 3 * i} w7", 48) for i in range(3)]
            # a long and a short request at once: under DP=2, once the short one is answered one rank has
            # no request while the other decodes (it steps dummy batches through the DP dispatch)
            with ThreadPoolExecutor(2) as pool:
                unequal = list(pool.map(lambda asked: completion(server, model_dir, *asked),
                                        [("w9 w21 w33 w7", 48), ("w11 w5 w2 w7", 2)]))
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=60) as response:
                scraped = response.read().decode()
            results[name] = {"quickstart": json.loads(quick.stdout), "longer": longer, "unequal": unequal,
                             "metrics": scraped}
        for name, server in started.items():  # each answer came from the server started for it, still up
            assert server.process.poll() is None, f"{name} server exited:\n{server.log.read_text()[-6000:]}"
    finally:
        for server in started.values():
            stop(server)
    for name, server in started.items():
        results[name]["log"] = server.log.read_text()
    return results


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    return serve_quickstart(SECTION, tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="module")
def multi_process_servers(tmp_path_factory):
    """The two-worker quickstart's TP=2 server and the same with --data-parallel-size 2, side by side."""
    workdir = tmp_path_factory.mktemp("server_ep2")
    write_checkpoint, = quickstart_blocks(SECTION, "python")
    model_dir = write_quickstart_checkpoint(write_checkpoint, SECTION, workdir)
    tp2, = quickstart_blocks(EP2_SECTION, "bash")
    assert "--tensor-parallel-size 2" in tp2
    dp2 = tp2.replace("--tensor-parallel-size 2", "--data-parallel-size 2")
    return serve_and_query({"tp2": (tp2, True), "dp2": (dp2, True)}, model_dir, workdir,
                           quickstart_blocks(SECTION, "bash")[1])


@pytest.fixture(scope="module")
def fp8_servers(tmp_path_factory):
    return serve_quickstart(FP8_SECTION, tmp_path_factory.mktemp("server_fp8"), quantized=True)


@pytest.fixture(scope="module")
def int4_servers(tmp_path_factory):
    return serve_quickstart(FP8_SECTION, tmp_path_factory.mktemp("server_int4"), quantized=True, writer=INT4_WRITER)


def texts(response: dict) -> list[str]:
    return [choice["text"] for choice in response["choices"]]


@pytest.mark.parametrize("pair", ["servers", "fp8_servers", "int4_servers"])
def test_completions_are_identical_with_eplb_on_and_off(request, pair):
    on, off = (request.getfixturevalue(pair)[name] for name in ("on", "off"))
    assert texts(on["quickstart"]) == texts(off["quickstart"])
    if pair == "servers":  # the tokenizer decodes every generated id (a quantized model may stop at EOS first)
        assert len(texts(on["quickstart"])[0].split()) == 16
    assert [texts(r) for r in on["longer"]] == [texts(r) for r in off["longer"]]
    assert len({word for r in off["longer"] for text in texts(r) for word in text.split()}) >= 20


WATCHING = re.compile(r"eplb-graph: watching for compiles from the end of warm-up on \(the EPLB pass made (\d+) "
                      r"layer mappings")


@pytest.mark.parametrize("pair", ["servers", "fp8_servers", "int4_servers"])
def test_no_model_graph_is_compiled_while_serving(request, pair):
    """The worker starts watching at the end of warm-up and logs any model graph compiled after
    it, while EPLB rearranges (compile_watch.py)."""
    log = request.getfixturevalue(pair)["on"]["log"]
    watching = list(WATCHING.finditer(log))
    assert len(watching) == 1, log[-4000:]
    assert int(watching[0][1]) >= TINY_QWEN3_MOE["num_hidden_layers"]  # compiled at warm-up: every MoE layer mapped
    serving = log[watching[0].end():]
    assert serving.count("Rearranging experts (async mode) ...") >= 3  # upstream rearranged while it watched
    assert "compiled while serving" not in log


def test_each_worker_logs_that_graph_mode_eplb_is_active_and_upstream_rearranged(servers):
    log = servers["on"]["log"]
    active = [line for line in log.splitlines() if "eplb-graph active on cpu" in line]
    assert len(active) == 1, log[-4000:]  # one worker (one process: EP > 1 is refused on CPU)
    assert "2 MoE layers bound" in active[0] and active[0].count(": graph_pass") == 2
    assert "load phase: every batch of the last 4 steps before each rearrangement, every 8 steps" in active[0]
    assert log.count("Rearranging experts (async mode)") >= 3
    assert "eplb-graph active" not in servers["off"]["log"]


def active_line(line: str) -> str:
    """The active line up to the registry's account of the upstream adaptations in force, which it ends with."""
    head, in_force = line.split("; upstream adaptations in force: ")
    assert "capability.commit_layer" in in_force and "gate.create_engine_config" in in_force
    return head


def scraped(run: dict) -> dict[str, list]:
    """The server's /metrics, parsed as Prometheus does: family name -> samples."""
    from prometheus_client.parser import text_string_to_metric_families

    return {family.name: family.samples for family in text_string_to_metric_families(run["metrics"])}


def by_rank(samples: list, name: str) -> dict[str, float]:
    return {s.labels["ep_rank"]: s.value for s in samples if s.name == name}


def test_metrics_count_what_upstream_did_and_eplb_off_registers_none(servers):
    on, log = scraped(servers["on"]), servers["on"]["log"]
    assert by_rank(on["eplb_graph:rearrangements_started"], "eplb_graph:rearrangements_started_total") == {
        "0": float(log.count("Rearranging experts (async mode) ..."))}  # upstream's own line, one per rearrangement
    # (its profile run's, "(async mode) (profile)...", moves nothing and is not counted)
    finished = by_rank(on["eplb_graph:rearrangements_finished"], "eplb_graph:rearrangements_finished_total")["0"]
    assert finished == len(re.findall(r"eplb-graph: rearrangement \d+ committed on EP rank 0", log)) >= 3
    assert by_rank(on["eplb_graph:layers_committed"], "eplb_graph:layers_committed_total")["0"] >= 2 * finished
    pauses = by_rank(on["eplb_graph:commit_pause_seconds"], "eplb_graph:commit_pause_seconds_count")["0"]
    assert pauses >= finished and by_rank(on["eplb_graph:rearrangement_duration_seconds"],
                                          "eplb_graph:rearrangement_duration_seconds_count")["0"] == finished
    assert by_rank(on["eplb_graph:async_worker_alive"], "eplb_graph:async_worker_alive") == {"0": 1.0}
    assert by_rank(on["eplb_graph:graphs_compiled_while_serving"], "eplb_graph:graphs_compiled_while_serving_total") == {
        "0": 0.0}
    assert {s.labels["model_name"] for s in on["eplb_graph:layers_committed"]} == {
        s.labels["model_name"] for s in on["vllm:num_requests_running"]}  # vLLM's own label values
    assert "vllm:num_requests_running" in scraped(servers["off"]) and "eplb_graph:" not in servers["off"]["metrics"]


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_two_workers_metrics_balance_and_move_bytes_both_ways(multi_process_servers, layout):
    families, log = scraped(multi_process_servers[layout]), multi_process_servers[layout]["log"]
    sent = by_rank(families["eplb_graph:expert_bytes_sent"], "eplb_graph:expert_bytes_sent_total")
    received = by_rank(families["eplb_graph:expert_bytes_received"], "eplb_graph:expert_bytes_received_total")
    assert sorted(sent) == ["0", "1"] and sum(sent.values()) == sum(received.values()) > 0  # every byte sent arrives
    committed = by_rank(families["eplb_graph:layers_committed"], "eplb_graph:layers_committed_total")
    assert committed["0"] == committed["1"] > 0  # both ranks commit each layer
    engines = {s.labels["ep_rank"]: s.labels["engine"] for s in families["eplb_graph:layers_committed"]}
    assert engines == ({"0": "0", "1": "1"} if layout == "dp2" else {"0": "0", "1": "0"})  # vLLM's DP rank
    window, after = ({s.labels["layer"]: s.value for s in families[f"eplb_graph:balancedness_{kind}"]}
                     for kind in ("window", "committed"))
    layers = TINY_QWEN3_MOE["num_hidden_layers"]
    assert set(window) == set(after) == {*map(str, range(layers)), "all"}
    assert all(0 < value <= 1 for value in [*window.values(), *after.values()])
    assert after["all"] >= window["all"]  # the committed placement balances the window it was computed from
    assert set(by_rank(families["eplb_graph:graphs_compiled_while_serving"],
                       "eplb_graph:graphs_compiled_while_serving_total").values()) == {0.0}
    assert "Rearranging experts (async mode)" in log


def test_an_fp8_checkpoint_moves_its_block_scales_with_its_experts(fp8_servers):
    log = fp8_servers["on"]["log"]
    active = [line for line in log.splitlines() if "eplb-graph active on cpu" in line]
    assert len(active) == 1, log[-4000:]
    assert active_line(active[0]).endswith("each expert moves with w13_weight, w2_weight, w13_weight_scale_inv, "
                                           "w2_weight_scale_inv")
    assert "async EPLB through GlooStagedCommunicator;" in active[0] and "Using CPU Fp8 MoE backend" in log
    assert log.count("Rearranging experts (async mode)") >= 3


def test_an_int4_checkpoint_moves_its_scales_and_zero_points_with_its_experts(int4_servers):
    log = int4_servers["on"]["log"]
    active = [line for line in log.splitlines() if "eplb-graph active on cpu" in line]
    assert len(active) == 1, log[-4000:]
    assert active_line(active[0]).endswith(
        "each expert moves with w13_weight_packed, w2_weight_packed, w13_weight_scale, w2_weight_scale, "
        "w2_weight_shape, w13_weight_shape, w13_weight_zero_point, w2_weight_zero_point")
    assert log.count("Rearranging experts (async mode)") >= 3


REARRANGED = re.compile(r"eplb-graph: rearrangement (\d+) committed on EP rank (\d) of 2 \(\d+ layer commits so far\); "
                        r"expert bytes sent (\d+), received (\d+) so far")


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_two_workers_serve_the_completions_of_one_process_without_eplb(servers, multi_process_servers, layout):
    """Under DP=2 each request is one engine's: while one is answered alone, and after the short one
    of the unequal pair, the other rank is idle mid-serving and its tokens still match."""
    run, off = multi_process_servers[layout], servers["off"]
    assert texts(run["quickstart"]) == texts(off["quickstart"])
    assert [texts(r) for r in run["longer"]] == [texts(r) for r in off["longer"]]
    assert [texts(r) for r in run["unequal"]] == [texts(r) for r in off["unequal"]]
    assert [r["usage"]["completion_tokens"] for r in run["unequal"]] == [48, 2]


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_two_workers_move_experts_between_them_with_no_graph_compiled_while_serving(multi_process_servers, layout):
    log = multi_process_servers[layout]["log"]
    active = [line for line in log.splitlines() if "eplb-graph active on cpu" in line]
    assert len(active) == 2, log[-4000:]  # one line per worker
    assert all("of 2: each layer's CPUUnquantizedExperts compute this rank's (token, k) pairs only" in line
               for line in active)
    assert all(("DP tokens dispatched over 2 ranks" in line) == (layout == "dp2") for line in active)
    last = {}  # per EP rank: its last rearrangement line
    for match in REARRANGED.finditer(log):
        last[int(match[2])] = tuple(int(match[i]) for i in (1, 3, 4))
    assert sorted(last) == [0, 1], log[-4000:]
    assert all(count >= 3 and sent > 0 and received > 0 for count, sent, received in last.values())
    assert len(WATCHING.findall(log)) == 2 and "compiled while serving" not in log
