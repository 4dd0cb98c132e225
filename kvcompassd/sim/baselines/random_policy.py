"""Random forwarding: a uniformly random (routable) worker of the whole pool, no discovery, no load. The
reference curve of the M/G/1 check (paper Fig. 9).
Sees: nothing."""

from __future__ import annotations

import numpy as np

from ..policy import BasePolicy, RouteDecision, Topology
from ..workloads import Request
from .common import routable_pools


class RandomPolicy(BasePolicy):
    name = "random"

    def __init__(self, topo: Topology, *, seed: int = 0, scope: str = "global") -> None:
        super().__init__(topo)
        self._rng = np.random.default_rng(seed)
        # All workers but a disaggregated fleet's decode workers (``scope="region"``: the edge's own).
        self._pools = routable_pools(topo, scope)

    def route(self, req: Request, *, now: float) -> RouteDecision:
        pool = self._pools[self.topo.region_index(req.region)]
        return RouteDecision(int(pool[self._rng.integers(len(pool))]), 0.0, 0)
