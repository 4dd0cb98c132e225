"""Each worker's prefill and decode rates as an edge observes them (sans-IO).

The score charges a worker ``beta`` ms per uncached token, from the config. A configured beta
that is off (another GPU, another model, a new batch size) makes the edge route against its own
cache: too high and each dispatch charges the holder of a prefix a queue that does not exist, so
the group is spread over every worker; too low and the prefill a hit saves looks smaller than the
true queue ahead of the holder. The edge forwards every request itself and sees its first token
and its end come back, so it measures the rates instead.

Prefill: a worker prefills one request after another (SGLang's scheduler, the emulator's model),
so the service time of a request, as the edge sees it, is the time from whichever came later --
the request reaching the worker, or the previous first token this edge saw from that worker --
to its own first token:

    service = min(first_token - sent - RTT,  first_token - previous_first_token,
                  first_token - previous_end)

(a worker's first tokens and ends reach the edge one way after they happen, so the previous
one's one-way cancels out; the round trip to the worker's region is the WAN share of the first
case). The last term is a prefill held back by memory: a worker admits a prompt only when its
KV fits beside the running requests' (SGLang's ``PrefillAdder``), and only a finish frees
room, so a request that waited for room starts at an end; as decoding pauses while a prompt is
prefilled (SGLang runs a pending prefill batch, chunk after chunk, before the next decode
batch; not so with ``--enable-mixed-chunk`` nor with vLLM, which mixes decodes into prefill
steps: there an end inside a long prefill cuts the sample short, and the median absorbs a few),
no end falls inside a prefill and the term never cuts one short. A wait for room the worker's queue report counts (the queue ahead of the
request, ``kvcompassd/worker/workermodel.py``) keeps the request from being sampled at all
(below); the one the report cannot count, the request's own prompt not fitting, ends at an
end this edge may have seen (issue 28: on the Mooncake trace at 1.5x the testbed's capacity
every worker was learned 1.63x too slow while its queue report left that wait out).

A busy edge reads a backlog's first tokens in bunches (its event loop takes them one after the
other, a few ms apart, though the worker produced them a service time apart), so the second term
is floored at this request's share of the backlog it waited for: ``(first_token - sent - RTT)``
times its own charged prefill over that plus the charged prefill of this edge's dispatches
still ahead of it there when it was sent. Without the floor a bunch's later first tokens read
as nearly free prefills (tests/test_rates.py: a rate an eighth of the true one), and the worker
the edge sends the most to, whose first tokens bunch the most, would look the cheapest. The
third term is floored the same way while some of this edge's work was ahead of the request
(ends read in a bunch with first tokens); with none ahead, the end that let the request start
is what it measures.

Both terms hold only this edge's own work: the first the wait for the queue ahead of the request,
the second every request the worker served since this edge's previous first token from it. A
worker that other edges keep busy puts their work in both, and nothing at the edge can tell how
much. So a prefill sample is taken only from a request the edge sent with no more than its own
requests ahead of it (``sent``'s ``ahead_ms``, the queue estimate it scored the worker with, at
most this edge's own prefills not yet done there, plus a tenth of the request's own): others' work
in the wait, if any, is then within the noise the median absorbs. Without this, past capacity
(every worker seconds behind), each edge learned the workers it shares with the others 1.5-8x
slower than they are, and the score, which prices prefill at (1 + lambda) beta with lambda in the
tens, then compares learned betas more than queues: the EU edge kept long prompts on its own two
workers behind 10 s queues while the others waited 3 s (issue 28: the Mooncake trace at 1.5x the
testbed's capacity, P99 TTFT 14.4 s against the central directory's 8.7 s). Under sustained
overload no sample qualifies, and the rates learned before stand; a request that finds its
worker idle always teaches.

A sample is ``service / uncached tokens`` (the worker's own ``cached_tokens`` count, known at the
end), taken only over ``min_tokens`` uncached tokens, where the fixed per-request costs do not
dominate. Decode: the time from the first token to the end over the tokens after the first.

Samples timed from arrival also count a request's fixed costs (tokenising and scheduling at the
worker; HTTP and a loaded host's scheduling too where the worker gives no account of its time,
below): on a busy host the rate reads high, which errs toward keeping prefixes on their holders
(under cache pressure that bias may have helped: README, "A cost model that corrects itself").
Timing only backlogs (first token to first token) leaves those costs out but errs the other way:
a busy edge reads a backlog's first tokens in bunches, a few ms apart, and the rate read low
sent a holder's requests away (tried against tests/test_e2e_costmodel.py).

The costs outside the worker are taken out where the worker says how long the request took it:
SGLang closes every response with ``meta_info["e2e_latency"]``, its tokenizer manager's seconds
from the request's arrival to its end (the emulated worker too). What the edge saw beyond that,
``(end - sent) - e2e_latency``, is the network both ways, HTTP, and this edge's event loop reading
the answer late, and the first token was read the same way: ``first_token - sent`` less that
stands for the first case in place of ``first_token - sent - RTT``, and floors the other two
(``finished``, where the account arrives). On zero-delay emulated workers an edge otherwise
learned its own loop's lag as prefill: 0.018-0.021 ms a token whatever beta was configured
(0.085, 0.017 or 0.00425; 4 workers, c = 16), and charged each dispatch ~10 ms its worker did
not spend. A worker whose account is longer than what the edge saw (a clock to distrust) is
timed as one without.

Each sample becomes the log of its ratio to the configured rate, clipped to +-log(bound), and a
worker's rate is the configured one times exp(median of its last ``window`` log-ratios): one
outlier (a request queued behind another edge's work, a pause of the host) moves the median by
at most one rank, and the rate follows a real change within half a window. A worker with fewer
than ``min_samples`` samples of its own takes the fleet's factor (the median over every
worker's samples): a configured rate that is off is usually off for the whole fleet (another
GPU, another model), and a worker the edge has not sent to yet must not look cheaper than the
ones it has measured. Before any sample the configured rates stand.

Times are seconds (``now``), rates milliseconds per token, as in the config.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import OrderedDict, deque

import numpy as np

from .config import ClusterConfig
from .score import SMALL_FLEET

__all__ = ["LearnedRates", "RateEstimator", "RatesError"]

# Samples a median is taken over, and how many a worker needs before its rate moves.
DEFAULT_WINDOW = 31
DEFAULT_MIN_SAMPLES = 5
# A prefill sample needs this many uncached tokens: below it the per-request overheads (HTTP,
# scheduling, the first decode step) outweigh the per-token work.
DEFAULT_MIN_TOKENS = 64
# Dispatches awaiting their first token or end: a shell that loses track of some (a bug, a
# cancelled task) must not grow the table without end; the oldest are dropped first.
MAX_OPEN_DISPATCHES = 1 << 14
# A prefill sample is taken when the queue ahead of the request was at most this edge's own
# prefills there plus this share of the request's own: others' work can then err it by that much.
FOREIGN_WORK_TOLERANCE = 0.1
# A worker's own factor stands only when it is off the fleet's by more than this ratio, either
# way; within it the worker takes the fleet's. The median of a window of samples differs by some
# per cent between equal workers, and a score that read those differences would send every
# prompt no worker holds to the one whose samples happened to read cheapest: under cache
# pressure its VRAM then holds every group's prefix, evicts them in turn, and each returning
# group misses there again (4 equal emulated workers, 8,192 tokens of VRAM each, one client:
# reuse 0.49 where round robin's is 0.48, against 0.98 before any rate was learned).
OWN_RATE_MARGIN = 1.25


class RatesError(ValueError):
    """Bad arguments to the rate estimators."""


def _clipped_log(ratio: float, log_bound: float) -> float | None:
    """A sample's log-ratio within the bound; None for 0, negative, nan or inf (a broken clock
    or a zero-length sample)."""
    if not (ratio > 0.0 and math.isfinite(ratio)):
        return None
    return min(log_bound, max(-log_bound, math.log(ratio)))


def _median(ordered: list[float]) -> float:
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _check_estimator(bound: float, window: int, min_samples: int) -> None:
    if not (isinstance(bound, (int, float)) and math.isfinite(bound) and bound >= 1.0):
        raise RatesError(f"bound must be a finite number >= 1, got {bound!r}")
    if not (isinstance(window, int) and window >= 1 and isinstance(min_samples, int)
            and 1 <= min_samples <= window):
        raise RatesError(f"need 1 <= min_samples <= window, got {min_samples!r}, {window!r}")


class RateEstimator:
    """One rate's multiplier: exp(median of the last ``window`` clipped log-ratios)."""

    __slots__ = ("_bound", "_samples", "_ordered", "_min_samples", "factor")

    def __init__(self, *, bound: float, window: int = DEFAULT_WINDOW, min_samples: int = DEFAULT_MIN_SAMPLES) -> None:
        _check_estimator(bound, window, min_samples)
        self._bound = math.log(bound)
        self._samples: deque[float] = deque(maxlen=window)
        self._ordered: list[float] = []  # the same samples, ascending (kept so, not sorted per sample)
        self._min_samples = min_samples
        self.factor = 1.0  # observed rate / configured rate

    def __len__(self) -> int:
        return len(self._samples)

    def observe(self, ratio: float) -> bool:
        """Fold one observed/configured ratio; True if the factor changed."""
        sample = _clipped_log(ratio, self._bound)
        if sample is None:
            return False
        samples, ordered = self._samples, self._ordered
        if len(samples) == samples.maxlen:
            del ordered[bisect_left(ordered, samples[0])]  # the sample the window drops
        samples.append(sample)
        insort(ordered, sample)
        if len(ordered) < self._min_samples:
            return False
        factor = math.exp(_median(ordered))
        changed = factor != self.factor
        self.factor = factor
        return changed


class ReadRateEstimator:
    """``RateEstimator``'s factor for a rate only read now and then (the decode rates: the
    gauges and ``kvcompassctl`` read them, the score does not): ``observe`` keeps the clipped
    log-ratio and the median is taken when ``factor`` is read, the same value bit for bit
    (``tests/test_rates.py``). The ordered window's upkeep per sample was two of an edge's
    four estimator updates per response."""

    __slots__ = ("_bound", "_samples", "_min_samples")

    def __init__(self, *, bound: float, window: int = DEFAULT_WINDOW, min_samples: int = DEFAULT_MIN_SAMPLES) -> None:
        _check_estimator(bound, window, min_samples)
        self._bound = math.log(bound)
        self._samples: deque[float] = deque(maxlen=window)
        self._min_samples = min_samples

    def __len__(self) -> int:
        return len(self._samples)

    def observe(self, ratio: float) -> None:
        sample = _clipped_log(ratio, self._bound)
        if sample is not None:
            self._samples.append(sample)

    @property
    def factor(self) -> float:
        if len(self._samples) < self._min_samples:
            return 1.0
        return math.exp(_median(sorted(self._samples)))


class LearnedRates:
    """The prefill and decode rates of every worker, as one edge of ``region`` observes them.

    The shell reports each dispatch's life: ``sent`` when it goes, ``first_token`` when the
    first output comes back, ``finished`` at its end (or ``dropped`` if it failed). ``finished``
    returns whether a worker's prefill rate changed; ``prefill_ms_per_token`` then holds the new
    rates (config worker order).
    """

    def __init__(self, cfg: ClusterConfig, region: str, *, window: int = DEFAULT_WINDOW,
                 min_samples: int = DEFAULT_MIN_SAMPLES, min_tokens: int = DEFAULT_MIN_TOKENS,
                 max_open: int = MAX_OPEN_DISPATCHES) -> None:
        if region not in cfg.region_names():
            raise RatesError(f"unknown region {region!r}")
        bound = cfg.score.learned_rate_bound
        self.enabled = bound > 1.0
        self.configured_prefill = tuple(w.prefill_ms_per_token for w in cfg.workers)
        self.configured_decode = tuple(w.decode_ms_per_token for w in cfg.workers)
        self._rtt_s = tuple(cfg.rtt_ms(region, w.region) / 1000.0 for w in cfg.workers)
        self._prefill = [RateEstimator(bound=bound, window=window, min_samples=min_samples) for _ in cfg.workers]
        self._decode = [ReadRateEstimator(bound=bound, window=window, min_samples=min_samples) for _ in cfg.workers]
        # The fleet's factors: every worker's samples, over a longer window.
        self._fleet_prefill = RateEstimator(bound=bound, window=2 * window + 1, min_samples=min_samples)
        self._fleet_decode = ReadRateEstimator(bound=bound, window=2 * window + 1, min_samples=min_samples)
        self._min_samples = min_samples
        # Each worker's own prefill factor and whether it has enough samples, as arrays, so
        # prefill_rates is one vector expression (a Python pass over 1,024 workers per changed
        # rate was a third of the simulator's CPU at 1,024 x 64).
        self._configured_prefill_arr = np.array(self.configured_prefill, dtype=np.float64)
        self._prefill_own = np.ones(len(cfg.workers))
        self._prefill_ready = np.zeros(len(cfg.workers), dtype=bool)
        # A worker's own prefill factor goes stale once the fleet's window has turned over since
        # its latest sample: it was learned under another load (rates read under a backlog are
        # higher than an idle worker's), and the workers the edge keeps using are re-learned
        # while it is not. Counted in fleet samples (sans-IO, no clock): the fleet's sample count
        # at each worker's latest sample, and which worker each of the last window + 1 samples was
        # (a new sample leaves the oldest of them a window behind: stale, if it was its worker's last).
        self._fleet_window = 2 * window + 1
        self._fleet_samples = 0
        self._prefill_last = np.full(len(cfg.workers), -self._fleet_window - 1, dtype=np.int64)
        self._sampled: deque[int] = deque(maxlen=self._fleet_window + 1)
        self._min_tokens = min_tokens
        self._max_open = max_open
        # dispatch -> [worker, sent at, first token at (or None), the gaps a prefill sample is made
        # of (or None), prefill ms ahead of this edge's later dispatches until its first token,
        # whether it may be sampled, this edge's prefill ms ahead of it when it was sent]
        # (ordered: the oldest goes first at the cap, in O(1); a dict's next(iter()) after many
        # deletions from its front scans them all, 12 µs a decision at the cap)
        self._open: OrderedDict[int, list] = OrderedDict()
        self._last_first = [-math.inf] * len(cfg.workers)  # the latest first token seen per worker
        self._last_end = [-math.inf] * len(cfg.workers)  # the latest end seen per worker
        # Per worker: the prefill ms of this edge's dispatches there still awaiting their first token.
        self._own_ahead_ms = [0.0] * len(cfg.workers)

    def __len__(self) -> int:
        """Dispatches awaiting their end."""
        return len(self._open)

    def sent(self, dispatch: int, worker: int, *, now: float, ahead_ms: float = 0.0, work_ms: float = 0.0) -> None:
        """The dispatch went to ``worker`` at ``now``. ``ahead_ms``: the queue the edge estimated
        ahead of it there; ``work_ms``: the prefill it charged for it (the module docstring says
        why: a request that may have waited for other edges' work teaches no prefill rate)."""
        if not self.enabled:
            return
        if not (0.0 <= ahead_ms < math.inf and 0.0 <= work_ms < math.inf):
            raise RatesError(f"ahead_ms and work_ms must be finite and >= 0, got {ahead_ms!r}, {work_ms!r}")
        if len(self._open) >= self._max_open:
            self._release(self._open.popitem(last=False)[1])
        own = self._own_ahead_ms[worker]
        self._own_ahead_ms[worker] = own + work_ms
        alone = ahead_ms <= own + FOREIGN_WORK_TOLERANCE * work_ms  # nobody else's work ahead of it
        self._open[dispatch] = [worker, now, None, None, work_ms, alone, own]

    def _release(self, record: list) -> None:
        """A dispatch's prefill is no longer ahead of this edge's next ones (first token, end, failure)."""
        if record[2] is None and record[4]:
            worker = record[0]
            left = self._own_ahead_ms[worker] - record[4]
            self._own_ahead_ms[worker] = left if left > 1e-9 else 0.0
            record[4] = 0.0

    def first_token(self, dispatch: int, *, now: float) -> None:
        record = self._open.get(dispatch)
        if record is None or record[2] is not None:
            return
        worker, work_ms = record[0], record[4]
        self._release(record)  # (zeroes record[4]: read first)
        record[2] = now
        if record[5]:  # else others' work may have been ahead of it: no prefill sample
            # The gaps since the worker's previous first token and end; the sample is made at
            # the end, when the worker's own account of the request's time may come with it.
            record[3] = (now - self._last_first[worker], now - self._last_end[worker], work_ms)
        self._last_first[worker] = max(self._last_first[worker], now)

    def _service_s(self, record: list, end_at: float, worker_latency_s: float | None) -> float:
        """The prefill sample of a dispatch that ended at ``end_at`` (the module docstring)."""
        worker, sent_at, first_at, (after_previous, after_end, work_ms), own_ahead_ms = (
            record[0], record[1], record[2], record[3], record[6])
        outside = -1.0 if worker_latency_s is None else (end_at - sent_at) - worker_latency_s
        if outside >= 0.0:
            # What the edge saw beyond the worker's own time (the network both ways, HTTP, this
            # edge's event loop reading the answer late) was not the worker's either before the
            # first token: the response's first token and end are read the same way.
            after_arrival = first_at - sent_at - outside
        else:  # (no account, or one longer than what the edge saw: a clock to distrust)
            after_arrival = first_at - sent_at - self._rtt_s[worker]
        if work_ms > 0.0:  # first tokens (and ends) read in a bunch are not a service time apart
            share = after_arrival * work_ms / (own_ahead_ms + work_ms)
            after_previous = max(after_previous, share)
            if own_ahead_ms > 0.0:  # (with nothing of ours ahead, an end is what let it start)
                after_end = max(after_end, share)
        return min(after_previous, after_arrival, after_end)

    def finished(self, dispatch: int, *, uncached_tokens: int, output_tokens: int, now: float,
                 worker_latency_s: float | None = None) -> bool:
        """The dispatch ended, its worker having computed ``uncached_tokens`` and produced
        ``output_tokens``; True if a prefill rate may have changed (``prefill_rates`` then has
        the new ones). A decode rate is learned too, but only read when asked for
        (``decode_ms_per_token``): its change alone returns False, as the score does not read it.
        ``worker_latency_s``: the worker's own time from the request's arrival to its end, if it
        says (SGLang's ``meta_info["e2e_latency"]``); what the edge saw beyond it is taken out of
        the prefill sample."""
        record = self._open.pop(dispatch, None)
        if record is None or record[2] is None:
            if record is not None:
                self._release(record)
            return False
        worker, first_at = record[0], record[2]
        self._last_end[worker] = max(self._last_end[worker], now)
        changed = False
        if output_tokens >= 2:
            ratio = 1000.0 * (now - first_at) / (output_tokens - 1) / self.configured_decode[worker]
            self._decode[worker].observe(ratio)
            self._fleet_decode.observe(ratio)
        if uncached_tokens >= self._min_tokens and record[3] is not None:
            ratio = 1000.0 * self._service_s(record, now, worker_latency_s) / uncached_tokens / self.configured_prefill[worker]
            own = self._prefill[worker]
            changed = own.observe(ratio) | self._fleet_prefill.observe(ratio)
            self._prefill_own[worker] = own.factor
            self._prefill_ready[worker] = len(own) >= self._min_samples
            self._fleet_samples = count = self._fleet_samples + 1
            changed = self._went_stale(count) | changed
            self._prefill_last[worker] = count
            self._sampled.append(worker)
        return changed

    def ended(self, worker: int, *, now: float) -> None:
        """One of this edge's requests at ``worker`` ended at ``now``, after its dispatch was
        closed (a shell that closes dispatches at the first token, as the simulator's policy
        does, and still sees each end; ``finished`` notes the end itself)."""
        if self.enabled:
            self._last_end[worker] = max(self._last_end[worker], now)

    def own_work_ahead_ms(self, worker: int) -> float:
        """The prefill ms this edge charged for its dispatches to ``worker`` that await their first token."""
        return self._own_ahead_ms[worker]

    def worker_of(self, dispatch: int) -> int:
        """The worker an open dispatch went to (-1: not open)."""
        record = self._open.get(dispatch)
        return -1 if record is None else record[0]

    def dropped(self, dispatch: int) -> None:
        """The dispatch failed: it says nothing about its worker's rates."""
        record = self._open.pop(dispatch, None)
        if record is not None:
            self._release(record)

    def _went_stale(self, count: int) -> bool:
        """Whether fleet sample ``count`` (not yet recorded) makes a worker's own prefill factor
        stale, one that was in use (its rate falls back to the fleet's): the worker of sample
        ``count - window - 1``, if that was its latest."""
        sampled = self._sampled
        if len(sampled) < sampled.maxlen:
            return False
        worker = sampled[0]
        return (self._prefill_last.item(worker) == count - self._fleet_window - 1
                and self._prefill_ready.item(worker))

    def _factor(self, own: RateEstimator | ReadRateEstimator, fleet: RateEstimator | ReadRateEstimator,
                fresh: bool = True) -> float:
        if len(own) < self._min_samples or not fresh:
            return fleet.factor
        factor, shared = own.factor, fleet.factor
        return factor if (factor > shared * OWN_RATE_MARGIN or factor < shared / OWN_RATE_MARGIN) else shared

    def prefill_factor(self, worker: int) -> float:
        fresh = self._fleet_samples - self._prefill_last.item(worker) <= self._fleet_window
        return self._factor(self._prefill[worker], self._fleet_prefill, fresh)

    def decode_factor(self, worker: int) -> float:
        return self._factor(self._decode[worker], self._fleet_decode)

    def prefill_ms_per_token(self, worker: int) -> float:
        return self.configured_prefill[worker] * self.prefill_factor(worker)

    def decode_ms_per_token(self, worker: int) -> float:
        return self.configured_decode[worker] * self.decode_factor(worker)

    def prefill_rates(self) -> np.ndarray:
        """Every worker's prefill ms per token (config worker order)."""
        # The same products as prefill_ms_per_token's, element by element: in Python for a fleet
        # of a few workers (an edge's region, learned from every response: 1.9 µs for 4 workers
        # against numpy's 4.4), in numpy for many (the simulator's 1,024).
        if len(self.configured_prefill) <= SMALL_FLEET:
            return np.array([self.prefill_ms_per_token(i) for i in range(len(self.configured_prefill))])
        own, shared = self._prefill_own, self._fleet_prefill.factor
        apart = (own > shared * OWN_RATE_MARGIN) | (own < shared / OWN_RATE_MARGIN)
        fresh = self._fleet_samples - self._prefill_last <= self._fleet_window
        return self._configured_prefill_arr * np.where(self._prefill_ready & apart & fresh, own, shared)

    def snapshot(self) -> dict[str, np.ndarray]:
        """Learned rates and sample counts (config worker order), for inspection and metrics."""
        n = len(self.configured_prefill)
        return {
            "prefill_ms_per_token": np.array([self.prefill_ms_per_token(i) for i in range(n)]),
            "decode_ms_per_token": np.array([self.decode_ms_per_token(i) for i in range(n)]),
            "prefill_samples": np.array([len(e) for e in self._prefill]),
            "decode_samples": np.array([len(e) for e in self._decode]),
        }
