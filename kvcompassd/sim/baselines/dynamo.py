"""NVIDIA Dynamo (paper baseline 6): a KV-aware router in every region with a periodically
broadcast global view.

Dynamo's KV router builds a radix index from the workers' KV events and picks the worker with
the lowest cost = (blocks to prefill) + (active load). We express both in milliseconds with the
deployment's calibration: residual prefill + DRAM reload + queueing, plus the WAN round trip (a
router that forwards across regions must pay it, so it prices it). Each region's router sees its
own workers' events and load live; the other regions' state reaches it by a broadcast every
``broadcast_period_ms`` that lands after the one-way WAN latency (the staleness the paper names).
Block events of remote workers are therefore applied at broadcast ticks, loads of remote workers
are the broadcast snapshot (aged by elapsed time).
Sees: live events/load of its own region, broadcast snapshots of the rest, and the work it
routed itself since (counted until a reading replaces it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..blockmirror import GlobalBlockMap
from ..policy import BasePolicy, DelayQueue, LoadView, RouteDecision, Topology
from ..workloads import Request
from .common import (RecentAssignments, argmin_tiebreak, closed_cost, expected_ttft_ms, match_vectors,
                     prefill_work_ms)


class DynamoPolicy(BasePolicy):
    name = "dynamo"

    def __init__(self, topo: Topology, *, broadcast_period_ms: float = 100.0) -> None:
        super().__init__(topo)
        self.period_s = broadcast_period_ms / 1000.0
        # One block map: a block event becomes visible to every router at the next broadcast
        # tick after it happened (plus the WAN trip), an approximation that is exact for the
        # remote routers' tick granularity and pessimistic by < Delta for the local one.
        self.map = GlobalBlockMap(topo.n_workers, topo.block_size)
        self._buffered: list[tuple[int, Sequence[Any]]] = []
        self._pending = DelayQueue()
        self.live = LoadView(topo.n_workers)
        self.remote = [LoadView(topo.n_workers) for _ in topo.regions]
        self._members = [topo.workers_in(r) for r in range(len(topo.regions))]
        self._next = 0.0
        self.recent = [RecentAssignments(topo.n_workers) for _ in topo.regions]  # per regional router
        self._closed = closed_cost(topo)

    def on_cache_events(self, worker_index: int, events: Sequence[Any], *, now: float) -> None:
        self._buffered.append((worker_index, events))

    def on_worker_load(self, worker_index: int, queue_ms: float, *, now: float, running: int = 0) -> None:
        self.live.set(worker_index, queue_ms, now)

    def next_timer(self) -> float | None:
        return self._next

    def on_timer(self, *, now: float) -> None:
        topo = self.topo
        mean_one_way = float(np.mean(topo.one_way_ms[np.triu_indices(len(topo.regions), 1)])) if len(topo.regions) > 1 else 0.0
        if self._buffered:
            self._pending.push(now + mean_one_way / 1000.0, ("events", self._buffered))
            self._buffered = []
        for src, members in enumerate(self._members):
            snap = (self.live.queue_ms[members].copy(), self.live.at_s[members].copy())
            for dst in range(len(topo.regions)):
                if dst != src:
                    self._pending.push(now + topo.one_way_ms[src, dst] / 1000.0, ("load", dst, members, snap))
        self._next = now + self.period_s

    def _catch_up(self, now: float) -> None:
        for item in self._pending.pop_due(now):
            if item[0] == "events":
                for w, evs in item[1]:
                    self.map.apply(w, evs)
            else:
                _, dst, members, (q, at) = item
                self.remote[dst].queue_ms[members] = q
                self.remote[dst].at_s[members] = at

    def route(self, req: Request, *, now: float) -> RouteDecision:
        topo = self.topo
        self._catch_up(now)
        region = topo.region_index(req.region)
        load = self.remote[region].current(now)
        local = self._members[region]
        load[local] = self.live.current(now, local)
        matched, dram = match_vectors(topo, self.map, req.tokens)
        cost = expected_ttft_ms(topo, region, req.prompt_tokens, load, matched, dram) + self._closed
        recent = self.recent[region]
        w = argmin_tiebreak(cost, recent.current(now))
        recent.add(w, now)
        # The router counts what it sent (Dynamo's router tracks its active requests per worker)
        # until the next live reading or broadcast replaces it.
        view = self.live if self.topo.worker_region[w] == region else self.remote[region]
        view.add(w, prefill_work_ms(topo, w, req.prompt_tokens, int(matched[w]), bool(dram[w])), now)
        return RouteDecision(w, 0.0, int(matched[w]))
