"""PlanetServe (NSDI'26; paper baseline 3): a decentralised serving overlay whose forwarding
uses a hash radix tree (HRT) of prompt-chunk hashes.

The HRT maps the hash chain of a prompt's 64-token chunks to the model nodes that served it;
the overlay shares it among user-side nodes (we give every edge the same, instantly updated
tree, which is generous). A request goes to the holder of its longest matched chunk path; among
several holders the least loaded by the overlay's periodic load reports (every
``report_period_ms``, after the WAN trip). If that holder's queue exceeds ``overload_ms``, or
nothing matches, the request goes to the worker with the lowest (WAN round trip + reported
queue). The tree never learns evictions (entries expire after a TTL), which is the design's
source of false hits.
Sees: its own routing history; periodic load reports; no block events.
"""

from __future__ import annotations

import numpy as np

from ..policy import BasePolicy, DelayQueue, LoadView, RouteDecision, Topology
from ..workloads import Request
from .common import RecentAssignments, argmin_tiebreak, closed_cost
from .routed_tree import RoutedPrefixTree


class PlanetServePolicy(BasePolicy):
    name = "planetserve"

    def __init__(self, topo: Topology, *, report_period_ms: float = 100.0, overload_ms: float = 500.0) -> None:
        super().__init__(topo)
        self.tree = RoutedPrefixTree(topo.block_size)
        self.period_s = report_period_ms / 1000.0
        self.overload_ms = overload_ms
        self.live = LoadView(topo.n_workers)
        self.reported = LoadView(topo.n_workers)
        self._pending = DelayQueue()
        self._next = 0.0
        self.recent = RecentAssignments(topo.n_workers)
        self._closed = closed_cost(topo)

    def on_worker_load(self, worker_index: int, queue_ms: float, *, now: float, running: int = 0) -> None:
        self.live.set(worker_index, queue_ms, now)  # only read by the periodic report below

    def next_timer(self) -> float | None:
        return self._next

    def on_timer(self, *, now: float) -> None:
        # Reports cross the WAN; use the mean one-way latency of each worker to the edges.
        lag_s = self.topo.one_way_ms[self.topo.worker_region].mean(axis=1) / 1000.0
        self._pending.push(now + float(lag_s.mean()), (self.live.queue_ms.copy(), self.live.at_s.copy()))
        self._next = now + self.period_s

    def route(self, req: Request, *, now: float) -> RouteDecision:
        topo = self.topo
        for q, at in self._pending.pop_due(now):
            self.reported.queue_ms[:] = q
            self.reported.at_s[:] = at
        region = topo.region_index(req.region)
        load = self.reported.current(now)
        keys = self.tree.chunk_keys(req.tokens)
        matched, holders = self.tree.longest(keys)
        w = -1
        if holders:
            h = np.array(sorted(holders))
            cand = int(h[argmin_tiebreak(load[h], self.recent.current(now)[h])])
            if load[cand] <= self.overload_ms:
                w = cand
        if w < 0:
            w = argmin_tiebreak(topo.rtt_to_workers(region) + load + self._closed, self.recent.current(now))
            matched = 0
        self.recent.add(w, now)
        self.tree.record(keys, w, now)
        return RouteDecision(w, 0.0, matched)
