"""False hits of the keyless views, and how much each guard removes (issue 3 item 5; paper §3.2,
Table 5 right half).

A keyless Ludo view answers every query, so a prefix key that was never registered can read an
unrelated entry and name a worker that does not hold the prefix. Two guards:
  - cross-level consistency: a worker registers a cached prefix at every indexed length it
    covers, so a hit above a miss toward the same region can only be false;
  - fingerprint bits per slot: a d-bit digest of the key, checked on lookup.

The index is filled the way serving fills it: workers of the paper's testbed cache prefixes of
shared documents (system prompts, long contexts) and register them at every indexed length; the
tables are sized so that they end near the target load. Queries are (a) prompts never seen and
(b) prompts that share a registered document's beginning and then diverge — the realistic case,
where the truth is the shared part. A claim is false when a worker's reported match exceeds what
it really holds.

    python tools/bench_false_hits.py [--entries 200000] [--queries 3000]
"""

from __future__ import annotations

import argparse

import numpy as np

from kvcompassd.core.config import load_config
from kvcompassd.core.events import PrefixCached, Tier
from kvcompassd.core.fingerprints import expected_false_claims
from kvcompassd.core.index import EdgeIndexView, MaintenanceShard
from kvcompassd.core.keys import namespace_salt, prefix_keys
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.levels import LevelPlan
from kvcompassd.core.lookup import PrefixLookup


def build(cfg, holdings, docs, *, fingerprint_bits: int, capacity: int):
    layout = IndexLayout.from_config(cfg)
    plan = LevelPlan.from_config(cfg)
    salt = namespace_salt(cfg.model)
    shards = [MaintenanceShard(layout, s, cfg.shards, epoch=1, initial_capacity=capacity,
                               fingerprint_bits=fingerprint_bits) for s in range(cfg.shards)]
    for worker, d, length, tier in holdings:
        keys = prefix_keys(docs[d], plan.registration_lengths_upto(length), salt)
        events = [PrefixCached(worker, int(k), tier) for k in keys]
        for e in events:
            shards[e.key % cfg.shards].apply([e])
    views = {}
    for region in cfg.region_names():
        view = EdgeIndexView(layout, cfg.shards, edge=f"edge-{region}")
        for s in shards:
            s.flush()
            view.install_snapshot(s.snapshot())
        views[region] = view
    entries = sum(s.entries() for s in shards)
    return layout, plan, salt, views, entries, shards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="config/testbed-3continent.toml")
    ap.add_argument("--docs", type=int, default=400)
    ap.add_argument("--holdings", type=int, default=3000, help="(worker, document prefix) pairs cached")
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    cfg = load_config(args.config)
    rng = np.random.default_rng(args.seed)
    plan = LevelPlan.from_config(cfg)
    max_len = plan.max_length + 512
    docs = [rng.integers(0, 50000, max_len, dtype=np.uint32) for _ in range(args.docs)]
    workers = [w.id for w in cfg.workers]
    holdings = [(workers[rng.integers(len(workers))], int(rng.integers(args.docs)),
                 int(rng.integers(64, max_len)), Tier.VRAM if rng.random() < 0.7 else Tier.DRAM)
                for _ in range(args.holdings)]
    truth: dict[tuple[str, int], int] = {}
    for w, d, length, _ in holdings:
        truth[(w, d)] = max(truth.get((w, d), 0), length)

    # Queries: unseen prompts, and prompts sharing a document's first `shared` tokens.
    unseen = [rng.integers(0, 50000, int(rng.integers(256, max_len)), dtype=np.uint32) for _ in range(args.queries)]
    related = []
    for _ in range(args.queries):
        d = int(rng.integers(args.docs))
        shared = int(rng.integers(16, max_len - 64))
        tail = rng.integers(0, 50000, int(rng.integers(64, 2048)), dtype=np.uint32)
        related.append((d, shared, np.concatenate([docs[d][:shared], tail])))

    # Size tables so that they end near 90 % load: count keys first with a throwaway build.
    _, _, _, _, entries, shards = build(cfg, holdings, docs, fingerprint_bits=0, capacity=1 << 20)
    groups = len(IndexLayout.from_config(cfg).groups)
    per_table = max(64, int(entries / (cfg.shards * groups) / 0.90))

    print(f"config {args.config}: {len(workers)} workers, {cfg.shards} shards x {groups} region groups; "
          f"{entries} index entries from {args.holdings} cached prefixes; {args.queries} queries of each kind")
    print()
    # The config's own bits too. core/fingerprints.py bounds the false reads per query (each can
    # name several workers of its group) by groups x load x 2^-bits with consistency, x the reads
    # per group without (more than index.levels toward the own region, where same_region_growth
    # adds lengths): 'queries with any false claim' should sit under that bound.
    layout0 = IndexLayout.from_config(cfg)
    reads_per_group = max(len(plan.lengths_toward(r, g.region)) for r in cfg.region_names() for g in layout0.groups)
    print(f"false_lookup_budget {cfg.index.false_lookup_budget:g} per request; config fingerprint_bits "
          f"{cfg.index.fingerprint_bits}; bound = {groups} groups (x {reads_per_group} reads per group without "
          f"consistency) x load x 2^-bits")
    header = f"{'fingerprint bits':>16}  {'consistency':>11}  {'table load':>10}  {'unseen: false claims/query':>27}  {'related: false claims/query':>28}  {'queries with any false claim':>28}  {'bound':>9}"
    print(header)
    print("-" * len(header))
    for fp in sorted({0, 4, 8, cfg.index.fingerprint_bits}):
        layout, plan, salt, views, entries, shards = build(cfg, holdings, docs, fingerprint_bits=fp, capacity=per_table)
        load = np.mean([t["load"] for s in shards for t in s.table_stats()])
        for consistency in (False, True):
            false_unseen = false_related = any_false = 0
            for region in cfg.region_names():
                lk = PrefixLookup(layout, plan, region, salt, views[region], consistency=consistency)
                for q in unseen:
                    found = lk.lookup(q)
                    n = int((found.matched > 0).sum())
                    false_unseen += n
                    any_false += n > 0
                for d, shared, q in related:
                    found = lk.lookup(q)
                    bad = 0
                    for i, w in enumerate(layout.worker_ids):
                        true_len = min(truth.get((w, d), 0), shared)
                        if found.matched[i] > true_len:
                            bad += 1
                    false_related += bad
                    any_false += bad > 0
            nq = args.queries * len(cfg.region_names())
            print(f"{fp:>16}  {'on' if consistency else 'off':>11}  {load:>10.2f}  {false_unseen / nq:>27.4f}  "
                  f"{false_related / nq:>28.4f}  {any_false / (2 * nq):>28.4f}  "
                  f"{expected_false_claims(groups=groups, levels=reads_per_group, load=float(load), bits=fp, consistency=consistency):>9.4f}")


if __name__ == "__main__":
    main()
