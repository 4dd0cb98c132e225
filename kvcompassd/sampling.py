"""Sampling parameters checked at the edge as SGLang checks them, so that the common mistakes are
refused here with a 400 naming the parameter instead of crossing the WAN to be refused there.

The rules are SGLang's ``SamplingParams`` (``sglang/srt/sampling/sampling_params.py``, 0.5.23): the fields
it accepts (any other is a ``TypeError`` there), ``__post_init__``'s defaults for ``None`` and its
greedy case (temperature 0 means top_k 1, so top_k is not checked then), and ``verify()``'s
ranges. On top: what the edge's own path needs (``n`` is 1; every value fits the wire's
``Params``: 64-bit integers, bounded nesting).
"""

from __future__ import annotations

import math
from typing import Any

from kvcompassd.wire import Params, WireError

_SAMPLING_EPS = 1e-6
_FLOATS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_INTS = ("max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval", "sampling_seed", "beam_width")
_BOOLS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "ebnf_full_assistant")
_GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")
SGLANG_FIELDS = frozenset((*_FLOATS, *_INTS, *_BOOLS, *_GRAMMARS, "stop", "stop_token_ids", "stop_regex",
                           "custom_params", "logit_bias", "watermark"))
MAX_STOPS = 16
MAX_STOP_CHARS = 512
_WIRE_PARAMS = Params()


class SamplingError(ValueError):
    """A sampling parameter SGLang would refuse; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingError(name, f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise SamplingError(name, f"{name} must be finite, got {value}")
    return value


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingError(name, f"{name} must be an integer, got {type(value).__name__}")
    if not -(1 << 63) <= value < (1 << 64):
        raise SamplingError(name, f"{name} must fit 64 bits")
    return value


def _strings(name: str, value: Any) -> None:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise SamplingError(name, f"{name} must be a non-empty string or a list of them")
    if len(items) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in items):
        raise SamplingError(name, f"{name} takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters")


# Parameter objects of scalar values already accepted, by their fields, values and the values'
# types (1 and True are equal keys, and only True is a boolean), with the limits they were checked
# against, and the max_new_tokens they were given: most clients send the same few objects, and
# the checks were 24 us of a request in the edge's path (thread CPU timed in place, c = 1). The
# wire check returns scalars as they are, so an accepted object's answer is itself with that
# max_new_tokens. Only acceptances are kept, and no string longer than ACCEPTED_CHARS (a client
# cannot park large grammars here); full, it starts again.
_ACCEPTED: dict[tuple, int] = {}
ACCEPTED_MAX = 256
ACCEPTED_CHARS = 64
_SCALARS = frozenset((bool, int, float, str, type(None)))


def _cacheable(field: tuple) -> bool:
    kind = field[1]
    return kind in _SCALARS and (kind is not str or len(field[2]) <= ACCEPTED_CHARS)


def check_sampling(params: Any, *, max_new_tokens_limit: int, default_max_new_tokens: int,
                   vocab_size: int | None = None) -> dict[str, Any]:
    """SGLang ``sampling_params`` as SGLang's ``/generate`` would take them; returns them with
    ``max_new_tokens`` filled in (a new dict), or raises :class:`SamplingError`."""
    key = None
    if params.__class__ is dict and len(params) <= 32:
        key = (max_new_tokens_limit, default_max_new_tokens, vocab_size,
               *[(name, value.__class__, value) for name, value in params.items()])
        if all(map(_cacheable, key[3:])):
            max_new = _ACCEPTED.get(key)
            if max_new is not None:
                return {**params, "max_new_tokens": max_new}
        else:
            key = None
    checked = _check_sampling(params, max_new_tokens_limit=max_new_tokens_limit,
                              default_max_new_tokens=default_max_new_tokens, vocab_size=vocab_size)
    if key is not None:
        if len(_ACCEPTED) >= ACCEPTED_MAX:
            _ACCEPTED.clear()
        _ACCEPTED[key] = checked["max_new_tokens"]
    return checked


def _check_sampling(params: Any, *, max_new_tokens_limit: int, default_max_new_tokens: int,
                    vocab_size: int | None) -> dict[str, Any]:
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise SamplingError("sampling_params", "sampling_params must be an object")
    for name in params:
        if name not in SGLANG_FIELDS:
            raise SamplingError(name, f"unknown sampling parameter {name[:64]!r}")
    p = {k: v for k, v in params.items() if v is not None}  # SGLang: None means the default
    for name in _FLOATS:
        if name in p:
            _number(name, p[name])
    for name in _INTS:
        if name in p:
            _integer(name, p[name])
    for name in _BOOLS:
        if name in p and not isinstance(p[name], bool):
            raise SamplingError(name, f"{name} must be a boolean")
    for name in _GRAMMARS:
        if name in p and not isinstance(p[name], str):
            raise SamplingError(name, f"{name} must be a string")

    temperature = p.get("temperature", 1.0)
    if temperature < 0.0:
        raise SamplingError("temperature", f"temperature must be a non-negative finite number, got {temperature}")
    if not 0.0 < p.get("top_p", 1.0) <= 1.0:
        raise SamplingError("top_p", f"top_p must be in (0, 1], got {p['top_p']}")
    if not 0.0 <= p.get("min_p", 0.0) <= 1.0:
        raise SamplingError("min_p", f"min_p must be in [0, 1], got {p['min_p']}")
    top_k = p.get("top_k", -1)
    if not temperature < _SAMPLING_EPS and top_k != -1 and top_k < 1:  # greedy sets top_k = 1
        raise SamplingError("top_k", f"top_k must be -1 (disable) or at least 1, got {top_k}")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= p.get(name, 0.0) <= 2.0:
            raise SamplingError(name, f"{name} must be in [-2, 2], got {p[name]}")
    if not 0.0 < p.get("repetition_penalty", 1.0) <= 2.0:
        raise SamplingError("repetition_penalty", f"repetition_penalty must be in (0, 2], got {p['repetition_penalty']}")
    max_new = p.get("max_new_tokens", default_max_new_tokens)
    if not 0 <= max_new <= max_new_tokens_limit:
        raise SamplingError("max_new_tokens", f"max_new_tokens must be an integer in [0, {max_new_tokens_limit}], "
                            f"got {max_new}")
    min_new = p.get("min_new_tokens", 0)
    if not 0 <= min_new <= max_new:
        raise SamplingError("min_new_tokens", f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}")
    if p.get("n", 1) != 1:
        raise SamplingError("n", "only n=1 is supported")
    if p.get("beam_width", 1) < 1:
        raise SamplingError("beam_width", f"beam_width must be at least 1, got {p['beam_width']}")
    if p.get("beam_width", 1) > 1:
        raise SamplingError("beam_width", "beam search is not supported by this edge (one output per request)")
    if not -(1 << 63) <= p.get("sampling_seed", 0) < (1 << 63):
        raise SamplingError("sampling_seed", f"sampling_seed must be in [-2**63, 2**63 - 1], got {p['sampling_seed']}")
    if "watermark" in p and not isinstance(p["watermark"], dict):
        raise SamplingError("watermark", "watermark must be an object")
    if "stream_interval" in p and p["stream_interval"] < 1:
        raise SamplingError("stream_interval", "stream_interval must be at least 1")
    for name in ("stop", "stop_regex"):
        if name in p:
            _strings(name, p[name])
    if "stop_token_ids" in p:
        ids = p["stop_token_ids"]
        if not isinstance(ids, list) or len(ids) > 1024 or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < (1 << 32) for t in ids):
            raise SamplingError("stop_token_ids", "stop_token_ids must be a list of at most 1024 token ids")
    if "logit_bias" in p:
        _logit_bias(p["logit_bias"], vocab_size)
    if "custom_params" in p and not isinstance(p["custom_params"], dict):
        raise SamplingError("custom_params", "custom_params must be an object")
    if sum(p.get(name) is not None for name in _GRAMMARS) > 1:
        raise SamplingError("regex", "Only one of json_schema, regex, ebnf, or structural_tag can be set.")
    out = {**params, "max_new_tokens": max_new}
    try:
        return _WIRE_PARAMS.check(out, "sampling_params")  # what the cross-region path can carry
    except WireError as exc:
        raise SamplingError("sampling_params", f"sampling_params cannot be forwarded: {exc}") from None


def _logit_bias(bias: Any, vocab_size: int | None) -> None:
    if not isinstance(bias, dict) or len(bias) > 1024:
        raise SamplingError("logit_bias", "logit_bias must be an object of at most 1024 token ids")
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise SamplingError("logit_bias", f"logit_bias keys must be token ids, got {key[:32]!r}") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            upper = f"{vocab_size - 1}" if vocab_size is not None else "..."
            raise SamplingError("logit_bias", f"logit_bias must has keys in [0, {upper}], got {token}")
        _number("logit_bias", value)
