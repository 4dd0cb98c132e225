"""Multi-level prefix lookup against a brute-force model of who holds what."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from clusters import make_cluster
from kvcompassd.core.events import PrefixCached, PrefixEvicted, Tier
from kvcompassd.core.index import EdgeIndexView, MaintenanceShard
from kvcompassd.core.keys import namespace_salt, prefix_keys
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.levels import LevelPlan
from kvcompassd.core.lookup import PrefixLookup

SHARDS = 2
REGIONS = {"a": 3, "b": 18, "c": 2}


class Deployment:
    """Shards + one edge view per region, wired in-process, plus the truth of who holds what."""

    def __init__(self, fingerprint_bits=0, consistency=True):
        self.cfg = make_cluster(REGIONS, shards=SHARDS, one_way_ms=2.0, prefill_ms_per_token=0.1,
                                fingerprint_bits=fingerprint_bits)
        self.layout = IndexLayout.from_config(self.cfg)
        self.plan = LevelPlan.from_config(self.cfg)
        self.salt = namespace_salt(self.cfg.model)
        self.shards = [MaintenanceShard(self.layout, s, SHARDS, epoch=1, initial_capacity=64,
                                        fingerprint_bits=fingerprint_bits) for s in range(SHARDS)]
        self.views = {}
        self.lookups = {}
        for region in REGIONS:
            view = EdgeIndexView(self.layout, SHARDS, edge=f"edge-{region}")
            for s in self.shards:
                view.install_snapshot(s.snapshot())
            self.views[region] = view
            self.lookups[region] = PrefixLookup(self.layout, self.plan, region, self.salt, view,
                                                consistency=consistency)

    def register(self, worker, tokens, cached_len, tier):
        lengths = self.plan.registration_lengths_upto(cached_len)
        keys = prefix_keys(tokens, lengths, self.salt) if lengths else []
        self._send([PrefixCached(worker, int(k), tier) for k in keys])

    def evict_above(self, worker, tokens, keep_len, cached_len):
        lengths = [n for n in self.plan.registration_lengths_upto(cached_len) if n > keep_len]
        keys = prefix_keys(tokens, lengths, self.salt) if lengths else []
        self._send([PrefixEvicted(worker, int(k)) for k in keys])

    def _send(self, events):
        for e in events:
            self.shards[e.key % SHARDS].apply([e])
        for s in self.shards:
            batch = s.flush()
            if batch is not None:
                for view in self.views.values():
                    assert view.apply_next(batch) is None

    def expected(self, edge_region, worker, cached_len, prompt_len):
        region = self.layout.worker_region[worker]
        fits = [n for n in self.plan.lengths_toward(edge_region, region) if n <= min(cached_len, prompt_len)]
        return fits[-1] if fits else 0


def _prompt(seed, n):
    return np.random.default_rng(seed).integers(0, 50000, n, dtype=np.uint32)


def test_lengths_queried_toward_each_region():
    d = Deployment()
    lk = d.lookups["a"]
    assert tuple(lk.group_lengths[0][: len(d.plan.lengths_toward("a", "a"))]) == d.plan.lengths_toward("a", "a")
    assert lk.family_length == d.plan.lengths_toward("a", "a")[0]


def test_holder_found_at_its_longest_indexed_length_from_every_region():
    d = Deployment()
    tokens = _prompt(1, 600)
    d.register("b-17", tokens, 400, Tier.DRAM)
    d.register("a-1", tokens, 100, Tier.VRAM)
    for region, lk in d.lookups.items():
        found = lk.lookup(tokens)
        assert found.prompt_len == 600
        for worker, cached, tier in (("b-17", 400, Tier.DRAM), ("a-1", 100, Tier.VRAM)):
            i = d.layout.worker_index(worker)
            exp = d.expected(region, worker, cached, 600)
            assert found.matched[i] >= exp
            if found.matched[i] == exp and exp:
                assert found.tier[i] == tier
    # A shorter prompt can only match up to its own length.
    short = d.lookups["b"].lookup(tokens[:70])
    assert short.matched[d.layout.worker_index("b-17")] <= 70


def test_eviction_shrinks_the_match():
    d = Deployment(fingerprint_bits=8)
    tokens = _prompt(2, 800)
    d.register("c-0", tokens, 800, Tier.VRAM)
    i = d.layout.worker_index("c-0")
    before = d.lookups["c"].lookup(tokens).matched[i]
    d.evict_above("c-0", tokens, 64, 800)
    after = d.lookups["c"].lookup(tokens).matched[i]
    assert before == max(n for n in d.plan.lengths_toward("c", "c") if n <= 800) and after == 64


def test_consistency_cuts_a_hit_above_a_miss():
    """A long-length entry without its shorter ones (what a keyless false hit looks like) is cut."""
    plain, checked = Deployment(consistency=False), Deployment(consistency=True)
    tokens = _prompt(3, 300)
    for d in (plain, checked):
        lengths = [n for n in d.plan.registration_lengths_upto(300) if n >= 128]
        keys = prefix_keys(tokens, lengths, d.salt)
        d._send([PrefixCached("a-2", int(k), Tier.VRAM) for k in keys])
    i = plain.layout.worker_index("a-2")
    assert plain.lookups["a"].lookup(tokens).matched[i] == 256
    assert checked.lookups["a"].lookup(tokens).matched[i] == 0


holdings = st.lists(
    st.tuples(st.integers(0, 22), st.integers(0, 5), st.integers(0, 700), st.sampled_from([Tier.VRAM, Tier.DRAM])),
    max_size=25,
)


@settings(max_examples=40, deadline=None)
@given(holdings=holdings)
def test_no_false_negatives_for_random_holdings(holdings):
    """Every true holder is reported at least at its true longest indexed length (paper §3.2)."""
    d = Deployment()
    prompts = [_prompt(100 + p, 700) for p in range(6)]
    truth: dict[tuple[str, int], tuple[int, Tier]] = {}
    for w, p, cached, tier in holdings:
        worker = d.layout.worker_ids[w]
        old = truth.get((worker, p))
        if old is not None:
            d.evict_above(worker, prompts[p], 0, old[0])
        d.register(worker, prompts[p], cached, tier)
        truth[(worker, p)] = (cached, tier)
    for region, lk in d.lookups.items():
        for p, tokens in enumerate(prompts):
            found = lk.lookup(tokens)
            for (worker, q), (cached, _tier) in truth.items():
                if q != p:
                    continue
                i = d.layout.worker_index(worker)
                exp = d.expected(region, worker, cached, len(tokens))
                assert found.matched[i] >= exp, (region, worker, cached)
