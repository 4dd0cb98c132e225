"""The routing-policy interface of the simulator, the deployment topology policies are built on,
and shared helpers (load views that age correctly, delayed application of reports).

What each policy may see is part of its design, and the engine gives every policy the same
feeds; each policy documents which of them it reads:

- ``route(req, now)``: the request (its tokens and its edge region) at its arrival time.
- ``on_cache_events(w, events, now)``: worker ``w``'s engine block events (SGLang format),
  delivered after the configured update delay and loss (§5.7).
- ``on_response(w, req, reused, queue_vector, now)``: when a response reaches the edge, the
  tokens the worker actually reused and the queue estimates of the workers in ``w``'s region
  (piggybacked, as in KVCompass).
- ``on_request_end(w, req, now)``: when the request's last token reaches its edge (only a
  policy that overrides :class:`BasePolicy`'s no-op is told).
- ``on_worker_load(w, queue_ms, now)``: the true queueing delay of ``w`` whenever it changes.
  Only designs that read live load (a region's own balancer reading its local workers) may use
  it, and only for the workers they could see.
- optional ``attach_exact_state(state)``: the simulator's exact worker state
  (``engine.ExactWorkerState``: every cache as it is now, each request's compute as the load
  factor counts it). No real router has it; only the load-balance oracle, a bound, reads it.
- ``next_timer()/on_timer(now)``: periodic work such as broadcasts.
- optional ``take_migrations() -> list[MigrationOrdered]``: polled after every route and timer;
  the engine carries the orders out (intra-region copy at ``INTRA_REGION_GBPS``, or shipping the
  prompt over the WAN and recomputing it on the destination's GPU).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .workloads import Request


class PolicyError(ValueError):
    """A policy was misconfigured or returned an invalid decision."""


# Why a claim was false (the simulator's exact cache map tells when; ``false_cause`` in records):
FALSE_LOST_IN_FLIGHT = 1  # the worker held the claim when chosen and lost it before the request came
FALSE_WITHIN_PAGE = 2     # it held every full page below the claim: the prompt diverges inside the
                          # page that holds the claimed length (an indexed length between page ends)
FALSE_VIEW_AHEAD = 3      # it held less than that already when chosen: a stale or false index entry
# ... and the policy (``BasePolicy.explain_claim``) tells which, from its index at the decision:
FALSE_INDEX_BEHIND = 4    # the index still listed the worker: its eviction had not reached the index
FALSE_VIEW_BEHIND = 5     # the index had dropped it, but the edge's view had not applied that batch yet
FALSE_KEYLESS = 6         # the view had every change to the key and still named the worker: a keyless false hit
FALSE_PENDING = 7         # the edge credited a prompt it had just sent the worker (pending ledger), not yet held
FALSE_NO_VRAM_ROOM = 8    # it still held the claim when the request came, partly in DRAM, and found no unpinned
                          # VRAM to reload it into (the requests ahead pin theirs): a loaded holder

@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Forward to ``worker_index`` after ``lookup_delay_ms`` of discovery (directory RTT, DHT
    hops); ``claimed_tokens`` is the cached prefix the policy believes the worker holds."""

    worker_index: int
    lookup_delay_ms: float = 0.0
    claimed_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.worker_index, (int, np.integer)) or self.worker_index < 0:
            raise PolicyError(f"worker_index must be a non-negative int, got {self.worker_index!r}")
        object.__setattr__(self, "worker_index", int(self.worker_index))
        if not (self.lookup_delay_ms >= 0 and np.isfinite(self.lookup_delay_ms)):
            raise PolicyError(f"lookup_delay_ms must be finite and >= 0, got {self.lookup_delay_ms!r}")
        if self.claimed_tokens < 0:
            raise PolicyError(f"claimed_tokens must be >= 0, got {self.claimed_tokens!r}")


@dataclass(frozen=True, slots=True, eq=False)
class MigrationOrdered:
    """Make ``dest_worker`` hold ``tokens``' prefix: copied from ``source_worker`` when both are
    in one region (tensor transfer), else the prompt is shipped and recomputed (§3.4)."""

    dest_worker: int
    tokens: np.ndarray
    source_worker: int = -1

    def __post_init__(self) -> None:
        if self.dest_worker < 0:
            raise PolicyError(f"dest_worker must be >= 0, got {self.dest_worker}")
        if not isinstance(self.tokens, np.ndarray) or self.tokens.ndim != 1 or len(self.tokens) == 0:
            raise PolicyError("migration tokens must be a non-empty 1-D array")


@runtime_checkable
class RoutingPolicy(Protocol):
    name: str

    def route(self, req: Request, *, now: float) -> RouteDecision: ...

    def on_cache_events(self, worker_index: int, events: Sequence[Any], *, now: float) -> None: ...

    def on_response(self, worker_index: int, req: Request, reused_tokens: int,
                    queue_vector: Mapping[int, float], *, now: float) -> None: ...

    def on_worker_load(self, worker_index: int, queue_ms: float, *, now: float, running: int = 0) -> None: ...

    def next_timer(self) -> float | None: ...

    def on_timer(self, *, now: float) -> None: ...


@dataclass(frozen=True, slots=True)
class Topology:
    """The static deployment as policies and the engine see it (indices, not names)."""

    config: Any  # kvcompassd.core.config.ClusterConfig
    regions: tuple[str, ...]
    worker_ids: tuple[str, ...]
    worker_region: np.ndarray  # region index of each worker
    one_way_ms: np.ndarray  # R x R, diagonal = intra-region one-way
    prefill_ms_per_token: np.ndarray
    decode_ms_per_token: np.ndarray
    max_running: np.ndarray
    gamma_ms_per_token: float
    block_size: int  # page size of the simulated engines' prefix caches (tokens per KV event block)
    # Workers a request may be routed to: all but a disaggregated fleet's decode workers, which
    # only receive KV a prefill worker of their region hands over (config ``routable``).
    routable: np.ndarray = None  # type: ignore[assignment]  # bool per worker; None: all

    def __post_init__(self) -> None:
        if self.routable is None:
            object.__setattr__(self, "routable", np.ones(len(self.worker_ids), dtype=bool))

    @classmethod
    def from_config(cls, cfg: Any, *, page_tokens: int | None = None) -> Topology:
        """``page_tokens`` overrides the engine page size of the simulated caches (default: the
        index block size). Larger pages mean fewer blocks and events per prompt, so a faster
        simulation, at the price of reuse granularity; the index keeps its own lengths."""
        if page_tokens is not None and (page_tokens <= 0 or page_tokens % cfg.index.block_size):
            raise PolicyError(f"page_tokens must be a positive multiple of the index block size "
                              f"{cfg.index.block_size}, got {page_tokens}")
        regions = tuple(cfg.region_names())
        ridx = {r: i for i, r in enumerate(regions)}
        workers = [cfg.worker(w) for w in cfg.worker_ids()]
        owm = np.zeros((len(regions), len(regions)))
        for i, a in enumerate(regions):
            for j, b in enumerate(regions):
                owm[i, j] = cfg.intra_region_one_way_ms if i == j else cfg.one_way_ms(a, b)
        return cls(
            config=cfg,
            regions=regions,
            worker_ids=tuple(w.id for w in workers),
            worker_region=np.array([ridx[w.region] for w in workers], dtype=np.int64),
            one_way_ms=owm,
            prefill_ms_per_token=np.array([w.prefill_ms_per_token for w in workers], dtype=float),
            decode_ms_per_token=np.array([w.decode_ms_per_token for w in workers], dtype=float),
            max_running=np.array([w.max_running for w in workers], dtype=np.int64),
            gamma_ms_per_token=float(cfg.score.gamma_ms_per_token),
            block_size=int(page_tokens or cfg.index.block_size),
            routable=np.array([cfg.routable(w) for w in workers], dtype=bool),
        )

    @property
    def n_workers(self) -> int:
        return len(self.worker_ids)

    def region_index(self, name: str) -> int:
        try:
            return self.regions.index(name)
        except ValueError:
            raise PolicyError(f"unknown region {name!r}; deployment has {self.regions}") from None

    def workers_in(self, region: int) -> np.ndarray:
        return np.flatnonzero(self.worker_region == region)

    @property
    def routable_workers(self) -> np.ndarray:
        """Indexes of the workers requests may be routed to, in config order."""
        return np.flatnonzero(self.routable)

    def rtt_to_workers(self, region: int) -> np.ndarray:
        """Round trip from an edge in ``region`` to every worker."""
        return 2.0 * self.one_way_ms[region, self.worker_region]


class LoadView:
    """Per-worker queueing delay as last reported, aged by the time since the report: a FIFO
    prefill queue drains at one ms per ms, so ``max(0, q - (now - t))`` is the best estimate."""

    def __init__(self, n: int) -> None:
        self.queue_ms = np.zeros(n)
        self.at_s = np.zeros(n)

    def set(self, w: int, queue_ms: float, now: float) -> None:
        self.queue_ms[w] = queue_ms
        self.at_s[w] = now

    def current(self, now: float, idx: np.ndarray | None = None) -> np.ndarray:
        if idx is None:
            return np.maximum(0.0, self.queue_ms - (now - self.at_s) * 1000.0)
        return np.maximum(0.0, self.queue_ms[idx] - (now - self.at_s[idx]) * 1000.0)

    def add(self, w: int, work_ms: float, now: float) -> None:
        """Count work a router just sent to ``w`` until a report that includes it replaces the
        value (as KVCompass's edge does, ``QueueEstimates.note_dispatched``): without it every
        request routed inside one report interval sees the same least-loaded worker."""
        self.queue_ms[w] = max(0.0, self.queue_ms[w] - (now - self.at_s[w]) * 1000.0) + work_ms
        self.at_s[w] = now

    def copy_from(self, other: LoadView, idx: np.ndarray) -> None:
        self.queue_ms[idx] = other.queue_ms[idx]
        self.at_s[idx] = other.at_s[idx]


class DelayQueue:
    """Items that take effect at a later virtual time (reports crossing the WAN)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = 0

    def push(self, due_s: float, item: Any) -> None:
        heapq.heappush(self._heap, (due_s, self._seq, item))
        self._seq += 1

    def pop_due(self, now: float) -> list[Any]:
        out = []
        while self._heap and self._heap[0][0] <= now:
            out.append(heapq.heappop(self._heap)[2])
        return out

    def __len__(self) -> int:
        return len(self._heap)


class BasePolicy:
    """No-op defaults for the optional feeds."""

    name = "base"

    def __init__(self, topo: Topology) -> None:
        self.topo = topo

    def route(self, req: Request, *, now: float) -> RouteDecision:  # pragma: no cover - abstract
        raise NotImplementedError

    def on_cache_events(self, worker_index: int, events: Sequence[Any], *, now: float) -> None:
        return None

    def on_response(self, worker_index: int, req: Request, reused_tokens: int,
                    queue_vector: Mapping[int, float], *, now: float) -> None:
        return None

    def on_request_end(self, worker_index: int, req: Request, *, now: float) -> None:
        return None

    def on_truth_tracked(self) -> None:
        """The engine keeps the exact cache map and will ask ``explain_claim``: keep what it needs."""
        return None

    def explain_claim(self, req: Request, decision: RouteDecision, *, now: float) -> int:
        """Why the worker held less than ``decision`` claimed when it was chosen (the engine asks
        only then, with the exact cache map tracked): a ``FALSE_*`` code. A policy that
        cannot tell says ``FALSE_VIEW_AHEAD`` (stale or false entry)."""
        return FALSE_VIEW_AHEAD

    def on_worker_load(self, worker_index: int, queue_ms: float, *, now: float, running: int = 0) -> None:
        return None

    def on_worker_room(self, worker_index: int, steps: tuple[tuple[float, int], ...], *, now: float) -> None:
        """With each exact load reading, when ``w``'s VRAM frees up: ``(ms from now, free
        tokens from then on)`` steps (``WorkerQueueModel.room_steps`` in tokens; empty: all
        free). Only a policy that overrides this is sent them."""
        return None

    def next_timer(self) -> float | None:
        return None

    def on_timer(self, *, now: float) -> None:
        return None

    def on_arrivals_end(self, *, now: float) -> None:
        """Every request of the run has been routed (the engine says so once): what only feeds
        later decisions may stop. The run still drains the requests in flight."""
        return None


def hash_prefix_lengths(levels: int = 6, first: int = 64) -> tuple[int, ...]:
    """The six content-hash levels of the hash-placement baselines: doubling from 64 tokens
    (64 ... 2048), mirroring KVCompass's own-region level ladder."""
    return tuple(first << k for k in range(levels))
