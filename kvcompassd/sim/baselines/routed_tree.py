"""A tree of *routed* prompts (what a router that sees no engine events can know): chunk-level
chain keys of each prompt it forwarded, mapped to the workers it forwarded them to. SGLang's
cache-aware router, SkyWalker's per-region balancer and PlanetServe's hash radix tree all keep
such an approximate tree; entries age out after ``ttl_s`` since the router cannot see evictions.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..blockmirror import chain_keys


class RoutedPrefixTree:
    def __init__(self, block_size: int, chunk_blocks: int = 4, ttl_s: float = 120.0, max_entries: int = 2_000_000) -> None:
        self.block_size = block_size
        self.chunk = chunk_blocks
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, int], float] = OrderedDict()  # (chunk key, worker) -> last use
        self._holders: dict[int, set[int]] = {}

    def chunk_keys(self, tokens: np.ndarray) -> list[int]:
        keys = chain_keys(tokens, self.block_size)
        return keys[self.chunk - 1 :: self.chunk].tolist()

    def record(self, keys: list[int], worker: int, now: float) -> None:
        for k in keys:
            e = (k, worker)
            if e in self._entries:
                self._entries.move_to_end(e)
            else:
                self._holders.setdefault(k, set()).add(worker)
            self._entries[e] = now
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._entries:
            (k, w), t = next(iter(self._entries.items()))
            if now - t <= self.ttl_s and len(self._entries) <= self.max_entries:
                break
            self._entries.popitem(last=False)
            hs = self._holders.get(k)
            if hs is not None:
                hs.discard(w)
                if not hs:
                    del self._holders[k]

    def longest(self, keys: list[int], allowed: set[int] | None = None) -> tuple[int, set[int]]:
        """(matched tokens, workers holding that longest match), optionally among ``allowed``."""
        best: set[int] = set()
        depth = 0
        active: set[int] | None = None
        for i, k in enumerate(keys):
            hs = self._holders.get(k)
            if not hs:
                break
            cur = set(hs) if active is None else active & hs
            if allowed is not None:
                cur &= allowed
            if not cur:
                break
            active, best, depth = cur, cur, i + 1
        return depth * self.chunk * self.block_size, best
