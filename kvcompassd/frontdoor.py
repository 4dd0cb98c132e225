"""The edge's HTTP front door: OpenAI-compatible completions and chat, SGLang's ``/generate``.

Every request gets an id (``X-Request-Id``, echoed in the body and in every log line on the edge
and the agent). Responses carry a ``kvcompass`` object naming the worker that served and how
many prompt tokens it reused. Bad requests get a 4xx with an OpenAI-style error body.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvcompassd.forwarding import ForwardError, ForwardRequest, Forwarder, GenerationFinished, TokensGenerated
from kvcompassd.metrics import EdgeMetrics
from kvcompassd.tokenizer import Tokenizer, TokenizerError

log = structlog.get_logger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class FrontDoorSettings:
    model: str
    max_prompt_tokens: int = 131072
    max_new_tokens_limit: int = 32768
    default_max_tokens: int = 16
    api_keys: frozenset[str] = frozenset()


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _error(status: int, message: str, request_id: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "code": status}}
    headers = {"X-Request-Id": request_id} if request_id else None
    return web.json_response(body, status=status, headers=headers)


def _sampling_from_openai(body: dict, settings: FrontDoorSettings) -> dict:
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", settings.default_max_tokens))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 0 <= max_tokens <= settings.max_new_tokens_limit:
        raise BadRequest(f"max_tokens must be an integer in [0, {settings.max_new_tokens_limit}]")
    params: dict[str, Any] = {"max_new_tokens": max_tokens}
    for name in ("temperature", "top_p", "top_k", "frequency_penalty", "presence_penalty", "seed"):
        if body.get(name) is not None:
            value = body[name]
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise BadRequest(f"{name} must be a number")
            params[name] = value
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
            raise BadRequest("stop must be a string or a list of at most 16 strings")
        params["stop"] = stop
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is supported")
    return params


def _check_sglang_sampling(params: Any, settings: FrontDoorSettings) -> dict:
    if params is None:
        return {"max_new_tokens": settings.default_max_tokens}
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object")
    m = params.get("max_new_tokens", settings.default_max_tokens)
    if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m <= settings.max_new_tokens_limit:
        raise BadRequest(f"sampling_params.max_new_tokens must be an integer in [0, {settings.max_new_tokens_limit}]")
    try:
        json.dumps(params)
    except (TypeError, ValueError):
        raise BadRequest("sampling_params must be plain JSON") from None
    return {**params, "max_new_tokens": m}


class FrontDoor:
    """aiohttp application around a ``Forwarder``."""

    def __init__(self, forwarder: Forwarder, tokenizer: Tokenizer, settings: FrontDoorSettings,
                 metrics: EdgeMetrics, *, health: callable = lambda: {}):
        self.forwarder = forwarder
        self.tokenizer = tokenizer
        self.settings = settings
        self.metrics = metrics
        self.health = health
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._auth])
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/generate", self.generate),
            web.get("/v1/models", self.models),
            web.get("/health", self.health_route),
            web.get("/metrics", self.metrics_route),
        ])

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.settings.api_keys and request.path not in ("/health", "/metrics"):
            auth = request.headers.get("Authorization", "")
            key = auth[7:] if auth.startswith("Bearer ") else request.headers.get("X-API-Key", "")
            if key not in self.settings.api_keys:
                log.warning("unauthorised request", path=request.path, remote=request.remote)
                self.metrics.requests.labels(request.path, "401").inc()
                return _error(401, "missing or invalid API key")
        return await handler(request)

    # -- helpers ------------------------------------------------------------------------------

    async def _json(self, request: web.Request) -> dict:
        try:
            body = await request.json(loads=json.loads)
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    def _tokens(self, ids: Any) -> np.ndarray:
        if not isinstance(ids, list) or not ids:
            raise BadRequest("token ids must be a non-empty list of integers")
        if len(ids) > self.settings.max_prompt_tokens:
            raise BadRequest(f"prompt has {len(ids)} tokens; the limit is {self.settings.max_prompt_tokens}", 413)
        # One vectorised check instead of a Python loop per token (it was most of the edge's
        # CPU per request): any non-integer makes numpy pick another dtype.
        try:
            arr = np.asarray(ids)
        except (ValueError, OverflowError):
            arr = None
        if arr is None or arr.ndim != 1 or arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) >= 2**32:
            raise BadRequest("token ids must be integers in [0, 2^32)")
        return arr.astype(np.uint32)

    def _encode_text(self, text: Any) -> np.ndarray:
        if not isinstance(text, str) or not text:
            raise BadRequest("prompt must be a non-empty string or a list of token ids")
        if len(text) > 16 * self.settings.max_prompt_tokens:
            raise BadRequest("prompt text is too long", 413)
        ids = self.tokenizer.encode(text)
        if len(ids) > self.settings.max_prompt_tokens:
            raise BadRequest(f"prompt has {len(ids)} tokens; the limit is {self.settings.max_prompt_tokens}", 413)
        return np.asarray(ids, dtype=np.uint32)  # our own tokenizer's ids need no checking

    async def _run(self, route: str, request: web.Request, parse) -> web.StreamResponse:
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        if len(request_id) > 128 or not request_id.isprintable():
            request_id = uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            try:
                body = await self._json(request)
                fwd, render = parse(body, request_id)
            except (BadRequest, TokenizerError) as exc:
                status = getattr(exc, "status", 400)
                self.metrics.requests.labels(route, str(status)).inc()
                log.info("bad request", route=route, status=status, error=str(exc))
                return _error(status, str(exc), request_id)
            started = time.perf_counter()
            if fwd.stream:
                return await self._stream(route, request, fwd, render, started)
            return await self._whole(route, fwd, render, started)
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    async def _whole(self, route, fwd: ForwardRequest, render, started) -> web.Response:
        ids: list[int] = []
        text: list[str] = []
        first = None
        try:
            async for item in self.forwarder.generate(fwd):
                if isinstance(item, TokensGenerated):
                    first = first or time.perf_counter()
                    ids.extend(item.token_ids)
                    text.append(item.text)
                else:
                    done = item
        except ForwardError as exc:
            self.metrics.requests.labels(route, str(exc.status)).inc()
            return _error(exc.status, str(exc), fwd.request_id)
        self._observe(route, started, first)
        return web.json_response(render.whole("".join(text), ids, done), headers=_headers(fwd, done))

    async def _stream(self, route, request, fwd: ForwardRequest, render, started) -> web.StreamResponse:
        agen = self.forwarder.generate(fwd)
        # Hold the response headers until the first piece arrives, so that a request no worker
        # can serve still gets a proper HTTP error instead of a broken stream.
        try:
            first_item = await agen.__anext__()
        except ForwardError as exc:
            self.metrics.requests.labels(route, str(exc.status)).inc()
            return _error(exc.status, str(exc), fwd.request_id)
        first = time.perf_counter()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": fwd.request_id})
        await resp.prepare(request)
        done = None
        try:
            item = first_item
            while True:
                if isinstance(item, TokensGenerated):
                    await resp.write(_sse(render.chunk(item)))
                else:
                    done = item
                    await resp.write(_sse(render.final(done)))
                    break
                item = await agen.__anext__()
        except ForwardError as exc:
            log.warning("stream broken", error=str(exc))
            await resp.write(_sse({"error": {"message": str(exc), "code": exc.status}}))
        except StopAsyncIteration:
            pass
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self._observe(route, started, first)
        return resp

    def _observe(self, route: str, started: float, first: float | None) -> None:
        end = time.perf_counter()
        self.metrics.requests.labels(route, "200").inc()
        self.metrics.request_seconds.observe(end - started)
        if first is not None:
            self.metrics.ttft_seconds.observe(first - started)

    # -- routes -------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        def parse(body, request_id):
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                tokens = self._tokens(prompt)
            elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                tokens = self._encode_text(prompt[0])
            else:
                tokens = self._encode_text(prompt)
            params = _sampling_from_openai(body, self.settings)
            stream = _flag(body, "stream")
            fwd = ForwardRequest(request_id, tokens, params, stream)
            return fwd, _OpenAIRender("text_completion", request_id, self.settings.model, len(tokens))
        return await self._run("/v1/completions", request, parse)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        def parse(body, request_id):
            tokens = self._tokens(self.tokenizer.apply_chat_template(body.get("messages")))
            params = _sampling_from_openai(body, self.settings)
            stream = _flag(body, "stream")
            fwd = ForwardRequest(request_id, tokens, params, stream)
            return fwd, _OpenAIRender("chat.completion", request_id, self.settings.model, len(tokens))
        return await self._run("/v1/chat/completions", request, parse)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        def parse(body, request_id):
            if body.get("input_ids") is not None:
                tokens = self._tokens(body["input_ids"])
            else:
                tokens = self._encode_text(body.get("text"))
            params = _check_sglang_sampling(body.get("sampling_params"), self.settings)
            stream = _flag(body, "stream")
            return ForwardRequest(request_id, tokens, params, stream), _SGLangRender(request_id, len(tokens))
        return await self._run("/generate", request, parse)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.settings.model, "object": "model", "owned_by": "kvcompass"}]})

    async def health_route(self, request: web.Request) -> web.Response:
        state = self.health()
        return web.json_response(state, status=200 if state.get("ready", True) else 503)

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be a boolean")
    return value


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _headers(fwd: ForwardRequest, done: GenerationFinished) -> dict:
    return {"X-Request-Id": fwd.request_id, "X-KVCompass-Worker": done.worker,
            "X-KVCompass-Cached-Tokens": str(done.cached_tokens)}


def _kvcompass(done: GenerationFinished) -> dict:
    return {
        "worker": done.worker,
        "region": done.region,
        "cached_tokens": done.cached_tokens,
        "claimed_tokens": done.claimed_tokens,
        "attempts": done.attempts,
        "decision_us": round(done.decision_us, 1),
    }


class _OpenAIRender:
    def __init__(self, kind: str, request_id: str, model: str, prompt_tokens: int):
        self.kind, self.id, self.model, self.prompt_tokens = kind, request_id, model, prompt_tokens
        self.created = int(time.time())
        self.completion_tokens = 0

    def _choice(self, text: str, finish: str | None) -> dict:
        if self.kind == "chat.completion":
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def _usage(self, done: GenerationFinished) -> dict:
        return {
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
        }

    def whole(self, text: str, ids: list[int], done: GenerationFinished) -> dict:
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model,
                "choices": [self._choice(text, done.finish_reason or "stop")],
                "usage": self._usage(done), "kvcompass": _kvcompass(done)}

    def _chunk_obj(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"

    def _delta(self, text: str, finish: str | None) -> dict:
        if self.kind == "chat.completion":
            return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def chunk(self, item: TokensGenerated) -> dict:
        return {"id": self.id, "object": self._chunk_obj(), "created": self.created, "model": self.model,
                "choices": [self._delta(item.text, None)]}

    def final(self, done: GenerationFinished) -> dict:
        return {"id": self.id, "object": self._chunk_obj(), "created": self.created, "model": self.model,
                "choices": [self._delta("", done.finish_reason or "stop")], "usage": self._usage(done),
                "kvcompass": _kvcompass(done)}


class _SGLangRender:
    def __init__(self, request_id: str, prompt_tokens: int):
        self.id = request_id
        self.prompt_tokens = prompt_tokens
        self.text = ""
        self.ids: list[int] = []

    def _meta(self, done: GenerationFinished | None) -> dict:
        meta = {"id": self.id, "prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.ids)}
        if done is not None:
            meta.update(cached_tokens=done.cached_tokens, finish_reason={"type": done.finish_reason or "stop"},
                        completion_tokens=done.completion_tokens, kvcompass=_kvcompass(done))
        return meta

    def whole(self, text: str, ids: list[int], done: GenerationFinished) -> dict:
        self.ids = ids
        return {"text": text, "output_ids": ids, "meta_info": self._meta(done)}

    def chunk(self, item: TokensGenerated) -> dict:
        self.text += item.text
        self.ids.extend(item.token_ids)
        return {"text": self.text, "output_ids": list(self.ids), "meta_info": self._meta(None)}

    def final(self, done: GenerationFinished) -> dict:
        return {"text": self.text, "output_ids": list(self.ids), "meta_info": self._meta(done)}
