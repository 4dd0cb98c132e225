"""One request on a prefill-decode pair of SGLang engines, as SGLang's own router runs it.

SGLang's prefill-decode router (``sglang_router``'s ``mini_lb`` and the Rust PD router) sends
the same ``/generate`` body to a prefill server and to a decode server, with the bootstrap
fields added: ``bootstrap_host`` (the prefill server's host), ``bootstrap_port`` (its
``--disaggregation-bootstrap-port``) and ``bootstrap_room`` (a random integer in [0, 2**63)).
The decode server's response is the one the client gets; the prefill's is read to its end and
dropped, except what the router merges from it (``mini_lb`` merges the prefill's
``input_token_logprobs``; kvcompassd asks for no logprobs, and takes the prefill's
``cached_tokens``, the reuse the edge's belief is about). Used by the edge (its own region's
pairs, over HTTP) and by an agent (a pair in its region, for an edge of another region).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import urllib.parse
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from kvcompassd.engine.client import EngineClient, EngineError, EngineFinished, EngineOutput, EngineRejected

MAX_ROOM = (1 << 63) - 1
# SGLang's FAKE_BOOTSTRAP_HOST (disaggregation/utils.py): a prefill for nobody (a warm-up, or an
# agent recomputing a migrated prefix) computes and caches its KV, then sends it nowhere.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
PREFILL_VERDICT_S = 0.5  # after a decode failure, how long the prefill may take to say it failed first


def new_bootstrap_room(rng: random.Random | None = None) -> int:
    """A random 63-bit room, as SGLang's router draws it (``_generate_bootstrap_room``)."""
    return (rng or random).randint(0, MAX_ROOM)


@dataclass(frozen=True, slots=True)
class BootstrapFields:
    host: str
    port: int
    room: int

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"bootstrap host must be a host name, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"bootstrap port must be a port number, got {self.port!r}")
        if isinstance(self.room, bool) or not isinstance(self.room, int) or not 0 <= self.room <= MAX_ROOM:
            raise ValueError(f"bootstrap room must be an int in [0, 2**63), got {self.room!r}")

    @classmethod
    def for_prefill(cls, prefill_http: str, bootstrap_port: int, room: int) -> BootstrapFields:
        """The fields naming a prefill server reached at ``prefill_http`` (its URL's host, IPv6
        in brackets as SGLang's ``maybe_wrap_ipv6_address`` does)."""
        host = urllib.parse.urlparse(prefill_http).hostname or ""
        if ":" in host:
            host = f"[{host}]"
        return cls(host, bootstrap_port, room)

    def body(self) -> dict[str, object]:
        return {"bootstrap_host": self.host, "bootstrap_port": self.port, "bootstrap_room": self.room}


class PrefillFailed(EngineError):
    """The prefill server failed the request (the prefill worker is to blame)."""


class DecodeFailed(EngineError):
    """The decode server failed the request (the decode worker is to blame)."""


async def _drain_prefill(prefill: EngineClient, input_ids, sampling_params: dict, rid: str | None,
                         bootstrap: BootstrapFields) -> EngineFinished:
    """Run the prefill half to its end: its figures, or PrefillFailed / EngineRejected."""
    finished: EngineFinished | None = None
    try:
        async with contextlib.aclosing(prefill.generate(input_ids, sampling_params, stream=False, rid=rid,
                                                        extra=bootstrap.body())) as items:
            async for item in items:
                if isinstance(item, EngineFinished):
                    finished = item
    except EngineRejected:
        raise
    except EngineError as exc:
        raise PrefillFailed(f"prefill: {exc}") from exc
    if finished is None:
        raise PrefillFailed("prefill: the response ended without figures")
    return finished


async def generate_on_pair(
    prefill: EngineClient,
    decode: EngineClient,
    bootstrap: BootstrapFields,
    input_ids: Sequence[int],
    sampling_params: dict,
    *,
    rid: str | None = None,
) -> AsyncIterator[EngineOutput | EngineFinished]:
    """Run one request on a prefill server and a decode server at once; yields the decode's
    output as it comes, then one ``EngineFinished`` with the prefill's ``cached_tokens``.

    Raises :class:`PrefillFailed` or :class:`DecodeFailed` (whose half broke; a prefill failure
    wins when both did, as the decode's then only says its KV never came) or ``EngineRejected``
    (either server refused the request itself). Closing the generator closes both connections,
    which aborts the request on both servers."""
    loop = asyncio.get_running_loop()
    prefill_task = loop.create_task(_drain_prefill(prefill, input_ids, sampling_params, rid, bootstrap))
    decoded: EngineFinished | None = None
    try:
        try:
            async with contextlib.aclosing(decode.generate(input_ids, sampling_params, stream=True, rid=rid,
                                                           extra=bootstrap.body())) as items:
                async for item in items:
                    if isinstance(item, EngineOutput):
                        yield item
                    else:
                        decoded = item
        except EngineRejected:
            raise
        except EngineError as exc:
            # The decode's KV never came because the prefill failed: blame the prefill. A prefill
            # failing at this very moment says the same, so it gets a moment to say it.
            if not prefill_task.done():
                await asyncio.wait({prefill_task}, timeout=PREFILL_VERDICT_S)
            prefill_error = _error_of(prefill_task)
            if prefill_error is not None:
                raise prefill_error from exc
            raise DecodeFailed(f"decode: {exc}") from exc
        assert decoded is not None
        try:
            cached = (await prefill_task).cached_tokens
        except EngineError:
            # The decode finished, so the KV did arrive: the answer is whole. The prefill's
            # figures are lost; SGLang's decode reports the prefill's reuse too.
            cached = decoded.cached_tokens
        yield EngineFinished(cached_tokens=cached, prompt_tokens=decoded.prompt_tokens,
                             completion_tokens=decoded.completion_tokens, finish_reason=decoded.finish_reason)
    finally:
        if not prefill_task.done():
            prefill_task.cancel()
        await asyncio.gather(prefill_task, return_exceptions=True)


def _error_of(task: asyncio.Task) -> BaseException | None:
    if not task.done() or task.cancelled():
        return None
    return task.exception()
