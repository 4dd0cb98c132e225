"""SGLang's cache-aware router (sgl-router ``--policy cache_aware``; paper Fig. 18's
"Cache-aware"), one per region's edge, over every routable worker of the fleet (WAN-blind), or
with ``scope="region"`` over its own region's.

Its rule, with sgl-router's defaults (cache_threshold 0.3, balance_abs_threshold 64,
balance_rel_threshold 1.5):
- the router counts the requests it has in flight at each worker (sent, response not back);
- if that load is imbalanced, ``max - min > 64`` and ``max > 1.5 * min``, the least-loaded worker;
- else the longest match in its *approximate* tree: a tree of the prompts this router itself
  sent (never engine events, so it knows no eviction and nothing another router sent). If the
  matched share of the prompt is above 0.3, a worker holding that match (the least loaded of
  them, then the lowest index); otherwise the worker with the smallest tree (fewest routed
  tokens), so new prefixes spread out;
- the prompt is then recorded in the tree under the chosen worker.
The tree is kept at block granularity (the engines' page); sgl-router's is character-level and
trimmed to 2^26 characters every 120 s, which a run of minutes at these rates never reaches
(the bound here: ``max_entries`` (block, worker) pairs, oldest first).
Sees: the request, and when its responses come back (for its in-flight counts)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..policy import BasePolicy, RouteDecision, Topology
from ..workloads import Request
from .common import routable_pools
from .routed_tree import RoutedPrefixTree


class _SizedTree(RoutedPrefixTree):
    """A routed-prefix tree that also counts each worker's entries (sgl-router's tenant size)."""

    def __init__(self, n_workers: int, block_size: int, max_entries: int) -> None:
        super().__init__(block_size, chunk_blocks=1, ttl_s=float("inf"), max_entries=max_entries)
        self.sizes = np.zeros(n_workers, dtype=np.int64)

    def record(self, keys: list[int], worker: int, now: float) -> None:
        added = sum(1 for k in keys if (k, worker) not in self._entries)
        self.sizes[worker] += added
        before = len(self._entries) + added
        super().record(keys, worker, now)
        if len(self._entries) < before:  # trimmed: recount (rare; only past max_entries)
            self.sizes[:] = 0
            for _, w in self._entries:
                self.sizes[w] += 1


class SGLangCacheAwarePolicy(BasePolicy):
    name = "sglang-cache-aware"

    def __init__(self, topo: Topology, *, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_entries: int = 1 << 22, scope: str = "global") -> None:
        super().__init__(topo)
        self._pools = routable_pools(topo, scope)
        self.cache_threshold = cache_threshold
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold
        n_regions = len(topo.regions)
        self.trees = [_SizedTree(topo.n_workers, topo.block_size, max_entries) for _ in range(n_regions)]
        self.in_flight = np.zeros((n_regions, topo.n_workers), dtype=np.int64)
        self._sent_by: dict[int, int] = {}  # request id -> the region whose router sent it
        self.balanced_decisions = 0
        self.load_decisions = 0

    def route(self, req: Request, *, now: float) -> RouteDecision:
        region = self.topo.region_index(req.region)
        pool = self._pools[region]
        loads = self.in_flight[region, pool]
        tree = self.trees[region]
        keys = tree.chunk_keys(req.tokens)
        hi, lo = int(loads.max()), int(loads.min())
        if hi - lo > self.abs_threshold and hi > lo * self.rel_threshold:
            chosen = int(pool[int(np.argmin(loads))])
            matched = 0
            self.load_decisions += 1
        else:
            matched, holders = tree.longest(keys)
            if holders and matched / max(1, req.prompt_tokens) > self.cache_threshold:
                chosen = min(holders, key=lambda w: (self.in_flight[region, w], w))
            else:
                chosen = int(pool[int(np.argmin(tree.sizes[pool]))])
                matched = 0
            self.balanced_decisions += 1
        tree.record(keys, chosen, now)
        self.in_flight[region, chosen] += 1
        self._sent_by[req.id] = region
        return RouteDecision(chosen, 0.0, matched)

    def on_response(self, worker_index: int, req: Request, reused_tokens: int,
                    queue_vector: Mapping[int, float], *, now: float) -> None:
        region = self._sent_by.pop(req.id, None)
        if region is not None:
            self.in_flight[region, worker_index] -= 1
