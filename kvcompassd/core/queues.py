"""Per-worker queue-delay estimates kept by an edge (paper §3.4; DESIGN.md §5).

An edge sees its own region's workers directly (``set_local``, live values read from agents).
Remote regions reach it through two channels:

- a cross-region *response* from region g carries g's queue vector to the requesting edge,
  which folds it in with an EWMA of weight w (``on_piggyback``); responses are frequent and
  noisy samples, hence the smoothing;
- every region broadcasts its vector to every other region each Delta (``due_broadcasts``),
  suppressed toward a region that already got this region's vector within Delta, i.e. a region
  one of our agents answered (``note_piggyback_sent``) or that we broadcast to. A received
  broadcast *replaces* the estimate (``on_broadcast``): it is the sender's own live view at
  ``sent_at``, newer than anything we hold, and averaging it with older values would only add lag.
  The daemons go quiet while nothing moves (``due_broadcasts`` with ``heartbeat_s``): a vector
  that stopped changing goes out marked ``steady`` a few times, then only every heartbeat; a
  receiver holds a steady vector's values as they are (no trend) until the next one.
  A dispatch of at least ``[score] urgent_broadcast_ms`` to an own-region worker (a long
  prompt's prefill) makes every region due at once (``urgent``): for up to Delta + one way the
  other regions' edges would otherwise see the worker as it was and send their own long prompts
  behind it.

A broadcast or piggybacked vector cannot include the work this edge sent within the last round
trip to the worker's region: that work was still crossing the WAN when the worker was read. Each such dispatch (``note_dispatched``) is kept until it is one round trip old and
added back on top of any value that replaces the estimate, so a broadcast never erases the
edge's in-flight dispatches (what went wrong without it: ``docs/design-history.md``).

A queue figure is the wait of a prompt that needs no new KV. A worker's engine admits a prompt
only when its KV fits beside what the running requests pin (SGLang's ``PrefillAdder``), so a
long prompt can wait for room at a worker whose queue is 0. Where the agent's engine says when
its VRAM frees up, the edge keeps those *room steps* (``set_room``: ms from the reading, free
tokens from then on) and broadcasts its region's with its queue vector (``room_broadcasts``,
read one way ago by the receiver, ``on_room_broadcast``); ``room_wait_ms`` is a prompt's wait
for the first step with room for it, which the Router takes where it is longer than the queue.

All times are seconds (``now``); queue values and periods are milliseconds, as in the config.
The arrays returned by ``queue_ms()`` are immutable snapshots: updates replace the array (a
copy of a few dozen floats), so a decision scored from a snapshot never sees it change.

A live reading is a wait measured at one instant, and a FIFO prefill queue drains at one ms per
ms until new work arrives (work this edge sends is added by ``note_dispatched``), so
``queue_ms(now=...)`` ages the own region's values by the time since they were taken:
``max(0, q - age)``. Between two readings of a worker busy with one long prefill, the unaged value
would show that prefill's whole length until it ends and push requests away from the worker
holding their prefix. Remote values are not simply aged: a broadcast or piggybacked value is a
snapshot of a worker that every region's edges feed, and between two of them it fills with their
work while it drains: aging it would invite every edge to the same worker at once, holding it
would hide the other edges' work (see ``docs/design-history.md``). So a remote value follows its worker's *trend*: the
slope of the values its vectors carried, taken over a few broadcast periods (so one prefill's rise
and fall averages out) and smoothed, from the instant it was read (one way ago) to ``now``.

An edge sends a request to the worker whose estimate is lowest, so the remote workers it
chooses are, on average, the ones whose estimates erred low (the winner's curse): the own
region's readings are exact, the remote ones are not, and every remote error in that direction
pulls more requests abroad. Each new value of a remote worker that this edge chose since its
last value measures that error: the new value less what the edge estimated for that moment, its
*surprise*. A smoothed surprise per remote region, fading without new samples, is added to that
region's estimates (``queue_ms``; never below 0: it only corrects the selection bias, which
makes estimates low).

Every edge reads the same broadcast, so when one remote worker looks lightest, it looks lightest
to the edges of every region at once, and each sends it work that none of the others' values
can show for a round trip: a herd (``docs/design-history.md`` has the one measured). So a chosen worker's surprise, divided by the work this edge sent it since its last
value, also measures how many ms reached it per ms of ours: the region's *herd factor*
(smoothed and fading toward 1 like the correction; between 1 and the number of regions).
``note_dispatched`` charges each send to a remote worker at that factor, in the estimate and
in flight, so an edge takes only its share of a gap the others see too. A worker that only this
edge feeds (a session's history) surprises nobody and keeps factor 1.

A queue is 0 while a worker has a free decode slot, however full its batch. Between an idle
holder of a prompt's shared prefix and an idle non-holder the saved prefill then always wins,
so a worker that has lost the popular shared prefixes is passed over until its peers' slots
fill, and never gets them back. ``queue_ms`` therefore adds ``score.occupancy_ms_per_running``
per request an own-region worker is running (its agent reports the count with each reading).
Only the score sees it: the stored values, in-flight accounting and the broadcast vectors carry
the queue alone.

A dispatch's charge lasts only as long as the work it stands for. ``note_dispatched`` returns a
handle; when the edge sees the request's first token come back (its prefill is done),
``retire_prefill`` takes out what is left of its prefill charge, and ``retire`` at its end (or
failure) the rest: all of it if no first token came. What is left of a charge is what a FIFO
worker has not drained yet: the charge less the time since the dispatch beyond the work that was
ahead of it. A value replaced since the dispatch (a reading, a broadcast) speaks for the worker
from then on, and retiring changes nothing. Without this a charge aged at one ms per ms until the
next reading: a worker that finished in a millisecond carried a queue of the modelled prefill,
and on fast workers the score sent every prefix group away from its holder (issue 30).
"""

from __future__ import annotations

import math
import operator
import sys
from bisect import bisect_left, bisect_right
from collections import OrderedDict, deque
from collections.abc import Mapping

import numpy as np

from .config import ClusterConfig
from .lookup_plan import QueueAging
from .messages import QueueVectorBroadcast, RoomVectorBroadcast

# The trend of a remote worker's queue is its values' slope over this many broadcast periods
# (long enough to average out the rise and fall of single prefills), smoothed with this weight.
_TREND_PERIODS = 5
_TREND_WEIGHT = 0.5
_MAX_TREND = 100.0  # ms per ms; a sanity bound, far above any real fill rate
# The selection correction of a remote region: EWMA weight of each surprise, and how fast it
# fades without new ones, in broadcast periods (so a region the edge stopped choosing is tried again).
_SURPRISE_WEIGHT = 0.25
_SURPRISE_FADE_PERIODS = 30
# Charges awaiting retirement (one per request in flight): the oldest go beyond this.
_MAX_CHARGES = 1 << 14
# Entries of the change log (change_log): workers whose value, time or rate changed, for the
# Router's fused call to age only those between decisions. More changes than this between two
# decisions, or a store of more than half of it at once, and the next decision ages every worker.
_CHANGE_LOG = 1024
# A vector that stopped changing is broadcast this many more periods (marked steady) before
# the sender goes quiet until its heartbeat: one lost datagram does not leave a receiver
# carrying the values along an old trend.
STEADY_REPEATS = 2

__all__ = ["QueueEstimateError", "QueueEstimates", "QueueVectorBroadcast", "QueueVectorError"]


class QueueEstimateError(ValueError):
    """Local misuse: an unknown worker, a worker of the wrong region, a bad value."""


class QueueVectorError(QueueEstimateError):
    """A peer sent a queue vector that breaks the protocol (wrong region, bad values)."""


def _check_ms(value: object, what: str, error: type[QueueEstimateError]) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise error(f"{what}: queue delay must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0.0:
        raise error(f"{what}: queue delay must be finite and >= 0, got {value!r}")
    return value


class _RoomUpdates(dict):
    """``room_updates``' answer: worker index -> (ms steps, free tokens), with its workers sorted
    (``listed``) and their fewest free tokens (``floor``, None if it lists none) taken once for
    all the edges that receive the same broadcast."""

    __slots__ = ("listed", "floor")


class QueueEstimates:
    """The queue-delay table of one edge of ``region``, in config worker order."""

    def __init__(self, cfg: ClusterConfig, region: str, *, now: float) -> None:
        if region not in cfg.region_names():
            raise QueueEstimateError(f"unknown region {region!r}")
        self.region = region
        self.worker_ids: tuple[str, ...] = cfg.worker_ids()
        self._index = {w: i for i, w in enumerate(self.worker_ids)}
        self._region_of = {w.id: w.region for w in cfg.workers}
        self._local_ids = tuple(w.id for w in cfg.workers_in(region))
        self._withheld: set[str] = set()  # never an idle destination (the router routes nothing there)
        self._remote_regions = tuple(r for r in cfg.region_names() if r != region)
        self._weight = cfg.score.queue_ewma_weight
        self._occupancy_ms_per_running = cfg.score.occupancy_ms_per_running
        self._period_s = cfg.score.broadcast_period_ms / 1000.0
        self._urgent_ms = cfg.score.urgent_broadcast_ms or math.inf
        self._urgent = False  # a dispatch of at least _urgent_ms to an own-region worker awaits broadcast
        self._idle_s = cfg.score.idle_period_ms / 1000.0
        n = len(self.worker_ids)
        # Unknown workers start at 0 ms (optimistic) until the first report; ages say "never".
        self._ms = _snapshot(np.zeros(n, dtype=np.float64))
        self._taken_at = np.full(n, float(now))  # when each value in _ms was measured (or last added to)
        local = np.array([self._region_of[w] == region for w in self.worker_ids])
        # How each value moves between readings, ms per ms: own-region readings drain (-1);
        # a remote value follows the trend of its worker's vectors (0 until two are apart).
        self._rate = np.where(local, -1.0, 0.0)
        self._aging = QueueAging(self._taken_at, self._rate)  # reads both arrays, updated in place
        # Which workers' _ms, _taken_at or _rate changed, in order (kvc_forward.h: count, floor,
        # capacity, then the entries in a ring); _change_count mirrors its count.
        self._changes = np.zeros(3 + _CHANGE_LOG, dtype=np.int64)
        self._changes[2] = _CHANGE_LOG
        self._change_count = 0
        self._trend_anchor: list[tuple[float, float] | None] = [None] * n  # (received at, ms)
        self._trend_window_s = _TREND_PERIODS * self._period_s
        self._occupancy = np.zeros(n)  # ms the score adds per own-region worker for its running batch
        self._occupied = 0  # own-region workers whose occupancy is > 0 (none: nothing to add)
        # The requests each own-region worker is running at its latest reading (0 for the
        # others), and a count of the changes to them (the Router's decode-stall price reads both).
        self.running = np.zeros(n)
        self.running_version = 0
        # Workers short of VRAM room: index -> (read at, ms steps, free tokens per step); the
        # own region's from their readings (set_room), the others' from their edges' room
        # broadcasts (on_room_broadcast), read one way ago. Also kept per region (which of its
        # workers are listed, and the fewest free tokens among them), so a region's broadcast
        # replaces its own entries without a pass over every region's: the fleet's floor and
        # the listed indexes in order are made from them when read (None: changed since).
        self._room: dict[int, tuple[float, tuple[float, ...], tuple[int, ...]]] = {}
        self._room_listed: dict[str, tuple[int, ...]] = {}  # region -> its listed workers' indexes
        self._room_floor_of: dict[str, int] = {}  # region -> fewest free tokens of its listed workers
        self._room_floor: float | None = math.inf
        self._room_workers: tuple[int, ...] | None = ()
        # Own-region workers whose engine gives no room steps but the share of its KV pool its
        # requests hold (set_pinned: a real SGLang's load report); index -> share, > 0 only.
        self._pinned: dict[int, float] = {}
        self._one_way_s = {r: cfg.one_way_ms(region, r) / 1000.0 for r in self._remote_regions}
        self._last_room_from = {r: -math.inf for r in self._remote_regions}  # sender's clock
        self._rooms_sent_to: dict[str, bool] = {r: False for r in self._remote_regions}  # the last one listed some
        # Charges awaiting retirement (module docstring): handle -> [worker, sent at, ms ahead of
        # it, prefill ms still charged, value epoch at dispatch]; the epoch of a worker's value
        # moves each time a reading or vector replaces it.
        self._charges: OrderedDict[int, list] = OrderedDict()  # the oldest goes first at the cap, in O(1)
        self._next_handle = 0
        self._epoch = [0] * n
        self._aged: tuple[float, np.ndarray, np.ndarray] | None = None  # (now, _ms it aged, result)
        self._corrected: tuple[float, np.ndarray, np.ndarray] | None = None  # same, with the surprise
        # Both, in a fused decision's buffer (adopt_decision): (now, _ms it aged, DecisionArrays)
        self._adopted: tuple | None = None
        # The selection correction (module docstring): per remote region, the smoothed surprise
        # and when it was last updated; per worker, its region's position (-1: own region) and
        # when this edge last chose it.
        regions = {r: k for k, r in enumerate(self._remote_regions)}
        self._region_pos = np.array([regions.get(self._region_of[w], -1) for w in self.worker_ids], dtype=np.intp)
        self._surprise = np.zeros(len(self._remote_regions) + 1)  # last slot: the own region, always 0
        self._surprised = False  # some surprise > 0 (a Python bool: numpy's any() per decision costs µs)
        # Each worker's slot in the correction array (the own region's: the last, always 0), for
        # a caller that adds it in C (aging_arrays).
        self._region_slot = np.where(self._region_pos < 0, len(self._remote_regions), self._region_pos).astype(np.int64)
        self._surprise_at = np.full(len(self._remote_regions) + 1, float(now))
        self._surprise_fade_s = _SURPRISE_FADE_PERIODS * self._period_s
        self._chosen_at = [-math.inf] * n
        # The herd factor (module docstring): per remote region, how many ms of work reach its
        # workers per ms this edge sends (1: only ours), and when it was last updated; per
        # worker, the ms this edge sent since its last value. Every region's edge can be one of
        # the herd, so the factor is at most the number of regions.
        self._herd = np.ones(len(self._remote_regions) + 1)  # last slot: the own region, always 1
        self._herd_at = np.full(len(self._remote_regions) + 1, float(now))
        self._max_herd = float(len(cfg.region_names()))
        self._sent_since_value = [0.0] * n
        self._refreshed_at = [-math.inf] * n
        # Work this edge sent that a value received now cannot include yet: per remote worker,
        # the (sent at, ms) of dispatches younger than one round trip to its region. Own-region
        # readings come straight from the agents, so there the window is 0 and none is kept.
        self._in_flight_s = [0.0 if local.item(i) else cfg.rtt_ms(region, self._region_of[w]) / 1000.0
                             for i, w in enumerate(self.worker_ids)]
        self._in_flight: list[deque[tuple[float, float]]] = [deque() for _ in self.worker_ids]
        self._in_flight_total = [0.0] * n  # sum of each deque's ms, kept as entries come and go
        self._zero_since = [math.inf] * n  # when the queue last became 0; inf while busy or unknown
        self._last_sent_to = {r: -math.inf for r in self._remote_regions}
        # Idle suppression (due_broadcasts with heartbeat_s): per remote region, the vector last
        # broadcast to it and how many times in a row it went out unchanged.
        self._last_vector_to: dict[str, tuple | None] = {r: None for r in self._remote_regions}
        self._unchanged_sends = {r: 0 for r in self._remote_regions}
        self._last_broadcast_from = {r: -math.inf for r in self._remote_regions}  # sender's clock
        self._last_heard_from = {r: -math.inf for r in self._remote_regions}

    # ------------------------------------------------------------ updates

    def _worker_index(self, worker: str, error: type[QueueEstimateError]) -> int:
        try:
            return self._index[worker]
        except (KeyError, TypeError):
            raise error(f"unknown worker {worker!r}") from None

    def _in_flight_ms(self, i: int, now: float) -> float:
        """Work this edge sent to worker ``i`` that a value read for ``now`` does not include."""
        pending = self._in_flight[i]
        if not pending:
            return 0.0
        cutoff = now - self._in_flight_s[i]
        if pending[0][0] <= cutoff:
            while pending and pending[0][0] <= cutoff:
                self._in_flight_total[i] -= pending.popleft()[1]
            if not pending:
                self._in_flight_total[i] = 0.0  # no rounding residue once nothing is in flight
        return self._in_flight_total[i]

    def _note_trend(self, updates: list[tuple[int, float]], now: float) -> None:
        """Fold the slope of each remote worker's vector values, taken over a trend window."""
        rate = self._rate  # queue_ms's cache is keyed on _ms, which _store replaces right after
        anchors, window_s = self._trend_anchor, self._trend_window_s
        for i, ms in updates:
            anchor = anchors[i]
            if anchor is None:
                anchors[i] = (now, ms)
                continue
            elapsed_s = now - anchor[0]
            if elapsed_s < window_s:
                continue
            sample = (ms - anchor[1]) / (elapsed_s * 1000.0)
            rate[i] = min(_MAX_TREND, max(-1.0, _TREND_WEIGHT * sample + (1.0 - _TREND_WEIGHT) * rate.item(i)))
            anchors[i] = (now, ms)

    def _store(self, updates: list[tuple[int, float]], now: float) -> None:
        """Replace values with readings taken elsewhere (plus what is still in flight to them)."""
        values = self._ms.copy()
        believed = None
        # (locals: this loop runs for every worker of every vector each edge receives)
        in_flight_s, rate_of, chosen_at, refreshed_at = self._in_flight_s, self._rate.item, self._chosen_at, self._refreshed_at
        sent_since, taken_at, epoch, zero_since = self._sent_since_value, self._taken_at, self._epoch, self._zero_since
        inf = math.inf
        for i, ms in updates:
            window = in_flight_s[i]
            if window > 0.0:
                # A remote value was read one way (half the round trip, in ms) ago: carry it
                # along its trend to now.
                ms = max(0.0, ms + rate_of(i) * window * 500.0)
                if self._in_flight[i]:  # (else _in_flight_ms adds 0.0, which changes nothing here)
                    ms += self._in_flight_ms(i, now)
                if chosen_at[i] >= refreshed_at[i] > -inf:
                    if believed is None:
                        believed = self._aged_ms(now)
                    surprise, pos = ms - believed.item(i), self._region_pos.item(i)
                    self._note_surprise(pos, surprise, now)
                    if sent_since[i] > 0.0:
                        self._note_herd(pos, surprise / sent_since[i], now)
                sent_since[i] = 0.0
            values[i] = ms
            taken_at[i] = now
            refreshed_at[i] = now
            epoch[i] += 1
            if ms > 0.0:
                zero_since[i] = inf
            elif zero_since[i] == inf:
                zero_since[i] = now
        self._ms = _snapshot(values)
        # (_note_trend and a steady vector changed the rates of these same workers, just before)
        if len(updates) > _CHANGE_LOG // 2:
            self._changed_all()
        else:
            for i, _ in updates:
                self._changed(i)

    def _changed(self, i: int) -> None:
        """Log worker ``i``'s value, time or rate as changed (change_log)."""
        count = self._change_count
        changes = self._changes
        changes[3 + count % _CHANGE_LOG] = i
        self._change_count = count = count + 1
        changes[0] = count

    def _changed_all(self) -> None:
        """Every worker may have changed: no decision carries an aged value over this."""
        self._change_count = count = self._change_count + 1
        changes = self._changes
        changes[1] = count
        changes[0] = count

    def change_log(self) -> np.ndarray:
        """The log of the workers whose values, times or rates changed since (``kvc_forward.h``,
        ``kvc_forward_decide_sparse_out``'s ``changes``), for a caller that ages the estimates
        of ``queue_ms`` in C (``lookup_plan.SparseForwardKernel.track_changes``). Updated in place."""
        return self._changes

    def _fade(self, sampled_at: np.ndarray, pos: int, now: float) -> float:
        """How much of region ``pos``'s last sample (taken at ``sampled_at[pos]``) is left now."""
        return math.exp(-max(0.0, now - sampled_at.item(pos)) / self._surprise_fade_s)

    def _note_surprise(self, pos: int, surprise_ms: float, now: float) -> None:
        kept = self._surprise.item(pos) * self._fade(self._surprise_at, pos, now)
        self._surprise[pos] = _SURPRISE_WEIGHT * surprise_ms + (1.0 - _SURPRISE_WEIGHT) * kept
        self._surprise_at[pos] = now
        self._surprised = bool((self._surprise > 0.0).any())

    def _herd_now(self, pos: int, now: float) -> float:
        """Region ``pos``'s herd factor, faded toward 1 by the time since its last sample."""
        return 1.0 + (self._herd.item(pos) - 1.0) * self._fade(self._herd_at, pos, now)

    def _note_herd(self, pos: int, surprise_per_sent: float, now: float) -> None:
        # The believed value already charged our sends at the current factor k, so the work
        # that really came per ms we sent is k plus the surprise per ms sent.
        kept = self._herd_now(pos, now)
        sample = min(self._max_herd, max(1.0, kept + surprise_per_sent))
        self._herd[pos] = _SURPRISE_WEIGHT * sample + (1.0 - _SURPRISE_WEIGHT) * kept
        self._herd_at[pos] = now

    def _correction(self, now: float) -> np.ndarray:
        """Each region's correction: its smoothed surprise faded by the time since its last
        sample, never below 0 (the last slot, the own region's, stays 0)."""
        kept = self._surprise * np.exp(-np.maximum(0.0, now - self._surprise_at) / self._surprise_fade_s)
        return np.maximum(0.0, kept)

    def set_local(self, worker_id: str, queue_ms: float, *, now: float, running: int = 0) -> None:
        """A live reading for a worker of this edge's own region: its queueing delay and the
        requests it is running (decode occupancy, see the module docstring)."""
        i = self._worker_index(worker_id, QueueEstimateError)
        if self._region_of[worker_id] != self.region:
            raise QueueEstimateError(f"worker {worker_id!r} is in region {self._region_of[worker_id]!r}, not {self.region!r}")
        if isinstance(running, bool) or not isinstance(running, (int, np.integer)) or running < 0:
            raise QueueEstimateError(f"worker {worker_id!r}: running must be an int >= 0, got {running!r}")
        queue = _check_ms(queue_ms, f"worker {worker_id!r}", QueueEstimateError)
        if self.running.item(i) != running:
            self.running[i] = running
            self.running_version += 1
        occupancy = self._occupancy_ms_per_running * int(running)
        self._occupied += (occupancy > 0.0) - (self._occupancy.item(i) > 0.0)
        self._occupancy[i] = occupancy
        self._store([(i, queue)], float(now))  # a new _ms: queue_ms recomputes with the occupancy

    def set_room(self, worker_id: str, steps, *, now: float) -> None:
        """When a worker of this edge's own region frees VRAM, read with its queue: ``(ms from
        now, free tokens from then on)`` steps, both non-decreasing (empty: nothing pinned,
        every token free). The queue figure is for a prompt that needs no new KV; a prompt needing
        more tokens than are free waits for the first step with room (``room_wait_ms``)."""
        i = self._worker_index(worker_id, QueueEstimateError)
        if self._region_of[worker_id] != self.region:
            raise QueueEstimateError(f"worker {worker_id!r} is in region {self._region_of[worker_id]!r}, not {self.region!r}")
        ms = tuple(float(m) for m, _ in steps)
        free = tuple(int(f) for _, f in steps)
        # Non-decreasing from a first value >= 0 to a finite last one: every value finite and
        # >= 0 (a NaN fails its comparisons); the pairs compared in C, not a generator each.
        if ms and not (ms[0] >= 0.0 and ms[-1] < math.inf and free[0] >= 0
                       and all(map(operator.le, ms, ms[1:])) and all(map(operator.le, free, free[1:]))):
            raise QueueEstimateError(f"worker {worker_id!r}: room steps must be (ms >= 0, free tokens >= 0) pairs, "
                                     f"both non-decreasing, got {steps!r}")
        listed = self._room_listed.get(self.region, ())
        if ms:
            self._room[i] = (float(now), ms, free)
            own = listed if i in listed else tuple(sorted((*listed, i)))
        else:
            self._room.pop(i, None)
            own = tuple(j for j in listed if j != i)
        self._set_region_room(self.region, own)

    def _set_region_room(self, region: str, listed: tuple[int, ...], floor: int | None = None) -> None:
        """``region``'s listed workers are now ``listed`` (their entries already in ``_room``):
        its floor is taken again (``floor``, if the caller has it), the fleet's floor and
        ``room_workers`` when next read."""
        if listed:
            room = self._room
            self._room_listed[region] = listed
            self._room_floor_of[region] = min(room[i][2][0] for i in listed) if floor is None else floor
        else:
            self._room_listed.pop(region, None)
            self._room_floor_of.pop(region, None)
        self._room_floor = self._room_workers = None

    @property
    def room_workers(self) -> tuple[int, ...]:
        """The indexes of the workers short of room (of every region), in order."""
        workers = self._room_workers
        if workers is None:
            workers = self._room_workers = tuple(sorted(self._room))
        return workers

    def local_rooms(self, *, now: float) -> tuple[tuple[str, tuple[tuple[float, int], ...]], ...]:
        """The own region's workers short of room, each with its steps as of ``now``."""
        out = []
        for i in self._room_listed.get(self.region, ()):
            steps = self.room(i, now=now)
            if steps is not None and len(steps) > 1:  # (one step: all it will free is free now)
                out.append((self.worker_ids[i], steps))
        return tuple(out)

    def room_broadcasts(self, to_regions, *, now: float) -> tuple[RoomVectorBroadcast, ...]:
        """The room broadcasts to send with the queue vectors just sent to ``to_regions``: the own
        region's ``local_rooms``, to each region while some worker is short of room and once
        more when none is (the receiver then forgets them)."""
        rooms = self.local_rooms(now=now)
        to = []
        for r in to_regions:
            if rooms or self._rooms_sent_to[r]:
                to.append(r)
                self._rooms_sent_to[r] = bool(rooms)
        return RoomVectorBroadcast.to_each(self.region, to, float(now), rooms)

    def room_updates(self, from_region: str, rooms: tuple[tuple[str, tuple[tuple[float, int], ...]], ...]
                     ) -> _RoomUpdates:
        """A room broadcast's ``rooms`` from ``from_region``, checked, as what ``on_room_broadcast``
        stores: worker index -> (ms steps, free tokens), the workers with steps. Another edge built
        from the same config may pass them to its ``on_room_broadcast`` (``updates=``) instead of
        checking them again, as the simulator's 63 receivers of one region's broadcast do.
        Raises as ``on_room_broadcast``."""
        if from_region not in self._last_room_from:
            raise QueueVectorError(f"unknown or own region {from_region!r}")
        listed = _RoomUpdates()
        for worker, steps in rooms:
            i = self._worker_index(worker, QueueVectorError)
            if self._region_of[worker] != from_region:
                raise QueueVectorError(f"worker {worker!r} is not in region {from_region!r}")
            if steps:
                listed[i] = (tuple(float(m) for m, _ in steps), tuple(int(f) for _, f in steps))
        listed.listed = tuple(sorted(listed))
        listed.floor = min((free[0] for _, free in listed.values()), default=None)
        return listed

    def on_room_broadcast(self, msg: RoomVectorBroadcast, *, now: float,
                          updates: _RoomUpdates | None = None) -> bool:
        """Replace the sender's region's room steps with a room broadcast's, read one way ago (a
        worker it does not list has every token free); False if it was stale or reordered.
        ``updates``: ``room_updates(msg.from_region, msg.rooms)`` of an edge of the same config,
        if the caller has it (never changed here)."""
        if msg.to_region != self.region:
            raise QueueVectorError(f"room broadcast for region {msg.to_region!r} delivered to {self.region!r}")
        if updates is None:
            updates = self.room_updates(msg.from_region, msg.rooms)
        last = self._last_room_from.get(msg.from_region)
        if last is None:  # (updates checked by another region's edge: this one's own region)
            raise QueueVectorError(f"unknown or own region {msg.from_region!r}")
        if msg.sent_at <= last:
            return False
        self._last_room_from[msg.from_region] = msg.sent_at
        read_at = float(now) - self._one_way_s[msg.from_region]
        room = self._room
        for i in self._room_listed.get(msg.from_region, ()):
            del room[i]
        for i, (ms, free) in updates.items():
            room[i] = (read_at, ms, free)
        self._set_region_room(msg.from_region, updates.listed, updates.floor)  # (taken once, for every receiver)
        return True

    @property
    def room_floor(self) -> float:
        """The fewest free tokens any worker reported (inf: none is short of room):
        a prompt no longer than this fits everywhere and ``room_wait_ms`` has nothing to add."""
        floor = self._room_floor
        if floor is None:
            floor = self._room_floor = min(self._room_floor_of.values(), default=math.inf)
        return floor

    def set_pinned(self, worker_id: str, share: float) -> None:
        """An own-region worker's engine holds ``share`` of its KV pool for its requests (an
        engine that gives no room steps: a real SGLang's ``num_used_tokens`` over
        ``max_total_num_tokens``)."""
        i = self._worker_index(worker_id, QueueEstimateError)
        if self._region_of[worker_id] != self.region:
            raise QueueEstimateError(f"worker {worker_id!r} is not in this edge's region {self.region!r}")
        if not (0.0 <= share <= 1.0):
            raise QueueEstimateError(f"worker {worker_id!r}: a pinned share must be within [0, 1], got {share!r}")
        if share > 0.0:
            self._pinned[i] = float(share)
        else:
            self._pinned.pop(i, None)

    @property
    def pinned_workers(self) -> tuple[int, ...]:
        """The workers whose VRAM something pins, by their room steps or a reported share."""
        if not self._pinned:
            return self.room_workers
        return tuple(sorted(set(self.room_workers).union(self._pinned)))

    def pinned_share(self, i: int, *, now: float) -> float:
        """The share of worker ``i``'s VRAM its requests pin as of ``now``, from its room steps
        (the free tokens now against those once every request it holds has finished), else the
        share its engine reported (``set_pinned``); 0 when it reported neither (nothing pinned,
        or room enough for any prompt). Read per decision (``score.copy_weight``): the steps
        are not built, only the step reached."""
        room = self._room.get(i)
        if room is None:
            return self._pinned.get(i, 0.0)
        _, k, free = self._step_reached(room, now)
        capacity = free[-1]
        if capacity <= 0:
            return 1.0
        return min(1.0, max(0.0, 1.0 - free[k] / capacity))

    def room(self, i: int, *, now: float) -> tuple[tuple[float, int], ...] | None:
        """Worker ``i``'s room steps as of ``now`` (ms from ``now``, free tokens),
        those already past folded into the first; None when it has none (nothing pinned, or
        never reported)."""
        room = self._room.get(i)
        if room is None:
            return None
        age, k, free = self._step_reached(room, now)
        ms = room[1]
        return ((0.0, free[k]),) + tuple((m - age, f) for m, f in zip(ms[k + 1:], free[k + 1:]))

    @staticmethod
    def _step_reached(room: tuple[float, tuple[float, ...], tuple[int, ...]], now: float
                      ) -> tuple[float, int, tuple[int, ...]]:
        """(ms since the reading, index of the last step already reached (or the first), free
        tokens per step) of a worker's room reading as of ``now``."""
        read_at, ms, free = room
        age = 1000.0 * (now - read_at)
        return age, max(0, bisect_right(ms, age) - 1), free

    def room_wait_ms(self, i: int, tokens: float, *, now: float) -> float:
        """How long a prompt needing ``tokens`` new KV tokens waits at worker ``i`` for VRAM
        room (0 when it fits, or when no room was reported), from the steps last read, aged to
        ``now``. A prompt longer than every step's room waits for the last (it then runs alone)."""
        room = self._room.get(i)
        if room is None:
            return 0.0
        read_at, ms, free = room
        if tokens <= free[0]:
            return 0.0
        k = bisect_left(free, tokens)
        wait = ms[min(k, len(ms) - 1)] - 1000.0 * (now - read_at)
        return wait if wait > 0.0 else 0.0

    def _remote_updates(self, from_region: str, vector: Mapping[str, float] | tuple[tuple[str, float], ...]
                        ) -> list[tuple[int, float]]:
        if from_region not in self._last_heard_from:
            raise QueueVectorError(f"queue vector from unknown or own region {from_region!r}")
        items = vector.items() if isinstance(vector, Mapping) else vector
        updates = []
        for worker, ms in items:
            i = self._worker_index(worker, QueueVectorError)
            if self._region_of[worker] != from_region:
                raise QueueVectorError(f"region {from_region!r} reported worker {worker!r} of region "
                                       f"{self._region_of[worker]!r}")
            updates.append((i, _check_ms(ms, f"worker {worker!r}", QueueVectorError)))
        return updates

    def on_piggyback(self, from_region: str, vector: Mapping[str, float], *, now: float) -> None:
        """Fold the vector a response from ``from_region`` carried (EWMA weight w).

        The whole vector is validated before anything changes. A worker never heard of before
        takes the reported value as is (there is nothing to average with).
        """
        updates = self._remote_updates(from_region, vector)
        w = self._weight
        now = float(now)
        current = self._aged_ms(now)  # what we believed, before this vector moves the trend
        self._note_trend(updates, now)
        # _store adds the in-flight work back to each value; the current estimate already
        # holds it, so fold the sample against the estimate without it.
        folded = [(i, ms if self._refreshed_at[i] == -math.inf
                   else w * ms + (1.0 - w) * max(0.0, current.item(i) - self._in_flight_ms(i, now)))
                  for i, ms in updates]
        self._store(folded, now)
        self._last_heard_from[from_region] = now

    def remote_updates(self, from_region: str, vector: Mapping[str, float] | tuple[tuple[str, float], ...]
                       ) -> list[tuple[int, float]]:
        """A vector from ``from_region``, checked, as the (worker index, ms) pairs ``on_broadcast``
        reads: another edge built from the same config (the same workers in the same order) may
        pass them to its ``on_broadcast`` (``updates=``) instead of checking the vector again, as
        the simulator's 63 receivers of one region's broadcast do. Raises as ``on_broadcast``."""
        return self._remote_updates(from_region, vector)

    def on_broadcast(self, msg: QueueVectorBroadcast, *, now: float,
                     updates: list[tuple[int, float]] | None = None) -> bool:
        """Replace the sender's workers with a broadcast vector; False if it was stale or reordered.
        ``updates``: ``remote_updates(msg.from_region, msg.vector)`` of an edge of the same config,
        if the caller has it (never changed here)."""
        if msg.to_region != self.region:
            raise QueueVectorError(f"broadcast for region {msg.to_region!r} delivered to {self.region!r}")
        if updates is None:
            updates = self._remote_updates(msg.from_region, msg.vector)
        # Datagrams may arrive out of order; sent_at is on the sender's clock, so compare only
        # with the same sender's earlier broadcasts.
        if msg.sent_at <= self._last_broadcast_from[msg.from_region]:
            return False
        self._last_broadcast_from[msg.from_region] = msg.sent_at
        now = float(now)
        if msg.steady:
            # The sender's values stopped moving and it goes quiet until one changes: hold
            # them (no trend) rather than carry them along the slope they had while moving.
            for i, ms in updates:
                self._rate[i] = 0.0
                self._trend_anchor[i] = (now, ms)
        else:
            self._note_trend(updates, now)
        self._store(updates, now)
        self._last_heard_from[msg.from_region] = now
        return True

    def note_dispatched(self, worker_id: str, added_ms: float, *, now: float) -> int:
        """Count work this edge just sent to a worker until a reading includes it, or until the
        edge sees it done (``retire_prefill``, ``retire`` with the returned handle).

        Readings arrive every few tens of milliseconds (local) or every Delta (remote); without
        this, a burst of requests inside one reading interval would all see the same idle
        worker and herd onto it. A later reading, broadcast or piggyback replaces the value but
        keeps this work on top until it is one round trip old (see the module docstring).
        """
        i = self._worker_index(worker_id, QueueEstimateError)
        if added_ms.__class__ is float and 0.0 <= added_ms <= sys.float_info.max:
            added = added_ms  # what the Router passes, once per request: no conversion, no message
        else:
            added = _check_ms(added_ms, f"worker {worker_id!r}", QueueEstimateError)
        now = float(now)
        handle = self._next_handle
        self._next_handle = handle + 1
        charges = self._charges
        if len(charges) >= _MAX_CHARGES:
            charges.popitem(last=False)  # a shell that lost track of some: oldest first
        if added == 0.0:
            return handle
        values = self._ms.copy()
        ahead = self._aged_item(now, i)  # the decision just aged them at this now
        values[i] = ahead + added
        if self._in_flight_s[i] > 0.0:
            self._sent_since_value[i] += added
            pos = self._region_pos.item(i)
            if self._herd.item(pos) != 1.0:
                # Charge the herd's share of this work too: it is crossing the WAN as well.
                charged = added * self._herd_now(pos, now)
                values[i] += charged - added
                added = charged
            self._in_flight_ms(i, now)  # drops what has arrived by now
            self._in_flight[i].append((now, added))
            self._in_flight_total[i] += added
            self._chosen_at[i] = now
        elif added >= self._urgent_ms and self._remote_regions:
            self._urgent = True  # own region (no in-flight window): other regions hear of it now
        self._taken_at[i] = now
        self._zero_since[i] = math.inf
        self._ms = _snapshot(values)
        self._changed(i)
        charges[handle] = [i, now, ahead, added, self._epoch[i]]
        return handle

    def retire_prefill(self, handle: int, *, now: float) -> float:
        """The dispatch's first token came back: take out what is left of its prefill charge.
        Returns the ms taken out (0 for an unknown handle, a replaced value, a second call)."""
        charge = self._charges.get(handle)
        if charge is None or charge[3] == 0.0:
            return 0.0
        i, sent_at, ahead, charged, epoch = charge
        charge[3] = 0.0
        if epoch != self._epoch[i]:
            return 0.0  # a reading or vector replaced the value: it speaks for the worker now
        now = float(now)
        # A FIFO worker drains what was ahead of the dispatch first, then the dispatch itself;
        # a remote value does not drain (it follows its trend), so there all of it is left.
        drained = max(0.0, -self._rate.item(i)) * max(0.0, now - sent_at) * 1000.0
        left = min(charged, max(0.0, ahead + charged - drained))
        if left > 0.0:
            values = self._ms.copy()
            values[i] = max(0.0, self._aged_item(now, i) - left)
            self._taken_at[i] = now
            if values[i] == 0.0 and self._zero_since[i] == math.inf:
                self._zero_since[i] = now
            self._ms = _snapshot(values)
            self._changed(i)
        return left

    def retire(self, handle: int, *, now: float) -> None:
        """The dispatch ended (or failed): retire what is left of its charge (all of it when no
        first token came) and forget the handle."""
        self.retire_prefill(handle, now=now)
        self._charges.pop(handle, None)

    def open_charges(self) -> int:
        """Dispatches whose charge awaits retirement."""
        return len(self._charges)

    def note_piggyback_sent(self, to_region: str, *, now: float) -> None:
        """One of this region's agents answered a request from ``to_region`` with our vector."""
        if to_region not in self._last_sent_to:
            raise QueueEstimateError(f"unknown or own region {to_region!r}")
        self._last_sent_to[to_region] = max(self._last_sent_to[to_region], float(now))

    @property
    def urgent(self) -> bool:
        """A dispatch of at least ``[score] urgent_broadcast_ms`` to an own-region worker was
        made since the last broadcasts: every remote region is due now (the shell wakes its
        broadcast timer; ``next_deadline`` says now)."""
        return self._urgent

    def due_broadcasts(self, *, now: float, heartbeat_s: float | None = None) -> tuple[QueueVectorBroadcast, ...]:
        """Broadcasts to send now: to every remote region that got no vector from us within Delta,
        or to all of them after an urgent dispatch (``urgent``).

        With ``heartbeat_s`` (the daemons' ``[idle] heartbeat_ms``), a vector that has stopped
        changing goes out marked ``steady`` for ``STEADY_REPEATS`` periods (a datagram may be
        lost), then only every ``heartbeat_s`` until it changes: an idle region sends nothing
        else. Without it (the simulator), every period as before.

        Returned broadcasts count as sent (the shell sends them all).
        """
        now = float(now)
        if self._urgent:
            self._urgent = False
            due = list(self._remote_regions)
        else:
            # Same expression as next_deadline, so a timer armed there always finds the broadcast due.
            due = [r for r in self._remote_regions if now >= self._last_sent_to[r] + self._period_s]
        if not due:
            return ()
        vector = self.local_vector(now=now)
        if heartbeat_s is None:
            for r in due:
                self._last_sent_to[r] = now
            return QueueVectorBroadcast.to_each(self.region, due, now, vector)
        out = []
        for r in due:
            unchanged = vector == self._last_vector_to[r]
            if (unchanged and self._unchanged_sends[r] >= STEADY_REPEATS
                    and now < self._last_sent_to[r] + heartbeat_s):
                continue
            self._unchanged_sends[r] = self._unchanged_sends[r] + 1 if unchanged else 0
            self._last_vector_to[r] = vector
            self._last_sent_to[r] = now
            out.append(QueueVectorBroadcast(self.region, r, now, vector, steady=unchanged))
        return tuple(out)

    def next_deadline(self, *, now: float, heartbeat_s: float | None = None) -> float | None:
        """When ``due_broadcasts`` will next have something (now if overdue); None with one region.

        With ``heartbeat_s``, a region gone quiet (its vector sent unchanged ``STEADY_REPEATS``
        times) is next asked about one period from ``now`` (its vector may change by then) or at
        its heartbeat, whichever is first, instead of at once."""
        if not self._remote_regions:
            return None
        now = float(now)
        if self._urgent:
            return now
        if heartbeat_s is None:
            earliest = min(self._last_sent_to.values()) + self._period_s
        else:
            earliest = min(min(last + heartbeat_s, max(last + self._period_s, now + self._period_s))
                           if self._unchanged_sends[r] >= STEADY_REPEATS else last + self._period_s
                           for r, last in self._last_sent_to.items())
        return max(now, earliest)

    # ------------------------------------------------------------ queries

    def queue_ms(self, *, now: float | None = None) -> np.ndarray:
        """Estimated queue delays (ms) in config worker order: an immutable snapshot. With
        ``now``, the values carried to ``now`` (own region aged, remote along their trend) plus
        each remote region's selection correction and each own-region worker's occupancy (see
        the module docstring); without, the values as last set."""
        if now is None:
            return self._ms
        cached = self._corrected
        if cached is not None and cached[0] == now and cached[1] is self._ms:
            return cached[2]
        ms = self._ms
        adopted = self._adopted
        if adopted is not None and adopted[0] == now and adopted[1] is ms:
            corrected = adopted[2].queue()
            self._corrected = (now, ms, corrected)
            return corrected
        aged = self._aged_ms(now)
        # Until some remote pick has surprised this edge (below capacity, usually never) there
        # is nothing to add.
        corrected = aged if not self._surprised else aged + self._correction(float(now))[self._region_pos]
        if self._occupied:  # adding zeros would change no value (aged values are never -0.0)
            corrected = corrected + self._occupancy
        if corrected is not aged:
            corrected = _snapshot(corrected)
        self._corrected = (now, ms, corrected)
        return corrected

    def aging_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The arrays ``queue_ms(now)`` reads that change in place: (taken_at, rate, occupancy,
        each worker's slot in the correction), for a caller that carries the estimates to ``now``
        in C (the Router's fused call, ``lookup_plan.SparseForwardKernel.run_aged``) and hands
        them back with ``adopt_estimates``. A caller may write them: the change log
        (``change_log``) takes every worker as changed."""
        self._changed_all()
        return self._taken_at, self._rate, self._occupancy, self._region_slot

    def estimate_terms(self, now: float) -> tuple[np.ndarray, np.ndarray | None, bool] | None:
        """What ``queue_ms(now)`` adds up, for such a caller: (the values as last set, the
        correction per region slot or None, whether the occupancy is added); None when
        ``queue_ms(now)`` is known already."""
        cached = self._corrected
        if cached is not None and cached[0] == now and cached[1] is self._ms:
            return None
        adopted = self._adopted
        if adopted is not None and adopted[0] == now and adopted[1] is self._ms:
            return None
        return self._ms, (self._correction(float(now)) if self._surprised else None), self._occupied > 0

    def adopt_estimates(self, now: float, ms: np.ndarray, aged: np.ndarray, corrected: np.ndarray) -> None:
        """Take ``aged`` and ``corrected`` as ``_aged_ms(now)`` and ``queue_ms(now)`` of the values
        ``ms`` (``estimate_terms``' first), computed by the caller in numpy's operations and
        order (bit for bit); they become this edge's snapshots."""
        aged.setflags(write=False)
        if corrected is not aged:
            corrected.setflags(write=False)
        self._aged = (now, ms, aged)
        self._corrected = (now, ms, corrected)

    def adopt_decision(self, now: float, ms: np.ndarray, arrays) -> None:
        """``adopt_estimates`` of a fused decision's buffer (``lookup_plan.DecisionArrays``,
        its ``aged()`` and ``queue()``): the arrays are made when something reads them, and one
        worker's aged value (``note_dispatched``) is read without them."""
        self._adopted = (now, ms, arrays)

    def _aged_item(self, now: float, i: int) -> float:
        """``_aged_ms(now).item(i)``, from an adopted decision's buffer when it holds them."""
        adopted = self._adopted
        if adopted is not None and adopted[0] == now and adopted[1] is self._ms:
            return adopted[2].aged_at(i)
        return self._aged_ms(now).item(i)

    def _aged_ms(self, now: float) -> np.ndarray:
        """The values carried to ``now``, without the selection correction."""
        cached = self._aged
        if cached is not None and cached[0] == now and cached[1] is self._ms:
            return cached[2]
        ms = self._ms
        adopted = self._adopted
        if adopted is not None and adopted[0] == now and adopted[1] is ms:
            aged = adopted[2].aged()
            self._aged = (now, ms, aged)
            return aged
        # max(0, ms + rate x max(0, (now - taken_at) x 1000)), one C loop (bit for bit numpy's)
        aged = _snapshot(self._aging.aged(ms, float(now)))
        self._aged = (now, ms, aged)
        return aged

    def surprises(self, *, now: float) -> dict[str, float]:
        """Each remote region's selection correction (ms) as ``queue_ms`` adds it now."""
        correction = self._correction(float(now))
        return {r: correction.item(k) for k, r in enumerate(self._remote_regions)}

    def herd_factors(self, *, now: float) -> dict[str, float]:
        """Each remote region's herd factor: the multiple of its own sends this edge charges."""
        return {r: self._herd_now(k, float(now)) for k, r in enumerate(self._remote_regions)}

    def trends(self) -> np.ndarray:
        """How each value moves between readings (ms per ms, config worker order): -1 for the own
        region (it drains), the measured trend for remote workers."""
        return self._rate.copy()

    def get(self, worker_id: str) -> float:
        return float(self._ms[self._worker_index(worker_id, QueueEstimateError)])

    def ages(self, *, now: float) -> np.ndarray:
        """Seconds since each worker's estimate was refreshed (inf: never)."""
        return float(now) - np.array(self._refreshed_at, dtype=np.float64)

    def last_heard_from(self, region: str) -> float:
        """When a piggyback or broadcast from ``region`` last arrived (-inf: never)."""
        try:
            return self._last_heard_from[region]
        except KeyError:
            raise QueueEstimateError(f"unknown or own region {region!r}") from None

    def local_vector(self, *, now: float | None = None) -> tuple[tuple[str, float], ...]:
        """This region's own workers and their live values (aged to ``now`` if given), to
        piggyback or broadcast."""
        values = self._ms if now is None else self._aged_ms(now)
        return tuple((w, values.item(self._index[w])) for w in self._local_ids)

    def is_persistently_idle(self, worker_id: str, *, now: float) -> bool:
        """True if the worker's queue has stayed at 0 for ``idle_period_ms`` up to ``now``."""
        i = self._worker_index(worker_id, QueueEstimateError)
        return float(now) - self._zero_since[i] >= self._idle_s

    def idle_since(self, worker_id: str) -> float:
        """When the worker's queue last became 0 (inf while busy or never reported)."""
        return self._zero_since[self._worker_index(worker_id, QueueEstimateError)]

    def withhold(self, worker_id: str, withheld: bool = True) -> None:
        self._worker_index(worker_id, QueueEstimateError)
        (self._withheld.add if withheld else self._withheld.discard)(worker_id)

    def persistently_idle_local(self, *, now: float) -> tuple[str, ...]:
        """Own-region workers idle for ``idle_period_ms``, longest idle first (ties: config order);
        withheld workers are never offered."""
        idle = [w for w in self._local_ids if w not in self._withheld and self.is_persistently_idle(w, now=now)]
        return tuple(sorted(idle, key=lambda w: self._zero_since[self._index[w]]))


def _snapshot(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array
