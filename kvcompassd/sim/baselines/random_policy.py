"""Random forwarding: a uniformly random worker of the whole pool, no discovery, no load. The
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

    def route(self, req: Request, *, now: float) -> RouteDecision:
        return RouteDecision(int(self._rng.integers(self.topo.n_workers)), 0.0, 0)
