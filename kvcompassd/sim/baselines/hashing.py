"""Hash-placement baselines: consistent hashing with six rings, and Chord with six levels.

Both place a prefix by its content hash, never by where its KV cache was computed (the
paper's §2.3 argument). Consistent Hashing (paper baseline 1): six independent rings, one per
prefix length (64, 128, ..., 2048 tokens); a request goes to the owner, on the ring of the
longest length its prompt covers, of that prefix's hash. Each worker has 160 virtual nodes per
ring (ketama's count) so the key space splits evenly. Lookup is local (the rings are static),
so there is no discovery delay. The paper's CH has no bounded-load variant (§5.1: "six
independent content-hash rings"), so none is applied. Sees: nothing but the request.

Chord (baseline 2): the same six-level layout, one DHT key per level, resolved by Chord lookups:
the edge's local Chord node routes greedily through finger tables (finger k = successor(id +
2^k)) to the key's successor, each hop a message between the two nodes' regions (one-way WAN
latency, or the intra-region latency), and the owner's address returns to the edge. The lookup
of the longest covered level decides the worker (lookups of all levels run in parallel; the
longest is the one used). Nodes use virtual servers (8 per worker, Chord §6) for balance.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ..blockmirror import chain_keys
from ..policy import BasePolicy, RouteDecision, Topology, hash_prefix_lengths
from ..workloads import Request
from .common import routable_pools

_MASK64 = (1 << 64) - 1


def _h64(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def level_keys(tokens: np.ndarray, block_size: int, lengths: tuple[int, ...]) -> list[tuple[int, int]]:
    """(level, 64-bit key) for every level length the prompt covers; a prompt shorter than the
    first level is keyed by all of its full blocks (or its raw tokens if it has none)."""
    keys = chain_keys(tokens, block_size)
    out = [(lvl, int(keys[n // block_size - 1])) for lvl, n in enumerate(lengths) if n <= len(tokens)]
    if not out:
        if len(keys):
            out = [(0, int(keys[-1]))]
        else:
            out = [(0, int.from_bytes(hashlib.blake2b(tokens.tobytes(), digest_size=8).digest(), "little"))]
    return out


class HashRing:
    """A consistent-hash ring with virtual nodes; ``owner(key)`` is the successor's worker."""

    def __init__(self, workers: int | Sequence[int], vnodes: int, salt: object) -> None:
        """``workers``: the worker indexes on the ring (an int n: all of 0..n-1)."""
        members = range(workers) if isinstance(workers, int) else [int(w) for w in workers]
        pos = [(_h64(salt, w, v), w) for w in members for v in range(vnodes)]
        pos.sort()
        self.positions = np.array([p for p, _ in pos], dtype=np.uint64)
        self.owners = np.array([w for _, w in pos], dtype=np.int64)

    def successor_index(self, key: int) -> int:
        i = int(np.searchsorted(self.positions, np.uint64(key & _MASK64), side="left"))
        return 0 if i == len(self.positions) else i

    def owner(self, key: int) -> int:
        return int(self.owners[self.successor_index(key)])


def _mix(key: int, level: int) -> int:
    # Independent rings: rehash the prefix key with the level so ring positions are unrelated.
    return _h64("level", level, key)


class ConsistentHashPolicy(BasePolicy):
    name = "consistent-hash"

    def __init__(self, topo: Topology, *, levels: int = 6, vnodes: int = 160, scope: str = "global") -> None:
        super().__init__(topo)
        self.lengths = hash_prefix_lengths(levels)
        # Only routable workers own keys (a disaggregated fleet's decode workers are not); with
        # scope="region" each region's edge hashes onto rings of its own region's workers.
        rings: dict[tuple[int, ...], list[HashRing]] = {}
        self._rings_of = []
        for pool in routable_pools(topo, scope):
            members = tuple(pool.tolist())
            if members not in rings:
                rings[members] = [HashRing(members, vnodes, ("ch", lvl)) for lvl in range(levels)]
            self._rings_of.append(rings[members])
        self.rings = self._rings_of[0]

    def route(self, req: Request, *, now: float) -> RouteDecision:
        level, key = level_keys(req.tokens, self.topo.block_size, self.lengths)[-1]
        rings = self._rings_of[self.topo.region_index(req.region)]
        return RouteDecision(rings[level].owner(_mix(key, level)), 0.0, 0)


class ChordPolicy(BasePolicy):
    name = "chord"

    def __init__(self, topo: Topology, *, levels: int = 6, vnodes: int = 8, seed: int = 0) -> None:
        super().__init__(topo)
        self.lengths = hash_prefix_lengths(levels)
        # One Chord ring (a DHT), keys of different levels are different keys on it.
        self.ring = HashRing(topo.routable_workers, vnodes, ("chord", seed))
        self.m = 64
        n = len(self.ring.positions)
        # Finger tables: finger[k] of node i = index of successor(id_i + 2^k).
        self.fingers = np.empty((n, self.m), dtype=np.int64)
        for i, pid in enumerate(self.ring.positions.tolist()):
            for k in range(self.m):
                self.fingers[i, k] = self.ring.successor_index((pid + (1 << k)) & _MASK64)
        self._rng = np.random.default_rng(seed)
        self.hops_total = 0
        self.lookups = 0

    @staticmethod
    def _between(x: int, a: int, b: int) -> bool:
        """x in the ring interval (a, b]."""
        if a < b:
            return a < x <= b
        return x > a or x <= b

    def lookup_path(self, start: int, key: int) -> list[int]:
        """Ring-node indices visited from ``start`` to the key's successor (Chord find_successor)."""
        pos = self.ring.positions
        n = len(pos)
        path = [start]
        node = start
        for _ in range(4 * self.m):
            succ = (node + 1) % n
            if self._between(key, int(pos[node]), int(pos[succ])) or n == 1:
                if succ != node:
                    path.append(succ)
                return path
            # closest preceding finger
            nxt = node
            for k in range(self.m - 1, -1, -1):
                f = int(self.fingers[node, k])
                if f != node and self._between(int(pos[f]), int(pos[node]), (key - 1) & _MASK64):
                    nxt = f
                    break
            if nxt == node:
                nxt = succ
            path.append(nxt)
            node = nxt
        return path

    def route(self, req: Request, *, now: float) -> RouteDecision:
        topo = self.topo
        region = topo.region_index(req.region)
        level, key = level_keys(req.tokens, topo.block_size, self.lengths)[-1]
        key = _mix(key, level)
        # The edge queries a Chord node of its own region (a random virtual server of a local worker).
        local = np.flatnonzero(topo.worker_region[self.ring.owners] == region)
        start = int(self._rng.choice(local)) if len(local) else int(self._rng.integers(len(self.ring.owners)))
        path = self.lookup_path(start, key)
        owners = self.ring.owners[path]
        regions = topo.worker_region[owners]
        delay = float(topo.one_way_ms[region, regions[0]])  # edge -> first node
        delay += float(sum(topo.one_way_ms[a, b] for a, b in zip(regions[:-1], regions[1:])))
        delay += float(topo.one_way_ms[regions[-1], region])  # owner's answer back to the edge
        self.hops_total += len(path) - 1
        self.lookups += 1
        return RouteDecision(int(owners[-1]), delay, 0)
