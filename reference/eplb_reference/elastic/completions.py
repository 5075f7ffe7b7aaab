"""OpenAI's completions API over the elastic server: what a standard client or load generator sends.

The reference decoder speaks the tiny word-level vocabulary (``models/tiny_tokenizer.py``:
token ``i`` is the word ``w{i}``), so text maps to ids and back without a tokenizer file. Only
greedy decoding exists (``temperature=0`` asked for, one choice); ``prompt`` is text or a list of
token ids, as OpenAI allows. ``stream=true`` answers in OpenAI's server-sent events (the whole
completion in one chunk, as the server returns it whole), with the usage chunk when
``stream_options.include_usage`` asks. A request the server cannot serve is refused before it is
queued.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from eplb_reference.models.tiny_tokenizer import SPECIAL_TOKENS, tiny_vocabulary

SERVED_MODEL = "eplb-graph-reference"
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class CompletionError(ValueError):
    """A completion request the server refuses; ``status`` is the HTTP code (400, 404)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class CompletionRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    stream: bool = False
    include_usage: bool = False


class TinyText:
    """Words ``w{i}`` <-> token ids of a ``vocab_size`` vocabulary."""

    def __init__(self, vocab_size: int) -> None:
        self.ids = tiny_vocabulary(vocab_size)
        self.words = {index: word for word, index in self.ids.items()}

    def encode(self, text: str) -> list[int]:
        unknown = [word for word in text.split() if word not in self.ids]
        if unknown:
            raise CompletionError(f"prompt words {unknown[:5]} are not in the vocabulary (w{len(SPECIAL_TOKENS)} .. "
                                  f"w{len(self.ids) - 1})")
        return [self.ids[word] for word in text.split()]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(f" {self.words[t]}" for t in token_ids)  # as vLLM's word-level detokenizer does


def parse_completion(body: object, text: TinyText) -> CompletionRequest:
    """The OpenAI body -> what the server queues; CompletionError naming the field otherwise."""
    if not isinstance(body, dict):
        raise CompletionError("the body must be a JSON object")
    model = body.get("model", SERVED_MODEL)
    if model != SERVED_MODEL:
        raise CompletionError(f"The model `{model}` does not exist.", status=404)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        prompt_ids = text.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt_ids = prompt
    else:
        raise CompletionError("prompt must be a string or a list of token ids (one prompt per request)")
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise CompletionError("max_tokens must be a positive integer")
    if body.get("temperature", 1.0) != 0 or body.get("n", 1) != 1:  # OpenAI's default temperature is 1
        raise CompletionError("this server decodes greedily only: ask for temperature=0 and n=1")
    stream, options = body.get("stream", False), body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise CompletionError("stream must be a boolean and stream_options an object")
    return CompletionRequest(prompt_ids, max_tokens, stream, bool(options.get("include_usage", False)))


def completion_body(request_id: int, request: CompletionRequest, result: dict, text: TinyText) -> dict:
    """The server's result -> OpenAI's completion object (one choice, finished by length)."""
    tokens = result["token_ids"]
    return {
        "id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()), "model": SERVED_MODEL,
        "choices": [{"index": 0, "text": text.decode(tokens), "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": len(request.prompt_token_ids), "completion_tokens": len(tokens),
                  "total_tokens": len(request.prompt_token_ids) + len(tokens)},
    }


def completion_events(body: dict, request: CompletionRequest) -> list[str]:
    """The completion as OpenAI's stream: its choice in one chunk, the usage chunk if asked, [DONE]."""
    head = {key: body[key] for key in ("id", "object", "created", "model")}
    chunks = [{**head, "choices": body["choices"]}]
    if request.include_usage:
        chunks.append({**head, "choices": [], "usage": body["usage"]})
    return [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks] + ["data: [DONE]\n\n"]


def models_body() -> dict:
    """``GET /v1/models``: the one model served (clients and load generators ask first)."""
    return {"object": "list", "data": [{"id": SERVED_MODEL, "object": "model", "created": 0, "owned_by": "eplb-graph"}]}
