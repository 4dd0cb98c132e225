"""Random forwarding: a uniformly random (routable) worker of the whole pool, no discovery, no load. The
reference curve of the M/G/1 check (paper Fig. 9).
Sees: nothing."""

from __future__ import annotations

import numpy as np

from ..policy import BasePolicy, RouteDecision, Topology
from ..workloads import Request


class RandomPolicy(BasePolicy):
    name = "random"

    def __init__(self, topo: Topology, *, seed: int = 0) -> None:
        super().__init__(topo)
        self._rng = np.random.default_rng(seed)
        self._pool = topo.routable_workers  # all workers but a disaggregated fleet's decode workers

    def route(self, req: Request, *, now: float) -> RouteDecision:
        return RouteDecision(int(self._pool[self._rng.integers(len(self._pool))]), 0.0, 0)
