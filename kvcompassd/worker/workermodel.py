"""Timing model of one inference worker: A100-80GB serving Llama-3.1-8B in BF16 (sans-IO).

Shared by the simulator and the emulated worker. Event-driven and exact: state changes only at
arrivals, prefill completions and decode completions, and :meth:`WorkerQueueModel.next_event_time`
says when the next one is due, so a shell sleeps exactly that long and never polls.

The scheduler is SGLang's default one, simplified to what matters for time-to-first-token:
- a FIFO waiting queue; at most ``max_running`` requests hold a slot (``--max-running-requests``);
- the prompt's cached prefix is matched when its prefill starts, not when it arrives: SGLang's
  scheduler calls ``req.init_next_round_input(tree_cache)`` (the radix-tree match) and
  ``PrefillAdder.add_one_req`` (which locks the matched node) as it takes the request off the
  waiting queue into a prefill batch, and vLLM's scheduler calls ``get_computed_blocks`` then.
  A prefix evicted while the request waited is computed again, and one cached meanwhile by an
  earlier request is reused. The cached figures :meth:`WorkerQueueModel.admit` is given are the
  estimate at arrival; a caller that owns the cache passes ``prefill_starts`` (returns what is
  really reused, pinning it; or None when the prompt's KV does not fit beside what the running
  requests hold: SGLang's ``PrefillAdder`` then stops at the head of the queue, and the request
  waits there until a request finishes), ``prefill_ends`` (the prompt's KV enters the cache) and
  ``finished`` (the pins are released) to the constructor and is called at those instants, in
  time order with every other change (SGLang caches a prefill batch's KV and releases finished
  requests' locks before it schedules the next batch);
- the queue a worker reports (:meth:`WorkerQueueModel.queue_ms`) counts the wait for VRAM room:
  a caller that owns the cache also passes ``footprint`` (the cache pages a request pins while
  it runs, a root path of page ids) and ``vram_pages``, and the run-ahead that answers the
  report admits the head of the queue only when the union of the running requests' paths and
  its own fits in ``vram_pages``, as ``PrefixCache.lock(only_if_room=True)`` does. The union of
  root paths is kept sorted with the common prefix of neighbours (:class:`PinnedPaths`), so a
  start or a finish in the run-ahead costs O(log slots) path comparisons and a read stays
  O(slots);
- the GPU does one thing at a time: a pending prefill runs first (prefill-first scheduling) and
  pauses decoding; prefills run one after another in admission order;
- a prefill costs ``beta`` per uncached token plus ``gamma`` per token reloaded from DRAM and
  produces the first output token;
- otherwise all decoding requests advance one token per step, and a step takes
  ``decode_ms_per_token * (1 + decode_batch_slope * (batch - 1))`` (continuous batching: a
  step reads the weights once for the whole batch, plus each sequence's KV).

Calibration (A100-80GB SXM, Llama-3.1-8B BF16), all in milliseconds:
- beta = 0.085 ms/token: the KVCompass paper's testbed figure (paper section 5). Cross-check:
  prefill costs ~2 * 8.0e9 = 16 GFLOP/token; at 312 TFLOP/s BF16 peak and ~60 % MFU that is
  0.085 ms/token (~11.8k tokens/s). (The MFU is an assumption; no measured A100 prefill
  rate was checked.)
- gamma = 0.00524 ms/token: KV per token = 32 layers * 8 KV heads * 128 dims * 2 (K, V) *
  2 bytes = 128 KiB; over PCIe 4.0 x16 at ~25 GB/s effective: 131072 B / 25e9 B/s = 5.24 us.
- decode_ms_per_token = 12 ms at batch 1 (the cluster config's default): a decode step
  streams the 16 GB of weights from HBM (2.0 TB/s on the 80 GB part -> 8 ms) plus kernel and
  sampling overheads. Published: vLLM 0.23 serving Llama-3.1-8B-Instruct BF16 on an A100 *40GB*
  decodes ~75 tokens/s at concurrency 1 (13.3 ms/token; johnmusgrave.com, "vLLM
  throughput-latency sweep on NVIDIA A100"); scaled by HBM bandwidth (1.56 -> 2.04 TB/s) that is
  ~10 ms on the 80 GB part, so 12 ms is slightly conservative.
- decode_batch_slope = 0.01 (ASSUMPTION, fitted to published throughput): each extra sequence
  adds ~1 % to a step (its KV reads and attention), so a batch of 64 steps in ~19.6 ms, i.e.
  ~3.3k output tokens/s. Published: SGLang 0.5.6 on an A100-40GB, Llama-3.1-8B BF16, best
  offline output throughput 3,161 tokens/s (FreedomIntelligence/AccelMark results); the same
  vLLM sweep gains 6.6x throughput from concurrency 1 to 8 (this model: 7.5x for pure decode;
  the sweep's figure includes prefill interference, which this model charges separately).
- max_running = 64 (ASSUMPTION, the cluster config's default).
"""

from __future__ import annotations

import math
from collections import deque
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter

_by_arrival = attrgetter("arrived")


class WorkerModelError(ValueError):
    """Misuse of the worker model (time going backwards, a duplicate request id, bad params)."""


@dataclass(frozen=True, slots=True)
class WorkerTiming:
    """Timing parameters in milliseconds (see the module docstring for their sources)."""

    prefill_ms_per_token: float = 0.085
    reload_ms_per_token: float = 0.00524
    decode_ms_per_token: float = 12.0
    decode_batch_slope: float = 0.01
    max_running: int = 64

    def __post_init__(self) -> None:
        for name in ("prefill_ms_per_token", "reload_ms_per_token", "decode_ms_per_token", "decode_batch_slope"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise WorkerModelError(f"{name} must be a finite number >= 0, got {value!r}")
        if not isinstance(self.max_running, int) or self.max_running < 1:
            raise WorkerModelError(f"max_running must be an int >= 1, got {self.max_running!r}")

    @classmethod
    def from_worker_config(cls, worker: object, **overrides: float) -> WorkerTiming:
        """From a ``WorkerConfig`` (prefill_ms_per_token, decode_ms_per_token, max_running)."""
        values = {
            "prefill_ms_per_token": float(worker.prefill_ms_per_token),
            "decode_ms_per_token": float(worker.decode_ms_per_token),
            "max_running": int(worker.max_running),
        }
        values.update(overrides)
        return cls(**values)

    def prefill_ms(self, uncached_tokens: int, dram_tokens: int = 0) -> float:
        return self.prefill_ms_per_token * uncached_tokens + self.reload_ms_per_token * dram_tokens

    def decode_step_ms(self, batch: int) -> float:
        return self.decode_ms_per_token * (1.0 + self.decode_batch_slope * max(batch - 1, 0))


@dataclass(frozen=True, slots=True)
class FirstTokenProduced:
    request_id: str
    at: float


@dataclass(frozen=True, slots=True)
class RequestFinished:
    request_id: str
    at: float


WorkerEvent = FirstTokenProduced | RequestFinished


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt_tokens: int
    uncached: int
    dram: int
    output_tokens: int
    arrived: float
    prefill_s: float
    remaining: float = 0.0  # decode tokens still to produce
    first_token_at: float | None = None
    pages: tuple[int, ...] | None = None  # on a run-ahead: the page path it pins (footprint), once asked

    def copy(self) -> _Request:
        return _Request(self.request_id, self.prompt_tokens, self.uncached, self.dram, self.output_tokens,
                        self.arrived, self.prefill_s, self.remaining, self.first_token_at, self.pages)


@dataclass(slots=True)
class _Prefill:
    request: _Request
    started: float
    ends: float


# prefill_starts(request_id, now) -> (cached_vram, cached_dram) really reused from ``now`` on, or
# None: no room for its KV until a running request finishes
PrefillStarts = Callable[[str, float], tuple[int, int] | None]
# prefill_ends(request_id, now): the prompt is computed (its KV can enter the cache);
# finished(request_id, now): its last token is out (its pages can be released)
RequestMoment = Callable[[str, float], None]
# footprint(request_id): the ids of the cache pages the request pins while it runs, root first
# (a started request's lease; a queued one's full prompt pages, as its prefill will pin them).
# An id names its page's whole root path (the cache's event ids are a chained hash), so two
# paths share exactly the pages whose ids they share.
Footprint = Callable[[str], Sequence[int]]


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common prefix of two page paths (slice comparisons run in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low


class PinnedPaths:
    """The pages running requests pin, as the union of their root paths (a page shared by
    several counted once, as ``PrefixCache.pinned_vram_pages`` counts it).

    The paths are kept sorted; the union's size is the sum of their lengths less the common
    prefix of each sorted neighbour pair, so adding or removing a path changes it by its length
    less the longer of its common prefixes with its two neighbours: O(log n) path comparisons
    (each at most a path's length, in C) and one list insertion, never a pass over the union."""

    __slots__ = ("capacity", "size", "_keys", "_prefix", "_by_id")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0
        self._keys: list[tuple[tuple[int, ...], str]] = []  # (path, request id), sorted
        self._prefix: list[int] = []  # _prefix[i]: common prefix of paths i and i + 1
        self._by_id: dict[str, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def _neighbours(self, at: int, path: tuple[int, ...]) -> tuple[int, int]:
        """Common prefixes of ``path`` with the paths that would sit before and after it at
        position ``at``."""
        keys = self._keys
        before = _common_prefix(keys[at - 1][0], path) if at > 0 else 0
        after = _common_prefix(path, keys[at][0]) if at < len(keys) else 0
        return before, after

    def added_pages(self, path: tuple[int, ...]) -> int:
        """Pages the union would grow by with ``path`` in it."""
        at = bisect_left(self._keys, (path, ""))
        before, after = self._neighbours(at, path)
        return len(path) - max(before, after)

    def fits(self, path: tuple[int, ...]) -> bool:
        """Whether a request pinning ``path`` may start: its new pages fit beside the pinned
        ones, or nothing is pinned (a prompt longer than VRAM runs alone)."""
        return not self.size or self.size + self.added_pages(path) <= self.capacity

    def add(self, request_id: str, path: tuple[int, ...]) -> None:
        """A request pinning ``path`` starts (a path longer than the capacity, which starts only
        alone, pins as many pages as the capacity holds)."""
        path = path[: self.capacity]
        key = (path, request_id)
        at = bisect_left(self._keys, key)
        before, after = self._neighbours(at, path)
        self.size += len(path) - max(before, after)
        self._keys.insert(at, key)
        if at > 0:
            self._prefix.insert(at - 1, before)
            if at < len(self._keys) - 1:
                self._prefix[at] = after
        elif len(self._keys) > 1:
            self._prefix.insert(0, after)
        self._by_id[request_id] = path

    def discard(self, request_id: str) -> None:
        path = self._by_id.pop(request_id, None)
        if path is None:
            return
        at = bisect_left(self._keys, (path, request_id))
        last = len(self._keys) - 1
        before = self._prefix[at - 1] if at > 0 else 0
        after = self._prefix[at] if at < last else 0
        self.size -= len(path) - max(before, after)
        del self._keys[at]
        if at > 0 and at < last:
            self._prefix[at - 1] = min(before, after)
            del self._prefix[at]
        elif at > 0:
            del self._prefix[at - 1]
        elif last > 0:
            del self._prefix[0]


class WorkerQueueModel:
    """One worker's queue; times (``now``, event times) are seconds on the caller's clock."""

    def __init__(self, timing: WorkerTiming | None = None, *, start: float = 0.0,
                 prefill_starts: PrefillStarts | None = None, prefill_ends: RequestMoment | None = None,
                 finished: RequestMoment | None = None, footprint: Footprint | None = None,
                 vram_pages: int | None = None) -> None:
        """``prefill_starts``, ``prefill_ends``, ``finished``: the cache's side of a request
        (see the module docstring); without ``prefill_starts`` a request reuses what
        :meth:`admit` was told. ``footprint`` and ``vram_pages``: what :meth:`queue_ms` needs
        to count the wait for VRAM room that ``prefill_starts`` can impose (both or neither)."""
        self.timing = timing or WorkerTiming()
        if (footprint is None) != (vram_pages is None):
            raise WorkerModelError("footprint and vram_pages go together")
        if vram_pages is not None and (not isinstance(vram_pages, int) or vram_pages < 0):
            raise WorkerModelError(f"vram_pages must be an int >= 0, got {vram_pages!r}")
        self._prefill_starts = prefill_starts
        self._prefill_ends = prefill_ends
        self._finished = finished
        self._footprint = footprint
        self._vram_pages = vram_pages
        # On a run-ahead of a model with a footprint: the pages its running requests pin (None
        # on the model itself, whose cache decides through prefill_starts).
        self._pinned: PinnedPaths | None = None
        self._head_blocked = False  # no room for the head's KV: it waits for a finish
        self._now = start
        self._waiting: deque[_Request] = deque()   # no slot yet
        self._admitted: deque[_Request] = deque()  # hold a slot, prefill not started
        # Uncached tokens of _waiting + _admitted, kept as requests move: a long queue (an
        # overloaded worker) must not make every load report O(queue).
        self._queued_uncached = 0
        self._prefill: _Prefill | None = None
        self._decoding: dict[str, _Request] = {}
        # The fewest tokens any decoding request has left (None: not known, recompute). Every
        # step takes the same tokens off all of them and rounding is monotonic, so the minimum
        # follows from _progress without a pass over the batch per event.
        self._fewest_left: float | None = None
        self._ids: set[str] = set()
        self._outbox: list[WorkerEvent] = []
        self.completed = 0
        # While every slot is taken, a copy of this model run ahead until each request it holds
        # has a slot (see queue_ms); None when not needed.
        self._shadow: WorkerQueueModel | None = None
        self._answer: float | None = None  # on a shadow: its last answer, until it changes

    # ------------------------------------------------------------------------------ inputs

    def admit(
        self,
        request_id: str,
        prompt_tokens: int,
        cached_vram: int,
        cached_dram: int,
        output_tokens: int,
        *,
        now: float,
    ) -> None:
        """A request arrives at ``now``; ``cached_*`` are prompt tokens found in each tier (the
        estimate at arrival when the model has a ``prefill_starts`` to ask at the prefill's start)."""
        if request_id in self._ids:
            raise WorkerModelError(f"request {request_id!r} is already in the model")
        if min(prompt_tokens, cached_vram, cached_dram) < 0 or cached_vram + cached_dram > prompt_tokens:
            raise WorkerModelError(
                f"need 0 <= cached_vram + cached_dram <= prompt_tokens, got {cached_vram}+{cached_dram}/{prompt_tokens}"
            )
        if output_tokens < 1:
            raise WorkerModelError(f"output_tokens must be >= 1, got {output_tokens}")
        self._run_until(now)
        uncached = prompt_tokens - cached_vram - cached_dram
        request = _Request(
            request_id, prompt_tokens, uncached, cached_dram, output_tokens, now,
            self.timing.prefill_ms(uncached, cached_dram) / 1000.0,
        )
        self._ids.add(request_id)
        self._waiting.append(request)
        self._queued_uncached += uncached
        self._run_until(now)
        if self._shadow is not None:
            if self._needs_run_ahead():
                self._shadow._admit_ahead(request, now=now)
            else:
                self._shadow = None  # a slot is free: queue_ms needs no look-ahead

    def abort(self, request_id: str, *, now: float) -> bool:
        """The request's client went away at ``now`` (SGLang aborts it): it leaves the queue,
        its slot or the GPU and reports no more events. Returns whether it was still in the
        model (False once it finished)."""
        self._run_until(now)
        if request_id not in self._ids:
            return False
        self._ids.discard(request_id)
        self._shadow = None  # its run-ahead held the request
        self._head_blocked = False
        self._outbox = [e for e in self._outbox if e.request_id != request_id]
        for queue in (self._waiting, self._admitted):
            request = next((r for r in queue if r.request_id == request_id), None)
            if request is not None:
                queue.remove(request)
                self._queued_uncached -= request.uncached
                return True
        if self._prefill is not None and self._prefill.request.request_id == request_id:
            self._prefill = None
        elif self._decoding.pop(request_id, None) is not None:
            self._fewest_left = None
        self._run_until(now)  # the freed slot or GPU goes to the next request at once
        return True

    def advance(self, *, now: float) -> list[WorkerEvent]:
        """Run the model up to ``now``; return the events that happened, in time order."""
        self._run_until(now)
        out, self._outbox = self._outbox, []
        return out

    # ------------------------------------------------------------------------------ queries

    @property
    def now(self) -> float:
        return self._now

    @property
    def running(self) -> int:
        """Requests holding a slot (prefill pending, in prefill, or decoding)."""
        return len(self._admitted) + (self._prefill is not None) + len(self._decoding)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def decoding(self) -> int:
        return len(self._decoding)

    @property
    def head_blocked(self) -> bool:
        """The head of the queue waits for VRAM room (a running request's finish)."""
        return self._head_blocked

    @property
    def pending_prefill_tokens(self) -> int:
        """Uncached prompt tokens not yet prefilled (queued, admitted, and the rest of the
        current prefill)."""
        total = self._queued_uncached
        if self._prefill is not None:
            span = self._prefill.ends - self._prefill.started
            left = 1.0 if span <= 0 else max(0.0, (self._prefill.ends - self._now) / span)
            total += math.ceil(self._prefill.request.uncached * left)
        return total

    def next_event_time(self) -> float | None:
        """When the next state change is due, or ``now`` while events await :meth:`advance`
        (None when idle)."""
        if self._outbox:
            return self._now
        if self._prefill is not None:
            return self._prefill.ends
        if (self._admitted and not self._head_blocked) or (self._waiting and self.running < self.timing.max_running):
            return self._now
        if self._decoding:
            return self._now + self._fewest_remaining() * self._step_s()
        return None

    def queue_ms(self, *, now: float) -> float:
        """Exact wait before a request arriving at ``now`` would start its prefill, assuming
        no later arrivals. With a free slot that is the prefill backlog (prefills are serial
        and go first). With all slots taken it is read off the shadow: a copy of this model run
        ahead until every request it holds has a slot. The model is deterministic and arrivals
        only join the back of the queue, so the shadow stays exact as it is extended by each
        arrival (one slot release's work, as the model itself will do later) and a read costs
        O(slots), not a replay of the backlog (O(queue x batch)).

        With a ``footprint`` the wait for VRAM room counts too: a head whose KV does not fit
        beside the running requests' blocks those behind it until enough of them finish (SGLang's
        ``PrefillAdder``), so while prefills are pending the shadow runs ahead until every one
        has started, admitting each only when its pages fit. The arrival the answer is for is
        taken to need no new pages (as it is taken to be fully cached): a report is one figure
        for every prompt; a long one may wait longer."""
        self._run_until(now)
        if not self._needs_run_ahead():
            self._shadow = None
            return 1000.0 * self._prefill_backlog_s()
        if self._shadow is None:
            self._shadow = self._copy()
            self._shadow._admit_all()
        return 1000.0 * (self._shadow._next_slot_first_token(now) - now)

    def room_steps(self, *, now: float, enough_pages: int | None = None) -> tuple[tuple[float, int], ...]:
        """When VRAM pages free up, for an arrival at ``now`` whose prompt needs new pages
        (``queue_ms`` takes it to need none): ``(ms from now, free pages from then on)`` pairs,
        both increasing, the first at 0 ms; empty when nothing is running or queued (every page
        free). A prompt needing ``n`` new pages can start its prefill at the first step with at
        least ``n`` free (at the last when none has: it then runs alone), and not before
        ``queue_ms``.

        ``enough_pages``: the pages the longest prompt the worker can be sent needs (the
        model's context). While at least that many are free now (and so at every later step),
        no prompt waits for room here, and the answer is empty too, as if nothing were pinned:
        every reader (``QueueEstimates.room_wait_ms``, the room floor, room broadcasts) then
        answers 0 for every prompt, as the steps would have. A worker whose VRAM is far from full
        (the common case: the pages of a few running requests against a context's worth) is
        settled by the sum of its holders' path lengths, with no union taken.

        Every request the worker holds (running, in prefill, admitted or waiting for a slot)
        pins its pages until its last token, the queued ones ahead of the arrival as they will:
        counted from now. Decoding resumes once the prefill backlog (the queued ones' too) is
        done, and the requests finish in order of the tokens they have left, at the decode step
        of the batch that remains. An estimate from the current state, no run-ahead: the
        decode batch's step is taken to shrink only as its requests finish."""
        if self._footprint is None:
            raise WorkerModelError("room_steps needs a footprint (the pages each request pins)")
        self._run_until(now)
        pending = ([self._prefill.request] if self._prefill is not None else []) + [*self._admitted, *self._waiting]
        holders = [(r.remaining, r.request_id) for r in self._decoding.values()]
        holders += [(float(max(0, r.output_tokens - 1)), r.request_id) for r in pending]
        if not holders:
            return ()
        capacity = self._vram_pages
        holders.sort()
        footprint = self._footprint
        paths = [footprint(request_id)[:capacity] for _, request_id in holders]
        if enough_pages is not None and capacity - sum(map(len, paths)) >= enough_pages:
            return ()  # (the union is no larger than the paths' sum)
        # pinned_by[k]: the pages holders[k:] pin together, built from the last to finish
        # backwards. A page id names its root path (``Footprint``), so the union of the paths
        # is the set of their ids: one C-level set update per path (keeping the paths sorted,
        # as ``PinnedPaths`` does for the run-ahead's removals, cost 1.6x more on captured paths).
        # (a path past capacity runs alone and pins all of it: ``paths`` holds capacity's worth)
        pinned = set()
        pin = pinned.update
        pinned_by = [0] * (len(holders) + 1)
        for k in range(len(holders) - 1, -1, -1):
            pin(paths[k])
            pinned_by[k] = len(pinned)
        if enough_pages is not None and capacity - pinned_by[0] >= enough_pages:
            return ()
        steps = [(0.0, max(0, capacity - pinned_by[0]))]
        at = self._prefill_backlog_s() + sum(r.prefill_s for r in self._waiting)  # seconds from now
        decoded, batch = 0.0, len(holders)
        for k, (remaining, _) in enumerate(holders, 1):
            at += (remaining - decoded) * self.timing.decode_step_ms(batch) / 1000.0
            decoded, batch = remaining, batch - 1
            free = capacity - pinned_by[k]
            if free > steps[-1][1]:
                steps.append((1000.0 * at, free))
        return tuple(steps)

    def _needs_run_ahead(self) -> bool:
        """Whether the wait of a new arrival depends on more than the prefill backlog: requests
        wait for a slot, or (VRAM room counted) a pending prefill may have to wait for room."""
        return (bool(self._waiting) or self.running >= self.timing.max_running
                or (self._footprint is not None and bool(self._admitted)))

    def _prefill_backlog_s(self) -> float:
        """Seconds of prefill the GPU must run before it decodes again."""
        backlog = sum(r.prefill_s for r in self._admitted)
        if self._prefill is not None:
            backlog += self._prefill.ends - self._now
        return backlog

    # ------------------------------------------------------------------------------ shadow

    def _admit_ahead(self, request: _Request, *, now: float) -> None:
        """The shadow's side of an arrival at ``now``: the request joins the back of the queue;
        run ahead until it has a slot. The shadow may already be past ``now`` (its last request
        gets a slot later than ``now``); then the arrival waits behind it, as in the model."""
        self._answer = None
        if self._now < now:
            self._run_until(now)
        clone = request.copy()
        self._waiting.append(clone)
        self._queued_uncached += clone.uncached
        self._admit_all()

    def _admit_all(self) -> None:
        """Run until the waiting queue is empty (and, counting VRAM room, until every pending
        prefill has started); the events are the model's to report, not ours."""
        while self._waiting or (self._pinned is not None and self._admitted):
            self._outbox.clear()  # (pending events would make next_event_time say "now")
            due = self.next_event_time()
            assert due is not None, "a full worker always has a next event"
            self._run_until(due)
        self._outbox.clear()

    def _next_slot_first_token(self, now: float) -> float:
        """On a shadow (nobody waiting): when a request arriving at ``now`` would produce its
        first token if its prompt were fully cached, i.e. when its prefill could start."""
        if self._now < now:
            self._run_until(now)
            self._outbox.clear()
            self._answer = None
        if self._answer is None:  # (the answer is a time: it holds until the shadow moves)
            self._answer = self._first_token_after_next_release()
        return self._answer

    def _first_token_after_next_release(self) -> float:
        start = self._now + self._prefill_backlog_s()
        if self.running < self.timing.max_running:
            return start
        pending = list(self._admitted)
        if self._prefill is not None:
            pending.append(self._prefill.request)
        if any(r.output_tokens <= 1 for r in pending):
            return start  # that one frees its slot at its prefill's end, ahead of our turn
        # Prefill-first: decoding resumes once every pending prefill is done, with them in the
        # batch; the first slot frees when the request with the fewest tokens left finishes.
        fewest = min([r.output_tokens - 1 for r in pending], default=math.inf)
        if self._decoding:
            fewest = min(fewest, self._fewest_remaining())
        batch = len(self._decoding) + len(pending)
        return start + fewest * self.timing.decode_step_ms(batch) / 1000.0

    def _copy(self) -> WorkerQueueModel:
        clone = WorkerQueueModel.__new__(WorkerQueueModel)
        clone.timing = self.timing
        clone._now = self._now
        copies = {id(r): r.copy()
                  for r in [*self._waiting, *self._admitted, *self._decoding.values()]
                  + ([self._prefill.request] if self._prefill else [])}
        clone._waiting = deque(copies[id(r)] for r in self._waiting)
        clone._admitted = deque(copies[id(r)] for r in self._admitted)
        clone._queued_uncached = self._queued_uncached
        clone._prefill = (None if self._prefill is None else
                          _Prefill(copies[id(self._prefill.request)], self._prefill.started, self._prefill.ends))
        clone._decoding = {k: copies[id(r)] for k, r in self._decoding.items()}
        clone._fewest_left = self._fewest_left
        clone._ids = set(self._ids)
        clone._outbox = []
        clone.completed = self.completed
        clone._shadow = None
        clone._answer = None
        clone._prefill_starts = clone._prefill_ends = clone._finished = None  # a run-ahead keeps the estimates
        clone._head_blocked = False
        clone._footprint = self._footprint
        clone._vram_pages = self._vram_pages
        clone._pinned = None
        if self._footprint is not None:
            # The running requests' pages as the cache pins them (the one in prefill: all of its
            # prompt's, as it will once computed); the head's fit is then checked again.
            clone._pinned = PinnedPaths(self._vram_pages)
            for request in [*clone._decoding.values()] + ([clone._prefill.request] if clone._prefill else []):
                clone._pinned.add(request.request_id, clone._pages_of(request, fresh=True))
        return clone

    def _pages_of(self, request: _Request, *, fresh: bool = False) -> tuple[int, ...]:
        """On a run-ahead: the page path ``request`` pins while it runs (asked once; ``fresh``:
        ask again, a running request's lease may have grown)."""
        if request.pages is None or fresh:
            request.pages = tuple(self._footprint(request.request_id))
        return request.pages

    # ------------------------------------------------------------------------------ engine

    def _step_s(self) -> float:
        return self.timing.decode_step_ms(len(self._decoding)) / 1000.0

    def _run_until(self, t: float) -> None:
        if t < self._now - 1e-9:
            raise WorkerModelError(f"time went backwards: {t} < {self._now}")
        t = max(t, self._now)
        while True:
            while self._waiting and self.running < self.timing.max_running:
                self._admitted.append(self._waiting.popleft())
            if self._prefill is None and self._admitted and not self._head_blocked:
                request = self._admitted[0]
                estimate = request.uncached
                if self._prefill_starts is not None and not self._match_at_start(request):
                    self._head_blocked = True  # until a request finishes (_finish)
                elif self._pinned is not None and not self._pinned.fits(self._pages_of(request)):
                    self._head_blocked = True  # (a run-ahead's own check, as the cache's)
                else:
                    if self._pinned is not None:
                        self._pinned.add(request.request_id, self._pages_of(request))
                    self._admitted.popleft()
                    self._queued_uncached -= estimate
                    self._prefill = _Prefill(request, self._now, self._now + request.prefill_s)
            if self._prefill is not None:
                if self._prefill.ends > t:
                    self._now = t  # decoding is paused while the GPU prefills
                    return
                self._now = self._prefill.ends
                self._finish_prefill()
                continue
            if not self._decoding:
                self._now = t
                return
            step = self._step_s()
            soonest = self._fewest_remaining()
            due = self._now + soonest * step
            if due > t:
                self._progress((t - self._now) / step)
                self._now = t
                return
            done, fewest_left = self._progress(soonest)
            self._now = due
            # Only the finished ones, in arrival order (a stable sort of the subset keeps the
            # order sorting all of them would give it).
            done.sort(key=_by_arrival)
            for request in done:
                self._finish(request)
            self._fewest_left = fewest_left

    def _match_at_start(self, request: _Request) -> bool:
        """Ask the cache what ``request`` reuses now that its prefill is due to start; a figure
        that differs from the arrival estimate makes the run-ahead shadow stale. False: no room
        for it yet (it stays at the head)."""
        answer = self._prefill_starts(request.request_id, self._now)
        if answer is None:
            self._shadow = None
            return False
        vram, dram = answer
        if min(vram, dram) < 0 or vram + dram > request.prompt_tokens:
            raise WorkerModelError(
                f"need 0 <= cached_vram + cached_dram <= prompt_tokens at the prefill's start, "
                f"got {vram}+{dram}/{request.prompt_tokens}")
        uncached = request.prompt_tokens - vram - dram
        if uncached != request.uncached or dram != request.dram:
            request.uncached, request.dram = uncached, dram
            request.prefill_s = self.timing.prefill_ms(uncached, dram) / 1000.0
            self._shadow = None
        return True

    def _fewest_remaining(self) -> float:
        """min(remaining) over the decode batch (which is not empty)."""
        fewest = self._fewest_left
        if fewest is None:
            # Only the value matters, not which request: a plain float min is several times
            # cheaper than min(key=...) over the decode batch.
            fewest = self._fewest_left = min([r.remaining for r in self._decoding.values()])
        return fewest

    def _progress(self, tokens: float) -> tuple[list[_Request], float | None]:
        """Decode ``tokens`` more for every request in the batch. Returns those now finished
        and the fewest tokens left among the others (None if none)."""
        done = []
        rest = math.inf  # the fewest left among those not finished
        for request in self._decoding.values():
            left = request.remaining - tokens
            if left > 1e-9:
                request.remaining = left
                if left < rest:
                    rest = left
            else:
                request.remaining = left if left > 0.0 else 0.0  # max(0.0, left), without the call
                done.append(request)
        fewest = None if rest == math.inf else rest
        # While the finished ones are still in the batch their 0 is the minimum (recounted).
        self._fewest_left = None if done else fewest
        return done, fewest

    def _finish_prefill(self) -> None:
        assert self._prefill is not None
        request = self._prefill.request
        self._prefill = None
        request.first_token_at = self._now
        if self._prefill_ends is not None:
            self._prefill_ends(request.request_id, self._now)
        self._outbox.append(FirstTokenProduced(request.request_id, self._now))
        if request.output_tokens <= 1:
            self._finish(request)
        else:
            request.remaining = float(request.output_tokens - 1)
            self._decoding[request.request_id] = request
            if self._fewest_left is not None and request.remaining < self._fewest_left:
                self._fewest_left = request.remaining

    def _finish(self, request: _Request) -> None:
        if self._decoding.pop(request.request_id, None) is not None:
            self._fewest_left = None  # the caller that knows the rest's minimum sets it back
        self._ids.discard(request.request_id)
        self.completed += 1
        self._head_blocked = False  # its KV is released: the head may fit now
        if self._pinned is not None:
            self._pinned.discard(request.request_id)
        if self._finished is not None:
            self._finished(request.request_id, self._now)
        self._outbox.append(RequestFinished(request.request_id, self._now))
