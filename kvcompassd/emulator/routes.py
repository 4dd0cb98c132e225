"""HTTP layer of the emulated SGLang worker (aiohttp): request parsing and response shapes.

Shapes follow SGLang: ``/generate`` returns ``{"text", "output_ids", "meta_info": {"id",
"finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}}`` and
streams cumulative chunks as ``data: {...}`` then ``data: [DONE]``; the OpenAI routes report
reuse in ``usage.prompt_tokens_details.cached_tokens``; ``/v1/loads`` is SGLang's
``{"timestamp", "version", "dp_rank_count", "loads": [...], "aggregate": {...}}``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvcompassd.worker.workermodel import WorkerModelError
from kvcompassd.emulator.kvtransfer import Bootstrap, TransferFailed
from kvcompassd.emulator.server import (
    MAX_TOKEN_ID,
    VERSION,
    BadRequest,
    EmulatedEngine,
    Generation,
)
from kvcompassd.tokenizer import BYTE, TokenizerError

ENGINE = web.AppKey("engine", EmulatedEngine)


def chat_tokens(engine: EmulatedEngine, messages: Any) -> list[int]:
    """The chat rendered with the worker tokenizer's template (the byte tokenizer's is Llama 3's
    layout as text), as SGLang renders a chat completion."""
    return engine.tokenizer.apply_chat_template(messages)


def text_tokens(engine: EmulatedEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def output_text(engine: EmulatedEngine, ids: list[int]) -> str:
    return engine.tokenizer.decode(ids)


def context_length(engine: EmulatedEngine) -> int:
    """The emulated model's context length: what its VRAM KV pool holds (the limit a prompt
    meets first on a real worker too)."""
    return engine.cache.vram_pages_max * engine.settings.block_size


def parse_ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise BadRequest(f"{what} must be a non-empty array of token ids")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
            raise BadRequest(f"{what} holds an invalid token id {t!r}")
    return value


def _count(value: Any, what: str, default: int, limit: int) -> int:
    if value is None:
        return default
    # SGLang takes 0: the prompt is prefilled (and cached), nothing is generated.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise BadRequest(f"{what} must be an int in [0, {limit}], got {value!r}")
    return value


# SGLang's SamplingParams.verify ranges (sglang/srt/sampling/sampling_params.py, Apache-2.0):
# name -> (low, high, low inclusive, its message). An engine refuses these with a 400, which the
# edge must pass to its client as the client's error.
_SAMPLING_RANGES = {
    "temperature": (0.0, math.inf, True, "temperature must be a non-negative finite number, got {}."),
    "top_p": (0.0, 1.0, False, "top_p must be in (0, 1], got {}."),
    "min_p": (0.0, 1.0, True, "min_p must be in [0, 1], got {}."),
    "frequency_penalty": (-2.0, 2.0, True, "frequency_penalty must be in [-2, 2], got {}."),
    "presence_penalty": (-2.0, 2.0, True, "presence_penalty must be in [-2, 2], got {}."),
    "repetition_penalty": (0.0, 2.0, False, "repetition_penalty must be in (0, 2] (1.0 = no penalty), got {}."),
}


def check_sampling_ranges(params: dict[str, Any]) -> None:
    """Refuse sampling parameters out of the ranges SGLang accepts, with SGLang's messages."""
    for name, (low, high, low_inclusive, message) in _SAMPLING_RANGES.items():
        value = params.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRequest(f"{name} must be a number, got {value!r}")
        above_low = value >= low if low_inclusive else value > low
        if not (math.isfinite(value) and above_low and value <= high):
            raise BadRequest(message.format(float(value)))


def _generation(engine: EmulatedEngine, rid: str, prompt: list[int], max_new: int,
                params: dict[str, Any]) -> Generation:
    """A Generation with SGLang's stop conditions (``stop``, a string or strings,
    ``stop_token_ids``, ``min_new_tokens`` and ``no_stop_trim``) and its ``stream_interval``."""
    context = context_length(engine)
    # SGLang's TokenizerManager._validate_one_request (0.5.23), with its messages: a 400 the edge
    # cannot foresee, so it passes the engine's words to its client.
    if len(prompt) >= context:
        raise BadRequest(f"The input ({len(prompt)} tokens) is longer than the model's context length "
                         f"({context} tokens).")
    if max_new + len(prompt) > context:
        raise BadRequest(f"Requested token count exceeds the model's maximum context length of {context} tokens. "
                         f"You requested a total of {max_new + len(prompt)} tokens: {len(prompt)} tokens from the "
                         f"input messages and {max_new} tokens for the completion. Please reduce the number of "
                         "tokens in the input messages or the completion to fit within the limit.")
    stop = params.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop)):
        raise BadRequest("stop must be a non-empty string or a list of them")
    ids = params.get("stop_token_ids")
    if ids:
        parse_ids(ids, "stop_token_ids")
    min_new = params.get("min_new_tokens") or 0
    if isinstance(min_new, bool) or not isinstance(min_new, int) or not 0 <= min_new <= max_new:
        raise BadRequest(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new!r}")
    # SGLang takes None or 0 as the server's interval (1 here) and checks no other value; the
    # emulator refuses what is not a positive integer rather than stream oddly (the edge never sends one).
    interval = params.get("stream_interval") or 1
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise BadRequest(f"stream_interval must be a positive integer, got {interval!r}")
    return Generation(rid, prompt, max_new, stop=tuple(stop or ()), stop_token_ids=frozenset(ids or ()),
                      min_new_tokens=min_new, no_stop_trim=bool(params.get("no_stop_trim")),
                      decode=engine.tokenizer.decode, stream_interval=interval)


def server_info(engine: EmulatedEngine) -> dict[str, Any]:
    s, publisher = engine.settings, engine.publisher
    kv_events = None if publisher is None else {  # SGLang's --kv-events-config JSON, as on its command line
        "publisher": "zmq",
        "endpoint": publisher.endpoint,
        "replay_endpoint": publisher.replay_endpoint,
        "topic": s.kv_events_topic,
        "buffer_steps": s.replay_buffer_steps,
    }
    info = {
        "model_path": s.model,
        "served_model_name": s.model,
        "tokenizer_path": _tokenizer_path(engine),
        "page_size": s.block_size,
        "max_running_requests": s.timing.max_running,
        "max_total_num_tokens": engine.cache.vram_pages_max * s.block_size,
        "radix_eviction_policy": s.eviction,
        "enable_hierarchical_cache": s.dram_kv_tokens > 0,
        "hicache_size_tokens": s.dram_kv_tokens,
        "kv_events_config": json.dumps(kv_events) if publisher is not None else None,
        "disaggregation_mode": _disaggregation_mode(engine),
        "version": VERSION,
        "emulator": {"worker_id": s.worker_id, "time_scale": s.time_scale, "seed": s.seed,
                     "block_size": s.block_size, "timing": dataclasses.asdict(s.timing)},
        "internal_states": [{"last_gen_throughput": engine.load()["gen_throughput"]}],
    }
    if engine.kv_sender is not None:
        info["disaggregation_bootstrap_port"] = engine.kv_sender.port
    return info


def _disaggregation_mode(engine: EmulatedEngine) -> str:
    """SGLang's ``--disaggregation-mode``: "null" for a worker that serves whole requests."""
    return "null" if engine.settings.role == "mixed" else engine.settings.role


def _tokenizer_path(engine: EmulatedEngine) -> str:
    return "byte-level" if engine.tokenizer.name == BYTE else engine.tokenizer.name


def model_info(engine: EmulatedEngine) -> dict[str, Any]:
    """SGLang's ``/model_info`` keys (``http_server.model_info``)."""
    s = engine.settings
    return {"model_path": s.model, "served_model_name": s.model, "tokenizer_path": _tokenizer_path(engine),
            "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
            "load_format": "dummy", "reasoning_parser": None, "tool_call_parser": None,
            "disaggregation_mode": _disaggregation_mode(engine), "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": None, "architectures": None}


def loads_response(engine: EmulatedEngine) -> dict[str, Any]:
    load = engine.load()
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "version": VERSION,
        "dp_rank_count": 1,
        "loads": [load],
        "aggregate": {
            "total_running_reqs": load["num_running_reqs"],
            "total_waiting_reqs": load["num_waiting_reqs"],
            "total_reqs": load["num_total_reqs"],
            "avg_token_usage": load["token_usage"],
            "avg_throughput": load["gen_throughput"],
            "avg_utilization": load["utilization"],
        },
    }


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"object": "error", "error": {"message": message, "type": "BadRequestError", "code": status}}, status=status
    )


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


async def _sse_start(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def _sse_send(response: web.StreamResponse, payload: Any) -> None:
    data = b"[DONE]" if payload is None else json.dumps(payload, separators=(",", ":")).encode()
    await response.write(b"data: " + data + b"\n\n")


def _handler(fn: Callable[[EmulatedEngine, web.Request], Any]) -> Callable[[web.Request], Any]:
    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            return await fn(request.app[ENGINE], request)
        except (BadRequest, WorkerModelError, TokenizerError) as exc:
            return _error(400, str(exc))
        except TransferFailed as exc:
            # SGLang aborts a request whose KV transfer failed with a server-side error.
            return _error(500, f"KV transfer failed: {exc}")

    return handle


async def generate(engine: EmulatedEngine, request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            raise BadRequest("batched input_ids are not supported by the emulator")
        prompt = parse_ids(ids, "input_ids")
    elif isinstance(body.get("text"), str) and body["text"]:
        prompt = text_tokens(engine, body["text"])
    else:
        raise BadRequest("give 'text' (a non-empty string) or 'input_ids'")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object")
    check_sampling_ranges(params)
    s = engine.settings
    max_new = _count(params.get("max_new_tokens"), "max_new_tokens", s.default_max_new_tokens, s.max_new_tokens_limit)
    rid = body.get("rid") or uuid.uuid4().hex
    if not isinstance(rid, str):
        raise BadRequest("rid must be a string")
    gen = _generation(engine, rid, prompt, max_new, params)
    gen.bootstrap = _bootstrap(engine, body)

    def shape(g: Generation) -> dict[str, Any]:
        return {"text": g.text(), "output_ids": list(g.output), "meta_info": g.meta_info()}

    if body.get("stream"):
        response = await _sse_start(request)
        # aclosing: a write to a client that went away ends the request in the engine now.
        try:
            async with contextlib.aclosing(engine.generate(gen, stream=True)) as outputs:
                async for g in outputs:
                    await _sse_send(response, shape(g))
        except TransferFailed as exc:
            # After the 200 headers: SGLang's streamed error event, then the end of the stream.
            await _sse_send(response, {"error": {"message": f"KV transfer failed: {exc}", "code": 500}})
        await _sse_send(response, None)
        return response
    async for _ in engine.generate(gen, stream=False):
        pass
    return web.json_response(shape(gen))


def _bootstrap(engine: EmulatedEngine, body: dict[str, Any]) -> Bootstrap | None:
    """The request's bootstrap fields, which a prefill or decode worker needs (a mixed one
    ignores them, as SGLang does outside disaggregation mode)."""
    role = engine.settings.role
    if role == "mixed":
        return None
    try:
        bootstrap = Bootstrap.from_body(body)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    if bootstrap is None:
        raise BadRequest(f"this worker runs in disaggregation mode {role}: give bootstrap_host, bootstrap_port "
                         "and bootstrap_room, as SGLang's prefill-decode router does")
    if role == "decode" and bootstrap.fake:
        raise BadRequest("a decode worker cannot serve a request with the fake bootstrap host")
    return bootstrap


def _usage(g: Generation) -> dict[str, Any]:
    return {
        "prompt_tokens": len(g.prompt),
        "completion_tokens": len(g.output),
        "total_tokens": len(g.prompt) + len(g.output),
        "prompt_tokens_details": {"cached_tokens": g.cached_tokens},
    }


async def _openai(engine: EmulatedEngine, request: web.Request, *, chat: bool) -> web.StreamResponse:
    body = await _body(request)
    if engine.settings.role != "mixed":
        raise BadRequest(f"this emulated worker runs in disaggregation mode {engine.settings.role}: "
                         "it serves /generate with bootstrap fields only")
    if chat:
        prompt = chat_tokens(engine, body.get("messages"))
    else:
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
            raw = raw[0]
        if isinstance(raw, str) and raw:
            prompt = text_tokens(engine, raw)
        elif isinstance(raw, list):
            prompt = parse_ids(raw, "prompt")
        else:
            raise BadRequest("prompt must be a non-empty string or an array of token ids")
    s = engine.settings
    limit_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_new = _count(body.get(limit_key), limit_key, 16 if not chat else s.default_max_new_tokens,
                     s.max_new_tokens_limit)
    kind = "chat.completion" if chat else "text_completion"
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created, model = int(time.time()), body.get("model") or s.model
    gen = _generation(engine, ident, prompt, max_new, {"stop": body.get("stop"), "stop_token_ids": body.get("stop_token_ids"),
                                               "min_new_tokens": body.get("min_tokens"),
                                               "no_stop_trim": body.get("no_stop_trim")})

    def finish() -> str:
        return "length" if gen.matched is None else "stop"

    def choice(text: str, finish: str | None, *, delta: bool, first: bool = False) -> dict[str, Any]:
        if not chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "matched_stop": gen.matched}
        if not delta:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": finish, "matched_stop": gen.matched}
        content: dict[str, Any] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish}

    if not body.get("stream"):
        async for _ in engine.generate(gen, stream=False):
            pass
        return web.json_response({"id": ident, "object": kind, "created": created, "model": model,
                                  "choices": [choice(gen.text(), finish(), delta=False)],
                                  "usage": _usage(gen)})
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    response = await _sse_start(request)
    chunk_kind = kind + ".chunk" if chat else kind

    async def send(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> None:
        payload = {"id": ident, "object": chunk_kind, "created": created, "model": model, "choices": choices}
        if usage is not None:
            payload["usage"] = usage
        await _sse_send(response, payload)

    if chat:
        await send([choice("", None, delta=True, first=True)])
    sent = 0
    async for g in engine.generate(gen, stream=True):
        visible = g.text()
        text, sent = visible[sent:], max(sent, len(visible))
        if g.finished:
            if text:
                await send([choice(text, None, delta=True)])
            await send([choice("", finish(), delta=True)])
        elif text:
            await send([choice(text, None, delta=True)])
    if include_usage:
        await send([], _usage(gen))
    await _sse_send(response, None)
    return response


async def completions(engine: EmulatedEngine, request: web.Request) -> web.StreamResponse:
    return await _openai(engine, request, chat=False)


async def chat_completions(engine: EmulatedEngine, request: web.Request) -> web.StreamResponse:
    return await _openai(engine, request, chat=True)


def _openai_error(message: str) -> web.Response:
    """SGLang's OpenAI-route error (``ErrorResponse``, flat; ``/generate``'s is nested)."""
    return web.json_response({"object": "error", "message": message, "type": "BadRequestError", "param": None,
                              "code": 400}, status=400)


def _tokenize_chat(engine: EmulatedEngine, body: dict[str, Any]) -> list[int]:
    """``messages`` as SGLang's ``OpenAIServingTokenize._tokenize_chat_request`` renders them:
    without ``add_generation_prompt``, as for a chat completion (a final assistant message
    becomes a user turn); with it, as given, encoded with ``add_special_tokens`` only if the
    request sets it (``TokenizeRequest.to_chat_completion_request``)."""
    generation = body.get("add_generation_prompt")
    if body.get("continue_final_message"):
        raise BadRequest("continue_final_message is not supported by the emulated worker")
    if generation is None:
        return chat_tokens(engine, body["messages"])
    if not isinstance(generation, bool):
        raise BadRequest("add_generation_prompt must be a boolean")
    text = engine.tokenizer.render_chat(body["messages"], add_generation_prompt=generation)  # type: ignore[attr-defined]
    return engine.tokenizer.encode(text, add_special_tokens=body.get("add_special_tokens") is True)


async def tokenize(engine: EmulatedEngine, request: web.Request) -> web.Response:
    """SGLang's ``/v1/tokenize``: ``{"prompt": str | [str]}`` or ``{"messages": [...]}`` (exactly
    one) -> ``{"tokens", "count", "max_model_len"}`` (``serving_tokenize.OpenAIServingTokenize``);
    refusals in SGLang's flat OpenAI error shape."""
    try:
        body = await _body(request)
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise BadRequest("add_special_tokens must be a boolean")
        messages, prompt = body.get("messages"), body.get("prompt")
        if (messages is None) == (prompt is None):
            raise BadRequest("Exactly one of 'prompt' or 'messages' must be provided.")
        if messages is not None:
            tokens: list = _tokenize_chat(engine, body)
            count: Any = len(tokens)
        elif isinstance(prompt, str):
            tokens = engine.tokenizer.encode(prompt, add_special_tokens=special)
            count = len(tokens)
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            tokens = [engine.tokenizer.encode(p, add_special_tokens=special) for p in prompt]
            count = [len(t) for t in tokens]
        else:
            raise BadRequest(f"Invalid prompt type: {type(prompt).__name__}. Expected str or List[str].")
    except (BadRequest, TokenizerError) as exc:
        return _openai_error(str(exc))
    return web.json_response({"tokens": tokens, "count": count, "max_model_len": context_length(engine)})


async def detokenize(engine: EmulatedEngine, request: web.Request) -> web.Response:
    """SGLang's ``/v1/detokenize``: ``{"tokens": [int] | [[int]]}`` -> ``{"text": str | [str]}``."""
    tokens = (await _body(request)).get("tokens")
    if isinstance(tokens, list) and tokens and isinstance(tokens[0], list):
        return web.json_response({"text": [output_text(engine, parse_ids(t, "tokens")) if t != [] else ""
                                           for t in tokens]})
    if tokens == []:
        return web.json_response({"text": ""})
    return web.json_response({"text": output_text(engine, parse_ids(tokens, "tokens"))})


async def get_model_info(engine: EmulatedEngine, request: web.Request) -> web.Response:
    return web.json_response(model_info(engine))


async def models(engine: EmulatedEngine, request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [
        {"id": engine.settings.model, "object": "model", "created": 0, "owned_by": "sglang",
         "root": engine.settings.model}]})


async def info(engine: EmulatedEngine, request: web.Request) -> web.Response:
    return web.json_response(server_info(engine))


async def loads(engine: EmulatedEngine, request: web.Request) -> web.Response:
    return web.json_response(loads_response(engine))


async def metrics(engine: EmulatedEngine, request: web.Request) -> web.Response:
    engine.update_gauges()
    body = generate_latest(engine.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def health(engine: EmulatedEngine, request: web.Request) -> web.Response:
    return web.Response(status=200)


async def flush_cache(engine: EmulatedEngine, request: web.Request) -> web.Response:
    engine.flush()
    return web.Response(text="Cache flushed.\n")


def build_app(engine: EmulatedEngine) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    app[ENGINE] = engine
    post = {"/generate": generate, "/v1/completions": completions, "/v1/chat/completions": chat_completions,
            "/flush_cache": flush_cache, "/v1/tokenize": tokenize, "/tokenize": tokenize,
            "/v1/detokenize": detokenize, "/detokenize": detokenize}
    get = {"/v1/models": models, "/server_info": info, "/get_server_info": info, "/v1/loads": loads,
           "/get_loads": loads, "/metrics": metrics, "/health": health, "/health_generate": health,
           "/model_info": get_model_info, "/get_model_info": get_model_info}
    for path, fn in post.items():
        app.router.add_post(path, _handler(fn))
    for path, fn in get.items():
        app.router.add_get(path, _handler(fn))
    return app
