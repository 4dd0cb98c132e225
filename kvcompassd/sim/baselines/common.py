"""Helpers shared by the cache-aware baselines: per-worker match vectors and the TTFT estimate
they all minimise (WAN round trip + queueing + residual prefill + DRAM reload)."""

from __future__ import annotations

import numpy as np

from kvcompassd.engine.kvevents import StorageTier

from ..blockmirror import GlobalBlockMap, chain_keys
from ..policy import Topology


def match_vectors(topo: Topology, bmap: GlobalBlockMap, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(matched tokens per worker, 1.0 where that match sits in DRAM)."""
    matched = np.zeros(topo.n_workers)
    dram = np.zeros(topo.n_workers)
    for w, (n, tier) in bmap.longest(chain_keys(tokens, topo.block_size)).items():
        matched[w] = n
        dram[w] = 1.0 if tier is StorageTier.DRAM else 0.0
    return matched, dram


def expected_ttft_ms(topo: Topology, region: int, prompt_tokens: int, queue_ms: np.ndarray,
                     matched: np.ndarray, dram: np.ndarray, *, include_wan: bool = True) -> np.ndarray:
    """Per worker: the TTFT a request would see if the view were exact."""
    residual = topo.prefill_ms_per_token * np.maximum(0.0, prompt_tokens - matched)
    reload = topo.gamma_ms_per_token * matched * dram
    cost = queue_ms + residual + reload
    if include_wan:
        cost = cost + topo.rtt_to_workers(region)
    return cost


def prefill_work_ms(topo: Topology, w: int, prompt_tokens: int, matched: int = 0, dram: bool = False) -> float:
    """GPU time a request adds to ``w``'s queue: its residual prefill plus any DRAM reload."""
    work = float(topo.prefill_ms_per_token[w]) * max(0, prompt_tokens - matched)
    if dram:
        work += float(topo.gamma_ms_per_token) * matched
    return work


def closed_cost(topo: Topology) -> np.ndarray:
    """0 for every routable worker, +inf for the rest (a disaggregated fleet's decode workers):
    added to a cost vector, it keeps an argmin off workers no request may be routed to."""
    return np.where(topo.routable, 0.0, np.inf)


def argmin_tiebreak(cost: np.ndarray, secondary: np.ndarray) -> int:
    """Lowest cost; among (near-)equal costs the lowest secondary value, then lowest index."""
    best = cost.min()
    tied = np.flatnonzero(cost <= best + 1e-9)
    if len(tied) == 1:
        return int(tied[0])
    return int(tied[np.argmin(secondary[tied])])


class RecentAssignments:
    """Requests this router sent to each worker, decayed with a half-life (seconds). Queueing
    delay is 0 for every worker with a free slot, however busy decoding, so ties among idle
    workers are broken by what the router itself sent recently (any router knows that)."""

    def __init__(self, n: int, half_life_s: float = 1.0) -> None:
        self.counts = np.zeros(n)
        self.at = 0.0
        self.rate = np.log(2.0) / half_life_s

    def current(self, now: float) -> np.ndarray:
        if now > self.at:
            self.counts *= np.exp(-self.rate * (now - self.at))
            self.at = now
        return self.counts

    def add(self, w: int, now: float) -> None:
        self.current(now)[w] += 1.0


SCOPES = ("global", "region")


def routable_pools(topo: Topology, scope: str = "global") -> list[np.ndarray]:
    """Per edge region, the workers its router dispatches among: every routable worker of the
    fleet (``"global"``, WAN-blind, as the paper's baselines), or those of its own region
    (``"region"``: a stock per-region balancer; the fleet's if the region has none)."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    fleet = topo.routable_workers
    if scope == "global":
        return [fleet] * len(topo.regions)
    pools = []
    for r in range(len(topo.regions)):
        own = fleet[topo.worker_region[fleet] == r]
        pools.append(own if len(own) else fleet)
    return pools
