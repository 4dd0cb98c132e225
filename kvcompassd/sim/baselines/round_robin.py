"""Round robin (paper Fig. 18's "Round-robin"): each region's router cycles through every
routable worker of the fleet (``scope="region"``: of its own region) in config order, as SGLang's router does with ``--policy
round_robin`` (one counter per router, starting at the first worker).
Sees: nothing but its own counter."""

from __future__ import annotations

from ..policy import BasePolicy, RouteDecision, Topology
from ..workloads import Request
from .common import routable_pools


class RoundRobinPolicy(BasePolicy):
    name = "round-robin"

    def __init__(self, topo: Topology, *, scope: str = "global") -> None:
        super().__init__(topo)
        self._pools = [pool.tolist() for pool in routable_pools(topo, scope)]
        self._next = [0] * len(topo.regions)  # one counter per region's router

    def route(self, req: Request, *, now: float) -> RouteDecision:
        region = self.topo.region_index(req.region)
        pool = self._pools[region]
        i = self._next[region]
        self._next[region] = (i + 1) % len(pool)
        return RouteDecision(pool[i], 0.0, 0)
