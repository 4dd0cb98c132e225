"""Emulated SGLang worker: SGLang's HTTP routes and KV-event stream, no GPU.

A :class:`~kvcompassd.worker.prefixcache.PrefixCache` (paged, VRAM + DRAM, LRU/LFU) decides what
each request reuses and emits the KV events, published on a ZMQ PUB socket with a replay ROUTER
exactly as SGLang's ``ZmqEventPublisher`` does; the shared
:class:`~kvcompassd.worker.workermodel.WorkerQueueModel` decides when the first token and the last
token come. Delays are the modelled ones times ``time_scale`` (1 = real time, 0 = no delay: the
model is bypassed and requests complete at once, for tests and benchmarks; loads then report
in-flight HTTP requests). Text and chats are tokenised with the worker's tokenizer: byte-wise by
default (token = byte value), or a Hugging Face tokenizer directory (``--tokenizer``), which
``/v1/tokenize`` exposes as SGLang does so an edge can check it tokenises the same way; output
tokens are printable ASCII ids derived from a hash of the prompt and the seed.

Routes: ``/generate``, ``/v1/completions``, ``/v1/chat/completions`` (streaming as SGLang: SSE
``data: {...}`` lines then ``data: [DONE]``), ``/v1/models``, ``/server_info``
(``/get_server_info``), ``/v1/loads`` (``/get_loads``), ``/metrics``, ``/health``,
``/health_generate``, ``/flush_cache``, ``/v1/tokenize`` (``/tokenize``), ``/v1/detokenize``
(``/detokenize``), ``/model_info`` (``/get_model_info``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq.asyncio
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvcompassd.worker.kvtransfer import KvTransferTiming
from kvcompassd.worker.prefixcache import CacheLease, CacheMatch, EvictionPolicy, PrefixCache
from kvcompassd.worker.workermodel import FirstTokenProduced, WorkerModelError, WorkerQueueModel, WorkerTiming
from kvcompassd.emulator.kvtransfer import Bootstrap, KvSender, receive_kv
from kvcompassd.emulator.publisher import KvEventPublisher
from kvcompassd.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)
VERSION = "0.5.23-kvcompassd-emulator"
MAX_TOKEN_ID = (1 << 32) - 1


class EmulatorConfigError(ValueError):
    """A bad emulator setting; the message names the field."""


class BadRequest(ValueError):
    """The client's request is malformed (answered with HTTP 400)."""


@dataclass(frozen=True, slots=True)
class EmulatorSettings:
    host: str = "127.0.0.1"
    port: int = 30000  # 0 = ephemeral
    worker_id: str = "emu-0"
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    kv_events_endpoint: str = "tcp://127.0.0.1:5557"  # port "*" = ephemeral
    kv_replay_endpoint: str | None = "tcp://127.0.0.1:5558"
    kv_events_topic: str = ""  # the engines' default
    kv_events_style: str = "map"  # SGLang 0.5.23 sends map-encoded events
    replay_buffer_steps: int = 10_000
    block_size: int = 16
    vram_kv_tokens: int = 250_000
    dram_kv_tokens: int = 1_000_000
    eviction: str = "lru"
    timing: WorkerTiming = field(default_factory=WorkerTiming)
    time_scale: float = 1.0
    seed: int = 0
    default_max_new_tokens: int = 128
    max_new_tokens_limit: int = 32_768
    tokenizer: str = "byte"  # or a Hugging Face tokenizer directory: what text and chats become
    chat_template: str | None = None  # a Jinja file replacing the tokenizer's template
    # Prefill-decode disaggregation (SGLang's --disaggregation-mode): a "prefill" worker computes
    # and caches the prompt and hands its KV to the decode instance named by the request's
    # bootstrap fields, through its bootstrap server on bootstrap_port (0 = ephemeral); a
    # "decode" worker waits for that KV (at most transfer_timeout_s), streams the tokens and
    # publishes no KV events.
    role: str = "mixed"
    bootstrap_port: int = 8998
    kv_transfer: KvTransferTiming = field(default_factory=KvTransferTiming)
    transfer_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        checks = [
            ("port", 0 <= self.port <= 65535),
            ("worker_id", bool(self.worker_id)),
            ("block_size", self.block_size > 0),
            ("vram_kv_tokens", self.vram_kv_tokens >= self.block_size),
            ("dram_kv_tokens", self.dram_kv_tokens >= 0),
            ("eviction", self.eviction in ("lru", "lfu")),
            ("kv_events_style", self.kv_events_style in ("map", "positional")),
            ("time_scale", self.time_scale >= 0),
            ("replay_buffer_steps", self.replay_buffer_steps > 0),
            ("default_max_new_tokens", 0 < self.default_max_new_tokens <= self.max_new_tokens_limit),
            ("tokenizer", isinstance(self.tokenizer, str) and bool(self.tokenizer)),
            ("role", self.role in ("mixed", "prefill", "decode")),
            ("bootstrap_port", 0 <= self.bootstrap_port <= 65535),
            ("transfer_timeout_s", self.transfer_timeout_s > 0),
        ]
        for name, ok in checks:
            if not ok:
                raise EmulatorConfigError(f"emulator setting {name}={getattr(self, name)!r} is invalid")

    @classmethod
    def from_worker_config(cls, worker: Any, **overrides: Any) -> EmulatorSettings:
        """From a cluster ``WorkerConfig``: its http/kv_events addresses, capacities, timing."""
        values: dict[str, Any] = {
            "worker_id": worker.id,
            "vram_kv_tokens": worker.vram_kv_tokens,
            "dram_kv_tokens": worker.dram_kv_tokens,
            "timing": WorkerTiming.from_worker_config(worker),
        }
        if getattr(worker, "http", None):
            hostport = worker.http.split("://", 1)[-1].rstrip("/")
            host, _, port = hostport.rpartition(":")
            values["host"], values["port"] = host or "127.0.0.1", int(port)
        if getattr(worker, "kv_events", None):
            values["kv_events_endpoint"] = worker.kv_events
            base, _, port = worker.kv_events.rpartition(":")
            values["kv_replay_endpoint"] = f"{base}:{int(port) + 1}" if port.isdigit() else None
        if getattr(worker, "kv_events_replay", None):
            values["kv_replay_endpoint"] = worker.kv_events_replay
        values["kv_events_topic"] = getattr(worker, "kv_events_topic", "")
        values["role"] = getattr(worker, "role", "mixed")
        if getattr(worker, "bootstrap_port", None) is not None:
            values["bootstrap_port"] = worker.bootstrap_port
        values.update(overrides)
        return cls(**values)


def byte_tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def byte_text(tokens: list[int]) -> str:
    return bytes(t & 0xFF for t in tokens).decode("utf-8", errors="replace")


def output_tokens(prompt: list[int], count: int, seed: int) -> list[int]:
    """Deterministic printable-ASCII tokens from the prompt and the seed."""
    out: list[int] = []
    state = hashlib.blake2b(seed.to_bytes(8, "little", signed=True) + np.asarray(prompt, dtype="<u4").tobytes(),
                            digest_size=32).digest()
    while len(out) < count:
        out.extend(32 + b % 95 for b in state)
        state = hashlib.blake2b(state, digest_size=32).digest()
    return out[:count]


def apply_stop(output: list[int], stop: tuple[str, ...], stop_token_ids: frozenset[int],
               min_new_tokens: int = 0, decode: Callable[[list[int]], str] = byte_text,
               ) -> tuple[list[int], str | int | None]:
    """``output`` cut where SGLang's ``check_finished`` would stop it (a stop token id, or a stop
    string in the decoded text, checked after each token once ``min_new_tokens`` are out) and
    what matched (None: it ran to its length)."""
    longest = max((len(s.encode()) for s in stop), default=0)
    for i, token in enumerate(output):
        if i + 1 < min_new_tokens:
            continue
        if token in stop_token_ids:
            return output[: i + 1], token
        if stop:
            # A token is at least one byte: the last `longest + 1` tokens hold any stop that ends here.
            tail = decode(output[max(0, i + 1 - longest - 1): i + 1])
            for s in stop:
                if s in tail:
                    return output[: i + 1], s
    return output, None


@dataclass(slots=True)
class Generation:
    """One request's progress as the HTTP layer sees it."""

    rid: str
    prompt: list[int]
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    min_new_tokens: int = 0
    no_stop_trim: bool = False
    decode: Callable[[list[int]], str] = byte_text  # the worker's tokenizer's decode
    matched: str | int | None = None
    text_end: int | None = None
    cached_tokens: int = 0
    output: list[int] = field(default_factory=list)
    emitted: int = 0
    finished: bool = False
    started: float = 0.0
    e2e_latency: float = 0.0
    bootstrap: Bootstrap | None = None  # a disaggregated request's (prefill and decode roles)
    prefill_only: bool = False  # a prefill instance's: ends with the first token
    # A stream's pieces: the first token at once, then whenever this many are unsent, then the
    # end (SGLang's per-request ``stream_interval``, 0.5.23's output streamer).
    stream_interval: int = 1

    def text(self) -> str:
        """The output as SGLang's detokenizer returns it: without the matched stop (unless
        ``no_stop_trim``), and while streaming never past where the finished text ends."""
        return self.decode(self.output)[: self.text_end]

    def stop_at(self, output: list[int]) -> list[int]:
        """Cut the whole ``output`` at its stop condition; note what matched and where the text ends."""
        output, self.matched = apply_stop(output, self.stop, self.stop_token_ids, self.min_new_tokens, self.decode)
        full = self.decode(output)
        if self.matched is None or self.no_stop_trim:
            self.text_end = len(full)
        elif isinstance(self.matched, int):
            self.text_end = len(self.decode(output[:-1]))
        else:
            self.text_end = full.find(self.matched)
        return output

    def finish_reason(self) -> dict[str, Any] | None:
        if not self.finished:
            return None
        if self.prefill_only:  # SGLang's prefill server: FINISH_LENGTH(length=0) once the KV went
            return {"type": "length", "length": 0}
        if self.matched is not None:
            return {"type": "stop", "matched": self.matched}
        return {"type": "length", "length": self.max_new_tokens}

    def meta_info(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason(),
            "prompt_tokens": len(self.prompt),
            "completion_tokens": self.emitted,
            "cached_tokens": self.cached_tokens,
        }
        if self.finished:
            meta["e2e_latency"] = self.e2e_latency
        return meta


def piece_due(emitted: int, sent: int, interval: int) -> bool:
    """Whether a stream that has sent its first ``sent`` tokens sends a piece now that
    ``emitted`` are out: once ``interval`` are unsent (SGLang 0.5.23's output streamer, after the
    first token, which goes at once, and before the end, which always goes;
    ``tests/data/engine_streams`` holds what SGLang's own sends)."""
    return emitted - sent >= interval


@dataclass(slots=True)
class _Queued:
    """A request in the model: what its cache side needs at its prefill's start, end and finish."""

    prompt: list[int]
    output: list[int]
    no_prefill: tuple[int, int] | None = None  # a decode instance's: the prompt's KV came with it
    lease: CacheLease | None = None
    found: CacheMatch | None = None  # what it reused, matched when its prefill started
    pinned: tuple[int, ...] | None = None  # its lease's pages once its prompt is cached


class _Metrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge("sglang:num_running_reqs", "The number of running requests.", labels, registry=r)
        self.queued = Gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", labels, registry=r)
        self.used_tokens = Gauge("sglang:num_used_tokens", "The number of used tokens.", labels, registry=r)
        self.token_usage = Gauge("sglang:token_usage", "The token usage.", labels, registry=r)
        self.hit_rate = Gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", labels, registry=r)
        self.gen_throughput = Gauge("sglang:gen_throughput", "The generation throughput (token/s).", labels, registry=r)
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("sglang:generation_tokens", "Number of generation tokens processed.", labels, registry=r)
        self.cached_tokens = Counter("sglang:cached_tokens", "Number of cached prompt tokens.", labels, registry=r)
        self.requests = Counter("sglang:num_requests", "Number of requests processed.", labels, registry=r)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, registry=r, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                             labels, registry=r, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.model = model


class EmulatedEngine:
    """Cache, queue model, publisher and clock of one emulated worker."""

    def __init__(self, settings: EmulatorSettings, publisher: KvEventPublisher | None,
                 tokenizer: Tokenizer | None = None, kv_sender: KvSender | None = None) -> None:
        self.settings = settings
        self.publisher = publisher
        self.tokenizer = tokenizer or load_tokenizer(settings.tokenizer, settings.chat_template)
        self.cache = PrefixCache(
            block_size=settings.block_size, vram_tokens=settings.vram_kv_tokens,
            dram_tokens=settings.dram_kv_tokens, policy=EvictionPolicy(settings.eviction),
        )
        # The prefix is matched and pinned when the prefill starts, and only when the prompt's
        # KV fits beside the running requests' (SGLang's PrefillAdder); the queue report counts
        # the wait for that room (the model runs ahead with each request's pages).
        self._queued: dict[str, _Queued] = {}
        self.model = WorkerQueueModel(settings.timing, prefill_starts=self._prefill_starts,
                                      prefill_ends=self._prefill_ends, finished=self._finished,
                                      footprint=self._footprint, vram_pages=self.cache.vram_pages_max)
        self.metrics = _Metrics(settings.model)
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self._wake = asyncio.Event()
        self._waiters: dict[str, tuple[asyncio.Future[float], asyncio.Future[float]]] = {}
        self._scheduler: asyncio.Task[None] | None = None
        self.inflight = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self._recent_tokens: list[tuple[float, int]] = []
        self.kv_sender = kv_sender  # a prefill worker's bootstrap server
        self.kv_received = 0  # a decode worker's completed hand-overs

    # -------------------------------------------------------------------------- clock

    @property
    def delays(self) -> bool:
        return self.settings.time_scale > 0

    def model_now(self) -> float:
        elapsed = self._loop.time() - self._t0
        now = elapsed / self.settings.time_scale if self.delays else elapsed
        return max(now, self.model.now)

    def start(self) -> None:
        if self.delays and self._scheduler is None:
            self._scheduler = self._loop.create_task(self._run_scheduler())

    async def close(self) -> None:
        """Stop modelling; requests still waiting for a token are cancelled."""
        for first, done in self._waiters.values():
            first.cancel()
            done.cancel()
        self._waiters.clear()
        if self._scheduler is not None:
            self._scheduler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scheduler

    async def _run_scheduler(self) -> None:
        """Sleep exactly until the model's next state change (or a new arrival)."""
        while True:
            due = self.model.next_event_time()
            if due is None:
                await self._wake.wait()
            else:
                delay = self._t0 + due * self.settings.time_scale - self._loop.time()
                if delay > 0:
                    # asyncio.timeout: wait_for can swallow a cancellation on Python 3.11
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await self._wake.wait()
            # Woken early (an arrival, an abort): the model runs to the present only. Running it
            # to the stale ``due`` would jump its clock ahead, e.g. past an aborted request's end.
            woken = self._wake.is_set()
            self._wake.clear()
            now = self.model_now()
            for event in self.model.advance(now=now if woken else max(now, due or 0.0)):
                futures = self._waiters.get(event.request_id)
                if futures is None:
                    continue
                target = futures[0] if isinstance(event, FirstTokenProduced) else futures[1]
                if not target.done():
                    target.set_result(event.at)
                if target is futures[1]:
                    del self._waiters[event.request_id]

    # -------------------------------------------------------------------------- requests

    def _publish(self, events: list) -> None:
        if events and self.publisher is not None:  # a decode worker publishes nothing
            self.publisher.publish(events)

    async def generate(self, gen: Generation, *, stream: bool) -> AsyncIterator[Generation]:
        """Run one request; yields ``gen`` whenever new tokens are out (last: finished).

        A prefill worker stops after the first token, once its KV went to the decode instance
        (raises :class:`TransferFailed` if it could not); a decode worker first waits for that
        KV, then decodes without a prefill (raises :class:`TransferFailed` if it never comes)."""
        if gen.rid in self._waiters:
            raise WorkerModelError(f"request id {gen.rid!r} is already running")
        role = self.settings.role
        gen.started = time.perf_counter()
        self.inflight += 1
        lease = None
        try:
            output = gen.stop_at(output_tokens(gen.prompt, gen.max_new_tokens, self.settings.seed))
            no_prefill = None
            if role == "decode":
                assert gen.bootstrap is not None  # the route refuses a decode request without one
                kv = await receive_kv(gen.bootstrap, self.settings.worker_id, gen.prompt,
                                      timeout_s=self.settings.transfer_timeout_s)
                self.kv_received += 1
                if output:
                    output = gen.stop_at([kv.first_token] + output[1:])
                gen.cached_tokens = kv.cached_tokens  # the prefill's, as SGLang's decode reports it
                no_prefill = (len(gen.prompt), 0)  # the prompt's KV is all here: no prefill
            if role == "prefill":
                gen.prefill_only = True
                output = output[:1]
            first = done = None
            if self.delays:
                # Matched (and pinned) when its prefill starts, as SGLang does: what it reuses is
                # what the cache holds then (``_prefill_starts``); now only the estimate.
                queued = self._queued[gen.rid] = _Queued(gen.prompt, output, no_prefill)
                estimate = no_prefill or self._match(gen.prompt)
                first, done = self._loop.create_future(), self._loop.create_future()
                self._waiters[gen.rid] = (first, done)
                # max_new_tokens = 0 still runs the prefill (its logits are dropped)
                self.model.admit(gen.rid, len(gen.prompt), *estimate, max(1, len(output)), now=self.model_now())
                self._wake.set()
                await first
                if queued.found is not None:
                    gen.cached_tokens = queued.found.total_tokens
            elif role != "decode":
                # No modelled time: the prefill starts at once.
                lease, found, events = self.cache.lock(gen.prompt[:-1], now=self.model_now())
                self._publish(events)
                gen.cached_tokens = found.total_tokens
            self.metrics.ttft.labels(self.metrics.model).observe(time.perf_counter() - gen.started)
            if lease is not None:
                self._publish(self.cache.insert(gen.prompt, now=self.model_now(), lease=lease))
            if role == "prefill":
                if done is not None:
                    await done
                if gen.bootstrap is not None and self.kv_sender is not None:
                    first_token = output[0] if output else output_tokens(gen.prompt, 1, self.settings.seed)[0]
                    await self.kv_sender.hand_over(gen.bootstrap, gen.prompt, first_token, gen.cached_tokens)
                gen.output, gen.emitted, gen.finished = output, len(output), True
                gen.e2e_latency = time.perf_counter() - gen.started
                self._account(gen)
                yield gen
                return
            gen.output, gen.emitted = output[:1], min(1, len(output))
            if done is not None and stream and len(output) > 1:
                yield gen
                sent = gen.emitted
                step = max(0.001, self.settings.timing.decode_step_ms(1) / 1000.0 * self.settings.time_scale)
                while not done.done():
                    await asyncio.wait({done}, timeout=step)
                    if not done.done() and gen.emitted < len(output) - 1:
                        gen.emitted += 1
                        if piece_due(gen.emitted, sent, gen.stream_interval):
                            gen.output = output[: gen.emitted]
                            sent = gen.emitted
                            yield gen
            if done is not None:
                await done
            gen.output, gen.emitted, gen.finished = output, len(output), True
            gen.e2e_latency = time.perf_counter() - gen.started
            if lease is not None:
                # like cache_finished_req: the last token's KV was never computed
                self._publish(self.cache.insert(gen.prompt + output[:-1], now=self.model_now(), lease=lease))
            self._account(gen)
            yield gen
        finally:
            if self.delays and not gen.finished and self.model.abort(gen.rid, now=self.model_now()):
                # Closed early (the client disconnected, as SGLang notices): the request
                # stops holding its slot and the GPU.
                self._wake.set()
            if role == "prefill" and not gen.finished and gen.bootstrap is not None and self.kv_sender is not None:
                self.kv_sender.abandon(gen.bootstrap, "the prefill request ended before its KV was computed")
            self._waiters.pop(gen.rid, None)
            queued = self._queued.pop(gen.rid, None)
            if queued is not None and queued.lease is not None and not queued.lease.released:
                self.cache.unlock(queued.lease)  # a prefill instance's, or aborted after its prefill started
            if lease is not None:
                self.cache.unlock(lease)
            self.inflight -= 1

    # -------------------------------------------------------------------------- the cache, as the model asks

    def _match(self, prompt: list[int]) -> tuple[int, int]:
        """What the cache holds of ``prompt`` now, by tier (SGLang matches all but the last token)."""
        found = self.cache.match(prompt[:-1])
        return found.vram_tokens, found.dram_tokens

    def _prefill_starts(self, rid: str, now: float) -> tuple[int, int] | None:
        """The model starts the request's prefill: match and pin its prefix now, or None while
        its prompt's KV does not fit beside the running requests' (it waits at the head)."""
        queued = self._queued[rid]
        if queued.no_prefill is not None:
            return queued.no_prefill
        locked = self.cache.lock(queued.prompt[:-1], now=now, only_if_room=True, prompt_tokens=len(queued.prompt))
        if locked is None:
            return None
        queued.lease, queued.found, events = locked
        self._publish(events)
        return queued.found.vram_tokens, queued.found.dram_tokens

    def _prefill_ends(self, rid: str, now: float) -> None:
        """The prompt is computed: its KV enters the cache before the next prefill starts."""
        queued = self._queued[rid]
        if queued.lease is not None:
            self._publish(self.cache.insert(queued.prompt, now=now, lease=queued.lease))
            queued.pinned = tuple(queued.lease.pages)

    def _finished(self, rid: str, now: float) -> None:
        """The last token is out: the output's KV is cached (like cache_finished_req, the last
        token's never computed) and the pages released, before anything else is scheduled. A
        prefill instance keeps them pinned until its KV went to the decode instance (released
        when ``generate`` ends)."""
        queued = self._queued[rid]
        if queued.lease is not None:
            self._publish(self.cache.insert(queued.prompt + queued.output[:-1], now=now, lease=queued.lease))
            if self.settings.role != "prefill":
                self.cache.unlock(queued.lease)

    def _footprint(self, rid: str) -> tuple[int, ...]:
        """The pages the request pins while it runs (for the queue report's run-ahead)."""
        queued = self._queued[rid]
        if queued.no_prefill is not None:
            return ()
        if queued.pinned is None:
            queued.pinned = tuple(self.cache.path_ids(queued.prompt))
        return queued.pinned

    def _account(self, gen: Generation) -> None:
        m, label = self.metrics, self.metrics.model
        self.prompt_tokens_total += len(gen.prompt)
        self.cached_tokens_total += gen.cached_tokens
        m.prompt_tokens.labels(label).inc(len(gen.prompt))
        m.cached_tokens.labels(label).inc(gen.cached_tokens)
        m.generation_tokens.labels(label).inc(len(gen.output))
        m.requests.labels(label).inc()
        m.e2e.labels(label).observe(gen.e2e_latency)
        now = self._loop.time()
        self._recent_tokens.append((now, len(gen.output)))
        self._recent_tokens = [(t, n) for t, n in self._recent_tokens if now - t <= 10.0]

    def flush(self) -> None:
        self._publish(self.cache.flush())

    # -------------------------------------------------------------------------- load

    def load(self) -> dict[str, Any]:
        if self.delays:
            now = self.model_now()
            running, waiting = self.model.running, self.model.waiting
            # The model's clock runs time_scale times slower than the wall's: its wait for a new
            # arrival, in the wall milliseconds every reader of a load (the agent, the edge aging
            # it) counts in.
            pending = self.model.pending_prefill_tokens
            queue_ms = self.model.queue_ms(now=now) * self.settings.time_scale
            page = self.cache.block_size
            room = [[round(ms * self.settings.time_scale, 3), pages * page]
                    for ms, pages in self.model.room_steps(now=now)]
        else:
            running, waiting, pending, queue_ms, room = self.inflight, 0, 0, 0.0, []
        # As SGLang counts them: the KV the running requests hold (not the evictable cache), and
        # that plus every waiting prompt's length (what must fit before the queue drains; more
        # than the capacity: the head waits for room, the wait estimated_queue_ms counts).
        used = self.cache.pinned_vram_pages * self.cache.block_size
        waiting_prompts = sum(len(q.prompt) for q in self._queued.values()
                              if q.found is None and q.no_prefill is None)
        capacity = self.cache.vram_pages_max * self.cache.block_size
        hit = self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0
        throughput = sum(n for _, n in self._recent_tokens) / 10.0
        return {
            "dp_rank": 0,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_waiting_uncached_tokens": pending,
            "num_used_tokens": used,
            "num_total_tokens": used + waiting_prompts,
            "max_total_num_tokens": capacity,
            "token_usage": round(used / capacity, 4) if capacity else 0.0,
            "gen_throughput": throughput,
            "cache_hit_rate": round(hit, 4),
            "utilization": round(running / self.settings.timing.max_running, 4),
            "max_running_requests": self.settings.timing.max_running,
            "num_total_reqs": running + waiting,
            # emulator extension: the model's exact wait for a new arrival, in wall ms
            "estimated_queue_ms": round(queue_ms, 3),
            # emulator extension: when VRAM frees up, [wall ms from now, free KV tokens from
            # then on] (WorkerQueueModel.room_steps; empty: nothing pinned)
            "room_steps": room,
        }

    def update_gauges(self) -> None:
        load, m, label = self.load(), self.metrics, self.metrics.model
        m.running.labels(label).set(load["num_running_reqs"])
        m.queued.labels(label).set(load["num_waiting_reqs"])
        m.used_tokens.labels(label).set(load["num_used_tokens"])
        m.token_usage.labels(label).set(load["token_usage"])
        m.hit_rate.labels(label).set(load["cache_hit_rate"])
        m.gen_throughput.labels(label).set(load["gen_throughput"])


class EmulatedWorker:
    """The whole emulated worker: HTTP server, engine, publisher. ``start``/``stop``."""

    def __init__(self, settings: EmulatorSettings, *, context: zmq.asyncio.Context | None = None) -> None:
        self.settings = settings
        self._ctx = context
        self.engine: EmulatedEngine | None = None
        self.publisher: KvEventPublisher | None = None
        self.kv_sender: KvSender | None = None
        self._runner: web.AppRunner | None = None
        self.http_url = ""
        # Fault injection: every route answers 503, as an engine whose HTTP side is down or
        # stuck while its scheduler (and event stream, and cache) carries on.
        self.http_unavailable = False

    async def start(self) -> None:
        s = self.settings
        tokenizer = load_tokenizer(s.tokenizer, s.chat_template)  # a bad tokenizer fails before any socket
        if s.role != "decode":  # a decode worker's KV is never indexed: it publishes nothing
            self.publisher = KvEventPublisher(
                s.kv_events_endpoint, s.kv_replay_endpoint, topic=s.kv_events_topic,
                buffer_steps=s.replay_buffer_steps, style=s.kv_events_style, context=self._ctx,  # type: ignore[arg-type]
            )
            await self.publisher.start()
        if s.role == "prefill":
            self.kv_sender = KvSender(s.host, s.bootstrap_port, s.kv_transfer, time_scale=s.time_scale,
                                      timeout_s=s.transfer_timeout_s)
            await self.kv_sender.start()
        self.engine = EmulatedEngine(s, self.publisher, tokenizer, kv_sender=self.kv_sender)
        self.engine.start()
        from kvcompassd.emulator.routes import build_app  # the HTTP layer imports this module

        app = build_app(self.engine)

        @web.middleware
        async def unavailable(request: web.Request, handler):
            if self.http_unavailable:
                return web.Response(status=503, text="unavailable (fault injection)")
            return await handler(request)

        app.middlewares.append(unavailable)
        # handler_cancellation: a client that disconnects cancels its request, as in SGLang.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, s.host, s.port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.http_url = f"http://{s.host}:{port}"
        if self.publisher is not None:
            log.info("emulated %s worker %s on %s, KV events on %s (replay %s)", s.role, s.worker_id, self.http_url,
                     self.publisher.endpoint, self.publisher.replay_endpoint)
        else:
            log.info("emulated %s worker %s on %s, no KV events", s.role, s.worker_id, self.http_url)
        if self.kv_sender is not None:
            log.info("emulated worker %s: KV-transfer bootstrap on %s:%d", s.worker_id, s.host, self.kv_sender.port)

    @property
    def kv_events_endpoint(self) -> str:
        assert self.publisher is not None
        return self.publisher.endpoint

    @property
    def kv_replay_endpoint(self) -> str | None:
        assert self.publisher is not None
        return self.publisher.replay_endpoint

    @property
    def bootstrap_port(self) -> int | None:
        """A prefill worker's bound bootstrap port (None in the other roles)."""
        return self.kv_sender.port if self.kv_sender is not None else None

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.close()  # first: lets handlers blocked on the model return
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.kv_sender is not None:
            await self.kv_sender.close()
        if self.publisher is not None:
            await self.publisher.close()

