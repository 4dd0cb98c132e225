"""The OpenAI side of the front door: what a completions or chat request may ask, translated to
SGLang sampling parameters, and the response shapes an OpenAI client expects.

Every parameter is either carried to SGLang (which supports it) or refused with a 400 naming it;
none is silently ignored. A wrong ``model`` is a 404 ``model_not_found``. Chat streams open with
``delta.role``; in streams, ``usage`` comes only when ``stream_options.include_usage`` asks for
it, as a last chunk with empty ``choices``.
"""

from __future__ import annotations

import time
from typing import Any

from kvcompassd.forwarding import GenerationFinished, TokensGenerated
from kvcompassd.sampling import SamplingError, check_sampling


class RequestError(Exception):
    """A request the edge refuses; rendered as an OpenAI error naming ``param``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


# OpenAI name -> SGLang sampling parameter, for what SGLang's own OpenAI adapter carries over.
_CARRIED = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty", "stop": "stop", "stop_token_ids": "stop_token_ids",
    "seed": "sampling_seed", "logit_bias": "logit_bias", "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens", "no_stop_trim": "no_stop_trim", "min_tokens": "min_new_tokens",
    "regex": "regex", "ebnf": "ebnf",
}
# Accepted and used by the edge itself (or harmless metadata about the caller).
_HANDLED = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options",
            "user", "n", "best_of", "echo", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice",
            "functions", "function_call", "parallel_tool_calls", "suffix"}


def _unsupported(name: str, why: str = "") -> RequestError:
    return RequestError(400, f"parameter {name!r} is not supported by this edge{why}", param=name,
                        code="unsupported_parameter")


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is None:
        return  # SGLang serves its one model to requests that name none; so does the edge
    if not isinstance(model, str):
        raise RequestError(400, "model must be a string", param="model", code="invalid_type")
    if model != served:
        raise RequestError(404, f"The model {model[:200]!r} does not exist; this edge serves {served!r}",
                           param="model", code="model_not_found")


def openai_sampling(body: dict, *, chat: bool, max_new_tokens_limit: int, default_max_tokens: int,
                    vocab_size: int | None = None) -> dict[str, Any]:
    """SGLang sampling parameters for an OpenAI completions (``chat=False``) or chat request."""
    for name in body:
        if name not in _CARRIED and name not in _HANDLED:
            raise _unsupported(name[:64])
    _refuse_unsupported(body, chat)
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(name)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 0 <= max_tokens <= max_new_tokens_limit:
        raise RequestError(400, f"{name} must be an integer in [0, {max_new_tokens_limit}]", param=name,
                           code="invalid_value")
    params: dict[str, Any] = {"max_new_tokens": max_tokens}
    for openai_name, sglang_name in _CARRIED.items():
        if body.get(openai_name) is not None:
            params[sglang_name] = body[openai_name]
    reverse = {v: k for k, v in _CARRIED.items()}
    try:
        return check_sampling(params, max_new_tokens_limit=max_new_tokens_limit,
                              default_max_new_tokens=default_max_tokens, vocab_size=vocab_size)
    except SamplingError as exc:
        param = reverse.get(exc.param, name if exc.param == "max_new_tokens" else exc.param)
        raise RequestError(400, str(exc), param=param, code="invalid_value") from None


def _refuse_unsupported(body: dict, chat: bool) -> None:
    if body.get("n") not in (None, 1):
        raise _unsupported("n", " (n > 1)")
    if body.get("best_of") not in (None, 1):
        raise _unsupported("best_of", " (best_of > 1)")
    if body.get("echo") not in (None, False):
        raise _unsupported("echo")
    if body.get("suffix") not in (None, ""):
        raise _unsupported("suffix")
    logprobs = body.get("logprobs")
    if logprobs not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise _unsupported("logprobs" if logprobs not in (None, False) else "top_logprobs")
    for name in ("tools", "functions"):
        if body.get(name) not in (None, []):
            raise _unsupported(name)
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            raise _unsupported(name)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _unsupported("response_format", " (only {\"type\": \"text\"})")
    options = body.get("stream_options")
    if options is not None:
        if body.get("stream") is not True:
            raise RequestError(400, "stream_options is only allowed when stream is true", param="stream_options",
                               code="invalid_value")
        if not isinstance(options, dict) or any(k != "include_usage" for k in options) or \
                not isinstance(options.get("include_usage", False), bool):
            raise RequestError(400, "stream_options takes only include_usage (a boolean)", param="stream_options",
                               code="invalid_value")
    if not chat and "messages" in body:
        raise RequestError(400, "completions take a prompt, not messages", param="messages", code="invalid_value")
    if chat and "prompt" in body:
        raise RequestError(400, "chat completions take messages, not a prompt", param="prompt", code="invalid_value")


def include_usage(body: dict) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage", False))


def kvcompass_info(done: GenerationFinished) -> dict:
    info = {
        "worker": done.worker,
        "region": done.region,
        "cached_tokens": done.cached_tokens,
        "claimed_tokens": done.claimed_tokens,
        "attempts": done.attempts,
        "decision_us": round(done.decision_us, 1),
    }
    if done.decode_worker:  # a disaggregated fleet: ``worker`` prefilled, this one decoded
        info["decode_worker"] = done.decode_worker
    if done.pending_credited:  # the claim was the edge's pending ledger's, not its index view's
        info["pending"] = True
    return info


def _finish_reason(done: GenerationFinished) -> str:
    return "length" if done.finish_reason == "length" else "stop"


class OpenAIRender:
    """Responses of one completions or chat request, whole or as stream chunks."""

    def __init__(self, kind: str, request_id: str, model: str, prompt_tokens: int, *, usage_in_stream: bool = False):
        self.kind, self.id, self.model, self.prompt_tokens = kind, request_id, model, prompt_tokens
        self.usage_in_stream = usage_in_stream
        self.created = int(time.time())
        self._opened = False

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def _usage(self, done: GenerationFinished) -> dict:
        return {
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
        }

    def whole(self, text: str, ids: list[int], done: GenerationFinished) -> dict:
        finish = _finish_reason(done)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self._usage(done), "kvcompass": kvcompass_info(done)}

    def _chunk(self, choices: list[dict]) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if self.usage_in_stream:
            chunk["usage"] = None  # as OpenAI: null on every chunk but the last
        return chunk

    def _choice(self, text: str, finish: str | None) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        delta: dict[str, Any] = {"content": text} if text else {}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def opening(self) -> list[dict]:
        """Chunks sent before any output: a chat stream opens with the assistant's role."""
        if not self.chat or self._opened:
            return []
        self._opened = True
        return [self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])]

    def chunk(self, item: TokensGenerated) -> dict:
        return self._chunk([self._choice(item.text, None)])

    def final(self, done: GenerationFinished) -> list[dict]:
        last = self._chunk([self._choice("", _finish_reason(done))])
        last["kvcompass"] = kvcompass_info(done)
        if not self.usage_in_stream:
            return [last]
        usage = self._chunk([])
        usage["usage"] = self._usage(done)
        return [last, usage]
