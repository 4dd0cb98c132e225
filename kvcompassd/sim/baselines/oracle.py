"""Oracle: every request goes to the globally least-loaded worker, read from the true worker
state with no delay and no discovery cost. It ignores KV-cache reuse and WAN distance, so its
load factor is the floor any scheme can reach (paper §5.3, Fig. 14).
Sees: true load of every worker, instantly, and the work it routed that has not arrived yet."""

from __future__ import annotations

from ..policy import BasePolicy, LoadView, RouteDecision, Topology
from ..workloads import Request
from .common import RecentAssignments, argmin_tiebreak, prefill_work_ms


class OraclePolicy(BasePolicy):
    name = "oracle"

    def __init__(self, topo: Topology) -> None:
        super().__init__(topo)
        self.loads = LoadView(topo.n_workers)
        self.recent = RecentAssignments(topo.n_workers)  # tie-break among equally (un)loaded workers

    def on_worker_load(self, worker_index: int, queue_ms: float, *, now: float, running: int = 0) -> None:
        self.loads.set(worker_index, queue_ms, now)

    def route(self, req: Request, *, now: float) -> RouteDecision:
        w = argmin_tiebreak(self.loads.current(now), self.recent.current(now))
        self.recent.add(w, now)
        # Counted until the request reaches the worker and its report replaces the value.
        self.loads.add(w, prefill_work_ms(self.topo, w, req.prompt_tokens), now)
        return RouteDecision(w, 0.0, 0)
