"""SkyWalker (EuroSys'26; paper baseline 5): a load balancer in every region.

Each regional balancer keeps a prefix tree of the prompts it routed (no engine events) and
reads its own replicas' load live. *Selective pushing*: a request is pushed only to a replica
whose pending queue is empty; among the idle local replicas it prefers the longest routed-prefix
match (locality first). When no local replica is idle it forwards to the nearest region that
has an idle replica according to the balancers' periodically exchanged availability (every
``exchange_period_ms``, arriving after the one-way WAN latency), choosing there by that
region's tree. When no replica anywhere is idle, the request waits for the local replica with
the shortest queue (the balancer's hold queue drains into the first replica to free up, which
is the same replica under FIFO prefill).
Sees: live load of its own region's workers; others' load as of the last exchange; the work it
routed itself since (counted until a reading replaces it); no block events.
"""

from __future__ import annotations

import numpy as np

from ..policy import BasePolicy, DelayQueue, LoadView, RouteDecision, Topology
from ..workloads import Request
from .common import RecentAssignments, argmin_tiebreak, prefill_work_ms
from .routed_tree import RoutedPrefixTree

IDLE_MS = 1e-6


class SkyWalkerPolicy(BasePolicy):
    name = "skywalker"

    def __init__(self, topo: Topology, *, exchange_period_ms: float = 100.0) -> None:
        super().__init__(topo)
        self.period_s = exchange_period_ms / 1000.0
        self.live = LoadView(topo.n_workers)
        n_regions = len(topo.regions)
        # remote[r] is region r's balancer's view of everyone else.
        self.remote = [LoadView(topo.n_workers) for _ in range(n_regions)]
        self.trees = [RoutedPrefixTree(topo.block_size) for _ in range(n_regions)]
        self._pending = DelayQueue()
        self._next = 0.0
        # Its replicas: a disaggregated fleet's prefill workers (decode workers are never routed to).
        self._members = [m[topo.routable[m]] for m in (topo.workers_in(r) for r in range(n_regions))]
        self._region_sets = [set(m.tolist()) for m in self._members]
        self.recent = RecentAssignments(topo.n_workers)

    def on_worker_load(self, worker_index: int, queue_ms: float, *, now: float, running: int = 0) -> None:
        self.live.set(worker_index, queue_ms, now)

    def next_timer(self) -> float | None:
        return self._next

    def on_timer(self, *, now: float) -> None:
        topo = self.topo
        for src, members in enumerate(self._members):
            snap = (self.live.queue_ms[members].copy(), self.live.at_s[members].copy())
            for dst in range(len(topo.regions)):
                if dst != src:
                    self._pending.push(now + topo.one_way_ms[src, dst] / 1000.0, (dst, members, snap))
        self._next = now + self.period_s

    def _catch_up(self, now: float) -> None:
        for dst, members, (q, at) in self._pending.pop_due(now):
            self.remote[dst].queue_ms[members] = q
            self.remote[dst].at_s[members] = at

    def _pick(self, region: int, keys: list[int], candidates: np.ndarray, load: np.ndarray,
              now: float) -> tuple[int, int]:
        matched, holders = self.trees[region].longest(keys, set(candidates.tolist()))
        recent = self.recent.current(now)
        if holders:
            h = np.array(sorted(holders))
            return int(h[argmin_tiebreak(load[h], recent[h])]), matched
        return int(candidates[argmin_tiebreak(load[candidates], recent[candidates])]), 0

    def route(self, req: Request, *, now: float) -> RouteDecision:
        topo = self.topo
        self._catch_up(now)
        region = topo.region_index(req.region)
        keys = self.trees[region].chunk_keys(req.tokens)
        local = self._members[region]
        live = self.live.current(now)
        idle_local = local[live[local] <= IDLE_MS]
        if len(idle_local):
            w, matched = self._pick(region, keys, idle_local, live, now)
        else:
            view = self.remote[region].current(now)
            target = None
            for r in np.argsort(topo.one_way_ms[region], kind="stable"):
                if r == region:
                    continue
                members = self._members[r]
                idle = members[view[members] <= IDLE_MS]
                if len(idle):
                    target = (int(r), idle)
                    break
            if target is not None:
                r, idle = target
                w, matched = self._pick(r, self.trees[r].chunk_keys(req.tokens), idle, view, now)
                self.trees[r].record(keys, w, now)
            else:  # (a region of decode workers only waits on the fleet's)
                waits = local if len(local) else topo.routable_workers
                w, matched = self._pick(region, keys, waits, live, now)
        self.trees[region].record(keys, w, now)
        self.recent.add(w, now)
        # The balancer counts what it sent until the next live reading or exchange replaces it.
        view = self.live if topo.worker_region[w] == region else self.remote[region]
        view.add(w, prefill_work_ms(topo, w, req.prompt_tokens, matched), now)
        return RouteDecision(w, 0.0, matched)
