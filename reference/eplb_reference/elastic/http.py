"""``eplb-graph serve``: the ``ElasticServer`` over HTTP, with vLLM's elastic EP endpoints.

    POST /v1/generate           {"prompt_token_ids": [...], "max_new_tokens": n} -> {"token_ids", "matches_reference"}
    POST /v1/completions        OpenAI's completions (``completions.py``: text of the tiny vocabulary,
                                greedy), for a standard client or load generator; GET /v1/models
    GET  /health                {"status": "ok", "ranks": n}
    GET  /metrics               Prometheus text (vLLM's names for the requests running and waiting)
    POST /scale_elastic_ep      {"new_data_parallel_size": M, "drain_timeout": s} (vLLM's path, body and codes:
                                200 scaled, 400 bad size, 408 drain timed out, 500 failed; 409 one is in progress)
    POST /is_scaling_elastic_ep {"is_scaling_elastic_ep": bool}

Endpoints are plain functions (FastAPI runs them on its thread pool): every call blocks on
the server, never on the event loop. A body over ``MAX_BODY_BYTES`` is answered 413 before it is
read whole (``BodyLimit``); ``drain_timeout`` is a finite number of seconds in
(0, ``MAX_DRAIN_TIMEOUT_S``]; ``/health`` names an error's type and first line, never a traceback.
With an API key, every route but ``/health`` and ``/metrics`` needs it; requests that generate or
resize are bounded in number (``http_access.py``).
"""

# no `from __future__ import annotations`: FastAPI reads the endpoints' annotations at run time
import json
import math
from typing import Any

from eplb_reference.elastic.http_access import DEFAULT_CONCURRENCY, ApiKey, ConcurrencyLimit, error_body

# The largest request body read. The biggest legitimate one is a completion's prompt: at most the
# server's tokens per request as ids or words (a few KiB); 1 MiB leaves room for any client's extra
# fields while one request can no longer make this process (which also hosts the group's store)
# parse or hold an unbounded body.
MAX_BODY_BYTES = 1 << 20
# The longest drain a resize may ask for: an hour. Requests held while it drains wait that long at
# most; NaN or infinity (both valid JSON to Python's parser) would otherwise disable the deadline.
MAX_DRAIN_TIMEOUT_S = 3600.0
HEALTH_ERROR_CHARS = 200  # /health names the error, not its traceback or a long message


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is answered 413 (and the connection
    closed) without reading it whole: at once where its Content-Length says so, else as soon as
    what arrived passes the limit; a body within it is handed on as one message."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                await _refuse(send, 400, "Content-Length is not a number")
                return
            if length > self.max_bytes:
                await _refuse(send, 413, f"request body of {length} bytes exceeds the limit of {self.max_bytes}")
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: nothing to answer
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await _refuse(send, 413, f"request body exceeds the limit of {self.max_bytes} bytes")
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        handed = False

        async def replay():
            nonlocal handed
            if not handed:
                handed = True
                return whole
            return await receive()  # then only a disconnect

        await self.app(scope, replay, send)


async def _refuse(send, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})  # the rest of the body is never read
    await send({"type": "http.response.body", "body": body})


def drain_timeout_problem(value: object) -> str | None:
    """Why ``value`` is not a drain timeout (None: it is one, or absent)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_DRAIN_TIMEOUT_S \
            or not math.isfinite(value):  # NaN fails the range too; an int too large for a float never gets here
        return f"drain_timeout must be a finite number of seconds in (0, {MAX_DRAIN_TIMEOUT_S:g}]"
    return None


def health_error(error: BaseException) -> str:
    """The error ``/health`` reports: its type and the first line of its message, shortened."""
    lines = str(error).strip().splitlines()
    described = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return described[:HEALTH_ERROR_CHARS]


def metrics_text(server) -> str:
    """The server's counters in Prometheus text format, from a registry of its own."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry()
    stats = server.stats
    values = {
        "eplb_graph_ep_ranks": ("EP ranks serving now", server.ranks),
        "eplb_graph_reconfigurations_total": ("resizes and recoveries switched", stats.reconfigurations),
        "eplb_graph_recoveries_total": ("members lost and recovered from", stats.recoveries),
        "eplb_graph_member_failures_total": ("members that ended with an error", stats.member_failures),
        "eplb_graph_members_fenced_total": ("members found hung (silent, or their main thread still) and fenced",
                                            stats.members_fenced),
        "eplb_graph_requests_completed_total": ("requests finished", stats.requests_completed),
        "eplb_graph_store_values_dropped_total": ("unproven or malformed store values dropped, never acted on",
                                                  stats.store_values_dropped),
        "eplb_graph_requests_requeued_total": ("requests re-queued from a member that left or died",
                                               stats.requests_requeued),
        "eplb_graph_output_mismatches_total": ("requests whose tokens differ from the reference", stats.output_mismatches),
        "eplb_graph_requests_duplicated_total": ("results for a request already answered (dropped)",
                                                 stats.requests_duplicated),
        "eplb_graph_steps_total": ("steps the group has run", server.progress()),
        "eplb_graph_step_latency_ms": ("the last generating step's latency on rank 0", server.last_step_ms()),
        "eplb_graph_rearrangements_total": ("upstream's EPLB rearrangements finished between resizes",
                                            server.eplb_rearrangements()),
        "eplb_graph_balancedness": ("mean / max per-rank load the placement expects under upstream's last "
                                    "load window (NaN before the first rearrangement)", server.balancedness()),
        # vLLM's own names, so dashboards and autoscalers built for vLLM read these two
        "vllm:num_requests_running": ("requests assigned to a member and not finished", server.in_flight()),
        "vllm:num_requests_waiting": ("requests held while a drain runs, assigned once it ends", server.waiting()),
    }
    for name, (help_text, value) in values.items():
        Gauge(name, help_text, registry=registry).set(value)
    return generate_latest(registry).decode()


def make_app(server, *, api_key: str | None = None, max_concurrency: int = DEFAULT_CONCURRENCY) -> Any:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    from eplb_reference.elastic import completions
    from eplb_reference.elastic.server import ScaleError

    app = FastAPI(title="eplb-graph elastic EP reference server")
    app.add_middleware(BodyLimit)
    app.add_middleware(ConcurrencyLimit, limit=max_concurrency)
    if api_key is not None:  # outermost: a request without the key is refused before anything else
        app.add_middleware(ApiKey, key=api_key)
    text = completions.TinyText(server.cfg.vocab_size)

    @app.post("/v1/generate")
    def generate(body: dict) -> Any:
        try:
            prompt, new_tokens = body["prompt_token_ids"], body.get("max_new_tokens", 1)
            if not isinstance(prompt, list) or not isinstance(new_tokens, int) or isinstance(new_tokens, bool):
                raise ValueError("prompt_token_ids must be a list of token ids and max_new_tokens an integer")
            return server.generate(prompt, new_tokens)
        except (KeyError, ValueError) as error:
            return JSONResponse(error_body(400, str(error)), status_code=400)
        except TimeoutError as error:
            return JSONResponse(error_body(408, str(error)), status_code=408)

    @app.post("/v1/completions")
    def complete(body: dict) -> Any:
        try:
            request = completions.parse_completion(body, text)
            rid = server.submit(request.prompt_token_ids, request.max_tokens)
            result = server.result(rid)
        except completions.CompletionError as error:
            return JSONResponse(error_body(error.status, str(error)), status_code=error.status)
        except ValueError as error:  # what the server refuses to queue (a token out of range, too long)
            return JSONResponse(error_body(400, str(error)), status_code=400)
        except TimeoutError as error:
            return JSONResponse(error_body(408, str(error)), status_code=408)
        answer = completions.completion_body(rid, request, result, text)
        if request.stream:
            return StreamingResponse(iter(completions.completion_events(answer, request)), media_type="text/event-stream")
        return answer

    @app.get("/v1/models")
    def models() -> Any:
        return completions.models_body()

    # /health and /metrics are async: on the event loop, answered while held requests take the threads
    @app.get("/health")
    async def health() -> Any:
        if server.error is not None:
            return JSONResponse({"status": "error", "error": health_error(server.error)}, status_code=500)
        return {"status": "ok", "ranks": server.ranks}

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(metrics_text(server))

    @app.post("/scale_elastic_ep")
    async def scale_elastic_ep(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse(error_body(400, "Invalid JSON format"), status_code=400)
        new_size = body.get("new_data_parallel_size") if isinstance(body, dict) else None
        drain_timeout = body.get("drain_timeout") if isinstance(body, dict) else None
        if new_size is None:
            return JSONResponse(error_body(400, "new_data_parallel_size is required"), status_code=400)
        if isinstance(new_size, bool) or not isinstance(new_size, int) or new_size <= 0:
            return JSONResponse(error_body(400, "new_data_parallel_size must be a positive integer"), status_code=400)
        problem = drain_timeout_problem(drain_timeout)
        if problem:
            return JSONResponse(error_body(400, problem), status_code=400)
        from starlette.concurrency import run_in_threadpool

        try:
            message = await run_in_threadpool(server.scale, new_size, drain_timeout)
        except ScaleError as error:
            return JSONResponse(error_body(error.status, str(error)), status_code=error.status)
        return {"message": message}

    @app.post("/is_scaling_elastic_ep")
    def is_scaling_elastic_ep() -> Any:
        return {"is_scaling_elastic_ep": bool(server.scaling)}

    return app


def serve(server, host: str, port: int, *, api_key: str | None = None,
          max_concurrency: int = DEFAULT_CONCURRENCY) -> None:
    """Runs until interrupted; the members are stopped either way."""
    import uvicorn

    server.start()
    try:
        uvicorn.run(make_app(server, api_key=api_key, max_concurrency=max_concurrency), host=host, port=port,
                    log_level="warning")
    finally:
        server.shutdown()
