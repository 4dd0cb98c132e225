"""The edge's HTTP front door: OpenAI-compatible completions and chat, SGLang's ``/generate``.

Every request gets an id (``X-Request-Id``, echoed in the body and in every log line on the edge
and the agent). Responses carry a ``kvcompass`` object naming the worker that served and how
many prompt tokens it reused. Every refusal, the HTTP layer's own included (404, 405, a head too
slow, large or malformed), is an OpenAI-style JSON error with a string ``code``
(``openai_errors``); what a request may cost the edge is bounded by ``httplimits``; the OpenAI
request and response shapes live in ``openai_api``. The HTTP server is ``http_server``
(``FrontDoor.serve`` starts one); its handler is ``FrontDoor.handle``.
"""

from __future__ import annotations

import array
import asyncio
import itertools
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvcompassd.forwarding import (
    Forwarder,
    ForwardError,
    ForwardRequest,
    GenerationFinished,
    TokensGenerated,
)
from kvcompassd.http_server import HttpServer, Request, Response, ResponseStream
from kvcompassd.httplimits import FrontDoorGuard, Refused, read_json
from kvcompassd.metrics import EdgeMetrics
from kvcompassd.openai_api import (
    OpenAIRender,
    RequestError,
    check_model,
    include_usage,
    kvcompass_info,
    openai_sampling,
)
from kvcompassd.openai_errors import error_body, error_response
from kvcompassd.sampling import SamplingError, check_sampling
from kvcompassd.tokenizer import Tokenizer, TokenizerError

log = structlog.get_logger(__name__)

# Route labels of the request counter: a fixed set, whatever paths clients try.
ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate", "/v1/models", "/health", "/metrics", "other")
_OPEN_PATHS = ("/health", "/metrics")
_UINT32 = next((code for code in "IL" if array.array(code).itemsize == 4), None)  # array's 4-byte unsigned int
# /generate fields the edge carries; the others SGLang takes are refused by name, never ignored.
_GENERATE_FIELDS = frozenset({"text", "input_ids", "sampling_params", "stream", "rid", "model", "return_logprob"})


@dataclass(frozen=True, slots=True)
class FrontDoorSettings:
    model: str
    max_prompt_tokens: int = 131072
    max_new_tokens_limit: int = 32768
    default_max_tokens: int = 16
    api_keys: frozenset[str] = frozenset()


class BadRequest(RequestError):
    def __init__(self, message: str, status: int = 400, *, param: str | None = None, code: str | None = None):
        super().__init__(status, message, param=param, code=code)


# What the edge's chat rendering passes to the template; any other field of a message (tool_calls,
# name, ...) would change what the engine renders, so it is refused by name, never dropped.
RENDERED_MESSAGE_FIELDS = frozenset({"role", "content"})


def _refuse_unrendered_message_fields(messages) -> None:
    if not isinstance(messages, list):
        return  # the tokenizer's own check names what is wrong
    for i, message in enumerate(messages):
        if isinstance(message, dict):
            for key in message:
                if key not in RENDERED_MESSAGE_FIELDS:
                    raise BadRequest(f"messages[{i}].{str(key)[:64]} is not supported by this edge",
                                     param=f"messages[{i}].{str(key)[:64]}", code="unsupported_parameter")


def route_label(request: Request) -> str:
    path = request.path
    return path if path in ROUTES else "other"


def json_bytes(obj: Any) -> bytes:
    """``obj`` as compact JSON in UTF-8, as SGLang's server writes its answers (orjson: a tenth
    of ``json.dumps``' time on a response's ids and meta); ``json`` for what orjson refuses (an
    int past 64 bits, a key that is not a string)."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, separators=(",", ":")).encode()


def json_response(obj: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json_bytes(obj), status=status, headers=headers)


class FrontDoor:
    """The OpenAI and SGLang routes around a ``Forwarder``; ``serve`` runs them on an
    ``http_server.HttpServer`` under ``guard``'s limits."""

    def __init__(self, forwarder: Forwarder, tokenizer: Tokenizer, settings: FrontDoorSettings,
                 metrics: EdgeMetrics, *, health: callable = dict, guard: FrontDoorGuard | None = None):
        self.forwarder = forwarder
        self.tokenizer = tokenizer
        self._encode_array = getattr(tokenizer, "encode_array", None)
        self.settings = settings
        self.metrics = metrics
        self.health = health
        self.guard = guard or FrontDoorGuard(metrics=metrics)
        # path -> (method, handler); GET routes answer HEAD too.
        self.routes = {
            "/v1/completions": ("POST", self.completions),
            "/v1/chat/completions": ("POST", self.chat_completions),
            "/generate": ("POST", self.generate),
            "/v1/models": ("GET", self.models),
            "/health": ("GET", self.health_route),
            "/metrics": ("GET", self.metrics_route),
        }
        self.server: HttpServer | None = None

    async def serve(self, host: str, port: int, *, reuse_port: bool = False) -> tuple[str, int]:
        """Listen on ``host:port`` (0: any free port); returns the address bound."""
        self.server = HttpServer(self.handle, self.guard)
        return await self.server.start(host, port, reuse_port=reuse_port)

    async def close(self) -> None:
        """Stop listening and end every connection (a request in progress is cancelled, which
        aborts it at its worker)."""
        if self.server is not None:
            await self.server.close()

    def _count(self, request: Request, status: int) -> None:
        self.metrics.count_request(route_label(request), status)

    async def handle(self, request: Request) -> Response | ResponseStream:
        """Every request: API key, route, method, then its handler; every refusal an OpenAI
        error in JSON."""
        try:
            if self.settings.api_keys and request.path not in _OPEN_PATHS:
                refusal = self._unauthorised(request)
                if refusal is not None:
                    return refusal
            route = self.routes.get(request.path)
            if route is None:
                self._count(request, 404)
                return error_response(404, "Not Found")
            method, handler = route
            if request.method != method and not (method == "GET" and request.method == "HEAD"):
                self.metrics.count_request("other", 405)
                allow = "GET,HEAD" if method == "GET" else method
                return error_response(405, "Method Not Allowed", headers={"Allow": allow})
            return await handler(request)
        except Refused as exc:
            self._count(request, exc.status)
            log.info("request refused", route=route_label(request), status=exc.status, error=str(exc))
            return error_response(exc.status, str(exc), code=exc.code, headers=exc.headers, close=exc.close)
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("front door handler failed", path=request.path[:200])
            self._count(request, 500)
            return error_response(500, "internal error at the edge", code="internal_error")

    def _unauthorised(self, request: Request) -> Response | None:
        headers = request.headers
        auth = headers.get("authorization", "")
        key = auth[7:] if auth.startswith("Bearer ") else headers.get("x-api-key", "")
        if key in self.settings.api_keys:
            return None
        log.warning("unauthorised request", path=request.path[:200], remote=request.remote)
        self._count(request, 401)
        return error_response(401, "missing or invalid API key", code="invalid_api_key")

    # -- helpers ------------------------------------------------------------------------------

    async def _json(self, request: Request) -> dict:
        body = await read_json(request, self.guard)
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object", code="invalid_json")
        return body

    def _tokens(self, ids: Any, param: str) -> np.ndarray:
        if not isinstance(ids, list) or not ids:
            raise BadRequest("token ids must be a non-empty list of integers", param=param)
        if len(ids) > self.settings.max_prompt_tokens:
            raise BadRequest(f"prompt has {len(ids)} tokens; the limit is {self.settings.max_prompt_tokens}", 413,
                             param=param, code="context_length_exceeded")
        # One vectorised check instead of a Python loop per token (it was most of the edge's
        # CPU per request): any non-integer makes numpy pick another dtype.
        try:
            arr = np.asarray(ids)
        except (ValueError, OverflowError):
            arr = None
        if arr is None or arr.ndim != 1 or arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) >= 2**32:
            raise BadRequest("token ids must be integers in [0, 2^32)", param=param)
        return arr.astype(np.uint32)

    def _encode_text(self, text: Any, param: str) -> np.ndarray:
        if not isinstance(text, str) or not text:
            raise BadRequest("prompt must be a non-empty string or a list of token ids", param=param)
        if len(text) > 16 * self.settings.max_prompt_tokens:
            raise BadRequest("prompt text is too long", 413, param=param, code="context_length_exceeded")
        # A tokenizer that can give its ids as a uint32 array (the byte tokenizer's, one numpy
        # call) spares the list and its copy below; its ids are the list's.
        ids = self._encode_array(text) if self._encode_array is not None else self.tokenizer.encode(text)
        if len(ids) > self.settings.max_prompt_tokens:
            raise BadRequest(f"prompt has {len(ids)} tokens; the limit is {self.settings.max_prompt_tokens}", 413,
                             param=param, code="context_length_exceeded")
        if isinstance(ids, np.ndarray):
            return ids
        # Our own tokenizer's ids need no checking. Through array.array: numpy converting a list
        # of thousands of ints costs ~4x the C loop that fills an array of uint32.
        if _UINT32 is not None:
            try:
                return np.frombuffer(array.array(_UINT32, ids), dtype=np.uint32)
            except (TypeError, OverflowError):  # not a list of ints after all: numpy's conversion
                pass
        return np.asarray(ids, dtype=np.uint32)

    async def _run(self, route: str, request: Request, parse) -> Response | ResponseStream:
        request_id = request.headers.get("x-request-id") or _new_request_id()
        if len(request_id) > 128 or not request_id.isprintable():
            request_id = _new_request_id()
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            try:
                fwd, render = parse(await self._json(request), request_id)
            except Refused as exc:
                self.metrics.count_request(route, exc.status)
                return error_response(exc.status, str(exc), code=exc.code, headers=exc.headers,
                                      request_id=request_id, close=exc.close)
            except (RequestError, TokenizerError) as exc:
                status = getattr(exc, "status", 400)
                self.metrics.count_request(route, status)
                log.info("bad request", route=route, status=status, error=str(exc))
                return error_response(status, str(exc), request_id=request_id, param=getattr(exc, "param", None),
                                      code=getattr(exc, "code", None))
            started = time.perf_counter()
            if fwd.stream:
                return await self._stream(route, request, fwd, render, started)
            return await self._whole(route, fwd, render, started)
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    def _forward_error(self, route: str, exc: ForwardError, request_id: str) -> Response:
        self.metrics.count_request(route, exc.status)
        return error_response(exc.status, str(exc), code=getattr(exc, "code", None), request_id=request_id)

    async def _whole(self, route, fwd: ForwardRequest, render, started) -> Response:
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
            return self._forward_error(route, exc, fwd.request_id)
        self._observe(route, started, first)
        return json_response(render.whole("".join(text), ids, done), headers=_headers(fwd, done))

    async def _stream(self, route, request: Request, fwd: ForwardRequest, render, started) -> Response | ResponseStream:
        agen = self.forwarder.generate(fwd)
        try:
            # Hold the response headers until the first piece arrives, so that a request no worker
            # can serve still gets a proper HTTP error instead of a broken stream.
            try:
                first_item = await agen.__anext__()
            except ForwardError as exc:
                return self._forward_error(route, exc, fwd.request_id)
            first = time.perf_counter()
            resp = request.start_stream({"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                         "X-Request-Id": fwd.request_id})
            for chunk in render.opening():
                await resp.write(_sse(chunk))
            try:
                item = first_item
                while True:
                    if isinstance(item, TokensGenerated):
                        await resp.write(_sse(render.chunk(item)))
                    else:
                        for chunk in render.final(item):
                            await resp.write(_sse(chunk))
                        break
                    item = await agen.__anext__()
            except ForwardError as exc:
                log.warning("stream broken", error=str(exc))
                await resp.write(_sse(error_body(exc.status, str(exc), code=getattr(exc, "code", None))))
            except StopAsyncIteration:
                pass
            await resp.write(b"data: [DONE]\n\n")
            await resp.end()
            self._observe(route, started, first)
            return resp
        finally:
            # A client gone mid-stream (its write failed, or its handler was cancelled while the
            # generator waited on the worker) closes the generator now, which aborts the request
            # at the worker, rather than whenever the collector finalises it.
            await agen.aclose()

    def _observe(self, route: str, started: float, first: float | None) -> None:
        end = time.perf_counter()
        self.metrics.count_request(route, 200)
        self.metrics.request_observations.observe(end - started)
        if first is not None:
            self.metrics.ttft_observations.observe(first - started)

    def _openai_params(self, body: dict, chat: bool) -> tuple[dict, bool]:
        check_model(body, self.settings.model)
        params = openai_sampling(body, chat=chat, max_new_tokens_limit=self.settings.max_new_tokens_limit,
                                 default_max_tokens=self.settings.default_max_tokens,
                                 vocab_size=getattr(self.tokenizer, "vocab_size", None))
        return params, _flag(body, "stream")

    # -- routes -------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response | ResponseStream:
        def parse(body, request_id):
            params, stream = self._openai_params(body, chat=False)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                tokens = self._tokens(prompt, "prompt")
            elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                one = prompt[0]
                tokens = self._tokens(one, "prompt") if isinstance(one, list) else self._encode_text(one, "prompt")
            elif isinstance(prompt, list) and len(prompt) > 1:
                raise BadRequest("a batch of prompts is not supported; send one prompt per request",
                                 param="prompt", code="unsupported_parameter")
            else:
                tokens = self._encode_text(prompt, "prompt")
            fwd = ForwardRequest(request_id, tokens, params, stream)
            return fwd, OpenAIRender("text_completion", request_id, self.settings.model, len(tokens),
                                     usage_in_stream=include_usage(body))
        return await self._run("/v1/completions", request, parse)

    async def chat_completions(self, request: Request) -> Response | ResponseStream:
        def parse(body, request_id):
            params, stream = self._openai_params(body, chat=True)
            _refuse_unrendered_message_fields(body.get("messages"))
            tokens = self._tokens(self.tokenizer.apply_chat_template(body.get("messages")), "messages")
            fwd = ForwardRequest(request_id, tokens, params, stream)
            return fwd, OpenAIRender("chat.completion", request_id, self.settings.model, len(tokens),
                                     usage_in_stream=include_usage(body))
        return await self._run("/v1/chat/completions", request, parse)

    async def generate(self, request: Request) -> Response | ResponseStream:
        def parse(body, request_id):
            for name in body:
                if name not in _GENERATE_FIELDS:
                    raise BadRequest(f"field {name[:64]!r} is not supported by this edge", param=name[:64],
                                     code="unsupported_parameter")
            if body.get("return_logprob") not in (None, False):
                raise BadRequest("return_logprob is not supported by this edge", param="return_logprob",
                                 code="unsupported_parameter")
            if body.get("model") is not None:
                check_model(body, self.settings.model)
            if body.get("input_ids") is not None:
                tokens = self._tokens(body["input_ids"], "input_ids")
            else:
                tokens = self._encode_text(body.get("text"), "text")
            try:
                params = check_sampling(body.get("sampling_params"),
                                        max_new_tokens_limit=self.settings.max_new_tokens_limit,
                                        default_max_new_tokens=self.settings.default_max_tokens,
                                        vocab_size=getattr(self.tokenizer, "vocab_size", None))
            except SamplingError as exc:
                param = exc.param if exc.param == "sampling_params" else f"sampling_params.{exc.param}"
                raise BadRequest(str(exc), param=param, code="invalid_value") from None
            stream = _flag(body, "stream")
            return ForwardRequest(request_id, tokens, params, stream), _SGLangRender(request_id, len(tokens))
        return await self._run("/generate", request, parse)

    async def models(self, request: Request) -> Response:
        return json_response({"object": "list", "data": [
            {"id": self.settings.model, "object": "model", "created": 0, "owned_by": "kvcompass"}]})

    async def health_route(self, request: Request) -> Response:
        state = self.health()
        return json_response(state, status=200 if state.get("ready", True) else 503)

    async def metrics_route(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), content_type=CONTENT_TYPE_LATEST)


# A request id is 32 hex digits, as ``uuid4().hex``: 64 random bits drawn once per process, then
# a 64-bit counter. Unique across processes and restarts without a getrandom system call per
# request (os.urandom was one); ids are names, not secrets (a client may send its own in X-Request-Id).
_REQUEST_ID_PREFIX = os.urandom(8).hex()
_request_counter = itertools.count()


def _new_request_id() -> str:
    return f"{_REQUEST_ID_PREFIX}{next(_request_counter) & 0xFFFFFFFFFFFFFFFF:016x}"


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be a boolean", param=name, code="invalid_type")
    return value


def _sse(obj: dict) -> bytes:
    return b"data: " + json_bytes(obj) + b"\n\n"


def _headers(fwd: ForwardRequest, done: GenerationFinished) -> dict:
    return {"X-Request-Id": fwd.request_id, "X-KVCompass-Worker": done.worker,
            "X-KVCompass-Cached-Tokens": str(done.cached_tokens)}


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
                        completion_tokens=done.completion_tokens, kvcompass=kvcompass_info(done))
        return meta

    def whole(self, text: str, ids: list[int], done: GenerationFinished) -> dict:
        self.ids = ids
        return {"text": text, "output_ids": ids, "meta_info": self._meta(done)}

    def opening(self) -> list[dict]:
        return []

    def chunk(self, item: TokensGenerated) -> dict:
        self.text += item.text
        self.ids.extend(item.token_ids)
        return {"text": self.text, "output_ids": list(self.ids), "meta_info": self._meta(None)}

    def final(self, done: GenerationFinished) -> list[dict]:
        return [{"text": self.text, "output_ids": list(self.ids), "meta_info": self._meta(done)}]
