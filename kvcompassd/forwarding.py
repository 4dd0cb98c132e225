"""The edge's forwarding path: decide with the core, run on the winner, retry before the first token.

Two ways to reach a worker, as in the paper's testbed: inside the edge's own region plain HTTP
to the engine's ``/generate`` (the datacenter network), and across regions a ``RequestForwarded``
exchange over QUIC to the worker's agent, whose response carries the serving region's queue
vector back. Token ids travel, never text, so the engine's cache and the edge's keys agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import zlib
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable, Collection

import numpy as np
import structlog

from kvcompassd.core.config import bootstrap_port_of
from kvcompassd.core.decode_choice import DecodeChooser, NoDecodeWorkerError
from kvcompassd.core.layout import UnknownWorkerError
from kvcompassd.core.router import ForwardDecided, Router
from kvcompassd.core.score import NoEligibleWorkerError, ScoreTerms
from kvcompassd.engine.client import (
    EngineClient,
    EngineError,
    EngineFinished,
    EngineOutput,
    EngineRejected,
)
from kvcompassd.engine.http1 import WorkerConnections
from kvcompassd.engine.disaggregated import BootstrapFields, DecodeFailed, generate_on_pair, new_bootstrap_room
from kvcompassd.metrics import EdgeMetrics
from kvcompassd.worker.kvtransfer import KvTransferTiming
from kvcompassd.transport import Peer, TransportError
from kvcompassd.wire import (
    ErrorReported,
    MigrationRequested,
    PrefillDecodeForwarded,
    RequestFailed,
    RequestForwarded,
    RequestRejected,
    ResponseChunked,
    ResponseCompleted,
)

log = structlog.get_logger(__name__)


# The next piece of output (``token_ids``, ``text``): the engine client's own type, so that the
# own-region HTTP path hands the worker's items on as they come, without a copy or a generator
# layer per request and per item.
TokensGenerated = EngineOutput


@dataclass(frozen=True, slots=True)
class GenerationFinished:
    """The request is done: who served it and how much of its prefix was reused."""

    worker: str
    region: str
    cached_tokens: int
    claimed_tokens: int
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    attempts: int
    decision_us: float
    queue_vector: tuple[tuple[str, float], ...] = ()  # the serving region's, piggybacked
    decode_worker: str = ""  # a disaggregated fleet's: the decode worker that streamed the tokens
    pending_credited: bool = False  # the claim came from the edge's pending ledger, beyond its view
    worker_latency_s: float | None = None  # the engine's own time for the request, if it said


class ForwardError(Exception):
    """The request could not be served; ``status`` is the HTTP status to answer with and
    ``code`` the OpenAI error code (None: the front door derives one from the status)."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code


class WorkerUnavailable(Exception):
    """The chosen worker failed before producing a token: the next best may serve it."""


class FirstTokenLate(WorkerUnavailable):
    """A worker brought no first token within the deadline."""


class OutputStalled(WorkerUnavailable):
    """A worker that had produced output brought no more within the inter-token deadline."""


class DecodeUnavailable(WorkerUnavailable):
    """The decode half of a prefill-decode pair failed before the first token: the decode
    worker is to blame, not the prefill worker the score chose (which may serve the retry).
    ``decode_worker`` empty: the prefill's region has no decode worker left for the request."""

    def __init__(self, decode_worker: str, message: str):
        super().__init__(message)
        self.decode_worker = decode_worker


@dataclass(frozen=True, slots=True)
class ForwardRequest:
    request_id: str
    tokens: np.ndarray
    sampling_params: dict
    stream: bool


class SuspectWorkers:
    """Workers that just failed a request (a crawling or dead path, a refusing or frozen
    engine): left out of decisions for a while, so that the next requests do not each pay the
    same deadline. The period doubles with each further failure, up to ``max_s``; a served
    request, or news that the worker is back (:meth:`back`), clears it. One entry per worker at
    most."""

    def __init__(self, initial_s: float = 5.0, max_s: float = 60.0) -> None:
        self.initial_s, self.max_s = initial_s, max_s
        self._avoided: dict[int, tuple[float, float]] = {}  # index -> (until, period)

    def failed(self, index: int, *, now: float) -> float:
        """Record a failure; returns how long the worker is now avoided (s)."""
        previous = self._avoided.get(index)
        period = min(self.max_s, 2 * previous[1]) if previous else self.initial_s
        self._avoided[index] = (now + period, period)
        return period

    def served(self, index: int) -> None:
        self._avoided.pop(index, None)

    def back(self, index: int, *, now: float) -> bool:
        """The worker's agent or health readings say it is back: suspicion ends now. Returns
        whether it was being avoided."""
        entry = self._avoided.pop(index, None)
        return entry is not None and entry[0] > now

    def current(self, *, now: float) -> set[int]:
        return {index for index, (until, _) in self._avoided.items() if until > now}

    def __len__(self) -> int:
        return len(self._avoided)


class _Deadlines:
    """The deadlines of one attempt's waits for its items, judged by one timer.

    ``wait(items)`` awaits the next item for at most ``first_s`` until the first token, then
    ``inter_s`` (a number, or a function giving it, called once if ever: the gap a worker's
    pieces may leave reads its learned decode rate, a median taken when read). A late item raises
    :class:`FirstTokenLate` or :class:`OutputStalled`; the caller closes ``items``, whose cleanup
    aborts the request at the worker. A deadline bounds the wait for an item, not the consumer's
    work on one. ``stop()`` when done.

    With ``progress`` (a count of the worker's output for any request, read when a deadline
    passes), a first-token deadline that passes while the count moved in the last ``first_s``
    is not a failure: the worker is serving, only its queue is longer than expected. The wait
    is judged again every ``first_s`` up to ``max_s`` in all (at least ``first_s``).

    One timer judges the whole attempt, re-armed only when it fires: a timeout per item (a
    ``Timeout`` and a timer each) cost 5 % of the request path's instructions (callgrind,
    README), on responses that come whole long before any deadline. The caller awaits ``wait``
    itself rather than through a wrapping async generator: a layer of those costs every item of
    a streamed answer a few microseconds.

    The timer is armed for the earliest moment a deadline could pass; when it fires it judges
    the wait in progress (if any) and arms itself again for the next such moment, or expires the
    wait: the waiting task is cancelled, and ``wait`` turns that cancellation (and only that
    one: an outer cancellation passes through) into the attempt's failure."""

    __slots__ = ("_loop", "_task", "_cancelling", "_first_s", "_inter_s", "_progress", "_max_s", "_start", "_mark",
                 "_produced", "_first_phase", "_waiting_since", "_timer", "_failure")

    def __init__(self, first_s: float, inter_s: float | Callable[[], float], progress: Callable[[], int] | None,
                 max_s: float) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._cancelling = self._task.cancelling()
        self._first_s, self._inter_s, self._progress = first_s, inter_s, progress
        self._max_s = max(first_s, max_s)
        self._start = loop.time()
        self._mark = progress() if progress is not None else 0
        self._produced = False  # a token came: the inter-token deadline from now on
        self._first_phase = True  # the first item not yet in: the progress judge applies
        self._waiting_since: float | None = None  # None while the consumer holds an item
        self._failure: Exception | None = None
        self._timer = loop.call_at(self._start + first_s, self._judge)

    async def wait(self, items: AsyncIterator):
        self._waiting_since = self._loop.time()
        try:
            item = await anext(items)
        except asyncio.CancelledError:
            if self._failure is not None and self._task.uncancel() <= self._cancelling:
                raise self._failure from None
            raise
        finally:
            self._waiting_since = None
        self._first_phase = False
        if not self._produced and isinstance(item, TokensGenerated):
            self._produced = True
        return item

    @property
    def _deadline(self) -> float:
        if not self._produced:
            return self._first_s
        inter_s = self._inter_s
        if callable(inter_s):
            inter_s = self._inter_s = inter_s()
        return inter_s

    def _judge(self) -> None:
        loop = self._loop
        now = loop.time()
        since = self._waiting_since
        if since is None:  # the consumer holds an item: the next wait has its whole deadline
            self._timer = loop.call_at(now + self._deadline, self._judge)
            return
        if self._first_phase and self._progress is not None:
            # Windows of first_s from the start: one in which the worker produced output for
            # anyone opens the next, up to max_s in all.
            seen = self._progress()
            if seen != self._mark and now + self._first_s <= self._start + self._max_s:
                self._mark = seen
                self._timer = loop.call_at(now + self._first_s, self._judge)
                return
            waited = now - self._start
            if seen != self._mark:
                self._expire(FirstTokenLate(f"no first token within {waited:.1f} s (the limit), though the worker "
                                            f"was serving other requests"))
            else:
                self._expire(FirstTokenLate(f"no first token within {waited:.1f} s, and no output from the worker "
                                            f"for any request in the last {self._first_s:.1f} s"))
            return
        due = since + self._deadline
        if now < due:
            self._timer = loop.call_at(due, self._judge)
            return
        if self._produced:
            self._expire(OutputStalled(f"no output for {self._deadline:.1f} s after the last"))
        else:
            self._expire(FirstTokenLate(f"no first token within {self._deadline:.1f} s"))

    def _expire(self, failure: Exception) -> None:
        self._failure = failure
        self._task.cancel()

    def stop(self) -> None:
        self._timer.cancel()


def _terms_fields(terms: ScoreTerms) -> dict:
    """One candidate's score terms (ms) for the debug-level ``forward`` log line."""
    return {"worker": terms.worker, "total": round(terms.total, 3), "wan_ms": round(terms.wan_ms, 3),
            "queue_ms": round(terms.queue_ms, 3), "prefill_ms": round(terms.prefill_ms, 3),
            "reload_ms": round(terms.reload_ms, 3), "copy_ms": round(terms.copy_ms, 3), "matched": terms.matched,
            "tier": terms.tier.name.lower(), "belief": round(terms.belief, 3)}


class Forwarder:
    """Runs requests for one edge; ``agent_peer(worker)`` gives the QUIC peer of a worker's agent.

    A request that has produced no token yet is never lost to one worker's failure: it moves to
    the next best worker, each worker tried at most once (``max_attempts``, default all of
    them). Workers reached over QUIC whose agent is not connected, and workers that just failed
    a request (:class:`SuspectWorkers`), are left out of the decision while any other worker is
    eligible. On both paths (own-region HTTP and QUIC) an attempt that brings no first token
    within ``first_token_timeout(expected)`` (a frozen engine, a connection crawling under loss
    or dead but not yet timed out) is abandoned for the next best, in the edge's own region if
    the late one was remote; after the first token, a gap of ``inter_token_s`` ends the request
    with a 504 rather than a hang. An engine's client error (a 4xx it gives the request
    itself) is the client's: it is answered as is, and neither retried nor held against the
    worker. Closing the generator (the client went away) aborts the request at the worker.
    Deadlines default to the config's ``[deadlines]``.
    """

    def __init__(
        self,
        edge_id: str,
        router: Router,
        agent_peer: Callable[[str], Peer | None],
        http: WorkerConnections,
        *,
        clock: Callable[[], float],
        metrics: EdgeMetrics,
        local_http: bool = True,
        max_attempts: int | None = None,
        first_token_floor_s: float | None = None,
        first_token_factor: float | None = None,
        first_token_max_s: float | None = None,
        inter_token_s: float | None = None,
        on_urgent: Callable[[], None] | None = None,
    ):
        self.edge_id = edge_id
        self._on_urgent = on_urgent  # called after a decision that made the queue broadcasts urgent
        self.router = router
        self.cfg = router.cfg
        self.agent_peer = agent_peer
        self.http = http
        self.clock = clock
        self.metrics = metrics
        self.local_http = local_http
        workers = router.layout.worker_ids
        self.max_attempts = len(workers) if max_attempts is None else max_attempts
        deadlines = self.cfg.deadlines
        self.first_token_floor_s = deadlines.first_token_floor_s if first_token_floor_s is None else first_token_floor_s
        self.first_token_factor = deadlines.first_token_factor if first_token_factor is None else first_token_factor
        self.first_token_max_s = deadlines.first_token_max_s if first_token_max_s is None else first_token_max_s
        # Pieces of output (tokens, completions) each worker brought this edge, for any request:
        # a first-token deadline passing while its worker's count moves is a long queue, not a fault.
        self._output_seen = [0] * len(workers)
        self.inter_token_s = deadlines.inter_token_s if inter_token_s is None else inter_token_s
        self.worker_stream_interval = deadlines.worker_stream_interval
        self.suspects = SuspectWorkers(deadlines.suspect_initial_s, deadlines.suspect_max_s)
        # (index, id) of the workers this edge reaches over QUIC (the others over local HTTP).
        self._quic_workers = tuple((i, w) for i, w in enumerate(workers) if not self._uses_http(w))
        self._remote_workers = {i for i, r in enumerate(router.worker_regions) if r != router.region}
        self.migrations: list[dict] = []  # recent, for kvcompassctl
        # Disaggregated fleets: the decode worker of each request, in its prefill's region.
        self.decode_chooser = (DecodeChooser.from_config(self.cfg, seed=zlib.crc32(edge_id.encode()))
                               if self.cfg.disaggregated else None)
        self._rooms = random.Random()  # bootstrap rooms: random, as SGLang's router draws them
        self._transfer_of = {w.id: KvTransferTiming.for_worker(self.cfg, w) for w in self.cfg.workers
                             if w.role == "prefill"}
        rates = router.rates
        for i, worker in enumerate(workers):  # read when scraped: nothing per request
            metrics.learned_prefill.labels(worker).set_function(lambda i=i: rates.prefill_ms_per_token(i))
            metrics.learned_decode.labels(worker).set_function(lambda i=i: rates.decode_ms_per_token(i))
        self._engines: dict[str, EngineClient] = {}  # own-region workers' HTTP clients, by base URL
        if router.pending is not None:
            metrics.pending_refuted.set_function(lambda: router.pending.refuted)
        for outcome in router.copy_charges:
            metrics.copy_charged.labels(outcome).set_function(lambda o=outcome: router.copy_charges[o])
        # Migration requests being sent (kept: the loop holds tasks weakly; cancelled by close()).
        self._sending: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        """Cancel the migration requests still being sent (the edge is stopping)."""
        sending, self._sending = self._sending, set()
        for task in sending:
            task.cancel()
        await asyncio.gather(*sending, return_exceptions=True)

    def first_token_timeout(self, expected_ms: float) -> float:
        """How long an attempt may take to its first token: a multiple of what the score
        expected, never under the floor (seconds)."""
        return max(self.first_token_floor_s, self.first_token_factor * expected_ms / 1000.0)

    def worker_back(self, worker_id: str, why: str) -> None:
        """The worker's agent reconnected, or its load readings resumed: stop avoiding it."""
        try:
            index = self.router.layout.worker_index(worker_id)
        except UnknownWorkerError:
            return
        if self.suspects.back(index, now=self.clock()):
            log.info("worker back: no longer avoided", worker=worker_id, why=why)

    def _expected_ms(self, d: ForwardDecided, req: ForwardRequest) -> float:
        """What the score expects until the first token; a prefill-decode pair adds the KV's
        move from prefill to decode (the prompt's, at the configured bandwidth)."""
        expected = d.score.total  # the winner's own score: reading every worker's would score them all
        if self.decode_chooser is not None and self.cfg.worker(d.worker).role == "prefill":
            expected += self._transfer_of[d.worker].transfer_ms(len(req.tokens))
        return expected

    def unreachable(self) -> set[int]:
        """Indexes of QUIC-reached workers whose agent is not connected right now."""
        out = set()
        for index, worker in self._quic_workers:
            peer = self.agent_peer(worker)
            if peer is None or not peer.is_connected:
                out.add(index)
        return out

    def _decide(self, req: ForwardRequest, excluded: set[int], stay_home: bool) -> ForwardDecided:
        """The best worker not yet tried, preferring reachable, unsuspected ones (and, with
        ``stay_home``, the edge's own region); NoEligibleWorkerError if none is left."""
        now = self.clock()
        avoided = self.unreachable() | self.suspects.current(now=now)
        if stay_home:
            avoided |= self._remote_workers
        avoided -= excluded
        decision = None
        if avoided:
            try:
                decision = self.router.decide(req.tokens, now=now, exclude=excluded | avoided)
            except NoEligibleWorkerError:
                pass  # only avoided workers left: try them (one may have come back)
        if decision is None:
            decision = self.router.decide(req.tokens, now=now, exclude=excluded)
        if self._on_urgent is not None and self.router.queues.urgent:
            self._on_urgent()
        return decision

    async def generate(self, req: ForwardRequest) -> AsyncIterator[TokensGenerated | GenerationFinished]:
        if not req.stream and req.sampling_params.get("stream_interval") is None:
            # Streamed toward the worker all the same, in pieces ([deadlines] worker_stream_interval).
            # (built directly: dataclasses.replace reads the fields anew each call, 11 us a request in place)
            req = ForwardRequest(req.request_id, req.tokens, {**req.sampling_params,
                                                              "stream_interval": self.worker_stream_interval}, req.stream)
        # Pieces of several tokens come that much further apart: the gap allowed between two is
        # inter_token_s plus the others' decode at the worker's rate (learned, else configured).
        # A piece holds at most the answer, so a client's huge interval cannot lift the deadline
        # beyond the answer's decode (max_new_tokens is bounded by the front door's limit).
        params = req.sampling_params
        piece_tokens = min(params.get("stream_interval") or 1, params.get("max_new_tokens") or 1 << 30)
        excluded: set[int] = set()
        decode_failed: set[str] = set()  # decode workers that failed this request (disaggregated fleets)
        stay_home = False  # set once a remote attempt ran into the first-token deadline
        reasons: list[str] = []
        for attempt in range(1, self.max_attempts + 1):
            t0 = time.perf_counter()
            try:
                decision = self._decide(req, excluded, stay_home)
            except NoEligibleWorkerError as exc:
                reasons.append(str(exc))
                break
            decision_us = (time.perf_counter() - t0) * 1e6
            self._observe_decision(req, decision, decision_us, attempt)
            first_s = self.first_token_timeout(self._expected_ms(decision, req))
            produced = ended = False
            seen, index = self._output_seen, decision.worker_index
            try:
                # aclosing: however this generator ends (the client went away and it is
                # closed, a deadline), the attempt's cleanup aborts the request at the worker.
                async with contextlib.aclosing(self._run(decision, req, decode_failed)) as items:
                    deadlines = _Deadlines(first_s, lambda i=index: self._piece_gap_s(i, piece_tokens),
                                           lambda seen=seen, i=index: seen[i], self.first_token_max_s)
                    try:
                        while True:
                            try:
                                item = await deadlines.wait(items)
                            except StopAsyncIteration:
                                break
                            seen[index] += 1
                            if isinstance(item, TokensGenerated):
                                if not produced:
                                    # Its prefill is done: the charge for it goes, the prompt is there.
                                    self.router.on_first_token(decision.dispatch, now=self.clock())
                                produced = True
                                yield item
                            else:
                                finished = self._finished(req, decision, item, attempt, decision_us, produced)
                                ended = True  # (its end retired the dispatch: nothing is left to abort)
                                yield finished
                                return
                    finally:
                        deadlines.stop()
                raise WorkerUnavailable("response ended without completion")
            except EngineRejected as exc:
                # The request's own fault: every worker would refuse it the same way.
                self.router.on_failed(decision.worker_index, dispatch=decision.dispatch, now=self.clock())
                log.info("engine rejected the request", request_id=req.request_id, worker=decision.worker,
                         status=exc.status, error=exc.message)
                raise ForwardError(exc.status, exc.message) from None
            except DecodeUnavailable as exc:
                if produced:
                    raise ForwardError(502, f"decode worker {exc.decode_worker} failed mid-response: {exc}") from exc
                # The prefill worker is not to blame: it stays eligible, the decode worker is avoided
                # (by this request for good, by the next ones for a while). With no decode worker
                # of its region left for this request, the prefill worker cannot serve it either.
                assert self.decode_chooser is not None
                if exc.decode_worker:
                    self.decode_chooser.failed(exc.decode_worker, now=self.clock())
                    decode_failed.add(exc.decode_worker)
                else:
                    excluded.add(decision.worker_index)
                reasons.append(f"{decision.worker}+{exc.decode_worker or 'no decode worker'}: {exc}")
                self.metrics.retries.inc()
                log.warning("decode worker failed before first token; retrying", request_id=req.request_id,
                            worker=decision.worker, decode_worker=exc.decode_worker, attempt=attempt, error=str(exc))
            except (WorkerUnavailable, EngineError) as exc:  # the HTTP path's engine errors come as they are
                avoided_s = self.suspects.failed(decision.worker_index, now=self.clock())
                if produced:
                    status = 504 if isinstance(exc, OutputStalled) else 502
                    log.warning("worker failed mid-response", request_id=req.request_id, worker=decision.worker,
                                error=str(exc), avoided_s=avoided_s)
                    raise ForwardError(status, f"worker {decision.worker} failed mid-response: {exc}") from exc
                reasons.append(f"{decision.worker}: {exc}")
                excluded.add(decision.worker_index)
                self.router.on_failed(decision.worker_index, dispatch=decision.dispatch, now=self.clock())
                if isinstance(exc, FirstTokenLate) and not decision.local:
                    # The request has spent its deadline on a crawling WAN path (shared by that
                    # region's workers, and likely not the only one): it stays in the edge's own
                    # region, with no WAN on the path, while a worker there can serve.
                    stay_home = True
                self.metrics.retries.inc()
                log.warning("worker failed before first token; retrying", request_id=req.request_id,
                            worker=decision.worker, attempt=attempt, error=str(exc), avoided_s=avoided_s)
            finally:
                # Whatever else ended the attempt (a mid-response failure, the client went away):
                # its charge goes (a no-op after a failure retired it). Not after its end: that
                # was 7 us a request, and a front door of `edge --workers N` told the others to
                # drop a dispatch their ledgers no longer held.
                if not ended:
                    self.router.on_aborted(decision.dispatch, now=self.clock())
        raise ForwardError(503, "no worker could serve the request: " + "; ".join(reasons))

    def _piece_gap_s(self, index: int, piece_tokens: int) -> float:
        """The longest gap allowed between two pieces of output of ``piece_tokens`` tokens from
        worker ``index``: ``inter_token_s`` plus the other tokens' decode at its rate."""
        if piece_tokens <= 1:
            return self.inter_token_s
        return self.inter_token_s + (piece_tokens - 1) * self.router.rates.decode_ms_per_token(index) / 1000.0

    def _observe_decision(self, req: ForwardRequest, d: ForwardDecided, decision_us: float, attempt: int) -> None:
        metrics = self.metrics
        metrics.count_decision(d.outcome)
        if d.pending:
            metrics.pending_credit_counts.inc()
        metrics.decision_observations.observe(decision_us / 1e6)
        # The winner's terms alone: the runners-up need every worker scored (the sparse decision
        # skips the workers that cannot win), so they are logged only at debug level.
        chosen = d.score.top(1)
        if chosen:
            for term, histogram in metrics.chosen_terms:
                histogram.observe(getattr(chosen[0], term))
        if log.is_enabled_for(logging.INFO):  # else the line's fields are not even built
            debug = log.is_enabled_for(logging.DEBUG)
            candidates = d.candidates if debug else chosen
            # At debug level, why: each candidate's score broken into its terms, so that a
            # request sent away from a prefix's holder can be read off the log line.
            terms = {"terms": [_terms_fields(c) for c in candidates]} if debug else {}
            log.info(
                "forward",
                request_id=req.request_id,
                worker=d.worker,
                region=d.region,
                outcome=d.outcome,
                claimed=d.claimed_tokens,
                pending=d.pending,
                prompt=d.prompt_len,
                lam=round(d.lam, 3),
                attempt=attempt,
                decision_us=round(decision_us, 1),
                top=[(c.worker, round(c.total, 2)) for c in candidates],
                **terms,
            )
        if d.migration is not None:
            self._start_migration(req, d)

    def _finished(self, req, d: ForwardDecided, done: GenerationFinished | EngineFinished, attempt: int,
                  decision_us: float, produced: bool):
        """``done``: the worker's closing figures, as the own-region HTTP path brings them
        (``EngineFinished``) or as the QUIC and prefill-decode paths do."""
        now = self.clock()
        if type(done) is EngineFinished:
            queue_vector, decode_worker = None, ""
        else:
            queue_vector, decode_worker = dict(done.queue_vector) or None, done.decode_worker
        worker_latency_s = done.worker_latency_s
        self.suspects.served(d.worker_index)
        router = self.router
        if not produced:  # it ended without output: its prefill is done all the same
            router.on_first_token(d.dispatch, now=now)
        router.on_finished(d.dispatch, prompt_tokens=done.prompt_tokens, cached_tokens=done.cached_tokens,
                           output_tokens=done.completion_tokens, now=now, worker_latency_s=worker_latency_s)
        self.router.on_response(
            d.worker,
            claimed_tokens=d.claimed_tokens,
            reused_tokens=done.cached_tokens,
            queue_vector=queue_vector,
            now=now,
            tokens=req.tokens,  # a shortfall the index explains is not held against the worker
            claimed_tier=d.tier,
        )
        metrics = self.metrics
        metrics.claimed_token_counts.inc(d.claimed_tokens)
        metrics.reused_token_counts.inc(done.cached_tokens)
        if done.cached_tokens < d.claimed_tokens:
            metrics.false_lookup_counts.inc()
        return GenerationFinished(
            worker=d.worker,
            region=d.region,
            cached_tokens=done.cached_tokens,
            claimed_tokens=d.claimed_tokens,
            prompt_tokens=done.prompt_tokens,
            completion_tokens=done.completion_tokens,
            finish_reason=done.finish_reason,
            attempts=attempt,
            decision_us=decision_us,
            decode_worker=decode_worker,
            worker_latency_s=worker_latency_s,
            pending_credited=d.pending,
        )

    # -- the two paths ------------------------------------------------------------------------

    def _uses_http(self, worker_id: str) -> bool:
        worker = self.cfg.worker(worker_id)
        return bool(self.local_http and worker.region == self.router.region and worker.http)

    def _run(self, d: ForwardDecided, req: ForwardRequest, decode_failed: Collection[str] = ()):
        if self.decode_chooser is not None and self.cfg.worker(d.worker).role == "prefill":
            return self._run_pair(d, req, decode_failed)
        if self._uses_http(d.worker):
            # The engine's own stream, streamed whatever the client asked (the deadlines see each
            # token): its outputs are TokensGenerated, its EngineFinished goes to _finished as it
            # is, its EngineError is the attempt's failure (Forwarder.generate). Closing it closes
            # its connection, which aborts the request at the engine.
            return self._engine(self.cfg.worker(d.worker).http).generate(
                req.tokens, req.sampling_params, stream=True, rid=req.request_id)
        return self._run_quic(d, req)

    async def _run_quic(self, d: ForwardDecided, req: ForwardRequest,
                        message: RequestForwarded | PrefillDecodeForwarded | None = None):
        peer = self.agent_peer(d.worker)
        if peer is None or not peer.is_connected:
            raise WorkerUnavailable("agent not connected")
        if message is None:
            message = RequestForwarded(
                request_id=req.request_id,
                edge=self.edge_id,
                origin_region=self.router.region,
                input_ids=tuple(req.tokens.tolist()),
                sampling_params=req.sampling_params,
                stream=True,  # output as it comes, whatever the client asked: the deadlines need it
                claimed_tokens=d.claimed_tokens,
            )
        exchange = None
        try:
            exchange = peer.open_stream()
            await exchange.send(message)
            async for reply in exchange:
                if isinstance(reply, ResponseChunked):
                    if reply.token_ids or reply.text:
                        yield TokensGenerated(tuple(reply.token_ids), reply.text)
                elif isinstance(reply, ResponseCompleted):
                    await exchange.close()
                    yield _completed(reply)
                    return
                elif isinstance(reply, RequestRejected):
                    raise EngineRejected(reply.status, reply.message)
                elif isinstance(reply, RequestFailed):
                    if isinstance(message, PrefillDecodeForwarded) and reply.worker == message.decode_worker:
                        raise DecodeUnavailable(reply.worker, reply.reason or "decode worker failed")
                    raise WorkerUnavailable(reply.reason or "agent reported failure")
                elif isinstance(reply, ErrorReported):
                    raise WorkerUnavailable(f"agent refused: {reply.code}: {reply.detail}")
            raise WorkerUnavailable("agent closed the exchange without completion")
        except TransportError as exc:
            raise WorkerUnavailable(f"transport: {exc}") from exc
        finally:
            if exchange is not None:
                exchange.abort()  # no-op after a completion; else the agent stops working on it

    def _engine(self, base: str) -> EngineClient:
        engine = self._engines.get(base)
        if engine is None:  # one per worker, not per request
            engine = self._engines[base] = EngineClient(base, self.http)
        return engine

    # -- prefill-decode pairs ------------------------------------------------------------------

    async def _run_pair(self, d: ForwardDecided, req: ForwardRequest, decode_failed: Collection[str] = ()):
        """The score's prefill worker with a decode worker of its region, as SGLang's
        prefill-decode router runs a request: own region over HTTP to both engines, another
        region through the prefill worker's agent (which reaches the decode worker in its region).
        ``decode_failed``: decode workers that already failed this request."""
        assert self.decode_chooser is not None
        try:
            decode = self.decode_chooser.choose(d.region, now=self.clock(), exclude=decode_failed)
        except NoDecodeWorkerError as exc:
            raise DecodeUnavailable("", str(exc)) from None
        room = new_bootstrap_room(self._rooms)
        self.decode_chooser.started(decode)
        self.metrics.count_decode_choice(decode)
        log.info("prefill-decode pair", request_id=req.request_id, prefill=d.worker, decode=decode, room=room)
        if self._uses_http(d.worker):
            runner = self._run_http_pair(d, req, decode, room)
        else:
            runner = self._run_quic(d, req, PrefillDecodeForwarded(
                request_id=req.request_id, edge=self.edge_id, origin_region=self.router.region,
                input_ids=tuple(req.tokens.tolist()), sampling_params=req.sampling_params, stream=True,
                claimed_tokens=d.claimed_tokens, decode_worker=decode, bootstrap_room=room))
        try:
            async with contextlib.aclosing(runner) as items:
                async for item in items:
                    if isinstance(item, GenerationFinished):
                        self.decode_chooser.served(decode)
                        item = replace(item, decode_worker=decode)
                    yield item
        finally:
            self.decode_chooser.finished(decode)

    async def _run_http_pair(self, d: ForwardDecided, req: ForwardRequest, decode: str, room: int):
        prefill_cfg, decode_cfg = self.cfg.worker(d.worker), self.cfg.worker(decode)
        if not decode_cfg.http:
            raise DecodeUnavailable(decode, f"decode worker {decode} has no http address in the config")
        bootstrap = BootstrapFields.for_prefill(prefill_cfg.http, bootstrap_port_of(prefill_cfg), room)
        pair = generate_on_pair(EngineClient(prefill_cfg.http, self.http), EngineClient(decode_cfg.http, self.http),
                                bootstrap, req.tokens, req.sampling_params, rid=req.request_id)
        try:
            async for item in _forwarded(pair):
                yield item
        except EngineRejected:
            raise
        except DecodeFailed as exc:
            raise DecodeUnavailable(decode, str(exc)) from exc
        except EngineError as exc:
            raise WorkerUnavailable(str(exc)) from exc

    # -- migration ----------------------------------------------------------------------------

    def _start_migration(self, req: ForwardRequest, d: ForwardDecided) -> None:
        plan = d.migration
        peer = self.agent_peer(plan.destination_worker)
        record = {
            "request_id": req.request_id,
            "family_key": plan.family_key,
            "prefix_len": plan.prefix_len,
            "source": plan.source_worker,
            "destination": plan.destination_worker,
            "mode": plan.mode,
            "sent": False,
        }
        self.migrations.append(record)
        del self.migrations[:-100]
        if peer is None or not peer.is_connected:
            log.warning("migration skipped: destination agent not connected", **record)
            return
        message = MigrationRequested(
            request_id=req.request_id,
            input_ids=tuple(req.tokens[: plan.prefix_len].tolist()),
            source_worker=plan.source_worker,
            destination_worker=plan.destination_worker,
            mode=plan.mode,
        )
        task = asyncio.get_running_loop().create_task(self._send_migration(peer, message))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)
        record["sent"] = True
        self.metrics.migrations.labels(plan.mode).inc()
        log.info("migration requested", **record)

    @staticmethod
    async def _send_migration(peer: Peer, message: MigrationRequested) -> None:
        try:
            await peer.send(message)
        except TransportError as exc:  # a lost hint: the request itself is served regardless
            log.warning("migration request not delivered", request_id=message.request_id, error=str(exc))


def _served(cached: int, prompt: int, completion: int, finish: str, queue_vector=(),
            worker_latency_s: float | None = None) -> GenerationFinished:
    """What the worker reported; ``_finished`` fills in the decision's side."""
    return GenerationFinished(worker="", region="", cached_tokens=cached, claimed_tokens=0, prompt_tokens=prompt,
                              completion_tokens=completion, finish_reason=finish, attempts=0, decision_us=0.0,
                              queue_vector=tuple(queue_vector), worker_latency_s=worker_latency_s)


def _completed(reply: ResponseCompleted) -> GenerationFinished:
    latency = reply.worker_latency_s
    return _served(reply.cached_tokens, reply.prompt_tokens, reply.completion_tokens, reply.finish_reason,
                   reply.queue_vector, None if latency < 0.0 else latency)


async def _forwarded(engine_items):
    """An engine's stream as the edge forwards it; closing this generator closes the engine's
    (its connection, which aborts the request at the engine)."""
    async with contextlib.aclosing(engine_items) as items:
        async for item in items:
            yield item if type(item) is EngineOutput else _from_engine(item)


def _from_engine(done: EngineFinished) -> GenerationFinished:
    return _served(done.cached_tokens, done.prompt_tokens, done.completion_tokens, done.finish_reason,
                   worker_latency_s=done.worker_latency_s)
