"""Prefixes an edge has just sent to workers, credited until its index view shows them (sans-IO).

A worker's new cache reaches the edge's view only after its registration has travelled to the
owning maintenance shard and the shard's batch back to the edge; on a fleet whose shards sit in
other continents that is two WAN crossings (testbed: 250-320 ms). A follow-up turn that comes
sooner finds nothing in the view and is recomputed wherever the score sends it. The edge knows
where it sent the previous turn, so it credits that worker with the prompt's indexed lengths,
in VRAM, until the view catches up (production routers keep the same ledger of their own
routing: Dynamo's approximate KV indexer, SGLang's cache-aware router tree).

Entries are the prefix keys of the lengths the worker will register (its group's lengths
toward the edge's region, up to the prompt) beyond what the view already showed at dispatch.
An entry is credited from ``starts_at``, the edge's estimate of when the worker starts computing
the prompt (the queue it scored ahead of it), until ``hold_s`` after ``ready_at``, when it has
computed it (that queue plus the prefill it charged). A worker prefills in admission order and
matches a request's prefix when its prefill starts (SGLang's and vLLM's schedulers, the
simulator's and the emulator's worker model), so a request sent there once the prompt's prefill
has started waits for it and finds it; the score charges that wait through the worker's queue.
Crediting only from ``ready_at`` sent such a request elsewhere to compute the prefix again: on
census-64x8's long-context sessions, a 125 K-token document whose prefill ended 30 ms after the
next request for it arrived was computed a second time in another region (issue 28). Before
the prefill starts the credit is not given: other requests may be admitted between the two and
evict the prefix. The credit ends early when a lookup finds the view holding that length for
that worker (from then on the index is authoritative, evictions included); ``hold_s`` after
``ready_at`` covers a worker that never cached it (a failed request, a full cache).
A dispatch noted with its id is credited from the moment the edge sees its first token come back
(``mark_ready``: the worker has computed the prompt), when that is sooner than the estimate: on a
worker faster than its configured rate the estimate is too late, and a follow-up inside it went
elsewhere.

What the edge sees of the responses corrects the ledger:
- with ``refute_misses`` (``[score] pending_refute``, on by default), a response that reused
  fewer tokens than its worker was credited with (``refute``) ends that worker's credits for the
  prompt's lengths beyond what it reused, those that started before the request was sent: the
  worker did not hold them when the request got there (evicted, or never cached: a cache full of
  running requests' pages cannot insert), and crediting them on for the hold sent the group's
  next requests to the same miss (issue 30.8). A prompt the worker computes and caches again
  comes back through its registration in the view;
- with ``from_first_token`` (``[score] pending_from_first_token``, off by default), a dispatch
  noted with its id is credited from its first token and never from the estimate. That suits a
  worker that matches a prompt when it arrives, where a follow-up sent while the prompt is still
  being computed misses; SGLang and vLLM match when they schedule a request, after the prefill
  ahead of it, so there the follow-up hits (as in the simulator's and the emulator's worker model).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque

import numpy as np

from .events import Tier

__all__ = ["MAX_OPEN_DISPATCHES", "PendingHoldings", "PendingHoldingsError"]

_VRAM = int(Tier.VRAM)
_NOT_YET = math.inf  # the ready time of a dispatch awaiting its first token
# Dispatches tracked between their send and their end: each ends with a first token, a
# response or a failure, so this only bounds memory if a shell never reports one.
MAX_OPEN_DISPATCHES = 1 << 14


class PendingHoldingsError(ValueError):
    """Bad arguments to the pending-holdings ledger."""


class PendingHoldings:
    """The edge's ledger of prefixes sent to workers and not yet seen in its view.

    ``group_lengths`` is the lookup's (groups x levels) matrix of lengths read toward each
    worker group (0 pads), ``query_lengths`` the ascending lengths the keys are computed at, and
    ``worker_group`` each worker's group: together they say which of a prompt's keys a worker
    registers where this edge reads them.

    A key names one prefix at one length, so it is credited at the query length where the
    request has it. Each key keeps only its latest dispatch: a prefix sent to two workers
    before the view showed either is credited to the later one (one holder is enough for the
    score to weigh; the view will show both soon).
    """

    def __init__(self, group_lengths: np.ndarray, query_lengths: np.ndarray, worker_group: np.ndarray, *,
                 hold_s: float, from_first_token: bool = False, refute_misses: bool = False,
                 max_open: int = MAX_OPEN_DISPATCHES) -> None:
        if isinstance(hold_s, bool) or not isinstance(hold_s, (int, float)) or not (math.isfinite(hold_s)
                                                                                     and hold_s > 0):
            raise PendingHoldingsError(f"hold_s must be a finite number > 0, got {hold_s!r}")
        for name, flag in (("from_first_token", from_first_token), ("refute_misses", refute_misses)):
            if not isinstance(flag, bool):
                raise PendingHoldingsError(f"{name} must be true or false, got {flag!r}")
        if isinstance(max_open, bool) or not isinstance(max_open, int) or max_open < 1:
            raise PendingHoldingsError(f"max_open must be an int >= 1, got {max_open!r}")
        self.hold_s = float(hold_s)
        self.from_first_token = from_first_token
        self.refute_misses = refute_misses
        self._max_open = max_open
        self._query = [int(n) for n in query_lengths]
        position = {n: i for i, n in enumerate(self._query)}
        # Per group: (length, index of its key among the query keys), ascending.
        group_reads = tuple(tuple((int(n), position[int(n)]) for n in row if n > 0) for row in np.asarray(group_lengths))
        # Per worker, its group's lengths and their key indexes as two lists, so that note_sent
        # finds the lengths in (shown, prompt_len] by bisection rather than a pass over them all.
        split = tuple(([n for n, _ in reads], [at for _, at in reads]) for reads in group_reads)
        if any(lengths != sorted(set(lengths)) for lengths, _ in split):
            raise PendingHoldingsError("each group's lengths must ascend (0 pads at the end)")
        self._worker_lengths = tuple(split[g] for g in np.asarray(worker_group).tolist())
        # key -> its latest dispatch, a record (worker, credited from, expires, keys, dispatch id or
        # None) shared by all the keys it noted; records in dispatch order, for purging; records
        # by dispatch id until marked ready. (Few objects per dispatch: the ledger runs once per
        # request, and garbage it leaves costs collector pauses.)
        self._by_key: dict[int, tuple[int, float, float, list[int], int | None]] = {}
        self._records: deque[tuple[int, float, float, list[int], int | None]] = deque()
        self._by_dispatch: dict[int, tuple[int, float, float, list[int], int | None]] = {}
        # With refute_misses: dispatch -> (worker, sent at, [(length, key)] of the lengths it
        # was credited with), for ``refute`` when its response comes back.
        self._claims: dict[int, tuple[int, float, list[tuple[int, int]]]] = {}
        self.refuted = 0  # credits ended by a response that reused less (for metrics and tests)

    def __len__(self) -> int:
        """Keys held (expired ones included until purged)."""
        return len(self._by_key)

    def held_by(self, worker: int) -> int:
        """How many keys ``worker`` is credited with (expired ones included until purged)."""
        return sum(record[0] == worker for record in self._by_key.values())

    def note_sent(self, worker: int, keys: np.ndarray, prompt_len: int, shown: int, *, ready_at: float,
                  now: float, dispatch: int | None = None, starts_at: float | None = None) -> int:
        """Record that ``worker`` will hold the prompt whose query keys are ``keys``: credited from
        ``starts_at`` (its prefill's estimated start; default ``ready_at``) until ``hold_s`` after
        ``ready_at`` (its estimated end).

        ``shown`` is the match the worker was credited with at the decision (its view's, raised
        by this ledger); only longer lengths are noted. ``dispatch`` names the request for
        ``mark_ready`` and ``refute``; with ``from_first_token`` its lengths are credited only
        from ``mark_ready`` (``ready_at`` is then unused). Returns how many lengths were noted.
        """
        if not ready_at >= now:
            raise PendingHoldingsError(f"ready_at must be >= now, got {ready_at!r} < {now!r}")
        if starts_at is None:
            starts_at = ready_at
        elif not now <= starts_at <= ready_at:
            raise PendingHoldingsError(f"starts_at must be within [now, ready_at], got {starts_at!r} "
                                       f"outside [{now!r}, {ready_at!r}]")
        self._purge(now)
        lengths, ats = self._worker_lengths[worker]  # ascending
        awaiting = self.from_first_token and dispatch is not None
        above_shown = bisect_right(lengths, shown)
        if self.refute_misses and dispatch is not None and shown > 0:
            self._open(self._claims, dispatch, (worker, now, [(lengths[i], keys.item(ats[i]))
                                                              for i in range(above_shown)]))
        noted = [keys.item(at) for at in ats[above_shown:bisect_right(lengths, prompt_len)]]  # (shown, prompt_len]
        if noted:
            if awaiting:
                # Credited from the first token only; kept out of the purge order until then.
                record = (worker, _NOT_YET, _NOT_YET, noted, dispatch)
                self._open(self._by_dispatch, dispatch, record)
            else:
                record = (worker, starts_at, ready_at + self.hold_s, noted, dispatch)
                self._records.append(record)
                if dispatch is not None and starts_at > now:
                    self._by_dispatch[dispatch] = record
            by_key = self._by_key
            for key in noted:
                by_key[key] = record
        return len(noted)

    def _open(self, table: dict, dispatch: int, entry: tuple) -> None:
        if len(table) >= self._max_open:  # a shell that never reported these: forget the oldest
            oldest = next(iter(table))
            stale = table.pop(oldest)
            if table is self._by_dispatch:
                self._release(stale)
        table[dispatch] = entry

    def _release(self, record: tuple) -> None:
        """Drop the keys a dispatch awaiting its first token still owns (it will not get one)."""
        if record[1] == _NOT_YET:
            by_key = self._by_key
            for key in record[3]:
                if by_key.get(key) is record:
                    del by_key[key]

    def mark_ready(self, dispatch: int, *, now: float) -> bool:
        """The dispatch's first token came back: its worker holds the prompt from ``now`` if
        that is sooner than the estimate. Returns whether its keys were moved earlier."""
        record = self._by_dispatch.pop(dispatch, None)
        if record is None or record[1] <= now:
            return False
        earlier = (record[0], now, now + self.hold_s, record[3], None)
        by_key, moved = self._by_key, False
        for key in record[3]:
            if by_key.get(key) is record:  # not since sent again (a later dispatch owns it)
                by_key[key] = earlier
                moved = True
        if moved:
            self._records.append(earlier)
        return moved

    def refute(self, dispatch: int, reused_tokens: int) -> int:
        """The dispatch's response says its worker reused ``reused_tokens`` of the prompt: end
        the worker's credits beyond that which started before the dispatch was sent (it did not
        hold them when the request arrived). Ends the dispatch's tracking; returns how many
        credits ended. A no-op without ``refute_misses`` or for a dispatch not credited."""
        claim = self._claims.pop(dispatch, None)
        self._release_dispatch(dispatch)
        if claim is None:
            return 0
        worker, sent_at, credited = claim
        by_key, ended = self._by_key, 0
        for length, key in credited:
            if length <= reused_tokens:
                continue
            record = by_key.get(key)
            if record is not None and record[0] == worker and record[1] <= sent_at:
                del by_key[key]
                ended += 1
        self.refuted += ended
        return ended

    def drop_dispatch(self, dispatch: int) -> None:
        """Forget a dispatch's id (it ended; ``forget`` drops the keys of a worker that failed
        it). A dispatch still awaiting its first token will not be credited."""
        self._claims.pop(dispatch, None)
        self._release_dispatch(dispatch)

    def _release_dispatch(self, dispatch: int) -> None:
        record = self._by_dispatch.pop(dispatch, None)
        if record is not None:
            self._release(record)

    def holds_any(self, keys: list[int], *, now: float) -> bool:
        """Whether any of ``keys`` is held (expired ones purged first): ``overlay`` over them
        changes nothing, and returns None, otherwise."""
        self._purge(now)
        return not self._by_key.keys().isdisjoint(keys)

    def overlay(self, keys: list[int], matched: np.ndarray, tier: np.ndarray, *, now: float,
                read_only: bool = False) -> np.ndarray | None:
        """Raise ``matched``/``tier`` (in place) to the pending holdings among ``keys``.

        ``keys`` are the request's query keys (those that fit the prompt, in query-length
        order). Entries the view already shows (its match for that worker reaches the length)
        end here, unless ``read_only`` (an inspection changes nothing). Returns the view's
        matches as they were (a copy) when any worker's match was raised, else None.
        """
        if not read_only:
            self._purge(now)
        by_key = self._by_key
        if by_key.keys().isdisjoint(keys):
            return None
        # The matches as Python ints, read once (a numpy scalar read per key was most of the
        # ledger's cost per decision); the arrays are written only where a match is raised.
        view_matches = matched.tolist()
        current = view_matches.copy()
        shown = None
        query = self._query
        for at, key in enumerate(keys):
            record = by_key.get(key)
            if record is None:
                continue
            worker = record[0]
            if record[2] <= now or record[1] > now:  # expired, or not ready yet
                continue
            length = query[at]
            if view_matches[worker] >= length:
                if not read_only:
                    del by_key[key]  # the view has it: the index speaks from here on
            elif length > current[worker]:
                if shown is None:
                    shown = matched.copy()
                current[worker] = length
                matched[worker] = length
                tier[worker] = _VRAM
        return shown

    def forget(self, worker: int) -> int:
        """Drop every key credited to ``worker`` (it failed the request: it will not hold the prompt).

        Returns how many were dropped.
        """
        by_key = self._by_key
        dropped = [key for key, record in by_key.items() if record[0] == worker]
        for key in dropped:
            del by_key[key]
        for dispatch in [d for d, record in self._by_dispatch.items() if record[0] == worker]:
            del self._by_dispatch[dispatch]
        for dispatch in [d for d, claim in self._claims.items() if claim[0] == worker]:
            del self._claims[dispatch]
        return len(dropped)

    def _purge(self, now: float) -> None:
        # Records leave in dispatch order once expired; one that expires later than its
        # successors (a longer queue ahead of it) holds them back a little, which costs only
        # memory: expired keys are never credited.
        records, by_key = self._records, self._by_key
        while records and records[0][2] <= now:
            record = records.popleft()
            for key in record[3]:
                if by_key.get(key) is record:
                    del by_key[key]
            if record[4] is not None and self._by_dispatch.get(record[4]) is record:
                del self._by_dispatch[record[4]]
