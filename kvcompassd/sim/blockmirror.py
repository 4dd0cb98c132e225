"""Exact prefix-cache knowledge for baselines that track engine KV events (central directory,
Dynamo): a per-block chain key computed from token content, and a global map from chain key to
the workers holding that block and in which tier.

Chain key of block i of a prompt: ``sum_{j<=i} h_j * R[j] mod 2^64`` where ``h_j`` is a seeded
linear hash of block j's tokens and ``R`` a seeded vector of odd multipliers. It is computed for a
whole prompt with one vectorised cumulative sum, and incrementally from an event's parent key.
Two different prefixes collide with probability ~2^-64 per pair, negligible for a simulation.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Sequence

import numpy as np

from kvcompassd.engine.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, StorageTier, tier_of_medium

MAX_BLOCKS = 1 << 16
_RNG = np.random.default_rng(0x5EED_B10C)
_TOKEN_MULT = _RNG.integers(1, 2**63, size=4096, dtype=np.uint64) | np.uint64(1)
_POS_MULT = _RNG.integers(1, 2**63, size=MAX_BLOCKS, dtype=np.uint64) | np.uint64(1)
_POS_MULT_INT = _POS_MULT.tolist()
_TOKEN_MULT_INT = _TOKEN_MULT.tolist()
_MASK64 = (1 << 64) - 1
# sum(m for m in _TOKEN_MULT_INT[:n]) for each n: (t + 1) * m summed is sum(t * m) + sum(m)
_UNINDEXED = StorageTier.UNINDEXED
_TOKEN_MULT_SUMS = [0, *itertools.accumulate(_TOKEN_MULT_INT)]


def block_hashes(tokens: np.ndarray, block_size: int) -> np.ndarray:
    """Content hash of each full block of ``tokens``."""
    nb = len(tokens) // block_size
    if nb == 0:
        return np.zeros(0, dtype=np.uint64)
    blocks = np.asarray(tokens[: nb * block_size], dtype=np.uint64).reshape(nb, block_size) + np.uint64(1)
    # uint64 array arithmetic wraps modulo 2^64 silently (only numpy scalars warn).
    return (blocks * _TOKEN_MULT[:block_size]).sum(axis=1, dtype=np.uint64)


def _event_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """``block_hashes`` for an event's tokens; plain integer arithmetic for the common one- or
    two-block event (numpy's per-call overhead dominates there), identical results."""
    nb = len(token_ids) // block_size
    if nb > 2:
        return block_hashes(np.asarray(token_ids, dtype=np.uint32), block_size).tolist()
    mult = _TOKEN_MULT_INT[:block_size]
    offset = _TOKEN_MULT_SUMS[block_size]  # the "+ 1" of every token, summed once (exact integers)
    mul = operator.mul
    return [(sum(map(mul, token_ids[i * block_size:(i + 1) * block_size], mult)) + offset) & _MASK64
            for i in range(nb)]


def chain_keys(tokens: np.ndarray, block_size: int) -> np.ndarray:
    """Chain key of every full-block prefix of ``tokens`` (index i covers blocks 0..i)."""
    h = block_hashes(tokens, block_size)[:MAX_BLOCKS]
    return np.cumsum(h * _POS_MULT[: len(h)], dtype=np.uint64)


class GlobalBlockMap:
    """Which workers hold which full-block prefixes, fed by each worker's engine block events."""

    def __init__(self, workers: int, block_size: int) -> None:
        self.block_size = block_size
        self._holders: dict[int, dict[int, StorageTier]] = {}  # chain key -> {worker: best tier}
        # Per worker: engine block hash -> (chain key, depth, media)
        self._blocks: list[dict[object, tuple[int, int, set[StorageTier]]]] = [dict() for _ in range(workers)]

    def apply(self, worker: int, events: Iterable[object]) -> None:
        blocks = self._blocks[worker]
        for ev in events:
            if isinstance(ev, BlockStored):
                tier = tier_of_medium(ev.medium)
                if ev.parent_block_hash is None:
                    key, depth = 0, 0
                else:
                    parent = blocks.get(ev.parent_block_hash)
                    if parent is None:
                        continue  # an orphan: its prefix is unknown, so it cannot be matched
                    key, depth = parent[0], parent[1]
                hs = _event_block_hashes(ev.token_ids, ev.block_size)
                for bh, h in zip(ev.block_hashes, hs):
                    if depth >= MAX_BLOCKS:
                        break
                    key = (key + h * _POS_MULT_INT[depth]) & _MASK64
                    depth += 1
                    entry = blocks.get(bh)
                    if entry is None:
                        blocks[bh] = (key, depth, {tier})
                    else:
                        entry[2].add(tier)
                    self._refresh(worker, key, blocks[bh][2])
            elif isinstance(ev, BlockRemoved):
                drop = tier_of_medium(ev.medium)
                for bh in ev.block_hashes:
                    entry = blocks.get(bh)
                    if entry is None:
                        continue
                    entry[2].discard(drop)
                    if not entry[2]:
                        del blocks[bh]
                    self._refresh(worker, entry[0], entry[2])
            elif isinstance(ev, AllBlocksCleared):
                for key, _, _ in blocks.values():
                    self._refresh(worker, key, set())
                blocks.clear()

    def _refresh(self, worker: int, key: int, media: set[StorageTier]) -> None:
        if len(media) == 1:  # the usual case, without the list and min()
            (only,) = media
            indexed = None if only is _UNINDEXED else only
        else:
            tiers = [m for m in media if m is not _UNINDEXED]
            indexed = min(tiers) if tiers else None
        holders = self._holders.get(key)
        if indexed is not None:
            if holders is None:
                holders = self._holders[key] = {}
            holders[worker] = indexed
        elif holders is not None:
            holders.pop(worker, None)
            if not holders:
                del self._holders[key]

    def longest(self, keys: np.ndarray) -> dict[int, tuple[int, StorageTier]]:
        """Per holding worker: (longest matched full-block prefix in tokens, tier of its last
        block; with LRU demotion the deepest block is the worst-tier one)."""
        result: dict[int, tuple[int, StorageTier]] = {}
        active: set[int] | None = None
        for i, key in enumerate(keys.tolist()):
            holders = self._holders.get(key)
            if not holders:
                break
            if active is None:
                active = set(holders)
            else:
                active &= holders.keys()
            if not active:
                break
            for w in active:
                result[w] = ((i + 1) * self.block_size, holders[w])
        return result

    def entries(self) -> int:
        return len(self._holders)
