"""Central Directory (paper baseline 4): one coordinator holds the exact global KV-cache state.

Every worker reports its engine block events and its load to the coordinator; they take effect
there after the one-way WAN latency from the worker's region. Every request costs its edge one
WAN round trip to the coordinator (the paper's defining cost). The coordinator picks the worker
with the lowest expected TTFT under its (exact, report-delayed) view: WAN round trip from the
request's edge + queueing + residual prefill + DRAM reload. The coordinator sits in the region
with the lowest worker-weighted mean RTT to all workers.
Sees: all block events and all worker loads, each delayed by the report's WAN trip, and
the work it routed itself since (counted until a report replaces it).
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


def central_region(topo: Topology) -> int:
    mean_rtt = [float(np.mean(topo.rtt_to_workers(r))) for r in range(len(topo.regions))]
    return int(np.argmin(mean_rtt))


class CentralDirectoryPolicy(BasePolicy):
    name = "central-directory"

    def __init__(self, topo: Topology, *, coordinator_region: int | None = None) -> None:
        super().__init__(topo)
        self.coord = central_region(topo) if coordinator_region is None else coordinator_region
        self.map = GlobalBlockMap(topo.n_workers, topo.block_size)
        self.loads = LoadView(topo.n_workers)
        self._pending = DelayQueue()
        self._report_ms = topo.one_way_ms[topo.worker_region, self.coord]
        self.recent = RecentAssignments(topo.n_workers)
        self._closed = closed_cost(topo)

    def _catch_up(self, now: float) -> None:
        for kind, w, payload, at in self._pending.pop_due(now):
            if kind == "events":
                self.map.apply(w, payload)
            else:
                self.loads.set(w, payload, at)

    def on_cache_events(self, worker_index: int, events: Sequence[Any], *, now: float) -> None:
        self._pending.push(now + self._report_ms[worker_index] / 1000.0, ("events", worker_index, events, now))

    def on_worker_load(self, worker_index: int, queue_ms: float, *, now: float, running: int = 0) -> None:
        self._pending.push(now + self._report_ms[worker_index] / 1000.0, ("load", worker_index, queue_ms, now))

    def route(self, req: Request, *, now: float) -> RouteDecision:
        topo = self.topo
        region = topo.region_index(req.region)
        lookup_ms = 2.0 * float(topo.one_way_ms[region, self.coord])
        # The coordinator decides when the query reaches it.
        at_coord = now + topo.one_way_ms[region, self.coord] / 1000.0
        self._catch_up(at_coord)
        matched, dram = match_vectors(topo, self.map, req.tokens)
        cost = expected_ttft_ms(topo, region, req.prompt_tokens, self.loads.current(at_coord), matched, dram)
        cost += self._closed
        w = argmin_tiebreak(cost, self.recent.current(now))
        self.recent.add(w, now)
        self.loads.add(w, prefill_work_ms(topo, w, req.prompt_tokens, int(matched[w]), bool(dram[w])), at_coord)
        return RouteDecision(w, lookup_ms, int(matched[w]))
