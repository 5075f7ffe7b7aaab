"""``runtime/elastic/http.py`` (and ``completions.py``): vLLM's elastic endpoints and OpenAI's
completions, their paths, bodies and status codes, over a stand-in server.

The stand-in keeps this fast and exact about the HTTP contract; the server itself (processes,
resizes, a member killed under traffic) is ``test_server.py``'s.
"""

import socket
import threading
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from eplb_reference.elastic.http import MAX_BODY_BYTES, MAX_DRAIN_TIMEOUT_S, make_app
from eplb_reference.elastic.server import ScaleError, ServerStats


class StandInServer:
    """Generates token ``t + 1`` after a prompt ending in ``t``, as many as asked."""

    def __init__(self) -> None:
        self.ranks, self.scaling, self.error, self.stats = 2, False, None, ServerStats(requests_completed=3, members_fenced=1)
        self.cfg = SimpleNamespace(vocab_size=64)
        self.submitted: list = []
        self.scaled: list = []
        self.refuse: ScaleError | None = None

    def progress(self):
        return 42

    def last_step_ms(self):
        return 3.5

    def eplb_rearrangements(self):
        return 6

    def balancedness(self):
        return float("nan")  # no rearrangement finished yet

    def in_flight(self):
        return 5

    def waiting(self):
        return 1

    def submit(self, prompt, max_new_tokens):
        if not all(0 <= t < self.cfg.vocab_size for t in prompt):
            raise ValueError("prompt token ids must be integers in [0, 64)")
        self.submitted.append((prompt, max_new_tokens))
        return len(self.submitted) - 1

    def result(self, rid):
        prompt, max_new_tokens = self.submitted[rid]
        return {"token_ids": [prompt[-1] + 1 + i for i in range(max_new_tokens)], "matches_reference": True}

    def generate(self, prompt, max_new_tokens):
        if max_new_tokens > 8:
            raise ValueError("prompt (1) + max_new_tokens (9) exceeds the server's 16 tokens per request")
        return {"token_ids": [7] * max_new_tokens, "matches_reference": True, "member": 0}

    def scale(self, new_size, drain_timeout=None):
        if self.refuse is not None:
            raise self.refuse
        self.scaled.append((new_size, drain_timeout))
        self.ranks = new_size
        return f"Scaled to {new_size} data parallel engines"


@pytest.fixture
def server():
    return StandInServer()


@pytest.fixture
def client(server):
    return TestClient(make_app(server))


def test_generate_returns_the_tokens_and_refuses_a_bad_request(client):
    assert client.post("/v1/generate", json={"prompt_token_ids": [1], "max_new_tokens": 2}).json() == {
        "token_ids": [7, 7], "matches_reference": True, "member": 0}
    for body in ({"max_new_tokens": 2}, {"prompt_token_ids": "1 2"}, {"prompt_token_ids": [1], "max_new_tokens": 9}):
        response = client.post("/v1/generate", json=body)
        assert response.status_code == 400 and response.json()["error"]["code"] == 400


def test_scale_answers_as_vllm_does(client, server):
    response = client.post("/scale_elastic_ep", json={"new_data_parallel_size": 4, "drain_timeout": 30})
    assert response.status_code == 200 and response.json() == {"message": "Scaled to 4 data parallel engines"}
    assert server.scaled == [(4, 30)] and client.get("/health").json() == {"status": "ok", "ranks": 4}


@pytest.mark.parametrize("body, message", [
    ({}, "new_data_parallel_size is required"),
    ({"new_data_parallel_size": 0}, "new_data_parallel_size must be a positive integer"),
    ({"new_data_parallel_size": True}, "new_data_parallel_size must be a positive integer"),
    ({"new_data_parallel_size": "4"}, "new_data_parallel_size must be a positive integer"),
    ({"new_data_parallel_size": 4, "drain_timeout": 0}, "drain_timeout must be a finite number of seconds in (0, 3600]"),
])
def test_a_bad_scale_body_is_a_400_naming_the_field(client, server, body, message):
    response = client.post("/scale_elastic_ep", json=body)
    assert response.status_code == 400
    assert response.json() == {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
    assert server.scaled == []


def test_a_body_that_is_not_json_is_a_400(client):
    response = client.post("/scale_elastic_ep", content=b"{nope", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["message"] == "Invalid JSON format"


@pytest.mark.parametrize("status", [400, 408, 409, 500])
def test_the_servers_refusals_keep_their_status(client, server, status):
    server.refuse = ScaleError(status, f"refused with {status}")
    response = client.post("/scale_elastic_ep", json={"new_data_parallel_size": 3})
    assert response.status_code == status and response.json()["error"]["message"] == f"refused with {status}"


def test_is_scaling_and_metrics(client, server):
    assert client.post("/is_scaling_elastic_ep").json() == {"is_scaling_elastic_ep": False}
    server.scaling = True
    assert client.post("/is_scaling_elastic_ep").json() == {"is_scaling_elastic_ep": True}
    text = client.get("/metrics").text
    assert "eplb_graph_ep_ranks 2.0" in text and "eplb_graph_requests_completed_total 3.0" in text
    assert "eplb_graph_steps_total 42.0" in text and "eplb_graph_step_latency_ms 3.5" in text
    assert "eplb_graph_rearrangements_total 6.0" in text and "eplb_graph_balancedness NaN" in text
    assert "eplb_graph_members_fenced_total 1.0" in text and "eplb_graph_requests_duplicated_total 0.0" in text
    assert "vllm:num_requests_running 5.0" in text and "vllm:num_requests_waiting 1.0" in text


def test_health_says_when_the_coordinator_stopped(client, server):
    server.error = RuntimeError("store lost")
    response = client.get("/health")
    assert response.status_code == 500 and "store lost" in response.json()["error"]


def test_health_names_the_error_never_its_traceback(client, server):
    try:
        raise RuntimeError("the EP group cannot keep serving: member 1\nTraceback (most recent call last):\n  File x")
    except RuntimeError as error:
        server.error = error
    answer = client.get("/health").json()
    assert answer == {"status": "error", "error": "RuntimeError: the EP group cannot keep serving: member 1"}
    server.error = ValueError("x" * 10_000)
    assert len(client.get("/health").json()["error"]) <= 200


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "-1", "0", "-0.0", "3600.5", "1e308",
                                   "1" + "0" * 400, '"30"', "true", "[30]", "{}"])
def test_a_drain_timeout_that_is_not_a_finite_bounded_number_is_a_400_naming_it(client, server, value):
    body = '{"new_data_parallel_size": 4, "drain_timeout": ' + value + "}"  # NaN and Infinity: Python's JSON reads both
    response = client.post("/scale_elastic_ep", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, value
    assert response.json()["error"]["message"] == "drain_timeout must be a finite number of seconds in (0, 3600]"
    assert server.scaled == []


def test_a_drain_timeout_up_to_the_bound_is_taken(client, server):
    for value in (0.5, MAX_DRAIN_TIMEOUT_S):
        assert client.post("/scale_elastic_ep", json={"new_data_parallel_size": 3, "drain_timeout": value}).status_code == 200
    assert server.scaled == [(3, 0.5), (3, 3600.0)]


def test_a_body_declared_over_the_limit_is_a_413_before_it_is_read(client, server):
    declared = str(64 << 20)  # 64 MiB announced, a few bytes sent: nothing waits for, or holds, the rest
    for path in ("/scale_elastic_ep", "/v1/completions", "/v1/generate"):
        response = client.post(path, content=b'{"new_data_parallel_size": 4}',
                               headers={"content-type": "application/json", "content-length": declared})
        assert response.status_code == 413 and response.json()["error"]["type"] == "PayloadTooLarge"
    assert server.scaled == [] and server.submitted == []
    assert client.post("/scale_elastic_ep", json={"new_data_parallel_size": 4}).status_code == 200


@pytest.fixture
def live(server):
    yield from live_app(make_app(server))


def live_app(app):
    """The app on a real (uvicorn) HTTP server in a thread of this process, on a loopback port."""
    import uvicorn

    listening = socket.create_server(("127.0.0.1", 0))
    http = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=http.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not http.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert http.started
    yield listening.getsockname()[1]
    http.should_exit = True
    thread.join(30)
    listening.close()


def exchange(port: int, head: bytes, chunks=()) -> bytes:
    """Sends a raw request (``chunks`` after its head, each as it goes) and reads the answer to its
    end: the server's close, or its reset when it closes with some of the body unread."""
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        try:
            connection.sendall(head)
            for chunk in chunks:
                connection.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):  # refused before all of it was sent
            pass
        try:
            while data := connection.recv(65536):
                answer += data
        except ConnectionResetError:
            pass
    return answer


def test_a_body_over_the_limit_is_refused_on_a_real_server_which_stays_healthy(live, server):
    import httpx

    head = (b"POST /scale_elastic_ep HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(64 << 20).encode() + b"\r\n\r\n")
    assert exchange(live, head + b'{"new_data_parallel_size": 4, ').startswith(b"HTTP/1.1 413 ")
    # no Content-Length (chunked): refused once what arrived passes the limit, the rest never sent
    chunk = b"x" * 65536
    framed = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    assert exchange(live, head, [framed] * (MAX_BODY_BYTES // len(chunk) + 1)).startswith(b"HTTP/1.1 413 ")
    assert server.scaled == [] and server.submitted == []
    with httpx.Client(base_url=f"http://127.0.0.1:{live}", timeout=30) as client:
        assert client.get("/health").json() == {"status": "ok", "ranks": 2}
        assert client.post("/scale_elastic_ep", json={"new_data_parallel_size": 3}).status_code == 200
        answer = client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 1, "temperature": 0})
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == " w6"


def test_a_standard_openai_client_gets_greedy_completions(client, server):
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
    assert [model.id for model in api.models.list()] == ["eplb-graph-reference"]
    answer = api.completions.create(model="eplb-graph-reference", prompt="w5 w17 w40", max_tokens=3, temperature=0)
    assert answer.choices[0].text == " w41 w42 w43" and answer.choices[0].finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (3, 3)
    assert server.submitted == [([5, 17, 40], 3)]
    ids = api.completions.create(model="eplb-graph-reference", prompt=[7, 9], max_tokens=2, temperature=0)
    assert ids.choices[0].text == " w10 w11"


def test_a_streamed_completion_is_one_chunk_then_the_usage_then_done(client):
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
    chunks = list(api.completions.create(model="eplb-graph-reference", prompt="w3", max_tokens=2, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    assert [c.choices[0].text for c in chunks if c.choices] == [" w4 w5"]
    assert chunks[-1].usage.completion_tokens == 2


@pytest.mark.parametrize("body, status, message", [
    ({"prompt": "w5", "max_tokens": 2}, 400, "decodes greedily only"),  # OpenAI's default temperature is 1
    ({"prompt": "w5", "temperature": 0.7}, 400, "decodes greedily only"),
    ({"prompt": "w5", "temperature": 0, "n": 2}, 400, "decodes greedily only"),
    ({"prompt": "hello", "temperature": 0}, 400, "prompt words ['hello'] are not in the vocabulary"),
    ({"prompt": ["w5", "w6"], "temperature": 0}, 400, "one prompt per request"),
    ({"prompt": "w5", "temperature": 0, "max_tokens": 0}, 400, "max_tokens must be a positive integer"),
    ({"prompt": [99], "temperature": 0}, 400, "prompt token ids must be integers in [0, 64)"),
    ({"model": "gpt-4", "prompt": "w5", "temperature": 0}, 404, "The model `gpt-4` does not exist."),
])
def test_a_completion_the_server_cannot_serve_is_refused_before_it_is_queued(client, server, body, status, message):
    response = client.post("/v1/completions", json=body)
    assert response.status_code == status and message in response.json()["error"]["message"]
    assert server.submitted == []


KEY = "k3y-of-the-operator-0123456789"


def test_with_an_api_key_every_route_but_health_and_metrics_needs_it(server):
    client = TestClient(make_app(server, api_key=KEY))
    for method, path, body in (("post", "/scale_elastic_ep", {"new_data_parallel_size": 3}),
                               ("post", "/v1/completions", {"prompt": "w5", "max_tokens": 1, "temperature": 0}),
                               ("post", "/v1/generate", {"prompt_token_ids": [5]}), ("get", "/v1/models", None),
                               ("post", "/is_scaling_elastic_ep", None)):
        for headers in ({}, {"Authorization": "Bearer wrong-key-0123456789"}, {"Authorization": KEY}):
            answer = client.request(method.upper(), path, json=body, headers=headers)
            assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer", (path, headers)
            assert answer.json()["error"]["type"] == "Unauthorized"
    assert server.scaled == [] and server.submitted == []
    assert client.get("/health").json() == {"status": "ok", "ranks": 2}
    assert "vllm:num_requests_running" in client.get("/metrics").text
    authorized = {"Authorization": f"Bearer {KEY}"}
    assert client.post("/scale_elastic_ep", json={"new_data_parallel_size": 3}, headers=authorized).status_code == 200
    assert server.scaled == [(3, None)]


def test_the_key_is_read_from_a_private_file_or_the_environment_and_a_bad_one_is_named(tmp_path):
    from eplb_reference.elastic.http_access import API_KEY_ENV, ApiKeyError, load_api_key

    assert load_api_key(None, {}) is None
    assert load_api_key(None, {API_KEY_ENV: KEY}) == KEY
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    assert load_api_key(str(key_file), {API_KEY_ENV: "ignored-when-a-file-is-given"}) == KEY
    key_file.chmod(0o644)
    with pytest.raises(ApiKeyError, match="closed to others"):
        load_api_key(str(key_file), {})
    with pytest.raises(ApiKeyError, match="cannot be read"):
        load_api_key(str(tmp_path / "absent"), {})
    with pytest.raises(ApiKeyError, match="at least 16 printable characters"):
        load_api_key(None, {API_KEY_ENV: "short"})


def test_requests_over_the_concurrency_limit_are_a_503_while_health_and_metrics_answer(server):
    import httpx

    release, entered = threading.Event(), threading.Semaphore(0)
    held_result = server.result

    def held(rid):  # a completion held as in a drain: it keeps a worker thread until released
        entered.release()
        release.wait(30)
        return held_result(rid)

    server.result = held
    live = live_app(make_app(server, max_concurrency=2))
    port = next(live)
    answers = []

    def complete():
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            answers.append(client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 1, "temperature": 0}).status_code)

    workers = [threading.Thread(target=complete) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        assert entered.acquire(timeout=30) and entered.acquire(timeout=30)  # both held in the server
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            over = client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 1, "temperature": 0})
            assert over.status_code == 503 and over.json()["error"]["type"] == "ServiceUnavailable"
            assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
    finally:
        release.set()
        for worker in workers:
            worker.join(30)
    assert answers == [200, 200]
    server.result = held_result
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        assert client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 1, "temperature": 0}).status_code == 200
    next(live, None)  # stops the server
