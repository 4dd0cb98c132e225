"""Round robin (paper Fig. 18's "Round-robin"): each region's router cycles through every
routable worker of the fleet in config order, as SGLang's router does with ``--policy
round_robin`` (one counter per router, starting at the first worker).
Sees: nothing but its own counter."""

from __future__ import annotations

from ..policy import BasePolicy, RouteDecision, Topology
from ..workloads import Request


class RoundRobinPolicy(BasePolicy):
    name = "round-robin"

    def __init__(self, topo: Topology) -> None:
        super().__init__(topo)
        self._pool = topo.routable_workers.tolist()
        self._next = [0] * len(topo.regions)  # one counter per region's router

    def route(self, req: Request, *, now: float) -> RouteDecision:
        region = self.topo.region_index(req.region)
        i = self._next[region]
        self._next[region] = (i + 1) % len(self._pool)
        return RouteDecision(self._pool[i], 0.0, 0)
