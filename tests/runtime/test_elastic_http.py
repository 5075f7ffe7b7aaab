"""``runtime/elastic_http.py``: vLLM's elastic endpoints' paths, bodies and status codes, over a stand-in server.

The stand-in keeps this fast and exact about the HTTP contract; the server itself (processes,
resizes, a member killed under traffic) is ``test_elastic_server.py``'s.
"""

import pytest
from fastapi.testclient import TestClient

from eplb_graph.runtime.elastic_http import make_app
from eplb_graph.runtime.elastic_server import ScaleError, ServerStats


class StandInServer:
    def __init__(self) -> None:
        self.ranks, self.scaling, self.error, self.stats = 2, False, None, ServerStats(requests_completed=3)
        self.coordinator = type("Coordinator", (), {"progress": lambda self: 42})()
        self.scaled: list = []
        self.refuse: ScaleError | None = None

    def last_step_ms(self):
        return 3.5

    def eplb_rearrangements(self):
        return 6

    def balancedness(self):
        return float("nan")  # no rearrangement finished yet

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
    ({"new_data_parallel_size": 4, "drain_timeout": 0}, "drain_timeout must be a positive integer"),
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


def test_health_says_when_the_coordinator_stopped(client, server):
    server.error = RuntimeError("store lost")
    response = client.get("/health")
    assert response.status_code == 500 and "store lost" in response.json()["error"]
