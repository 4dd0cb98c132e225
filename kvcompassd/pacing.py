"""Time- and size-bounded coalescing of small sends into fewer, larger ones.

Every message the discovery plane sends costs a roughly fixed amount of transport CPU (QUIC
packet build, encryption, ``sendto``, the acknowledgement coming back, and the same again at
the receiver), whatever its size. Under a steady stream of small items (index events at an
agent, edits at a maintenance unit) the daemons therefore gather items over a short window and
send them together: the first item of a window waits at most the window, everything added
meanwhile goes with it. The window is the staleness the coalescing adds (``[sync]
report_delay_ms`` and ``batch_delay_ms``).
"""

from __future__ import annotations

import asyncio
import math
from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable, Protocol


class FlushPacer:
    """Calls ``flush`` for what accumulated ``delay_s`` after the first item of a window was
    added (with the next loop turn at ``delay_s`` 0), and at once (synchronously) when
    ``max_pending`` items wait. So a lone item leaves within ``delay_s``, and a burst of items
    within one window leaves as one flush: a steady stream of ``r`` items a second costs about
    ``r / (1 + r * delay_s)`` flushes a second instead of ``r``."""

    def __init__(self, flush: Callable[[], None], *, delay_s: float, max_pending: int):
        if not 0 <= delay_s <= 1 or max_pending < 1:
            raise ValueError(f"delay_s must be in [0, 1] s and max_pending >= 1, got {delay_s!r}, {max_pending!r}")
        self.delay_s = delay_s
        self.max_pending = max_pending
        self._flush = flush
        self._timer: asyncio.Handle | None = None
        self._pending = 0

    @property
    def scheduled(self) -> bool:
        """Whether items wait for a flush that has not run yet."""
        return self._timer is not None

    def added(self, count: int) -> None:
        """``count`` items now wait for the next flush."""
        self._pending += count
        if self._pending >= self.max_pending:
            self.flush_now()
        elif self._timer is None:
            # One timer per window, armed by its first item (never re-armed by the others).
            loop = asyncio.get_running_loop()
            self._timer = (loop.call_soon(self.flush_now) if self.delay_s == 0
                           else loop.call_later(self.delay_s, self.flush_now))

    def flush_now(self) -> None:
        """Flush at once (the timer, if any, is cancelled)."""
        self.cancel()
        self._pending = 0
        self._flush()

    def cancel(self) -> None:
        """Forget the scheduled flush (items stay wherever the owner keeps them)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class LoadPollSchedule:
    """When an agent next reads its engine's load (sans-IO: the agent sleeps ``delay_s``).

    Every ``busy_s`` while the engine has work or its readings move; while it sits idle and
    unchanged the delay doubles up to ``idle_s`` (the heartbeat period, so edges still hear from
    the agent every period and their silence detector is unaffected). A sign of work (a
    forwarded request, KV events from the engine) asks for a reading at once, no sooner than
    ``busy_s`` after the previous one (``wake_delay``), and leaves the period alone: that
    reading says whether the engine has work or its load moved, and only then is the period
    ``busy_s`` again. So a burst is seen within one fast period of its first sign, and an
    engine that finishes each request before the next reading is read about once per request,
    not ~6 times as the period doubled back up from ``busy_s`` after every one (issue 30
    item 4). An idle host reads each engine ``1 / idle_s`` times a second instead of
    ``1 / busy_s`` (once instead of 50 times at the defaults).

    A sign of work *done* (the engine's KV events: a prefill it finished) brings a reading no
    sooner than ``done_spacing_s`` after the previous one (``wake_delay(..., done=True)``): an
    engine that serves each request in about a millisecond publishes a batch per request and is
    idle again at the reading, so waking at ``busy_s`` read it about once per request (issue 30's
    profile of the zero-delay gateway run: ~1.5 readings per served request) to learn nothing the
    edges use. The
    first sign after a quiet spell still reads at once; a reading that shows work brings
    ``busy_s`` back as before, so a loaded engine is read as often as ever."""

    def __init__(self, *, busy_s: float, idle_s: float, done_spacing_s: float | None = None) -> None:
        if done_spacing_s is None:
            done_spacing_s = busy_s
        if not 0 < busy_s <= idle_s or not busy_s <= done_spacing_s <= idle_s:
            raise ValueError(f"need 0 < busy_s <= done_spacing_s <= idle_s, got {busy_s!r}, {done_spacing_s!r}, "
                             f"{idle_s!r}")
        self.busy_s = busy_s
        self.idle_s = idle_s
        self.done_spacing_s = done_spacing_s
        self.delay_s = busy_s

    def observed(self, *, changed: bool, busy: bool, period_s: float | None = None) -> None:
        """A reading came back: ``changed`` from the previous one, ``busy`` if work is queued or
        running; ``period_s`` (from ``busy_s`` to ``idle_s``) replaces ``busy_s`` as the period
        while so (``ReadingCadence``)."""
        period = self.busy_s if period_s is None else min(self.idle_s, max(self.busy_s, period_s))
        self.delay_s = period if changed or busy else min(self.idle_s, 2.0 * self.delay_s)

    def failed(self) -> None:
        """A reading failed: retry at the fast period (the down detector counts consecutive failures)."""
        self.delay_s = self.busy_s

    def hastens(self, *, done: bool = False) -> bool:
        """Whether a sign of work (``done``: work done) can bring the next reading sooner than
        ``delay_s``: one of work arriving while readings are slower than the fast period, one of
        work done while slower than ``done_spacing_s``. (At a period no longer than that, such
        as the sole-edge period, a KV batch, about one a request, woke the reader only for it
        to sleep again.)"""
        return self.delay_s > (self.done_spacing_s if done else self.busy_s)

    def wake_delay(self, since_last_s: float, *, done: bool = False) -> float:
        """Work is arriving (``done``: work was done, the engine's KV events) and the previous
        reading started ``since_last_s`` ago: how long to wait before reading (none if a fast
        period, or for ``done`` the ``done_spacing_s``, has passed since)."""
        return max(0.0, (self.done_spacing_s if done else self.busy_s) - since_last_s)


# An engine whose requests hold at least this share of its KV pool is memory-bound: when its
# queue drains hangs on when running requests end and free room, which only its readings say.
TIGHT_POOL_SHARE = 0.75
# Why a reading set the period it did (ReadingCadence.period; a label of the agents' metric).
READING_PERIOD_REASONS = ("one_edge", "several_edges", "other_regions", "pool_unreported", "memory_bound",
                          "decode_worker")


@dataclass(frozen=True, slots=True)
class ReadingCadence:
    """How often an agent reads its busy engine (sans-IO): ``fast_s`` while the readings carry
    what the edges cannot work out themselves, else ``sole_s``.

    An edge charges each request it sends a worker with its modelled prefill, ages the charge
    as the queue drains and retires it at the request's first token and end, which it sees
    (``QueueEstimates``): when one edge is all that sends the worker work, it knows the queue
    the readings would tell it. The readings are then the plane's largest cost in a service-time
    gateway run (each a packet and a wake-up at both ends, every 20 ms per busy engine), and at
    100 ms instead of 20 the edge routed no worse (README, "A busy engine's readings"). They
    stay at ``fast_s`` while another source of work is possible or the edge's model is not
    enough:

    - more than one of the region's edges is connected (each sees the others' dispatches only
      through the readings: at 100 ms two edges served 3-5 % less);
    - the agent serves requests from other regions (their edges read this worker off the own
      edge's queue vector, built from the readings; ``VectorInterest.wanted``);
    - the engine is memory-bound (``TIGHT_POOL_SHARE``) or does not say how full it is: a
      prompt then waits for room the running requests free, which only the readings tell the
      edge (at 8,192 tokens of VRAM and c = 64, 100 ms served ~4 % less);
    - it is a decode worker (edges pick decode workers by their readings alone)."""

    fast_s: float
    sole_s: float

    def __post_init__(self) -> None:
        if not (0 < self.fast_s <= self.sole_s < math.inf):
            raise ValueError(f"need 0 < fast_s <= sole_s, got {self.fast_s!r}, {self.sole_s!r}")

    def period(self, *, edges: int, remote: bool, pool_share: float | None,
               decode: bool = False) -> tuple[float, str]:
        """The busy period and why: ``edges`` of the region connected, ``remote`` while serving
        other regions, ``pool_share`` the share of the KV pool the engine's requests hold (None:
        not reported)."""
        if decode:
            return self.fast_s, "decode_worker"
        if edges > 1:
            return self.fast_s, "several_edges"
        if remote:
            return self.fast_s, "other_regions"
        if pool_share is None:
            return self.fast_s, "pool_unreported"
        if pool_share >= TIGHT_POOL_SHARE:
            return self.fast_s, "memory_bound"
        return self.sole_s, "one_edge"


# A load reading that takes longer than this came from an engine that stopped answering for a
# while (frozen, swapping, paused): a control endpoint answers in milliseconds.
ENGINE_STALL_S = 0.3


@dataclass(frozen=True, slots=True)
class LoadTolerance:
    """How far an engine's load may move from what its edges already hold before a reading is
    worth a report (``LoadReports``). An edge ages the last queue figure it got at one ms per ms
    (a FIFO prefill queue drains so until work arrives, and the work its own dispatches add it
    charges itself) and the last room steps alike, so a busy engine read every 20 ms mostly says
    what the edge already computes: in a service-time gateway run at 8,192 tokens and c = 64,
    80 % of the readings were within 2 ms or 2 % of that (issue 30). Each report is a QUIC
    packet at both ends (~0.5 ms of CPU together), and a busy worker is read 50 times a second.

    A reading is material, and goes at once, when any of these moves past the tolerance
    ``max(queue_ms, queue_share x the larger value)``: the queue figure against the last one
    sent, aged; the wait for VRAM room at any prompt size, against the last steps sent, aged;
    the score's occupancy term (``occupancy_ms_per_running`` per running request). Also when the
    queue or the running count reaches zero (the edges tell an idle worker by its zeros), when the
    prefill price ``min(1, stall_weight x running)`` or the pinned share moves by more than
    ``queue_share``, and, at a decode worker (``counts_exact``: the edges pick decode workers by
    these counts), when its running or waiting count changes at all. Both tolerances 0: every
    reading that differs from the last one sent is material (the behaviour before)."""

    # 0, as [idle]'s defaults (where an agent takes its own from): with several edges in a
    # region the readings held back may cost routing (README); 2 ms and 2 % were measured.
    queue_ms: float = 0.0
    queue_share: float = 0.0
    occupancy_ms_per_running: float = 0.0
    stall_weight: float = 0.0
    counts_exact: bool = False

    def __post_init__(self) -> None:
        for name in ("queue_ms", "queue_share", "occupancy_ms_per_running", "stall_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.queue_share >= 1:
            raise ValueError(f"queue_share must be below 1, got {self.queue_share!r}")

    @property
    def exact(self) -> bool:
        return self.queue_ms == 0 and self.queue_share == 0

    def _allows(self, a: float, b: float) -> bool:
        """Whether ``b`` is within the tolerance of ``a``."""
        return abs(a - b) <= max(self.queue_ms, self.queue_share * max(a, b))

    def material(self, sent: LoadReading, reading: LoadReading, elapsed_ms: float) -> bool:
        """Whether ``reading`` moved past the tolerance from ``sent``, read ``elapsed_ms`` before."""
        if self.exact or self.counts_exact:
            if (reading.running, reading.waiting) != (sent.running, sent.waiting):
                return True
            if self.exact:
                return (reading.queue_ms, reading.room_steps, reading.pinned_share) != (
                    sent.queue_ms, sent.room_steps, sent.pinned_share)
        if not self._allows(max(0.0, sent.queue_ms - elapsed_ms), reading.queue_ms):
            return True
        # Reaching zero goes whatever the tolerance: an edge tells an idle worker by the zeros it
        # is sent (QueueEstimates.is_persistently_idle picks where hot prefixes migrate to).
        if (reading.queue_ms == 0.0 < sent.queue_ms) or (reading.running == 0 < sent.running):
            return True
        if reading.running != sent.running:
            if not self._allows(0.0, self.occupancy_ms_per_running * abs(reading.running - sent.running)):
                return True
            stall = self.stall_weight
            if stall and abs(min(1.0, stall * reading.running) - min(1.0, stall * sent.running)) > self.queue_share:
                return True
        if (reading.pinned_share is None) != (sent.pinned_share is None) or (
                reading.pinned_share is not None and abs(reading.pinned_share - sent.pinned_share) > self.queue_share):
            return True
        return self._room_moved(sent.room_steps, reading.room_steps, elapsed_ms)

    def _room_moved(self, sent, steps, elapsed_ms: float) -> bool:
        """Whether a prompt of any size would wait for VRAM room, by ``steps``, past the
        tolerance of its wait by the steps ``sent`` aged ``elapsed_ms`` (as ``room_wait_ms``
        reads them: the first step with room for it, else the last; no steps, no wait)."""
        if sent is None or steps is None:
            return (sent is None) != (steps is None)
        # Each wait is a step function of the prompt's size, constant between consecutive free
        # levels of either list: comparing both at every level, and past the last, covers all sizes.
        sent_free = [free for _, free in sent]
        free = [free for _, free in steps]
        if sent_free == free and free:
            # The usual reading (the same requests pin the same room): each size waits for the
            # same step in both, the first of its free level, or the last past every level.
            allows, last = self._allows, len(free) - 1
            return not all(allows(max(0.0, was - elapsed_ms), ms)
                           for k, ((was, _), (ms, _)) in enumerate(zip(sent, steps))
                           if k == last or (k and free[k] > free[k - 1]))
        for need in (*sent_free, *free, math.inf):
            was = _wait(sent, sent_free, need) - elapsed_ms
            if not self._allows(max(0.0, was), _wait(steps, free, need)):
                return True
        return False


def _wait(steps, free: list[int], need: float) -> float:
    """A prompt needing ``need`` tokens' wait by room steps (``QueueEstimates.room_wait_ms``)."""
    if not steps or need <= free[0]:
        return 0.0
    return steps[min(bisect_left(free, need), len(steps) - 1)][0]


class LoadReading(Protocol):
    """What ``LoadReports`` reads of an engine's load (``kvcompassd.engine.client.EngineLoad``)."""

    queue_ms: float
    running: int
    waiting: int
    room_steps: tuple[tuple[float, int], ...] | None
    pinned_share: float | None


class LoadReports:
    """Which of its engine's load readings an agent sends its edges (sans-IO).

    A reading that moved past the ``tolerance`` from the last one sent (``LoadTolerance``: aged
    as the edges age it) goes at once. One equal to the last one sent goes ``steady_repeats``
    more times (a datagram may be lost), then once per ``heartbeat_s``, as does one that drifted
    within the tolerance; the first after an edge connects goes too (it would otherwise know
    nothing of an idle worker for a heartbeat). A reading after a failed one, or one the engine
    took longer than ``stall_s`` to answer, goes at once marked ``resumed``: idle, an agent
    reports only every heartbeat, so the edges cannot tell a short freeze from the report gap
    and need to be told that the engine is answering again."""

    def __init__(self, *, heartbeat_s: float, steady_repeats: int, stall_s: float = ENGINE_STALL_S,
                 tolerance: LoadTolerance = LoadTolerance()) -> None:
        if not (heartbeat_s > 0 and stall_s > 0 and steady_repeats >= 0):
            raise ValueError(f"need heartbeat_s > 0, stall_s > 0, steady_repeats >= 0, got "
                             f"{heartbeat_s!r}, {stall_s!r}, {steady_repeats!r}")
        self.heartbeat_s, self.steady_repeats, self.stall_s = heartbeat_s, steady_repeats, stall_s
        self.tolerance = tolerance
        self._previous: tuple | None = None  # (queue_ms, running, waiting) of the previous reading
        self._sent: LoadReading | None = None
        self._sent_at = float("-inf")
        self._unchanged = 0  # readings in a row equal to the last one sent
        self._unanswered = False
        self._due = False

    def listener_joined(self) -> None:
        """An edge connected (or reconnected): it has no reading yet, so the next one goes."""
        self._due = True

    def failed(self) -> None:
        """A reading failed: the next one that succeeds is a resumption."""
        self._unanswered = True

    def reading(self, load: LoadReading, *, started: float, now: float) -> tuple[bool, bool, bool]:
        """A reading asked for at ``started`` came back at ``now``: (changed from the previous
        reading, send, resumed)."""
        resumed = self._unanswered or now - started > self.stall_s
        self._unanswered = False
        values = (load.queue_ms, load.running, load.waiting)
        changed = values != self._previous
        self._previous = values
        sent = self._sent
        if sent is None:
            material = steady = False
        else:
            material = self.tolerance.material(sent, load, 1000.0 * (now - self._sent_at))
            steady = (values == (sent.queue_ms, sent.running, sent.waiting) and load.room_steps == sent.room_steps
                      and load.pinned_share == sent.pinned_share)
        self._unchanged = self._unchanged + 1 if steady else 0
        send = (sent is None or resumed or self._due or material or (steady and self._unchanged <= self.steady_repeats)
                or now - self._sent_at >= self.heartbeat_s)
        self._due = False
        if send:
            self._sent, self._sent_at = load, now
        return changed, send, resumed


class VectorInterest:
    """Whether an agent wants its region's queue vector, and whether the one it holds is fresh
    enough to piggyback (sans-IO; the agent says ``QueueVectorInterestReported`` when
    ``remote_started`` or ``lapsed`` tells it to).

    An agent piggybacks the vector only on its responses to other regions (paper §3.4), yet
    every edge sent it to every own agent each broadcast period while it changed: a packet at
    both ends per agent and period for an agent that serves no other region (issue 30: about a
    third of what busy agents received in a one-region gateway run, and most of their timer runs). So the agent wants it from the
    start of a request from another region until ``linger_s`` after the last such request
    ended, and piggybacks what it holds only if it arrived within ``fresh_s`` (a vector that
    stops changing is sent again every heartbeat, so this is the heartbeat and some slack);
    otherwise its own worker's reading alone, which is always current."""

    def __init__(self, *, linger_s: float, fresh_s: float) -> None:
        if not (0 < linger_s < math.inf and 0 < fresh_s < math.inf):
            raise ValueError(f"need finite linger_s > 0 and fresh_s > 0, got {linger_s!r}, {fresh_s!r}")
        self.linger_s, self.fresh_s = float(linger_s), float(fresh_s)
        self.wanted = False  # what the agent last told its edges
        self._in_flight = 0
        self._last_remote = -math.inf
        self._vector_at = -math.inf

    def remote_started(self, *, now: float) -> bool:
        """A request from another region arrived; True: say ``wanted`` now (it was not)."""
        self._in_flight += 1
        self._last_remote = max(self._last_remote, now)
        if self.wanted:
            return False
        self.wanted = True
        return True

    def remote_ended(self, *, now: float) -> None:
        self._in_flight = max(0, self._in_flight - 1)
        self._last_remote = max(self._last_remote, now)

    def lapsed(self, *, now: float) -> bool:
        """True: say ``not wanted`` now (no request from another region for ``linger_s``)."""
        if self.wanted and self._in_flight == 0 and now - self._last_remote >= self.linger_s:
            self.wanted = False
            return True
        return False

    def vector_received(self, *, now: float) -> None:
        self._vector_at = max(self._vector_at, now)

    def fresh(self, *, now: float) -> bool:
        """Whether the vector held arrived within ``fresh_s``."""
        return now - self._vector_at <= self.fresh_s

    def age_s(self, *, now: float) -> float | None:
        """Seconds since the vector held arrived (None: none yet)."""
        return None if self._vector_at == -math.inf else round(now - self._vector_at, 3)
