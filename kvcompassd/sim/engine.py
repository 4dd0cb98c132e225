"""The event-driven simulation loop on a virtual clock.

Per request: arrival at its region's edge -> ``policy.route`` (plus the policy's discovery
delay) -> WAN one-way to the worker's region -> the worker's queue model (FIFO prefill, continuous
batch decode); when its prefill starts (not at arrival: SGLang and vLLM match the prefix as the
request leaves the waiting queue) the worker's prefix cache is matched and the prefix pinned
(DRAM pages reload at gamma), and when it ends the prompt's KV enters the cache -> first token
back over the WAN (TTFT is measured at the user) -> decode -> last token back (end-to-end). Each worker's prefix cache emits the engine's block events; they reach
the policy after ``update_delay_ms`` unless lost (``update_loss``, §5.7). Actual WAN latencies
can jitter around the static matrix the policies know (``wan_jitter``, §5.7).

Worker timing is ``kvcompassd.worker.workermodel.WorkerQueueModel``; caches are
``kvcompassd.worker.prefixcache.PrefixCache`` — the same code the emulated worker runs.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvcompassd.worker.decodemodel import KV_BYTES_PER_TOKEN
from kvcompassd.worker.prefixcache import PrefixCache
from kvcompassd.worker.workermodel import FirstTokenProduced, RequestFinished, WorkerQueueModel, WorkerTiming

from .blockmirror import GlobalBlockMap, chain_keys
from .policy import (FALSE_LOST_IN_FLIGHT, FALSE_NO_VRAM_ROOM, FALSE_VIEW_AHEAD, FALSE_WITHIN_PAGE, BasePolicy, MigrationOrdered,
                     PolicyError, RoutingPolicy, Topology)
from .workloads import Request

_ARRIVE, _AT_WORKER, _WAKE, _RESPONSE, _DELIVER, _COPY, _CLIENT_FREE, _END = range(8)
FIRST_SUBCLASS_EVENT = 8  # kinds from here on are a subclass's (``Simulation._other_event``)
REMOTE_ONLY_MIN_TOKENS = 1024  # appendix D / Fig. 19 threshold
INTRA_REGION_GBPS = 100.0  # regional network for KV-tensor copies (paper §3.5: tens to hundreds of Gbps)


class SimulationError(ValueError):
    """Bad simulation settings or a policy decision the deployment cannot carry out."""


@dataclass(frozen=True, slots=True)
class SimSettings:
    eviction: str = "lru"            # worker KV-cache eviction: "lru" or "lfu" (§5.1)
    update_delay_ms: float = 0.0     # extra delay of cache events on their way to the policy
    update_loss: float = 0.0         # probability a batch of cache events is lost
    wan_jitter: float = 0.0          # actual one-way = static * (1 + U(-j, +j))
    load_bin_s: float = 1.0          # time bins of the per-worker load factor
    seed: int = 0
    track_truth: bool = False        # keep an exact global cache map for the cross-region-only share
    progress: bool = False           # tqdm progress bar
    decode_batch_slope: float | None = None  # override the worker model's assumption
    load_report_ms: float = 5.0      # how often a worker's exact queue delay is read (see _notify_load)
    # Closed loop: at most this many requests outstanding, as a benchmark client with a
    # concurrency limit sends them (SGLang's and vLLM's bench_serving --max-concurrency). A
    # request is sent at its arrival time or, if every client is busy, the moment one gets its
    # response back; its arrival_s is then that send time. None: open loop.
    clients: int | None = None

    def __post_init__(self) -> None:
        if self.eviction not in ("lru", "lfu"):
            raise SimulationError(f"eviction must be 'lru' or 'lfu', got {self.eviction!r}")
        if not 0 <= self.update_loss < 1:
            raise SimulationError(f"update_loss must be in [0, 1), got {self.update_loss}")
        if self.update_delay_ms < 0 or self.wan_jitter < 0 or self.load_bin_s <= 0:
            raise SimulationError("update_delay_ms and wan_jitter must be >= 0, load_bin_s > 0")
        if self.clients is not None and (not isinstance(self.clients, int) or self.clients < 1):
            raise SimulationError(f"clients must be a positive int or None, got {self.clients!r}")


@dataclass(slots=True)
class _InFlight:
    req: Request
    worker: int
    claimed: int
    lookup_ms: float
    edge_region: int
    lease: Any = None
    cached_vram: int = 0
    cached_dram: int = 0
    at_worker: float = 0.0
    first_token_at: float = -1.0
    ttft_s: float = -1.0
    remote_only: int = -1
    held_at_decision: int = -1  # tokens the chosen worker really held when the edge chose it (-1: untracked)
    claim_source: int = FALSE_VIEW_AHEAD  # the cause if the worker held less already (explain_claim)
    reload_short: bool = False  # it held more at its prefill's start than its lock could reuse (no VRAM to reload DRAM into)
    migration: bool = False
    path_pages: tuple[int, ...] | None = None  # its prompt's full pages (ids), once the queue report asked
    pinned_pages: tuple[int, ...] | None = None  # the pages its lease pins from its prefill's end


RECORD_FIELDS = (
    "id", "arrival_s", "edge_region", "worker", "worker_region", "session", "prompt_tokens", "output_tokens",
    "claimed_tokens", "reused_tokens", "dram_tokens", "lookup_ms", "ttft_ms", "e2e_ms", "finish_s",
    "compute_ms", "remote_only", "queue_ms", "held_at_decision", "false_cause",
)
# false_cause of a request whose worker reused fewer tokens than the policy claimed: the FALSE_*
# codes (policy.py, where explain_claim returns the finer ones), -1 untracked, 0 not a false lookup.


@dataclass
class SimResult:
    """Per-request records (numpy columns, ordered by request id) and run-level counters."""

    scheme: str
    records: dict[str, np.ndarray]
    load_bins: np.ndarray            # workers x bins, GPU compute ms sent to each worker per bin
    load_bin_s: float
    wall_s: float
    events_delivered: int = 0
    events_lost: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def completed(self) -> int:
        return len(self.records["id"])


def decode_share_ms(timing: WorkerTiming, output_tokens: int) -> float:
    """A request's share of its worker's decode: its output tokens after the first at a full
    batch's per-sequence step cost (the first comes out of prefill)."""
    return (output_tokens - 1) * timing.decode_step_ms(timing.max_running) / timing.max_running


def request_work_ms(timing: WorkerTiming, prompt_tokens: int, cached_vram: int, cached_dram: int,
                    output_tokens: int) -> float:
    """GPU compute one request costs its worker, as the load factor counts it (``load_bins``):
    prefill of the uncached prompt, reload of the DRAM-cached part, and its decode share."""
    return timing.prefill_ms(prompt_tokens - cached_vram - cached_dram, cached_dram) + decode_share_ms(
        timing, output_tokens)


def usable_cached(match_vram: int, match_dram: int, prompt_tokens: int) -> tuple[int, int]:
    """(VRAM, DRAM) cached tokens a request reuses: an engine always computes the last prompt token."""
    vram = min(match_vram, prompt_tokens - 1)
    return vram, min(match_dram, prompt_tokens - 1 - vram)


class ExactWorkerState:
    """What only an oracle may read: every worker's prefix cache as it is now, and the compute
    a request would cost there exactly as the load factor counts it. Read-only."""

    def __init__(self, caches: list[PrefixCache], timings: list[WorkerTiming], blocks: GlobalBlockMap) -> None:
        self._caches = caches
        self._timings = timings
        self._blocks = blocks  # every cache's events applied at once: which workers hold any prefix
        self._uncached: tuple[np.ndarray, np.ndarray] | None = None
        # Told (worker, request id or None for a migration's copy, compute ms) the instant a
        # prefill starts and its compute is known exactly: a request reuses what its worker
        # holds then, which can differ from what it held at the decision.
        self.on_work_accounted: Callable[[int, int | None, float], None] | None = None

    def cached(self, worker_index: int, tokens: np.ndarray) -> tuple[int, int]:
        """(VRAM, DRAM) tokens of ``tokens`` the worker would reuse if its prefill started now."""
        match = self._caches[worker_index].match(tokens)
        return usable_cached(match.vram_tokens, match.dram_tokens, len(tokens))

    def holders(self, tokens: np.ndarray) -> list[int]:
        """The workers caching at least one full page of ``tokens`` (all others reuse nothing)."""
        return sorted(self._blocks.longest(chain_keys(tokens, self._blocks.block_size)))

    def work_ms(self, worker_index: int, prompt_tokens: int, cached_vram: int, cached_dram: int,
                output_tokens: int) -> float:
        return request_work_ms(self._timings[worker_index], prompt_tokens, cached_vram, cached_dram, output_tokens)

    def uncached_work_ms(self, prompt_tokens: int, output_tokens: int) -> np.ndarray:
        """``work_ms`` on every worker with nothing cached (one vector, not a call per worker)."""
        if self._uncached is None:
            self._uncached = (np.array([t.prefill_ms(1) for t in self._timings]),
                              np.array([decode_share_ms(t, 2) for t in self._timings]))
        per_prompt, per_output = self._uncached
        return per_prompt * prompt_tokens + per_output * (output_tokens - 1)


class Simulation:
    # A request's prefill starts only when its prompt's KV fits in VRAM beside the pages the
    # running requests pin (SGLang's PrefillAdder; PrefixCache.lock(only_if_room=True)).
    _admit_only_if_room = True
    # A worker's room report is empty while it has a context's worth of pages free (False: the
    # full steps always, as before; tests compare the two).
    _room_cut_at_context = True

    def __init__(self, topo: Topology, policy: RoutingPolicy, settings: SimSettings = SimSettings()) -> None:
        self.topo = topo
        self.policy = policy
        # A policy that models its own update transport (KVCompass: agent -> shard -> edge, with
        # gap detection) takes the delay/loss settings over, so they are not applied twice.
        adopt = getattr(policy, "adopt_update_transport", None)
        if adopt is not None:
            settings = adopt(settings)
        self.s = settings
        self.rng = np.random.default_rng(settings.seed)
        overrides = {} if settings.decode_batch_slope is None else {"decode_batch_slope": settings.decode_batch_slope}
        cfg = topo.config
        self.timings = [
            WorkerTiming.from_worker_config(cfg.worker(w), reload_ms_per_token=topo.gamma_ms_per_token, **overrides)
            for w in topo.worker_ids
        ]
        # Each region's workers (a response carries its region's queue vector): read per response
        self._region_members = [topo.workers_in(r) for r in range(len(topo.regions))]
        # A policy that reads no cache events (it keeps BasePolicy's no-op) gets none built, when
        # nothing else needs them: no truth map, and no loss or delay draws that depend on them.
        attach = getattr(policy, "attach_exact_state", None)  # an oracle's privilege; no real router has it
        silent = (isinstance(policy, BasePolicy) and type(policy).on_cache_events is BasePolicy.on_cache_events
                  and not settings.track_truth and settings.update_loss == 0 and settings.update_delay_ms == 0
                  and attach is None)
        self.caches = [
            PrefixCache(block_size=topo.block_size, vram_tokens=cfg.worker(w).vram_kv_tokens,
                        dram_tokens=cfg.worker(w).dram_kv_tokens, policy=settings.eviction, emit_events=not silent)
            for w in topo.worker_ids
        ]
        # A worker's queue report counts the wait for VRAM room its cache imposes (the model
        # runs ahead with each request's pages: ``_footprint``).
        room = self._admit_only_if_room
        self.models = [
            WorkerQueueModel(t, prefill_starts=functools.partial(self._prefill_starts, w),
                             prefill_ends=functools.partial(self._prefill_ends, w),
                             finished=functools.partial(self._finished, w),
                             footprint=functools.partial(self._footprint, w) if room else None,
                             vram_pages=self.caches[w].vram_pages_max if room else None)
            for w, t in enumerate(self.timings)
        ]
        # The exact global cache map, applied as the caches change (no delay, no loss): for the
        # cross-region-only share and false-lookup causes (``truth``), and for an oracle.
        exact_map = (GlobalBlockMap(topo.n_workers, topo.block_size)
                     if settings.track_truth or attach is not None else None)
        self._exact_map = exact_map
        self.truth = exact_map if settings.track_truth else None
        if self.truth is not None:
            policy.on_truth_tracked()
        self._exact_state = None
        if attach is not None:
            self._exact_state = ExactWorkerState(self.caches, self.timings, exact_map)
            attach(self._exact_state)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._wake_version = [0] * topo.n_workers
        self._wake_at = [float("inf")] * topo.n_workers
        self._inflight: dict[int, _InFlight] = {}
        self._last_q = np.zeros(topo.n_workers)
        self._last_q_at = np.zeros(topo.n_workers)
        self._last_exact_at = np.full(topo.n_workers, -1.0)
        # A policy that reads neither live load nor piggybacked queue vectors (the hashing
        # schemes) is not sent load reports: they would cost a queue probe each, for nothing.
        self._reads_load = not (getattr(type(policy), "on_worker_load", None) is BasePolicy.on_worker_load
                                and getattr(type(policy), "on_response", None) is BasePolicy.on_response)
        # A policy that overrides on_request_end is told when each request's end reaches its edge.
        self._tells_end = (getattr(type(policy), "on_request_end", BasePolicy.on_request_end)
                           is not BasePolicy.on_request_end)
        # A policy that overrides on_worker_room is told, with each exact reading, when the
        # worker's VRAM frees up (a long prompt waits for room that the queue figure leaves out).
        self._tells_room = (room and getattr(type(policy), "on_worker_room", BasePolicy.on_worker_room)
                            is not BasePolicy.on_worker_room)
        # No prompt is longer than the model's context (a front door refuses it), so a worker
        # with a context's worth of pages free has nothing to tell: its room reads empty. A
        # replayed trace may hold longer prompts (Mooncake's reach 191 K tokens against the
        # configs' 128 K): the horizon is then the longest prompt so far (_arrive), and each
        # prompt that lengthens it is routed on reports cut at the shorter one.
        self._room_enough_pages = (-(-cfg.index.context_tokens // topo.block_size)
                                   if self._room_cut_at_context else None)
        self._rows: dict[str, list] = {f: [] for f in RECORD_FIELDS}
        self._load: dict[tuple[int, int], float] = {}
        self.events_delivered = 0
        self.events_lost = 0
        self.migrations = 0
        self.now = 0.0

    # ------------------------------------------------------------------------------ helpers

    def _push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._heap, (t, self._seq, kind, payload))
        self._seq += 1

    def _one_way_s(self, a: int, b: int) -> float:
        ms = self.topo.one_way_ms[a, b]
        if self.s.wan_jitter > 0 and a != b:
            ms *= max(0.0, 1.0 + self.rng.uniform(-self.s.wan_jitter, self.s.wan_jitter))
        return ms / 1000.0

    def _emit_cache_events(self, w: int, events: list, now: float) -> None:
        if not events:
            return
        if self._exact_map is not None:
            self._exact_map.apply(w, events)
        if self.s.update_loss > 0 and self.rng.random() < self.s.update_loss:
            self.events_lost += len(events)
            return
        if self.s.update_delay_ms > 0:
            self._push(now + self.s.update_delay_ms / 1000.0, _DELIVER, (w, events))
        else:
            self.events_delivered += len(events)
            self.policy.on_cache_events(w, events, now=now)

    def _notify_load(self, w: int, now: float, added_ms: float = 0.0) -> None:
        """Report ``w``'s queueing delay and running count. With a free slot the model's exact ``queue_ms`` is read
        at most every ``load_report_ms`` per worker, as an agent polling its engine would; in
        between the estimate drains at 1 ms/ms and grows by each admitted request's prefill time.
        While requests wait for a slot, or the head of the queue for VRAM room, it is read at
        every change: the backlog then moves with every release, not with time, and the model
        answers from its run-ahead shadow in O(slots)."""
        if not self._reads_load:
            return
        last = self._last_exact_at[w]
        model = self.models[w]
        if model.waiting > 0 or model.head_blocked or now - last >= self.s.load_report_ms / 1000.0 or last < 0:
            q = model.queue_ms(now=now)
            self._last_exact_at[w] = now
            if self._tells_room:
                page = self.caches[w].block_size
                steps = tuple((ms, pages * page)
                              for ms, pages in model.room_steps(now=now, enough_pages=self._room_enough_pages))
                self.policy.on_worker_room(w, steps, now=now)
        else:
            q = max(0.0, self._last_q[w] - (now - self._last_q_at[w]) * 1000.0) + added_ms
        self._last_q[w] = q
        self._last_q_at[w] = now
        self.policy.on_worker_load(w, q, now=now, running=self.models[w].running)

    def _schedule_wake(self, w: int) -> None:
        t = self.models[w].next_event_time()
        if t is None:
            self._wake_at[w] = float("inf")
            return
        if t < self._wake_at[w] - 1e-12 or self._wake_at[w] < self.now:
            self._wake_version[w] += 1
            self._wake_at[w] = t
            self._push(t, _WAKE, (w, self._wake_version[w]))

    def _remote_only(self, best: dict[int, tuple[int, Any]], region: int) -> int:
        local = max((n for w, (n, _) in best.items() if self.topo.worker_region[w] == region), default=0)
        remote = max((n for w, (n, _) in best.items() if self.topo.worker_region[w] != region), default=0)
        if max(local, remote) < REMOTE_ONLY_MIN_TOKENS:
            return -1  # no reusable prefix of the threshold length
        return int(local < REMOTE_ONLY_MIN_TOKENS)

    # ------------------------------------------------------------------------------ handlers

    def _arrive(self, req: Request, now: float) -> None:
        topo = self.topo
        enough = self._room_enough_pages  # (a trace's prompt past the context: __init__)
        if enough is not None and len(req.tokens) > enough * topo.block_size:
            self._room_enough_pages = -(-len(req.tokens) // topo.block_size)
        region = topo.region_index(req.region)
        decision = self.policy.route(req, now=now)
        w = decision.worker_index
        if not 0 <= w < topo.n_workers:
            raise PolicyError(f"{getattr(self.policy, 'name', self.policy)} routed to worker {w} of {topo.n_workers}")
        st = _InFlight(req, w, decision.claimed_tokens, decision.lookup_delay_ms, region)
        if self.truth is not None:
            best = self.truth.longest(chain_keys(req.tokens, self.topo.block_size))
            st.remote_only = self._remote_only(best, region)
            st.held_at_decision = best.get(w, (0, None))[0]
            if st.held_at_decision < st.claimed:  # a false claim in the making: ask why now
                st.claim_source = self.policy.explain_claim(req, decision, now=now)
        self._inflight[str(req.id)] = st
        t = now + decision.lookup_delay_ms / 1000.0 + self._one_way_s(region, int(topo.worker_region[w]))
        self._push(t, _AT_WORKER, str(req.id))
        self._take_migrations(now)

    def _take_migrations(self, now: float) -> None:
        take = getattr(self.policy, "take_migrations", None)
        if take is None:
            return
        for order in take():
            if not isinstance(order, MigrationOrdered) or not 0 <= order.dest_worker < self.topo.n_workers:
                raise PolicyError(f"bad migration order {order!r}")
            self.migrations += 1
            dest_region = int(self.topo.worker_region[order.dest_worker])
            src = order.source_worker
            if 0 <= src < self.topo.n_workers and int(self.topo.worker_region[src]) == dest_region:
                transfer_s = len(order.tokens) * KV_BYTES_PER_TOKEN * 8 / (INTRA_REGION_GBPS * 1e9)
                self._push(now + transfer_s + self._one_way_s(dest_region, dest_region), _COPY, order)
            else:
                src_region = int(self.topo.worker_region[src]) if 0 <= src < self.topo.n_workers else dest_region
                key = f"m{self.migrations}"
                req = Request(0, 0.0, self.topo.regions[dest_region], -1, order.tokens.astype(np.uint32), 1, "")
                self._inflight[key] = _InFlight(req, order.dest_worker, 0, 0.0, dest_region, migration=True)
                self._push(now + self._one_way_s(src_region, dest_region), _AT_WORKER, key)

    def _at_worker(self, rid: str, now: float) -> None:
        """The request reaches its worker: it queues with what the cache holds now as the
        estimate of its reuse (the queue report's); the match that counts is at its prefill's
        start (``_prefill_starts``)."""
        st = self._inflight[rid]
        w, req = st.worker, st.req
        st.at_worker = now
        match = self.caches[w].match(req.tokens)
        vram, dram = usable_cached(match.vram_tokens, match.dram_tokens, req.prompt_tokens)
        self.models[w].admit(rid, req.prompt_tokens, vram, dram, self._output_tokens_here(st), now=now)
        self._process_worker(w, now, admitted=self.timings[w].prefill_ms(req.prompt_tokens - vram - dram, dram))

    def _output_tokens_here(self, st: _InFlight) -> int:
        """Tokens the worker the request is at produces (a prefill-only worker: one)."""
        return st.req.output_tokens

    def _prefill_starts(self, w: int, rid: str, now: float) -> tuple[int, int] | None:
        """``w`` starts the request's prefill at ``now``: match and pin its cached prefix
        (reloading the DRAM part); returns the (VRAM, DRAM) tokens it reuses. None while its
        prompt's KV does not fit beside the running requests' (``_admit_only_if_room``)."""
        st = self._inflight[rid]
        req = st.req
        held = self.caches[w].match(req.tokens) if self.truth is not None and st.claimed else None
        locked = self.caches[w].lock(req.tokens, now=now, only_if_room=self._admit_only_if_room)
        if locked is None:
            return None
        lease, match, events = locked
        if held is not None:  # for false_cause: a DRAM copy the lock found no VRAM to reload into
            st.reload_short = (match.vram_tokens + match.dram_tokens < held.vram_tokens + held.dram_tokens
                               and held.vram_tokens + held.dram_tokens >= st.claimed)
        vram, dram = usable_cached(match.vram_tokens, match.dram_tokens, req.prompt_tokens)
        st.lease, st.cached_vram, st.cached_dram = lease, vram, dram
        self._emit_cache_events(w, events, now)
        self._account_load(w, now, st)
        return vram, dram

    def _prefill_ends(self, w: int, rid: str, now: float) -> None:
        """``w`` computed the request's prompt at ``now``: its KV enters the cache before the
        next prefill starts (in SGLang, ``cache_unfinished_req`` after the prefill batch)."""
        st = self._inflight[rid]
        self._emit_cache_events(w, self.caches[w].insert(st.req.tokens, now=now, lease=st.lease), now)
        st.pinned_pages = tuple(st.lease.pages)

    def _footprint(self, w: int, rid: str) -> tuple[int, ...]:
        """The pages the request pins on ``w`` while it runs, root first (for the queue report's
        run-ahead): its lease's once its prompt is cached, else every full page of its prompt."""
        st = self._inflight[rid]
        if st.pinned_pages is not None:
            return st.pinned_pages
        if st.path_pages is None:
            st.path_pages = tuple(self.caches[w].path_ids(st.req.tokens))
        return st.path_pages

    def _finished(self, w: int, rid: str, now: float) -> None:
        """``w`` produced the request's last token at ``now``: its pages are released before
        the worker schedules anything else (``cache_finished_req``)."""
        self.caches[w].unlock(self._inflight[rid].lease)

    def _account_load(self, w: int, now: float, st: _InFlight) -> None:
        work = request_work_ms(self.timings[w], st.req.prompt_tokens, st.cached_vram, st.cached_dram,
                               st.req.output_tokens)
        key = (w, int(now // self.s.load_bin_s))
        self._load[key] = self._load.get(key, 0.0) + work
        if self._exact_state is not None and self._exact_state.on_work_accounted is not None:
            self._exact_state.on_work_accounted(w, None if st.migration else int(st.req.id), work)

    def _process_worker(self, w: int, now: float, *, admitted: float | None = None) -> None:
        model = self.models[w]
        # The queue estimate changes with admissions and prefill completions, the running count
        # with completions: the daemon's agent sends a reading that moved past its tolerance, or
        # reached zero, at once (pacing.LoadReports), and a count left stale after a worker's
        # last decode ends shows it busy to the score's occupancy term. Nothing else is reported.
        changed = admitted is not None or model.waiting > 0 or model.head_blocked
        for ev in model.advance(now=now):
            rid = ev.request_id
            st = self._inflight[rid]
            if st.migration:
                if isinstance(ev, RequestFinished):  # (cached at its prefill's end, released at its finish)
                    changed = True
                    del self._inflight[rid]
                continue
            if isinstance(ev, FirstTokenProduced):
                changed = True
                self._prefilled(w, st, ev.at)
            elif isinstance(ev, RequestFinished):
                changed = True
                self._served(w, rid, st, ev.at)
        if changed or model.waiting > 0 or model.head_blocked:
            self._notify_load(w, now, admitted or 0.0)
        self._schedule_wake(w)

    def _prefilled(self, w: int, st: _InFlight, at: float) -> None:
        """``w`` finished the prompt's prefill at ``at`` (its first token; the prompt's KV
        entered the cache then, ``_prefill_ends``): the response (reused tokens, the region's
        queue vector) leaves."""
        st.first_token_at = at
        back = self._one_way_s(int(self.topo.worker_region[w]), st.edge_region)
        st.ttft_s = at + back - st.req.arrival_s
        members = self._region_members[self.topo.worker_region[w]]
        qv = np.maximum(0.0, self._last_q[members] - (at - self._last_q_at[members]) * 1000.0)
        reused = st.cached_vram + st.cached_dram
        self._push(at + back, _RESPONSE, (st.req, w, reused, dict(zip(members.tolist(), qv.tolist()))))

    def _served(self, w: int, rid: str, st: _InFlight, at: float) -> None:
        """``w`` produced the request's last token at ``at`` (its pages were released then,
        ``_finished``)."""
        back = self._one_way_s(int(self.topo.worker_region[w]), st.edge_region)
        self._record(st, at + back)
        if self._tells_end:
            self._push(at + back, _END, (st.req, w))
        del self._inflight[rid]

    def _other_event(self, kind: int, payload: Any, now: float) -> None:
        """An event kind a subclass added (``FIRST_SUBCLASS_EVENT`` and up)."""
        raise SimulationError(f"unknown event kind {kind}")

    def _false_cause(self, st: _InFlight) -> int:
        if st.held_at_decision < 0:
            return -1
        reused = st.cached_vram + st.cached_dram
        if st.claimed <= reused:
            return 0
        if st.held_at_decision >= st.claimed:
            return FALSE_NO_VRAM_ROOM if st.reload_short else FALSE_LOST_IN_FLIGHT
        page = self.topo.block_size
        if st.held_at_decision >= st.claimed // page * page:
            return FALSE_WITHIN_PAGE
        return st.claim_source

    def _record(self, st: _InFlight, done_at_user: float) -> None:
        req, rows = st.req, self._rows
        timing = self.timings[st.worker]
        prefill = timing.prefill_ms(req.prompt_tokens - st.cached_vram - st.cached_dram, st.cached_dram)
        decode = decode_share_ms(timing, req.output_tokens)
        values = (
            req.id, req.arrival_s, st.edge_region, st.worker, int(self.topo.worker_region[st.worker]), req.session,
            req.prompt_tokens, req.output_tokens, st.claimed, st.cached_vram + st.cached_dram, st.cached_dram,
            st.lookup_ms, st.ttft_s * 1000.0, (done_at_user - req.arrival_s) * 1000.0, done_at_user,
            prefill + decode, st.remote_only,
            max(0.0, (st.first_token_at - st.at_worker) * 1000.0 - prefill),  # wait before prefill started
            st.held_at_decision, self._false_cause(st),
        )
        for f, v in zip(RECORD_FIELDS, values):
            rows[f].append(v)
        if self.s.clients is not None:
            self._push(done_at_user, _CLIENT_FREE, None)  # the client has its answer: it may send again

    # ------------------------------------------------------------------------------ loop

    def release(self) -> None:
        """Drop everything the run built (``simulate`` calls it once the result is out). The
        workers' callbacks are partials of this Simulation's methods, a reference cycle through
        every worker, cache and page that only a full garbage collection would free; without the
        references it is freed as soon as the caller lets go of it. The Simulation is unusable
        afterwards."""
        self.__dict__.clear()

    def run(self, requests: Iterable[Request], *, max_requests: int | None = None,
            duration_s: float | None = None) -> SimResult:
        """Replay ``requests`` (arrival-ordered) until ``max_requests`` arrived or ``duration_s``
        of virtual time passed, then drain every admitted request to completion."""
        it: Iterator[Request] = iter(requests)
        started = time.perf_counter()
        bar = None
        if self.s.progress:
            from tqdm import tqdm

            bar = tqdm(total=max_requests, unit="req", desc=getattr(self.policy, "name", "sim"), leave=False)
        arrived = 0
        last_arrival = -1.0
        clients = self.s.clients
        outstanding = 0  # closed loop: requests sent whose response the client has not had yet
        held: Request | None = None  # closed loop: the next request, waiting for a free client

        pending_arrivals = 0  # arrivals pushed and not yet routed
        exhausted = False  # the stream has nothing more to send

        def send(req: Request, at: float) -> None:
            nonlocal outstanding, pending_arrivals
            # Never in the past: a request due earlier than now was waiting for this free client
            # (one freed at the instant the previous request was sent, say).
            at = max(at, self.now)
            outstanding += 1
            pending_arrivals += 1
            self._push(at, _ARRIVE, req if at == req.arrival_s else replace(req, arrival_s=at))

        def pull() -> None:
            nonlocal arrived, last_arrival, held, pending_arrivals, exhausted
            if max_requests is not None and arrived >= max_requests:
                exhausted = True
                return
            req = next(it, None)
            if req is None or (duration_s is not None and req.arrival_s >= duration_s):
                exhausted = True
                return
            if req.arrival_s < last_arrival:
                raise SimulationError(f"requests must arrive in order: {req.arrival_s} after {last_arrival}")
            last_arrival = req.arrival_s
            arrived += 1
            if clients is None:
                pending_arrivals += 1
                self._push(req.arrival_s, _ARRIVE, req)
            elif outstanding < clients:
                send(req, req.arrival_s)
            else:
                held = req

        pull()
        policy = self.policy
        stalled = 0
        while self._heap:
            t_next = self._heap[0][0]
            timer = policy.next_timer()
            if timer is not None and timer <= t_next:
                stalled = stalled + 1 if timer <= self.now else 0
                if stalled > 10_000:
                    raise SimulationError(f"{getattr(policy, 'name', policy)}: timer stuck at {timer}")
                self.now = max(self.now, timer)
                policy.on_timer(now=self.now)
                self._take_migrations(self.now)
                continue
            t, _, kind, payload = heapq.heappop(self._heap)
            self.now = t
            if kind == _ARRIVE:
                pending_arrivals -= 1
                self._arrive(payload, t)
                pull()
                if exhausted and held is None and pending_arrivals == 0:
                    end = getattr(policy, "on_arrivals_end", None)  # once: nothing is left to arrive
                    if end is not None:
                        end(now=t)
                if bar is not None:
                    bar.update(1)
            elif kind == _AT_WORKER:
                self._at_worker(payload, t)
            elif kind == _WAKE:
                w, version = payload
                if version == self._wake_version[w]:
                    self._wake_at[w] = float("inf")
                    self._process_worker(w, t)
            elif kind == _RESPONSE:
                req, w, reused, qv = payload
                policy.on_response(w, req, reused, qv, now=t)
            elif kind == _END:
                req, w = payload
                policy.on_request_end(w, req, now=t)
            elif kind == _COPY:
                order = payload
                self._emit_cache_events(order.dest_worker, self.caches[order.dest_worker].insert(order.tokens, now=t), t)
            elif kind == _DELIVER:
                w, events = payload
                self.events_delivered += len(events)
                policy.on_cache_events(w, events, now=t)
            elif kind == _CLIENT_FREE:
                outstanding -= 1
                if held is not None:
                    req, held = held, None
                    send(req, req.arrival_s)
            else:
                self._other_event(kind, payload, t)
        if bar is not None:
            bar.close()
        if self._inflight:
            raise SimulationError(f"{len(self._inflight)} requests never completed")
        return self._result(time.perf_counter() - started)

    def _result(self, wall_s: float) -> SimResult:
        records = {f: np.asarray(v) for f, v in self._rows.items()}
        order = np.argsort(records["id"], kind="stable")
        records = {f: v[order] for f, v in records.items()}
        n_bins = 1 + max((b for _, b in self._load), default=0)
        bins = np.zeros((self.topo.n_workers, n_bins))
        for (w, b), ms in self._load.items():
            bins[w, b] += ms
        extra: dict[str, Any] = {"migrations": self.migrations}
        for attr in ("hops_total", "lookups", "lf_bound_slack"):
            if hasattr(self.policy, attr):
                extra[attr] = getattr(self.policy, attr)
        for outcome, n in getattr(self.policy, "hot_misses_by_outcome", {}).items():
            extra[f"hot_misses_{outcome}"] = n
        # Events a silent cache only counted would all have been delivered (no loss, no delay).
        delivered = self.events_delivered + sum(c.events_unsent for c in self.caches)
        return SimResult(getattr(self.policy, "name", type(self.policy).__name__), records, bins,
                         self.s.load_bin_s, wall_s, delivered, self.events_lost, extra)


def request_window(requests: Iterable[Request], *, duration_s: float | None,
                   max_requests: int | None = None) -> list[Request]:
    """The requests ``simulate`` pulls from ``requests`` (those arriving before ``duration_s``, at
    most ``max_requests``), as a list that replays across schemes exactly as a fresh run."""
    if duration_s is not None:
        requests = itertools.takewhile(lambda r: r.arrival_s < duration_s, requests)
    return list(itertools.islice(requests, max_requests))


def simulate(topo: Topology, policy: RoutingPolicy, requests: Iterable[Request], *,
             settings: SimSettings = SimSettings(), max_requests: int | None = None,
             duration_s: float | None = None) -> SimResult:
    """One run of ``policy`` over ``requests`` on a fresh set of workers (prefill and decode
    pools when the deployment has prefill or decode workers: ``sim.disaggregated``)."""
    cls = Simulation
    if getattr(topo.config, "disaggregated", False):
        from .disaggregated import DisaggregatedSimulation as cls  # imports this module
    with collections_paused():
        sim = cls(topo, policy, settings)
        try:
            return sim.run(requests, max_requests=max_requests, duration_s=duration_s)
        finally:
            sim.release()


# A request stream (cli._stream) is many objects that live long and no cycles. At the default
# thresholds (700, 10, 10) the collector rescans them again and again; runs used these too (a
# KVCompass point, Mixed, 3000 req/s, 7.5 s on 64x8: 69.0 CPU-s at the defaults, 56.4 with these)
# before they ran without automatic collection (collections_paused).
_SIM_GC_THRESHOLDS = (50_000, 20, 100)


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """No automatic garbage collection inside (``simulate``). A run allocates millions of objects
    that live until it ends and makes no reference cycles but the Simulation's own (its workers'
    callbacks), which ``Simulation.release`` breaks: with the collector on, its passes over a
    1,024 x 64 KVCompass run (0.5 s of arrivals) found nothing until the finished Simulation and
    took 13 % of the run's CPU (gen0/gen1 passes 1.7 s, the full pass that freed the Simulation
    1.3 s, of 23.4 s). On the way out what the run made joins the oldest generation without a
    scan (freeze, unfreeze), as it would have after surviving the passes; cyclic garbage made
    inside (none seen) waits for the process's next full collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        if enabled:
            gc.enable()


@contextlib.contextmanager
def sparse_collections() -> Iterator[None]:
    saved = gc.get_threshold()
    gc.set_threshold(*_SIM_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*saved)
