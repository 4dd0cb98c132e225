"""The edge's lookup: which workers hold how much of a prompt's prefix, and in which tier.

For each target region group, the edge reads its view at each of its latency-derived lengths
toward that region that fit the prompt, and takes for every worker its longest matching length
``m_r`` and the tier ``t_r`` there (paper §3.4). Cost: O(levels x groups) table reads + O(workers).

Cross-level consistency: a worker registers a cached prefix at every indexed length it covers,
so its hits toward a region must form an unbroken run from the shortest length. A hit above a
miss can only be a keyless-view false hit, so with ``consistency=True`` the match stops at the
first miss.

Two paths compute the same result: the native one (default) hashes in C (``keys.prefix_keys``)
and does every table read and the decode in one C call (``lookup_plan.LookupPlan``); the
reference one (``native=False``) hashes with hashlib, reads each view from Python and decodes with
numpy. Tests hold them equal. The Router fuses the native path with its score into one C call
(``lookup_plan.ForwardKernel``, from ``native_plan``).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

from .index import EdgeIndexView
from .keys import prefix_keys, prefix_keys_reference
from .layout import IndexLayout
from .levels import LevelPlan
from .lookup_plan import LookupPlan, ViewPointers, slot_constructor


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Per worker (config order): longest matching indexed length and the tier there."""

    prompt_len: int
    matched: np.ndarray  # int64 tokens, 0 = no match
    tier: np.ndarray  # uint8 Tier values, 0 where matched == 0
    family_key: int | None  # key of the first own-region length: the prompt's prefix family


new_lookup_result = slot_constructor(LookupResult)  # positional, unvalidated: per request


class PrefixLookup:
    """Reads an ``EdgeIndexView`` at the lengths an edge of ``region`` queries."""

    def __init__(
        self,
        layout: IndexLayout,
        plan: LevelPlan,
        region: str,
        salt: bytes,
        view: EdgeIndexView,
        *,
        consistency: bool = True,
        native: bool = True,
    ):
        self.layout = layout
        self.region = region
        self.salt = salt
        self.view = view
        self.consistency = consistency
        # Lengths toward each group's region, padded into a (groups x max_levels) matrix; 0 pads.
        per_group = [tuple(plan.lengths_toward(region, g.region)) for g in layout.groups]
        self.max_levels = max((len(p) for p in per_group), default=0)
        self.group_lengths = np.zeros((len(per_group), self.max_levels), dtype=np.int64)
        for g, lengths in enumerate(per_group):
            self.group_lengths[g, : len(lengths)] = lengths
        self.query_lengths = np.array(sorted({n for p in per_group for n in p}), dtype=np.int64)
        own = plan.lengths_toward(region, region)
        self.family_length = int(own[0]) if own else int(self.query_lengths[0])
        self._shards = view.shards
        self.native = native
        self._query_list = self.query_lengths.tolist()
        self._family_index = (self._query_list.index(self.family_length)
                              if self.family_length in self._query_list else None)
        self._n_workers = len(layout.worker_ids)
        if native:
            self._plan = LookupPlan(self.group_lengths, self.query_lengths, layout.worker_group,
                                    layout.worker_shift, shards=view.shards, consistency=consistency)
            self._pointers = ViewPointers(view, len(layout.groups))

    def lookup(self, tokens) -> LookupResult:
        if not self.native:
            return self.lookup_reference(tokens)
        tokens = np.asarray(tokens)
        prompt_len = tokens.shape[0]
        n_fit = self.fitting(prompt_len)
        if n_fit == 0:
            n = self._n_workers
            return LookupResult(prompt_len, np.zeros(n, np.int64), np.zeros(n, np.uint8), None)
        keys = prefix_keys(tokens, self.query_lengths[:n_fit], self.salt)
        matched, tier = self._plan.run(self._pointers.pointers(), keys)
        family = self._family_index
        family_key = keys.item(family) if family is not None and family < n_fit else None
        return new_lookup_result(prompt_len, matched, tier, family_key)

    def fitting(self, prompt_len: int) -> int:
        """How many of the query lengths a prompt of ``prompt_len`` tokens covers."""
        return bisect_right(self._query_list, prompt_len)

    def query_keys(self, tokens) -> np.ndarray:
        """The prompt's keys at the query lengths it covers, hashed on this lookup's path."""
        tokens = np.asarray(tokens)
        lengths = self.query_lengths[:self.fitting(int(tokens.shape[0]))]
        if lengths.size == 0:
            return np.zeros(0, dtype=np.uint64)
        return (prefix_keys if self.native else prefix_keys_reference)(tokens, lengths, self.salt)

    def native_plan(self) -> tuple[LookupPlan, ViewPointers]:
        """The C lookup plan and the view pointers it reads (native lookups only)."""
        if not self.native:
            raise ValueError("a reference lookup has no native plan")
        return self._plan, self._pointers

    def family_index(self) -> int | None:
        """Index of the family length among the query lengths (None: not queried)."""
        return self._family_index

    def lookup_reference(self, tokens) -> LookupResult:
        """The pure-Python path: one ``LudoView.lookup`` per read, numpy decode."""
        tokens = np.asarray(tokens)
        prompt_len = int(tokens.shape[0])
        n_fit = int(np.searchsorted(self.query_lengths, prompt_len, side="right"))
        n_workers = len(self.layout.worker_ids)
        if n_fit == 0:
            return LookupResult(prompt_len, np.zeros(n_workers, np.int64), np.zeros(n_workers, np.uint8), None)
        lengths = self.query_lengths[:n_fit]
        keys = prefix_keys_reference(tokens, lengths, self.salt)
        key_of = dict(zip(lengths.tolist(), keys.tolist()))
        values = np.zeros(self.group_lengths.shape, dtype=np.uint64)
        state = self.view.state
        shards = self._shards
        for g, row in enumerate(self.group_lengths):
            for level, n in enumerate(row.tolist()):
                if n == 0 or n > prompt_len:
                    break
                key = key_of[n]
                view = state[key % shards].views.get(g)
                if view is not None:
                    values[g, level] = view.lookup(key)
        family_key = key_of.get(self.family_length)
        matched, tier = self._decode(values)
        return LookupResult(prompt_len, matched, tier, family_key)

    def _decode(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        layout = self.layout
        per_worker = values[layout.worker_group]  # (workers, levels)
        tiers = ((per_worker >> layout.worker_shift[:, None]) & np.uint64(3)).astype(np.uint8)
        hits = tiers != 0
        if self.consistency:
            # Length of the unbroken run of hits from the shortest level.
            run = np.where(hits.all(axis=1), hits.shape[1], np.argmin(hits, axis=1))
        else:
            # Longest level with any hit (the paper's plain rule).
            rev = hits[:, ::-1]
            run = np.where(hits.any(axis=1), hits.shape[1] - np.argmax(rev, axis=1), 0)
        has = run > 0
        last = np.maximum(run - 1, 0)
        rows = np.arange(len(run))
        matched = np.where(has, self.group_lengths[layout.worker_group, last], 0)
        tier = np.where(has, tiers[rows, last], 0).astype(np.uint8)
        return matched.astype(np.int64), tier
