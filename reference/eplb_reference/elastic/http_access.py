"""Who may use ``eplb-graph serve``'s HTTP API, and how much of it at once.

``ApiKey``: with a key configured, every route but ``/health`` and ``/metrics`` (which say only
whether the group serves and how much: no prompt, token or traceback) needs
``Authorization: Bearer <key>``, vLLM's own scheme for its ``--api-key``; anything else is
answered 401 before the request is read. The key comes from a file (``--api-key-file``) or
``EPLB_GRAPH_API_KEY``, never from the command line, where every local user reads it (``ps``).
It is compared in constant time. TLS is not provided: off loopback, put a TLS proxy in front.

``ConcurrencyLimit``: at most ``limit`` requests that generate or resize are in the server at
once; one more is answered 503 at once. Each takes a worker thread while it waits for its
tokens, so without a bound held requests (a drain) could take every thread; ``/health`` and
``/metrics`` are not counted, and run on the event loop (``http.py``), never behind them.
"""

from __future__ import annotations

import hmac
import json
import os
import stat
from pathlib import Path

ERROR_TYPES = {400: "BadRequestError", 401: "Unauthorized", 408: "RequestTimeout", 409: "Conflict",
               413: "PayloadTooLarge", 500: "InternalServerError", 503: "ServiceUnavailable"}
API_KEY_ENV = "EPLB_GRAPH_API_KEY"
OPEN_PATHS = ("/health", "/metrics")  # answered without a key: they leak nothing
MAX_KEY_FILE_BYTES = 4096
DEFAULT_CONCURRENCY = 64


class ApiKeyError(ValueError):
    """The API key cannot be read or is not one."""


def load_api_key(key_file: str | None, environ: dict[str, str] | os._Environ) -> str | None:
    """The key from ``key_file`` (this user's, unreadable by others) or the environment; None: no key."""
    if key_file is None:
        key = environ.get(API_KEY_ENV)
        if key is None:
            return None
        where = API_KEY_ENV
    else:
        path = Path(key_file)
        try:
            info = path.stat()
            if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise ApiKeyError(f"the API key file {path} must be this user's and closed to others (chmod 600)")
            if info.st_size > MAX_KEY_FILE_BYTES:
                raise ApiKeyError(f"the API key file {path} is larger than {MAX_KEY_FILE_BYTES} bytes")
            key = path.read_text().strip()
        except OSError as error:
            raise ApiKeyError(f"the API key file {path} cannot be read: {error.strerror}") from None
        where = str(path)
    if len(key) < 16 or not key.isprintable() or any(c.isspace() for c in key):
        raise ApiKeyError(f"the API key in {where} must be at least 16 printable characters without spaces")
    return key


def error_body(status: int, message: str) -> dict:
    """vLLM's error response shape."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": None, "code": status}}


async def _answer(send, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ApiKey:
    """ASGI middleware: 401 for a request without the key, on every route but ``OPEN_PATHS``."""

    def __init__(self, app, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await _answer(send, 401, "a valid API key is required (Authorization: Bearer <key>)")
                return
        await self.app(scope, receive, send)


class ConcurrencyLimit:
    """ASGI middleware: at most ``limit`` counted requests at once, 503 beyond (``OPEN_PATHS`` free)."""

    def __init__(self, app, limit: int = DEFAULT_CONCURRENCY) -> None:
        if limit < 1:
            raise ValueError(f"the concurrency limit must be at least 1, not {limit}")
        self.app = app
        self.limit = limit
        self.in_flight = 0  # the event loop's thread alone changes it

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            await _answer(send, 503, f"the server has {self.limit} requests in flight, its limit: retry later")
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
