"""The edge's per-request hot path in C (``ludo_c/ludo_plan.c``), from Python; hides cffi.

``LookupPlan`` is an edge's multi-level lookup compiled once into flat arrays (per group: its
lengths and the index of each length among the query lengths; per worker: group and field shift),
so one request is one C call over every (shard, group) view: ``run(views, keys)`` returns each
worker's matched length and tier, exactly as ``PrefixLookup``'s Python reference path does.

``ViewPointers`` keeps the C array of view pointers in step with an ``EdgeIndexView``: a shard's
views are replaced (as a whole dict) when a snapshot is installed, so checking the identity of
each shard's dict per request is enough to know when to rebuild it. Batches change views in place
and need nothing.

``ScoreKernel`` is the joint score's C loop (``JointScorer`` uses it for the common dtypes),
``MissSummary`` tells the Router what a decision means to the hot-prefix detector, and
``slot_constructor`` builds the per-request frozen dataclasses cheaply.

``top_k`` picks a decision's best few workers and ``QueueAging`` carries an edge's queue
estimates to ``now``, each one C loop over the workers (the Python they replace cost more than
the rest of a decision at 10,000 workers).

``ForwardKernel`` fuses a whole decision into one C call (``ludo_c/kvc_forward.c``): the prefix
keys at the query lengths, a ``LookupPlan``'s reads, a ``ScoreKernel``'s score, the tie rotation
and a ``MissSummary``, each the same C function its own wrapper calls; the Router drives it.

None of these objects is thread-safe (a plan and a kernel reuse scratch buffers, and cffi releases
the GIL inside the C calls): use them, and the views they read, from one thread. The view
pointers come from ``LudoView._ptr``, the wrapper's cffi handle (the C API takes ``kvc_view *``).
"""

from __future__ import annotations

import math
import sys
from dataclasses import fields
from operator import attrgetter, is_ as _is
from typing import Any, Callable

import numpy as np

from kvcompassd.core._ludo_cffi import ffi, lib

__all__ = ["DecisionArrays", "ForwardKernel", "SCORE_BLOCK", "ScoreBlocks", "SparseForwardKernel", "LookupPlan", "LookupPlanError", "MissSummary", "QueueAging", "ScoreKernel",
           "ViewPointers", "slot_constructor", "top_k", "MISS_LOCAL_HOLDER", "MISS_LOST_TO_LOAD", "MISS_REMOTE_WORTH", "SCORE_CROSS_REGION",
           "SCORE_LOAD_AWARE", "SCORE_TIER_AWARE"]

SCORE_LOAD_AWARE = int(lib.KVC_SCORE_LOAD_AWARE)
SCORE_TIER_AWARE = int(lib.KVC_SCORE_TIER_AWARE)
SCORE_CROSS_REGION = int(lib.KVC_SCORE_CROSS_REGION)
MISS_LOCAL_HOLDER = int(lib.KVC_MISS_LOCAL_HOLDER)
MISS_LOST_TO_LOAD = int(lib.KVC_MISS_LOST_TO_LOAD)
MISS_REMOTE_WORTH = int(lib.KVC_MISS_REMOTE_WORTH)

# Fleets of at most this many workers have their per-decision checks and learned rates worked
# out in Python (an edge's region: numpy's per-call cost is most of the work there), larger
# ones in numpy.
SMALL_FLEET = 16

_from_buffer = ffi.from_buffer
_lookup_plan = lib.kvc_lookup_plan
_score_choose = lib.kvc_score_choose
_miss_summary = lib.kvc_miss_summary
_forward_decide = lib.kvc_forward_decide
_forward_decide_sparse = lib.kvc_forward_decide_sparse
_forward_decide_sparse_aged = lib.kvc_forward_decide_sparse_aged
_forward_decide_sparse_out = lib.kvc_forward_decide_sparse_out
_queue_aged = lib.kvc_queue_aged
_top_k = lib.kvc_top_k
_NONE_ELIGIBLE = int(lib.KVC_FORWARD_NONE_ELIGIBLE)
_NULL = ffi.NULL
_empty = np.empty
_refcount = sys.getrefcount
# References to a ring buffer that only the ring holds, as _refcount counts them in out_buffer
# (the ring's slot, the local name, the call's argument).
_RING_ONLY = 3
# run_out's ring: at most this many buffers, and this many bytes of them.
_OUT_RING = 4
_OUT_RING_BYTES = 32 << 20
_int64 = np.int64
_uint8 = np.uint8
_float64 = np.float64
_I64, _F64 = np.dtype(np.int64), np.dtype(np.float64)
_views_of = attrgetter("views")


class LookupPlanError(ValueError):
    """A lookup plan's arrays do not describe a valid layout, or its inputs do not match it."""


class ViewPointers:
    """C pointers to every (shard, group) view of an ``EdgeIndexView``, kept current.

    ``pointers()`` returns the ``kvc_view *[shards * groups]`` array (NULL where a shard has no
    view of a group yet). It also keeps the ``LudoView`` objects alive, so a pointer never
    outlives its view even if the edge replaces it.
    """

    __slots__ = ("_state", "_groups", "_dicts", "_views", "_array", "_changes", "_seen")

    def __init__(self, view: Any, groups: int) -> None:
        self._state = view.state
        self._groups = groups
        self._dicts: list[object] = [None] * len(self._state)
        self._views: list[object] = []
        self._array = ffi.new("kvc_view *[]", max(1, len(self._state) * groups))
        # States that count their replaced dicts in one shared counter (index.ShardViewState):
        # one comparison per call instead of one identity test per shard (48,000 instructions
        # a decision at 100 shards). Otherwise, the identity tests.
        counters = {id(c): c for c in (getattr(st, "changes", None) for st in self._state)}
        self._changes: list[int] | None = None
        if len(counters) == 1 and None not in counters.values():
            self._changes = next(iter(counters.values()))
        self._seen = -1

    def pointers(self) -> Any:
        changes = self._changes
        if changes is not None:
            if changes[0] != self._seen:
                self._seen = changes[0]
                if not all(map(_is, map(_views_of, self._state), self._dicts)):
                    self._rebuild()
            return self._array
        # One identity test per shard, iterated in C (a Python loop cost µs per decision at 100 shards).
        if not all(map(_is, map(_views_of, self._state), self._dicts)):
            self._rebuild()
        return self._array

    def hand_over(self) -> tuple[Any, int]:
        """The array and its groups per shard, for a caller that keeps every slot current from
        now on (the simulator's shared table versions, ``kvc_versions.h``): the states' dicts as
        they are now count as read, so ``pointers()`` rebuilds only if one is replaced."""
        self._dicts = [st.views for st in self._state]
        if self._changes is not None:
            self._seen = self._changes[0]
        return self._array, self._groups

    def _rebuild(self) -> None:
        groups, array = self._groups, self._array
        views = []
        for s, st in enumerate(self._state):
            current = st.views
            self._dicts[s] = current
            for g in range(groups):
                v = current.get(g)
                array[s * groups + g] = ffi.NULL if v is None else v._ptr
                if v is not None:
                    views.append(v)
        self._views = views


class LookupPlan:
    """One edge's lookup: per group its lengths (ascending, 0 pads) and per worker its field.

    ``group_lengths`` (groups x max_levels, int64), ``query_lengths`` (the sorted union of the
    non-zero lengths), ``worker_group`` and ``worker_shift`` (per worker, as ``IndexLayout``).
    """

    __slots__ = ("shards", "groups", "max_levels", "workers", "consistency", "_lengths", "_key_index",
                 "_worker_group", "_worker_shift", "_values", "_c")

    def __init__(self, group_lengths: np.ndarray, query_lengths: np.ndarray, worker_group: np.ndarray,
                 worker_shift: np.ndarray, *, shards: int, consistency: bool) -> None:
        lengths = np.ascontiguousarray(group_lengths, dtype=np.int64)
        if lengths.ndim != 2:
            raise LookupPlanError(f"group_lengths must be 2-D, got shape {lengths.shape}")
        query = [int(n) for n in np.asarray(query_lengths).tolist()]
        if query != sorted(set(query)) or any(n <= 0 for n in query):
            raise LookupPlanError("query_lengths must be strictly ascending positive lengths")
        position = {n: i for i, n in enumerate(query)}
        key_index = np.full(lengths.shape, -1, dtype=np.int32)
        for g, row in enumerate(lengths.tolist()):
            previous = 0
            for level, n in enumerate(row):
                if n == 0:
                    if any(row[level:]):
                        raise LookupPlanError(f"group {g}: zero padding before a length")
                    break
                if n <= previous or n not in position:
                    raise LookupPlanError(f"group {g}: lengths must ascend and be query lengths, got {row}")
                key_index[g, level] = position[n]
                previous = n
        groups, max_levels = lengths.shape
        wg = np.ascontiguousarray(worker_group, dtype=np.int32)
        ws = np.asarray(worker_shift)
        if wg.ndim != 1 or ws.shape != wg.shape:
            raise LookupPlanError("worker_group and worker_shift must be 1-D arrays of one length")
        if wg.size and (wg.min() < 0 or wg.max() >= groups):
            raise LookupPlanError(f"worker_group must name groups in [0, {groups})")
        if ws.size and (ws.min() < 0 or ws.max() > 62 or np.any(ws % 2)):
            raise LookupPlanError("worker_shift must be even bit shifts in [0, 62]")
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise LookupPlanError(f"shards must be a positive integer, got {shards!r}")
        self.shards = shards
        self.groups = groups
        self.max_levels = max_levels
        self.workers = int(wg.size)
        self.consistency = bool(consistency)
        self._lengths = lengths
        self._key_index = key_index
        self._worker_group = wg
        self._worker_shift = np.ascontiguousarray(ws, dtype=np.uint8)
        self._values = np.zeros(max(1, groups * max_levels), dtype=np.uint64)
        # The constant arguments of every call, as cffi pointers made once.
        self._c = (
            _from_buffer("int64_t[]", self._lengths),
            _from_buffer("int32_t[]", self._key_index),
            max_levels,
            _from_buffer("int32_t[]", self._worker_group),
            _from_buffer("uint8_t[]", self._worker_shift),
            self.workers,
            1 if self.consistency else 0,
            _from_buffer("uint64_t[]", self._values),
        )

    def run(self, pointers: Any, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(matched int64, tier uint8) per worker for a prompt whose fitting keys are ``keys``.

        ``pointers`` comes from ``ViewPointers.pointers()``; ``keys`` (uint64, contiguous) holds
        one key per query length that fits the prompt, in query-length order.
        """
        if keys.__class__ is not np.ndarray or keys.dtype != np.uint64 or keys.ndim != 1 \
                or not keys.flags.c_contiguous:
            raise LookupPlanError("keys must be a contiguous 1-D uint64 numpy array")
        n = self.workers
        matched = _empty(n, _int64)
        tier = _empty(n, _uint8)
        lengths, key_index, max_levels, wg, ws, workers, consistency, values = self._c
        rc = _lookup_plan(pointers, self.shards, self.groups, _from_buffer("uint64_t[]", keys), keys.size,
                          lengths, key_index, max_levels, wg, ws, workers, consistency, values,
                          _from_buffer("int64_t[]", matched), _from_buffer("uint8_t[]", tier))
        if rc:
            raise LookupPlanError(f"kvc_lookup_plan rejected its arguments (code {rc})")
        return matched, tier

    def field_worker(self) -> np.ndarray:
        """The inverse of ``worker_group``/``worker_shift`` (``kvc_lookup_sparse``'s map): int32
        (groups x 32), the worker in each group's 2-bit field, -1 where none."""
        out = np.full((max(1, self.groups), 32), -1, dtype=np.int32)
        fields = self._worker_shift.astype(np.intp) // 2
        if self.workers:
            out[self._worker_group, fields] = np.arange(self.workers, dtype=np.int32)
            if np.count_nonzero(out >= 0) != self.workers:
                raise LookupPlanError("two workers share one field of a group")
        return out

    def values(self) -> np.ndarray:
        """The values read by the last ``run`` (groups x max_levels; 0 where not read): for tests."""
        return self._values[: self.groups * self.max_levels].reshape(self.groups, self.max_levels).copy()


class ScoreKernel:
    """The joint score's C loop over fixed per-worker constants (``kvc_score_choose``, the scores
    and argmin of ``kvc_score_joint`` in one pass).

    ``run`` takes the per-request arrays, contiguous and n long: float64 queue and belief, int64
    matched, uint8 tier, bool or uint8 eligible (or None); the caller checks shapes and dtypes
    (``JointScorer`` does). Returns (argmin, lam, scores).
    """

    __slots__ = ("n", "_constants", "_params", "_arrays", "_lam", "_chosen")

    def __init__(self, wan: np.ndarray, beta: np.ndarray, local_factor: np.ndarray, remote_penalty: np.ndarray,
                 *, gamma: float, lambda_max: float, tau: float) -> None:
        arrays = tuple(np.ascontiguousarray(a, dtype=np.float64) for a in (wan, beta, local_factor, remote_penalty))
        if any(a.ndim != 1 or a.shape != arrays[0].shape for a in arrays):
            raise LookupPlanError("score constants must be 1-D float64 arrays of one length")
        self.n = int(arrays[0].size)
        self._arrays = arrays  # keeps the buffers behind the pointers alive
        self._constants = tuple(_from_buffer("double[]", a) for a in arrays)
        self._params = (float(gamma), float(lambda_max), float(tau))
        self._lam = ffi.new("double *")  # reused: a kernel serves one thread
        self._chosen = ffi.new("int64_t *")  # (the tie rotation's answer: unused without last_sent)

    def run(self, prompt_len: float, queue: np.ndarray, belief: np.ndarray, matched: np.ndarray, tier: np.ndarray,
            eligible: np.ndarray | None, flags: int) -> tuple[int, float, np.ndarray]:
        chosen, _, lam, scores = self._score_choose(prompt_len, queue, belief, matched, tier, eligible, flags, _NULL)
        return chosen, lam, scores

    def choose(self, prompt_len: float, queue: np.ndarray, belief: np.ndarray, matched: np.ndarray,
               tier: np.ndarray, eligible: np.ndarray | None, flags: int, last_sent: np.ndarray
               ) -> tuple[int, int, float, np.ndarray]:
        """``run`` with the decision's tie rotation in the same C pass: (argmin, the first of the
        workers scoring exactly as it with the least ``last_sent``, lam, scores). ``last_sent``
        holds the Router's dispatch counters (contiguous int64, n long). What the Router runs
        when the pending ledger raised some matches after the fused call; the other arrays as
        ``run`` takes them."""
        sent = _from_buffer("int64_t[]", last_sent)
        if len(sent) != self.n:
            raise LookupPlanError(f"last_sent must hold {self.n} values")
        return self._score_choose(prompt_len, queue, belief, matched, tier, eligible, flags, sent)

    def _score_choose(self, prompt_len, queue, belief, matched, tier, eligible, flags, sent
                      ) -> tuple[int, int, float, np.ndarray]:
        # kvc_score_choose: kvc_score_joint's scores and argmin in one pass (what the fused call
        # runs), and with ``sent`` (not NULL) the tie rotation's pick
        n = self.n
        scores = _empty(n, _float64)
        lam, rotated = self._lam, self._chosen
        wan, beta, local_factor, remote_penalty = self._constants
        gamma, lambda_max, tau = self._params
        chosen = _score_choose(
            n, prompt_len, wan, beta, _from_buffer("double[]", queue), _from_buffer("double[]", belief),
            _from_buffer("int64_t[]", matched), _from_buffer("uint8_t[]", tier), local_factor, remote_penalty,
            _NULL if eligible is None else _from_buffer("uint8_t[]", eligible),
            gamma, lambda_max, tau, flags, sent, _from_buffer("double[]", scores), lam, rotated)
        return chosen, rotated[0], lam[0], scores


class MissSummary:
    """What a decision means to the hot-prefix detector, in one C call (``kvc_miss_summary``).

    Built once per edge from the workers' locality and per-worker ``floors`` (the least remote
    match that can trigger a migration); ``flags(matched, scores, queue, chosen)`` returns the
    ``MISS_*`` bits.
    """

    __slots__ = ("local", "floors", "_c", "_n")

    def __init__(self, local: np.ndarray, floors: np.ndarray) -> None:
        self.local = np.array(local, dtype=np.uint8)
        self.floors = np.array(floors, dtype=np.int64)
        if self.local.ndim != 1 or self.floors.shape != self.local.shape:
            raise LookupPlanError("local and floors must be 1-D arrays of one length")
        self.local.setflags(write=False)
        self.floors.setflags(write=False)
        self._n = int(self.local.size)
        self._c = (_from_buffer("uint8_t[]", self.local), _from_buffer("int64_t[]", self.floors))

    def flags(self, matched: np.ndarray, scores: np.ndarray, queue: np.ndarray, chosen: int) -> int:
        n = self._n
        if not (matched.__class__ is np.ndarray and matched.dtype == _I64 and matched.flags.c_contiguous
                and scores.__class__ is np.ndarray and scores.dtype == _F64 and scores.flags.c_contiguous
                and queue.__class__ is np.ndarray and queue.dtype == _F64 and queue.flags.c_contiguous):
            # Other dtypes or strided views are converted, not refused.
            matched = np.ascontiguousarray(matched, dtype=np.int64)
            scores = np.ascontiguousarray(scores, dtype=np.float64)
            queue = np.ascontiguousarray(queue, dtype=np.float64)
        if matched.shape != (n,) or scores.shape != (n,) or queue.shape != (n,):
            raise LookupPlanError(f"matched, scores and queue must have shape ({n},)")
        if not 0 <= chosen < n:
            raise LookupPlanError(f"chosen must be in [0, {n}), got {chosen}")
        local, floors = self._c
        return _miss_summary(n, _from_buffer("int64_t[]", matched), local, floors,
                             _from_buffer("double[]", scores), _from_buffer("double[]", queue), chosen)


class ForwardKernel:
    """One forwarding decision in one C call (``kvc_forward_decide``) over an edge's constants.

    Built from the edge's ``LookupPlan`` and ``ViewPointers``, its query lengths and salt, its
    ``ScoreKernel`` with the ablation's score ``flags``, its ``MissSummary``, the Router's
    per-worker dispatch counters ``last_sent`` (int64, updated in place by the Router; exact score
    ties go to the least recently sent), ``family_index`` (the family length's index among the
    query lengths, None if it is not one) and ``backend``, the prefix keys' SHA-256 backend code
    (``keys.SHA256_BACKENDS``).

    Each run hands C new per-worker arrays to write (a decision keeps them): at 10,000 workers a
    copy of reused buffers cost more than the cffi handles of new ones.
    """

    __slots__ = ("workers", "_plan", "_pointers", "_result", "_keys", "_outputs", "_belief", "_belief_c", "_keep")

    def __init__(self, plan: LookupPlan, pointers: ViewPointers, query_lengths: np.ndarray, salt: bytes,
                 score: ScoreKernel, flags: int, miss: MissSummary, last_sent: np.ndarray, *,
                 family_index: int | None, backend: int) -> None:
        query = np.ascontiguousarray(query_lengths, dtype=np.int64)
        if query.ndim != 1 or np.any(np.diff(query) <= 0) or (query.size and query[0] <= 0):
            raise LookupPlanError("query_lengths must be strictly ascending positive lengths")
        read = plan._key_index >= 0
        if np.any(plan._key_index >= query.size) or np.any(query[plan._key_index[read]] != plan._lengths[read]):
            raise LookupPlanError("the lookup plan's lengths are not these query lengths")
        n = plan.workers
        if not (n == score.n == miss._n) or n == 0:
            raise LookupPlanError("the lookup plan, score kernel and miss summary must cover the same workers")
        if not (last_sent.__class__ is np.ndarray and last_sent.dtype == _I64 and last_sent.shape == (n,)
                and last_sent.flags.c_contiguous):
            raise LookupPlanError(f"last_sent must be a contiguous int64 array of shape ({n},)")
        if not isinstance(salt, bytes):
            raise LookupPlanError("salt must be bytes")
        if family_index is not None and not 0 <= family_index < query.size:
            raise LookupPlanError(f"family_index must name a query length, got {family_index!r}")
        self.workers = n
        self._pointers = pointers
        self._keys = np.zeros(max(1, query.size), dtype=np.uint64)
        c = ffi.new("kvc_forward_plan *")
        salt_c = ffi.new("uint8_t[]", salt) if salt else _NULL
        c.salt, c.salt_len = salt_c, len(salt)
        query_c = _from_buffer("int64_t[]", query)
        c.query_lengths, c.n_query, c.sha_backend = query_c, query.size, backend
        lengths, key_index, max_levels, wg, ws, workers, consistency, values = plan._c
        c.views, c.shards, c.groups = pointers.pointers(), plan.shards, plan.groups
        c.level_lengths, c.level_keys, c.max_levels = lengths, key_index, max_levels
        c.worker_group, c.worker_shift, c.workers, c.consistency = wg, ws, workers, consistency
        c.values_scratch = values
        c.wan, c.beta, c.local_factor, c.remote_penalty = score._constants
        c.gamma, c.lambda_max, c.tau = score._params
        c.score_flags = flags
        c.local, c.floors = miss._c
        c.family_index = -1 if family_index is None else family_index
        self._plan = c
        self._outputs = (_from_buffer("int64_t[]", last_sent), _from_buffer("uint64_t[]", self._keys))
        self._belief: np.ndarray | None = None  # beliefs change on responses only: their pointer is kept
        self._belief_c = _NULL
        # The struct borrows these buffers: keep them (and their owners) alive with it.
        self._keep = (plan, score, miss, query, salt_c, query_c, last_sent)
        self._result = ffi.new("kvc_forward_result *")  # reused: a kernel serves one thread

    def run(self, tokens: Any, queue: np.ndarray, belief: np.ndarray, eligible: np.ndarray | None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int, float, int, int | None]:
        """One decision: (matched, tier, scores, best, chosen, lam, miss flags, family key).

        ``tokens`` is a buffer of uint32 little-endian tokens (``keys.token_buffer``); ``queue``
        and ``belief`` contiguous float64 and ``eligible`` bool or uint8 (or None), each
        ``workers`` long. ``best`` is -1 when no worker is eligible (every score +inf). The keys
        stay in ``keys()`` until the next run.
        """
        n = self.workers
        if belief is not self._belief:
            self._belief_c = _from_buffer("double[]", belief)
            self._belief = belief
        tokens_c = _from_buffer("uint8_t[]", tokens)
        queue_c = _from_buffer("double[]", queue)
        eligible_c = _NULL if eligible is None else _from_buffer("uint8_t[]", eligible)
        # Buffer sizes, checked so that a wrong array cannot make C read past its end.
        if len(queue_c) != n or len(self._belief_c) != n or (eligible is not None and len(eligible_c) != n):
            raise LookupPlanError(f"queue, belief and eligible must hold {n} values")
        self._pointers.pointers()  # rewrites the plan's view array in place after a snapshot
        result = self._result
        last_sent, keys = self._outputs
        # New arrays each decision (a decision keeps them), written by C in place: no copy.
        matched, tier, scores = _empty(n, _int64), _empty(n, _uint8), _empty(n, _float64)
        rc = _forward_decide(self._plan, tokens_c, len(tokens_c) >> 2, queue_c, self._belief_c, eligible_c,
                             last_sent, keys, _from_buffer("int64_t[]", matched), _from_buffer("uint8_t[]", tier),
                             _from_buffer("double[]", scores), result)
        if rc:
            if rc != _NONE_ELIGIBLE:
                raise LookupPlanError(f"kvc_forward_decide rejected its arguments (code {rc})")
            best = -1
        else:
            best = result.best
        family = result.family
        return matched, tier, scores, best, result.chosen, result.lam, result.miss, None if family < 0 else family

    def keys(self) -> np.ndarray:
        """The keys the last ``run`` computed, at every query length (valid up to its n_keys)."""
        return self._keys


# Workers per block of the pruned score's lower bounds: a region's workers are consecutive in a
# census fleet, so a block's least WAN is nearly every worker's.
SCORE_BLOCK = 32


class ScoreBlocks:
    """The pruned score's per-block lower bounds (``kvc_score_blocks``) over a ``ScoreKernel``'s
    constants: each block of ``SCORE_BLOCK`` consecutive workers' least wan, beta and remote
    penalty. ``refresh()`` re-reads beta after the scorer's rates changed (the C loop reads beta
    live, so a stale least beta would no longer be a bound)."""

    __slots__ = ("n", "block", "_starts", "_wan", "_beta", "_penalty", "_score", "c")

    def __init__(self, score: ScoreKernel, block: int = SCORE_BLOCK) -> None:
        if block < 1:
            raise LookupPlanError("block must be >= 1")
        self.n, self.block, self._score = score.n, block, score
        self._starts = np.arange(0, max(1, score.n), block)
        wan, beta, _, penalty = score._arrays
        self._wan = np.minimum.reduceat(wan, self._starts) if score.n else np.zeros(1)
        self._beta = np.empty(self._starts.size, dtype=np.float64)
        self._penalty = np.minimum.reduceat(penalty, self._starts) if score.n else np.zeros(1)
        self.c = ffi.new("kvc_score_blocks *")
        self.c.block, self.c.n_blocks = block, (score.n + block - 1) // block
        self.c.wan_min = _from_buffer("double[]", self._wan)
        self.c.beta_min = _from_buffer("double[]", self._beta)
        self.c.penalty_min = _from_buffer("double[]", self._penalty)
        self.refresh()

    def refresh(self) -> None:
        if self.n:
            np.minimum.reduceat(self._score._arrays[1], self._starts, out=self._beta)


class SparseForwardKernel(ForwardKernel):
    """``ForwardKernel`` on the sparse path (``kvc_forward_decide_sparse``): the decode works
    from each group's bit masks and the score skips blocks of workers that cannot reach the best
    (``ScoreBlocks``), so a decision's work follows the holders and the candidates, not the
    workers. The same answers as ``ForwardKernel``; ``run`` also says whether ``scores`` holds
    every worker's score (``ScoreResult`` completes it when something reads it).

    The pruning bound needs finite beliefs: a belief array with a NaN or an infinity (never the
    Router's, whose beliefs lie in [0, 1]) takes the full C call instead."""

    __slots__ = ("_sparse", "_sparse_result", "_blocks", "_field_worker", "_holders", "_belief_finite", "_aging",
                 "_ms", "_ms_c", "_out_size", "_out_record", "_fields", "_fields_c", "_group_fields", "_out_ring", "_out_next",
                 "_aging_record", "_changes", "_changes_c")

    def __init__(self, plan: LookupPlan, pointers: ViewPointers, query_lengths: np.ndarray, salt: bytes,
                 score: ScoreKernel, flags: int, miss: MissSummary, last_sent: np.ndarray, *,
                 family_index: int | None, backend: int, blocks: ScoreBlocks) -> None:
        super().__init__(plan, pointers, query_lengths, salt, score, flags, miss, last_sent,
                         family_index=family_index, backend=backend)
        if blocks._score is not score:
            raise LookupPlanError("the score blocks must bound this score kernel")
        self._field_worker = plan.field_worker()
        self._holders = np.zeros(max(1, self.workers), dtype=np.int32)
        self._blocks = blocks
        c = ffi.new("kvc_forward_sparse *")
        c.field_worker = _from_buffer("int32_t[]", self._field_worker)
        # Each group's field mask, once (kvc_lookup_sparse would derive it from field_worker per call).
        self._group_fields = np.zeros(max(1, plan.groups), dtype=np.uint64)
        if lib.kvc_field_masks(c.field_worker, plan.groups, self.workers,
                               _from_buffer("uint64_t[]", self._group_fields)):
            raise LookupPlanError("field_worker names a worker out of range")
        c.group_fields = _from_buffer("uint64_t[]", self._group_fields)
        c.blocks = blocks.c[0]
        remote = miss.local == 0
        c.remote_floor_free = int(bool(np.any(remote & (miss.floors <= 0))))
        c.holders = _from_buffer("int32_t[]", self._holders)
        self._sparse = c
        self._sparse_result = ffi.new("kvc_forward_sparse_result *")
        self._belief_finite = False
        self._aging: tuple | None = None
        self._ms: np.ndarray | None = None  # run_out's last estimates, and their pointer
        self._ms_c = _NULL
        self._out_size = DecisionArrays.buffer_size(self.workers)
        self._out_record = DecisionArrays.record_at(self.workers)
        self._aging_record = DecisionArrays.aging_at(self.workers)
        self._changes: np.ndarray | None = None  # the queue estimates' change log (track_changes)
        self._changes_c = _NULL
        # run_out's buffers, reused once nothing else holds them (out_buffer).
        self._out_ring: list[np.ndarray | None] = [None] * max(
            1, min(_OUT_RING, _OUT_RING_BYTES // (8 * self._out_size)))
        self._out_next = 0
        self._fields = np.zeros(int(lib.KVC_OUT_FIELDS), dtype=np.int64)  # run_out's integers
        self._fields_c = _from_buffer("int64_t[]", self._fields)

    def run(self, tokens: Any, queue: np.ndarray, belief: np.ndarray, eligible: np.ndarray | None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int, float, int, int | None, bool]:
        """``ForwardKernel.run``'s answer and whether ``scores`` is complete."""
        n = self.workers
        if not self.belief_finite(belief):
            return (*ForwardKernel.run(self, tokens, queue, belief, eligible), True)
        tokens_c = _from_buffer("uint8_t[]", tokens)
        queue_c = _from_buffer("double[]", queue)
        eligible_c = _NULL if eligible is None else _from_buffer("uint8_t[]", eligible)
        if len(queue_c) != n or (eligible is not None and len(eligible_c) != n):
            raise LookupPlanError(f"queue, belief and eligible must hold {n} values")
        self._pointers.pointers()
        result = self._sparse_result
        last_sent, keys = self._outputs
        matched, tier, scores = _empty(n, _int64), _empty(n, _uint8), _empty(n, _float64)
        rc = _forward_decide_sparse(self._plan, self._sparse, tokens_c, len(tokens_c) >> 2, queue_c, self._belief_c,
                                    eligible_c, last_sent, keys, _from_buffer("int64_t[]", matched),
                                    _from_buffer("uint8_t[]", tier), _from_buffer("double[]", scores), result)
        if rc:
            if rc != _NONE_ELIGIBLE:
                raise LookupPlanError(f"kvc_forward_decide_sparse rejected its arguments (code {rc})")
            best = -1
        else:
            best = result.best
        family = result.family
        return (matched, tier, scores, best, result.chosen, result.lam, result.miss,
                None if family < 0 else family, bool(result.complete))

    def belief_finite(self, belief: np.ndarray) -> bool:
        """Whether the sparse path takes ``belief`` (finite, ``workers`` long): checked once per array."""
        if belief is not self._belief:
            self._belief_c = _from_buffer("double[]", belief)
            self._belief = belief
            n = len(self._belief_c)
            if n != self.workers:
                self._belief_finite = False
            elif n <= SMALL_FLEET:
                # The Router's beliefs are a new array after most responses, so this runs about
                # once a decision: numpy's isfinite and all were 23 µs of it in the edge's request
                # path (two calls, their code cold between requests). A sum is finite only if
                # every term is (two huge finite terms overflow: the full call takes them).
                self._belief_finite = math.isfinite(sum(belief.tolist()))
            else:
                self._belief_finite = bool(np.isfinite(belief).all())
        return self._belief_finite

    def age_from(self, taken_at: np.ndarray, rate: np.ndarray, occupancy: np.ndarray, region_slot: np.ndarray) -> None:
        """The queue estimates' in-place arrays (``QueueEstimates.aging_arrays``) for ``run_aged``."""
        n = self.workers
        for name, a, dtype in (("taken_at", taken_at, _F64), ("rate", rate, _F64), ("occupancy", occupancy, _F64),
                               ("region_slot", region_slot, _I64)):
            if not (a.__class__ is np.ndarray and a.dtype == dtype and a.shape == (n,) and a.flags.c_contiguous):
                raise LookupPlanError(f"{name} must be a contiguous {dtype} array of shape ({n},)")
        c = self._sparse
        c.taken_at, c.rate = _from_buffer("double[]", taken_at), _from_buffer("double[]", rate)
        c.occupancy, c.region_slot = _from_buffer("double[]", occupancy), _from_buffer("int64_t[]", region_slot)
        self._aging = (int(region_slot.max(initial=0)), (taken_at, rate, occupancy, region_slot))

    def track_changes(self, changes: np.ndarray) -> None:
        """The change log of the estimates ``age_from`` named (``QueueEstimates.change_log``):
        ``run_out(..., tracked=True)`` then ages only the workers it names since a reused
        buffer's last decision, and those whose value still moves (``kvc_forward.h``, the aging
        record)."""
        if not (changes.__class__ is np.ndarray and changes.dtype == _I64 and changes.ndim == 1
                and changes.size > 3 and changes.flags.c_contiguous and int(changes[2]) == changes.size - 3):
            raise LookupPlanError("a change log is a contiguous int64 array: count, floor, capacity, then entries")
        self._changes = changes
        self._changes_c = _from_buffer("int64_t[]", changes)

    def run_aged(self, tokens: Any, ms: np.ndarray, now: float, correction: np.ndarray | None, occupied: bool,
                 belief: np.ndarray, eligible: np.ndarray | None):
        """``run`` on the queue estimates carried to ``now`` in the same C call (``age_from``'s
        arrays, ``ms`` the values as last set, ``correction`` per region slot or None, whether
        to add the occupancy). Returns ``run``'s answer, then the aged values and the estimates
        the decision scored (one array when nothing was added)."""
        n = self.workers
        if self._aging is None:
            raise LookupPlanError("run_aged needs the queue estimates' arrays (age_from)")
        top_slot, arrays = self._aging
        if not (ms.__class__ is np.ndarray and ms.dtype == _F64 and ms.shape == (n,) and ms.flags.c_contiguous):
            raise LookupPlanError(f"ms must be a contiguous float64 array of shape ({n},)")
        if correction is not None and not (correction.__class__ is np.ndarray and correction.dtype == _F64
                                           and correction.ndim == 1 and correction.size > top_slot
                                           and correction.flags.c_contiguous):
            raise LookupPlanError("correction must be a contiguous float64 array covering every region slot")
        aged = _empty(n, _float64)
        if not self.belief_finite(belief):  # the full C call, on the same estimates
            c = self._sparse
            _queue_aged(n, _from_buffer("double[]", ms), c.taken_at, c.rate, now, _from_buffer("double[]", aged))
            queue = aged if correction is None else aged + correction[arrays[3]]
            queue = queue + arrays[2] if occupied else queue
            return (*ForwardKernel.run(self, tokens, queue, belief, eligible), True, aged, queue)
        aged_c = _from_buffer("double[]", aged)
        if correction is None and not occupied:
            queue, queue_c = aged, aged_c
        else:
            queue = _empty(n, _float64)
            queue_c = _from_buffer("double[]", queue)
        tokens_c = _from_buffer("uint8_t[]", tokens)
        eligible_c = _NULL if eligible is None else _from_buffer("uint8_t[]", eligible)
        if eligible is not None and len(eligible_c) != n:
            raise LookupPlanError(f"eligible must hold {n} values")
        self._pointers.pointers()
        result = self._sparse_result
        last_sent, keys = self._outputs
        matched, tier, scores = _empty(n, _int64), _empty(n, _uint8), _empty(n, _float64)
        rc = _forward_decide_sparse_aged(self._plan, self._sparse, tokens_c, len(tokens_c) >> 2,
                                         _from_buffer("double[]", ms), now,
                                         _NULL if correction is None else _from_buffer("double[]", correction),
                                         occupied, self._belief_c, eligible_c, last_sent, keys,
                                         _from_buffer("int64_t[]", matched), _from_buffer("uint8_t[]", tier),
                                         _from_buffer("double[]", scores), aged_c, queue_c, result)
        if rc:
            if rc != _NONE_ELIGIBLE:
                raise LookupPlanError(f"kvc_forward_decide_sparse_aged rejected its arguments (code {rc})")
            best = -1
        else:
            best = result.best
        family = result.family
        return (matched, tier, scores, best, result.chosen, result.lam, result.miss,
                None if family < 0 else family, bool(result.complete), aged, queue)

    def run_out(self, tokens: Any, ms: np.ndarray, now: float, correction: np.ndarray | None, occupied: bool,
                belief: np.ndarray, eligible: np.ndarray | None, tracked: bool = False):
        """``run_aged`` with every per-worker output in one new buffer (``kvc_forward_decide_sparse_out``):
        one allocation and one cffi pointer per decision instead of five, the arrays made as
        views of it only when something reads them (``DecisionArrays``). Returns (arrays, best,
        chosen, lam, miss flags, family key, complete, the chosen worker's matched length and
        tier, the best worker's). ``ms`` is checked once per array (the estimates' snapshots
        are immutable). ``tracked``: ``ms`` is the current snapshot of the estimates whose change
        log ``track_changes`` holds, so a reused buffer's aged values are carried over where
        nothing changed them (the same values, bit for bit)."""
        n = self.workers
        if ms is not self._ms:
            if self._aging is None:
                raise LookupPlanError("run_out needs the queue estimates' arrays (age_from)")
            if not (ms.__class__ is np.ndarray and ms.dtype == _F64 and ms.shape == (n,) and ms.flags.c_contiguous):
                raise LookupPlanError(f"ms must be a contiguous float64 array of shape ({n},)")
            self._ms_c = _from_buffer("double[]", ms)
            self._ms = ms
        if correction is not None and not (correction.__class__ is np.ndarray and correction.dtype == _F64
                                           and correction.ndim == 1 and correction.size > self._aging[0]
                                           and correction.flags.c_contiguous):
            raise LookupPlanError("correction must be a contiguous float64 array covering every region slot")
        separate = correction is not None or occupied
        if not self.belief_finite(belief):  # the full C call, on the same estimates, copied into one buffer
            (matched, tier, scores, best, chosen, lam, miss, family, complete, aged,
             queue) = self.run_aged(tokens, ms, now, correction, occupied, belief, eligible)
            arrays = DecisionArrays.copied(matched, tier, scores, aged, queue if separate else None)
            return (arrays, best, chosen, lam, miss, family, complete, matched.item(chosen) if chosen >= 0 else 0,
                    tier.item(chosen) if chosen >= 0 else 0, matched.item(best) if best >= 0 else 0,
                    tier.item(best) if best >= 0 else 0)
        eligible_c = _NULL
        if eligible is not None:
            eligible_c = _from_buffer("uint8_t[]", eligible)
            if len(eligible_c) != n:
                raise LookupPlanError(f"eligible must hold {n} values")
        out = self.out_buffer()
        self._pointers.pointers()
        last_sent, keys = self._outputs
        tokens_c = _from_buffer("uint8_t[]", tokens)
        rc = _forward_decide_sparse_out(self._plan, self._sparse, tokens_c, len(tokens_c) >> 2, self._ms_c, now,
                                        _NULL if correction is None else _from_buffer("double[]", correction),
                                        occupied, self._belief_c, eligible_c, last_sent, keys,
                                        _from_buffer("double[]", out), self._sparse_result, self._fields_c,
                                        self._changes_c if tracked else _NULL)
        # The result's integers in one read (in kvc_forward_out_field's order), lam at the buffer's end.
        best, chosen, miss, family, complete, chosen_matched, chosen_tier, best_matched, best_tier = \
            self._fields.tolist()
        if rc:
            if rc != _NONE_ELIGIBLE:
                raise LookupPlanError(f"kvc_forward_decide_sparse_out rejected its arguments (code {rc})")
            best = -1
        arrays = _new_arrays(DecisionArrays)
        _set_out(arrays, out)
        _set_n(arrays, n)
        _set_separate(arrays, separate)
        return (arrays, best, chosen, out.item(self._out_record - 1), miss, None if family < 0 else family, complete != 0,
                chosen_matched, chosen_tier, best_matched, best_tier)

    def out_buffer(self) -> np.ndarray:
        """A buffer for ``run_out``: the first of the ring's that nothing but the ring holds (every
        array made from a buffer holds it, so a decision still read elsewhere keeps its own),
        else a new one that takes the next place in the ring. At thousands of workers a new buffer
        per decision cost more than the score: the allocator walked its bins of large free
        chunks, each one a cache miss. The first free one rather than the next: an edge that
        drops each decision reuses one buffer, still in the cache, instead of cycling through
        the ring's (4 x 370 KB at 10,000 workers); and a reused buffer's zeroing record lets C
        zero only what its last decision wrote."""
        ring = self._out_ring
        for out in ring:
            if out is not None and _refcount(out) == _RING_ONLY:
                return out
        k = self._out_next
        self._out_next = k + 1 if k + 1 < len(ring) else 0
        out = ring[k] = _empty(self._out_size, _float64)
        out[self._out_record] = 0.0  # its matches are unknown: C zeroes all of them
        out[self._aging_record] = 0.0  # and its aged values: C ages every worker
        return out

    def holders(self) -> np.ndarray:
        """The workers the last sparse ``run`` found holding a prefix (group by group)."""
        return self._holders[: self._sparse_result.n_holders].copy()


class DecisionArrays:
    """The per-worker arrays of one fused decision, in the one float64 buffer C wrote them to
    (``kvc_forward_decide_sparse_out``: scores, aged estimates, scored estimates, matched as
    int64, tiers as uint8). Each array is a view of the buffer made when first asked for (a view
    costs about what an array does: most decisions need none), the same view every time after;
    ``aged`` and ``queue`` are read-only (the queue estimates' snapshots), and so are ``matched``
    and ``tier`` unless asked for ``writable`` (the pending ledger raises matches in place): the
    buffer's zeroing record then says its matches are unknown, so that C zeroes all of them when
    the buffer is reused, not only the entries its lookup wrote (``kvc_forward.h``). ``*_at(i)``
    read one value without a view."""

    __slots__ = ("out", "n", "separate", "_scores", "_aged", "_queue", "_matched", "_tier")

    @staticmethod
    def size(n: int) -> int:
        """Doubles in the buffer of ``n`` workers' arrays."""
        return 4 * n + (n + 7) // 8

    @staticmethod
    def record_at(n: int) -> int:
        """Where the buffer's zeroing record starts (after the arrays and lam)."""
        return 4 * n + (n + 7) // 8 + 1

    @staticmethod
    def aging_at(n: int) -> int:
        """Where the buffer's aging record starts (after the zeroing record)."""
        return 4 * n + (n + 7) // 8 + 3 + (n + 1) // 2

    @staticmethod
    def buffer_size(n: int) -> int:
        """Doubles in a whole buffer: the arrays, lam, the zeroing record's flag and count, room
        for ``n`` workers listed as int32, then the aging record (``kvc_forward.h``: its head,
        each block of 16 workers' least aged value and NaN flag, the moving workers as int32 and
        two bit sets)."""
        blocks = (n + 15) // 16
        return 4 * n + (n + 7) // 8 + 3 + (n + 1) // 2 + 4 + 2 * blocks + (n + 1) // 2 + (n + 63) // 64 + (blocks + 63) // 64

    @classmethod
    def copied(cls, matched: np.ndarray, tier: np.ndarray, scores: np.ndarray, aged: np.ndarray,
               queue: np.ndarray | None) -> DecisionArrays:
        """The arrays of a decision made elsewhere, copied into one buffer (``queue`` None: the
        aged estimates were scored)."""
        n = int(scores.size)
        arrays = _new_arrays(cls)
        out = np.zeros(cls.buffer_size(n), dtype=np.float64)  # run_out's layout (no ring reuses it)
        out[:n] = scores
        out[n:2 * n] = aged
        if queue is not None:
            out[2 * n:3 * n] = queue
        out[3 * n:4 * n].view(np.int64)[:] = matched
        out[4 * n:].view(np.uint8)[:n] = tier
        _set_out(arrays, out)
        _set_n(arrays, n)
        _set_separate(arrays, queue is not None)
        return arrays

    def scores(self) -> np.ndarray:
        try:
            return self._scores
        except AttributeError:
            self._scores = self.out[:self.n]
            return self._scores

    def aged(self) -> np.ndarray:
        try:
            return self._aged
        except AttributeError:
            self._aged = _frozen_view(self.out[self.n:2 * self.n])
            return self._aged

    def queue(self) -> np.ndarray:
        """The estimates the decision scored: ``aged()`` itself when nothing was added to them."""
        if not self.separate:
            return self.aged()
        try:
            return self._queue
        except AttributeError:
            self._queue = _frozen_view(self.out[2 * self.n:3 * self.n])
            return self._queue

    def matched(self, writable: bool = False) -> np.ndarray:
        try:
            matched = self._matched
        except AttributeError:
            n = self.n
            matched = self._matched = _frozen_view(self.out[3 * n:4 * n].view(np.int64))
        if writable:
            self._unlist()
            matched.setflags(write=True)
        return matched

    def tier(self, writable: bool = False) -> np.ndarray:
        try:
            tier = self._tier
        except AttributeError:
            tier = self._tier = _frozen_view(self.out[4 * self.n:].view(np.uint8)[:self.n])
        if writable:
            self._unlist()
            tier.setflags(write=True)
        return tier

    def _unlist(self) -> None:
        """The caller may write matches: the zeroing record no longer lists them all."""
        self.out[4 * self.n + (self.n + 7) // 8 + 1] = 0.0

    def score_at(self, i: int) -> float:
        return self.out.item(i)

    def aged_at(self, i: int) -> float:
        return self.out.item(self.n + i)

    def queue_at(self, i: int) -> float:
        return self.out.item((2 if self.separate else 1) * self.n + i)


def _frozen_view(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


# DecisionArrays made per decision: three slot writes, no __init__.
_new_arrays = object.__new__
_set_out, _set_n, _set_separate = (getattr(DecisionArrays, name).__set__ for name in ("out", "n", "separate"))


# Beyond this many, a sort beats the C loop's O(n * k) (top_k is for the few best candidates).
_TOP_K_LOOP = 64


def top_k(scores: np.ndarray, k: int) -> list[int]:
    """Indexes of the ``k`` lowest ``scores`` (float64), best first: the first ``k`` of numpy's
    stable argsort (equal scores in index order, NaN last), in one O(n x k) pass."""
    if k <= 0:
        return []
    if k > _TOP_K_LOOP or scores.__class__ is not np.ndarray or scores.dtype != _F64 or scores.ndim != 1 \
            or not scores.flags.c_contiguous:
        return np.asarray(scores).argsort(kind="stable")[:k].tolist()
    out = _empty(min(k, scores.size), _int64)
    held = _top_k(scores.size, _from_buffer("double[]", scores), k, _from_buffer("int64_t[]", out))
    return out[:held].tolist()


class QueueAging:
    """``max(0, ms + rate x max(0, (now - taken_at) x 1000))`` per worker in one C loop, bit for
    bit numpy's result (``kvc_queue_aged``). ``taken_at`` and ``rate`` are the owner's arrays,
    updated in place between calls (float64, contiguous, ``n`` long); ``ms`` comes with each call."""

    __slots__ = ("n", "_taken_at", "_rate", "_c")

    def __init__(self, taken_at: np.ndarray, rate: np.ndarray) -> None:
        for name, a in (("taken_at", taken_at), ("rate", rate)):
            if not (a.__class__ is np.ndarray and a.dtype == _F64 and a.ndim == 1 and a.flags.c_contiguous):
                raise LookupPlanError(f"{name} must be a contiguous 1-D float64 array")
        if rate.shape != taken_at.shape:
            raise LookupPlanError("taken_at and rate must have one length")
        self.n = int(taken_at.size)
        self._taken_at, self._rate = taken_at, rate  # keep the buffers behind the pointers alive
        self._c = (_from_buffer("double[]", taken_at), _from_buffer("double[]", rate))

    def aged(self, ms: np.ndarray, now: float) -> np.ndarray:
        """A new array: ``ms`` (contiguous float64, ``n`` long) carried to ``now``."""
        if not (ms.__class__ is np.ndarray and ms.dtype == _F64 and ms.shape == (self.n,) and ms.flags.c_contiguous):
            raise LookupPlanError(f"ms must be a contiguous float64 array of shape ({self.n},)")
        out = _empty(self.n, _float64)
        taken_at, rate = self._c
        _queue_aged(self.n, _from_buffer("double[]", ms), taken_at, rate, now, _from_buffer("double[]", out))
        return out


def slot_constructor(cls: type) -> Callable[..., Any]:
    """Positional constructor of a frozen slotted dataclass that writes each slot directly.

    Half the cost of the generated ``__init__`` (which goes through ``object.__setattr__`` per
    field), for the objects made once per request. Only for classes without ``__post_init__``,
    whose ``__init__`` does nothing else. Generated like dataclasses' own ``__init__``.
    """
    names = tuple(f.name for f in fields(cls))
    if hasattr(cls, "__post_init__") or names != getattr(cls, "__slots__", None):
        raise TypeError(f"{cls.__name__} must be a slotted dataclass without __post_init__")
    namespace: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    lines = [f"def build({', '.join(names)}):", "    obj = _new(_cls)"]
    for name in names:
        namespace[f"_set_{name}"] = getattr(cls, name).__set__
        lines.append(f"    _set_{name}(obj, {name})")
    lines.append("    return obj")
    exec("\n".join(lines), namespace)  # noqa: S102 - field names of a dataclass, nothing else
    build = namespace["build"]
    build.__qualname__ = build.__name__ = f"new_{cls.__name__}"
    return build
