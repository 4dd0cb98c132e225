"""The paper's forwarding microbenchmark: one edge's ``Router.decide`` on a large view.

    python tools/bench_forward.py [--entries 10000000] [--levels 5] [--repeat 5000] [--rounds 10]
        [--tokens 4096] [--context-tokens N] [--in-flight 64] [--running N]
        [--configs testbed-3continent,census-64x8[,census:10000x100]]

``census:WxR[/S]`` names a census-shaped fleet of W workers in R regions (S shards), generated
by ``kvcompassd.sim.geo`` as tools/scale_projection.py does; issue 31 measures the decision at
``census:10000x100`` with ``--entries 2000000``.

Per deployment config: the shards' Ludo tables are filled with ``--entries`` random keys in
total (each key on its own shard, ``key % N``; one random holder per key, a second in a quarter)
through the tables' batch insert, plus the benchmark prompt registered by one worker per region
at every length it covers, so the lookup finds real holders. One edge view is built from the
shards' snapshots, and one edge (the first region's) decides for a ``--tokens`` prompt.

Each decision's request ends ``--in-flight`` decisions later (``Router.on_aborted``, outside the
timed call), as a daemon ends its requests: the edge's per-dispatch ledgers hold what is in
flight, not every dispatch ever made.

Printed per config, all measured in the same run on one thread:
- one SHA-256 pass over the prompt's uint32 bytes (the reference of issue 3's targets), sampled
  in ``--rounds`` rounds that alternate with the two decision cases below;
- ``Router.decide`` with the daemon's settings (top-3 score terms, migration detector on):
  P50, P99, decisions/s (a tight loop) and P50 / SHA;
- the same with ``top_k=0`` and without the migration detector (what the simulator runs);
- 64 prompts the view does not hold, each back every 64 decisions, with the pending ledger off
  and on (``score.pending_hold_ms``; on, a decision that finds its previous turn there is
  scored twice; the line after the table says how many of 64 were);
- the decision broken into its stages, each timed alone on the same inputs: hashing at the
  edge's query lengths (``prefix_keys``, the C SHA-256, and ``prefix_keys_reference``, hashlib),
  the fused C call (``SparseForwardKernel.run``: hashing + lookup + score), the
  native lookup alone (``PrefixLookup.lookup``), the reference lookup's view reads (one
  ``LudoView.lookup`` per group and level) and numpy decode (``PrefixLookup._decode``), score
  (``JointScorer.score``), top-k (``ScoreResult.top(3)``) and the migration detector
  (observation + ``HotPrefixDetector.observe``);
- the daemon decision's split: hashing, the C lookup, the C score, the miss summary (each the C
  function the fused call runs, called alone through cffi), the fused call as the Router makes it
  (``SparseForwardKernel.run_out``: queue aging + all of them, into one output buffer, tracked as
  the Router calls it: only the workers the estimates' change log names, and those whose values
  still move, aged again), and the
  Python around it (the
  decision's P50 less the fused call's median); then the full-pass functions these replaced
  (the fused call aging every worker, ``prefix_keys``, ``LookupPlan.run``, ``kvc_score_choose``),
  for comparison.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import itertools
import os
import statistics
import sys
import time
import tomllib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import hold_prompt  # noqa: E402  (this script's directory is on sys.path)
from kvcompassd.core.ablation import Ablation  # noqa: E402
from kvcompassd.core.config import ClusterConfig, load_config, parse_config  # noqa: E402
from kvcompassd.core.index import EdgeIndexView, MaintenanceShard  # noqa: E402
from kvcompassd.core.keys import namespace_salt, prefix_keys, prefix_keys_reference, sha256_backend  # noqa: E402
from kvcompassd.core.layout import IndexLayout  # noqa: E402
from kvcompassd.core.ludo import set_huge_page_views  # noqa: E402
from kvcompassd.core.router import Router  # noqa: E402
from kvcompassd.core.score import ScoreResult  # noqa: E402
from kvcompassd.sim.geo import DEPLOYMENTS, census_fleet, render_toml  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parent.parent / "config"
FILL_CHUNK = 1 << 20


def samples_ns(fn, repeat: int, after=None) -> list[int]:
    """``repeat`` timings of ``fn()``; ``after(result)``, if given, runs untimed after each call."""
    for _ in range(min(200, repeat)):
        result = fn()
        if after is not None:
            after(result)
    out = []
    clock = time.perf_counter_ns
    for _ in range(repeat):
        t0 = clock()
        result = fn()
        out.append(clock() - t0)
        if after is not None:
            after(result)
    return out


class InFlight:
    """Ends each decision's request ``depth`` decisions later (``Router.on_aborted``: its charge
    and ledgers retired, nothing learned), as a daemon with ``depth`` requests in flight ends
    them: without it every dispatch stays open and the edge's per-dispatch ledgers fill to their
    caps, which no serving edge does."""

    def __init__(self, router: Router, clock, depth: int) -> None:
        self.router, self.clock, self.depth = router, clock, depth
        self.open: collections.deque[int] = collections.deque()

    def __call__(self, decision) -> None:
        self.open.append(decision.dispatch)
        if len(self.open) > self.depth:
            self.router.on_aborted(self.open.popleft(), now=self.clock())


def p(samples: list[int], q: float) -> float:
    """Percentile in µs."""
    return float(np.percentile(samples, q)) / 1000.0


def median_us(fn, repeat: int) -> float:
    return statistics.median(samples_ns(fn, repeat)) / 1000.0


def rate_per_s(fn, repeat: int, after=None) -> float:
    """Calls of ``fn`` per second in a tight loop (``after(result)`` included, if given)."""
    t0 = time.perf_counter()
    if after is None:
        for _ in range(repeat):
            fn()
    else:
        for _ in range(repeat):
            after(fn())
    return repeat / (time.perf_counter() - t0)


def with_levels(cfg: ClusterConfig, levels: int, context_tokens: int | None = None) -> ClusterConfig:
    index = dataclasses.replace(cfg.index, levels=levels)
    if context_tokens is not None:
        index = dataclasses.replace(index, context_tokens=context_tokens)
    return dataclasses.replace(cfg, index=index)


def build_view(cfg: ClusterConfig, entries: int, prompt: np.ndarray, seed: int) -> tuple[EdgeIndexView, float, int]:
    """Shards filled to ``entries`` keys in total, the prompt registered, one edge view from snapshots."""
    t0 = time.perf_counter()
    layout = IndexLayout.from_config(cfg)
    n = cfg.shards
    groups = layout.groups
    per_table = max(1, entries // (n * len(groups)))
    capacity = int(per_table / cfg.index.max_load) + 1024  # no growth while filling
    shards = [MaintenanceShard(layout, s, n, epoch=1, initial_capacity=capacity,
                               fingerprint_bits=cfg.index.fingerprint_bits, max_load=cfg.index.max_load)
              for s in range(n)]
    rng = np.random.default_rng(seed)
    for s, shard in enumerate(shards):
        for g in groups:
            # Random keys of this shard: k * N + s, all distinct.
            keys = np.unique(rng.integers(0, ((1 << 63) - 1 - s) // n, size=per_table, dtype=np.uint64))
            keys = keys * np.uint64(n) + np.uint64(s)
            rng.shuffle(keys)
            # Sparse holders as in a serving fleet: one random worker of the group holds each
            # prefix (VRAM or DRAM), a second one a quarter of the time.
            width = len(g.workers)
            first = rng.integers(0, width, size=keys.size)
            values = rng.integers(1, 3, size=keys.size, dtype=np.uint64) << (2 * first).astype(np.uint64)
            second = rng.integers(0, width, size=keys.size)
            extra = (rng.random(keys.size) < 0.25) & (second != first)
            values |= np.where(extra, rng.integers(1, 3, size=keys.size, dtype=np.uint64) << (2 * second).astype(np.uint64),
                               np.uint64(0))
            table = shard._tables[g.group]  # the shard's own table: a bulk fill has no event API
            for start in range(0, keys.size, FILL_CHUNK):
                table.insert_many(keys[start:start + FILL_CHUNK], values[start:start + FILL_CHUNK])
                table.take_updates()  # the fill travels in the snapshot below, not as records
    # The prompt, held by the first worker of every region at every registration length.
    for region in cfg.region_names():
        hold_prompt(cfg, shards, cfg.workers_in(region)[0].id, prompt)
    view = EdgeIndexView(layout, n, edge="edge-bench")
    for shard in shards:
        shard.flush()
        assert view.install_snapshot(shard.snapshot()).applied
    total = sum(s.entries() for s in shards)
    del shards
    return view, time.perf_counter() - t0, total


def sparse_split(router: Router, prompt: np.ndarray, lengths: np.ndarray, keys: np.ndarray, queue: np.ndarray,
                 belief: np.ndarray, repeat: int) -> list[tuple[str, float]]:
    """The stages of the Router's fused call (``kvc_forward_decide_sparse_aged``), each its C
    function called alone through cffi on the decision's inputs: (label, median µs)."""
    from kvcompassd.core._ludo_cffi import ffi, lib

    kernel = router._kernel
    plan, pointers = router.lookup.native_plan()
    n = plan.workers
    tokens = ffi.from_buffer("uint8_t[]", prompt)
    salt = router.lookup.salt
    lengths_c = ffi.from_buffer("int64_t[]", np.ascontiguousarray(lengths, dtype=np.int64))
    keys_out = np.zeros(max(1, lengths.size), dtype=np.uint64)
    keys_c = ffi.from_buffer("uint64_t[]", keys)
    field_worker = ffi.from_buffer("int32_t[]", kernel._field_worker)
    values = ffi.from_buffer("uint64_t[]", np.zeros(max(1, plan.groups * plan.max_levels), dtype=np.uint64))
    matched, tier = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.uint8)
    holders, held = np.zeros(n, dtype=np.int32), ffi.new("size_t *")
    out = (ffi.from_buffer("int64_t[]", matched), ffi.from_buffer("uint8_t[]", tier),
           ffi.from_buffer("int32_t[]", holders), held)
    lookup_args = (plan.shards, plan.groups, keys_c, keys.size, ffi.from_buffer("int64_t[]", plan._lengths),
                   ffi.from_buffer("int32_t[]", plan._key_index), plan.max_levels, field_worker, n,
                   int(plan.consistency), values)
    lib.kvc_lookup_sparse(pointers.pointers(), *lookup_args, *out)
    score = router.scorer.kernel
    wan, beta, local_factor, penalty = score._constants
    gamma, lambda_max, tau = score._params
    flags = router.scorer.kernel_flags(router.ablation)
    scores = np.zeros(n)
    lam, chosen, complete = ffi.new("double *"), ffi.new("int64_t *"), ffi.new("int *")
    score_args = (n, float(len(prompt)), wan, beta, ffi.from_buffer("double[]", queue),
                  ffi.from_buffer("double[]", belief), out[0], out[1], local_factor, penalty, ffi.NULL, gamma,
                  lambda_max, tau, flags, ffi.from_buffer("int64_t[]", router._last_sent), out[2], held[0],
                  router.scorer.blocks.c, ffi.from_buffer("double[]", scores), lam, chosen, complete)
    lib.kvc_score_choose_pruned(*score_args)
    local, floors = router._miss_summary._c
    floor_free = kernel._sparse.remote_floor_free

    def hashing():
        return lib.kvc_prefix_keys_paired(salt, len(salt), tokens, len(prompt), lengths_c, lengths.size, 0,
                                          ffi.from_buffer("uint64_t[]", keys_out))

    stages = [
        (f"hashing (kvc_prefix_keys_paired, {lengths.size} lengths)", median_us(hashing, repeat)),
        (f"C lookup (kvc_lookup_sparse: {held[0]} holders)",
         median_us(lambda: lib.kvc_lookup_sparse(pointers.pointers(), *lookup_args, *out), repeat)),
        ("score (kvc_score_choose_pruned: holders, then blocks in reach)",
         median_us(lambda: lib.kvc_score_choose_pruned(*score_args), repeat)),
        ("miss summary (kvc_miss_summary_holders)",
         median_us(lambda: lib.kvc_miss_summary_holders(out[2], held[0], out[0], local, floors, floor_free,
                                                        score_args[-4], score_args[4], chosen[0], n), repeat)),
    ]
    return stages


def named_config(name: str) -> ClusterConfig:
    """A shipped config (``config/NAME.toml``) or ``census:WxR[/S]``: a census-shaped fleet of W
    workers in R regions (``kvcompassd.sim.geo.census_fleet`` from census-128x16), S shards
    (default: the generator's)."""
    if not name.startswith("census:"):
        return load_config(CONFIG_DIR / f"{name}.toml")
    size, _, shards = name[len("census:"):].partition("/")
    workers, _, regions = size.partition("x")
    spec = census_fleet(DEPLOYMENTS["census-128x16"], workers=int(workers), regions=int(regions),
                        shards=int(shards) if shards else None)
    return parse_config(tomllib.loads(render_toml(spec, over_budget=True)), spec.name)


def bench_config(name: str, args: argparse.Namespace) -> None:
    cfg = with_levels(named_config(name), args.levels, args.context_tokens)
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, 128_256, size=args.tokens, dtype=np.uint32)
    # The edge daemon makes its views on huge pages (kvcompassd edge; ludo.set_huge_page_views).
    set_huge_page_views(args.huge_page_views != "off")
    view, build_s, total = build_view(cfg, args.entries, prompt, args.seed)
    small_pages = None
    if args.huge_page_views == "both":  # the same view on 4 KiB pages, a case of its own
        set_huge_page_views(False)
        small_pages, _, _ = build_view(cfg, args.entries, prompt, args.seed)
    region = cfg.region_names()[0]
    salt = namespace_salt(cfg.model, cfg.tenant)
    data = prompt.astype("<u4").tobytes()

    daemon = Router(cfg, region, view, now=0.0)  # the edge daemon's settings
    lean = Router(cfg, region, view, now=0.0, top_k=0, ablation=Ablation(migration=False))
    # Conversations the view does not show yet, with and without the pending ledger: each of 64
    # prompts comes back every 64 decisions (0.64 s), so with the ledger on every decision after
    # the first round finds its previous turn there and is scored twice.
    unheld = [rng.integers(0, 128_256, size=args.tokens, dtype=np.uint32) for _ in range(64)]
    off_score = dataclasses.replace(cfg.score, pending_hold_ms=0.0)
    on_score = dataclasses.replace(cfg.score, pending_hold_ms=1000.0)
    ledger_off = Router(dataclasses.replace(cfg, score=off_score), region, view, now=0.0)
    ledger_on = Router(dataclasses.replace(cfg, score=on_score), region, view, now=0.0)
    # Every worker reported live or broadcast once, all idle; with --running, the own region's
    # workers each running that many requests (the occupancy the score adds: QueueEstimates.set_local).
    for router in (daemon, lean, ledger_off, ledger_on):
        for w in cfg.workers_in(region):
            router.queues.set_local(w.id, 0.0, now=0.0, running=args.running)

    # The reference and the decision cases are sampled in alternating rounds, so that load that
    # comes and goes on a shared machine falls on all alike (each round is long enough to keep
    # its own caches warm: no call of one runs between two calls of another).
    def same(): return itertools.repeat(prompt)
    def cycling(): return itertools.cycle(unheld)
    cases = (("Router.decide (daemon: top-3, migration on)", daemon, same),
             ("Router.decide (sim: top_k=0, no migration)", lean, same),
             ("unindexed follow-ups, pending ledger off", ledger_off, cycling),
             ("unindexed follow-ups, pending ledger on", ledger_on, cycling))
    if small_pages is not None:
        on_small = Router(cfg, region, small_pages, now=0.0)
        for w in cfg.workers_in(region):
            on_small.queues.set_local(w.id, 0.0, now=0.0, running=args.running)
        cases += (("Router.decide (daemon), views on 4 KiB pages", on_small, same),)
    # A slowly advancing clock keeps the hot-prefix windows realistic (no flood of one family).
    clocks = [itertools.count(0.0, 0.01) for _ in cases]
    feeds = [make() for _, _, make in cases]
    # The time each case's decisions were last made at, for the requests it ends.
    last_now = [0.0] * len(cases)

    def stamped(k: int):
        def tick() -> float:
            last_now[k] = next(clocks[k])
            return last_now[k]
        return tick

    ticks = [stamped(k) for k in range(len(cases))]
    ends = [InFlight(router, (lambda k=k: last_now[k]), args.in_flight) if args.in_flight else None
            for k, (_, router, _) in enumerate(cases)]
    sha_samples: list[int] = []
    case_samples: list[list[int]] = [[] for _ in cases]
    per_round = max(1, args.repeat // args.rounds)
    load_before = os.getloadavg()  # the machine's other load over this config's window
    for _ in range(args.rounds):
        sha_samples += samples_ns(lambda: hashlib.sha256(salt + data).digest(), per_round)
        for (_, router, _), tick, feed, end, out in zip(cases, ticks, feeds, ends, case_samples):
            out += samples_ns(lambda: router.decide(next(feed), now=tick()), per_round, end)
    sha = statistics.median(sha_samples) / 1000.0
    load_after = os.getloadavg()
    rows = []
    for (label, router, _), tick, feed, end, s in zip(cases, ticks, feeds, ends, case_samples):
        rate = rate_per_s(lambda: router.decide(next(feed), now=tick()), args.repeat, end)
        rows.append((label, p(s, 50), p(s, 99), rate))

    on_tick, on_feed = ticks[-1], feeds[-1]
    credited = sum(ledger_on.decide(next(on_feed), now=on_tick()).pending for _ in range(len(unheld)))

    # Stage breakdown on the same inputs.
    lk = daemon.lookup
    n_fit = int(np.searchsorted(lk.query_lengths, len(prompt), side="right"))
    lengths = lk.query_lengths[:n_fit]
    keys = prefix_keys(prompt, lengths, salt)
    key_of = dict(zip(lengths.tolist(), keys.tolist()))
    reads = [(g, level, key_of[n]) for g, row in enumerate(lk.group_lengths) for level, n in enumerate(row.tolist())
             if n and n <= len(prompt)]
    state, shards = view.state, view.shards

    def view_lookups() -> np.ndarray:
        values = np.zeros(lk.group_lengths.shape, dtype=np.uint64)
        for g, level, key in reads:
            values[g, level] = state[key % shards].views[g].lookup(key)
        return values

    values = view_lookups()
    found = lk.lookup(prompt)
    queue, belief = daemon.queues.queue_ms(), daemon.belief.values
    scored = daemon.scorer.score(found.prompt_len, found.matched, found.tier, queue, belief)
    mclock = itertools.count(0.0, 0.01)

    def observe(now: float):
        return daemon.hot.observe(daemon._observation(found, scored.scores, scored.chosen, now), now=now)

    kernel = daemon._kernel
    stages = [
        (f"hashing: prefix_keys at {n_fit} lengths ({sha256_backend()})",
         median_us(lambda: prefix_keys(prompt, lengths, salt), args.repeat)),
        (f"hashing: prefix_keys_reference (hashlib), {n_fit} lengths",
         median_us(lambda: prefix_keys_reference(prompt, lengths, salt), args.repeat)),
        ("fused C call: SparseForwardKernel.run (hash+lookup+score)",
         median_us(lambda: kernel.run(prompt, queue, belief, None), args.repeat)),
        ("PrefixLookup.lookup (C hash, C reads + decode)", median_us(lambda: lk.lookup(prompt), args.repeat)),
        (f"reference: {len(reads)} LudoView.lookup from Python", median_us(view_lookups, args.repeat)),
        ("reference: decode, PrefixLookup._decode", median_us(lambda: lk._decode(values), args.repeat)),
        ("score: JointScorer.score", median_us(lambda: daemon.scorer.score(found.prompt_len, found.matched, found.tier,
                                                                           queue, belief), args.repeat)),
        # A fresh result each time: a result keeps its top-k once built.
        ("top-k: ScoreResult.top(3), first read (with its ScoreResult)",
         median_us(lambda: ScoreResult(scored.chosen, scored.worker, scored.lam, scored.scores, daemon.scorer,
                                       found.prompt_len, found.matched, found.tier, queue, belief,
                                       daemon.ablation).top(3), args.repeat)),
        ("migration: observation + HotPrefixDetector.observe",
         median_us(lambda: observe(next(mclock)), args.repeat)),
    ]

    # The daemon's decision split into its stages, each the C function the fused call runs (or the
    # Python around it), timed alone on the same inputs; "Python around" is the decision's P50 less
    # the fused call's median.
    plan, pointers = lk.native_plan()
    split = sparse_split(daemon, prompt, lengths, keys, queue, belief, args.repeat)
    # (the occupancy is added while some own-region worker's is above 0, as QueueEstimates.queue_ms)
    occupied = args.running > 0 and cfg.score.occupancy_ms_per_running > 0.0
    ms, correction = daemon.queues.queue_ms(), None
    # As the Router calls it (tracked: the estimates' change log says which workers to age again),
    # at a clock that advances as the decisions' does.
    fused_clock = itertools.count(last_now[0] + 1.0, 0.01)
    fused = median_us(lambda: kernel.run_out(prompt, ms, next(fused_clock), correction, occupied, belief, None, True),
                      args.repeat)
    split.append(("fused C call (all of the above + queue aging)", fused))
    split.append(("Python around the C call (decide P50 - fused)", rows[0][1] - fused))
    # The full (non-sparse) stages the decision ran before, for comparison.
    score_kernel, flags = daemon.scorer.kernel, daemon.scorer.kernel_flags(daemon.ablation)
    split += [
        ("  before: fused call aging every worker (untracked)",
         median_us(lambda: kernel.run_out(prompt, ms, 1.0, correction, occupied, belief, None), args.repeat)),
        ("  before: hashing one final after another (prefix_keys)",
         median_us(lambda: prefix_keys(prompt, lengths, salt), args.repeat)),
        ("  before: C lookup over every worker (LookupPlan.run)",
         median_us(lambda: plan.run(pointers.pointers(), keys), args.repeat)),
        ("  before: score of every worker (kvc_score_choose)",
         median_us(lambda: score_kernel.run(float(len(prompt)), queue, belief, found.matched, found.tier, None, flags),
                   args.repeat)),
    ]

    hits = {cfg.workers[i].id: int(m) for i, m in enumerate(found.matched.tolist()) if m}
    print(f"\n== {name}: {len(cfg.workers)} workers, {len(cfg.region_names())} regions, {cfg.shards} shards, "
          f"{len(view.layout.groups)} region groups, levels={cfg.index.levels}, "
          f"context_tokens={cfg.index.context_tokens} ({len(lk.query_lengths)} query lengths); edge {region!r}; "
          f"own-region workers running {args.running} requests each (occupancy {'on' if occupied else 'off'})")
    print("load average (1/5/15 min) before this config's rounds: %.2f %.2f %.2f, after them: %.2f %.2f %.2f"
          % (*load_before, *load_after))
    print(f"view: {total:,} entries ({sum(v['memory_bytes'] for v in view.stats()) / 2**20:.0f} MiB), "
          f"built in {build_s:.1f} s; prompt {len(prompt)} tokens; holders found: {hits}")
    print(f"{'case':<54} {'P50 µs':>9} {'P99 µs':>9} {'dec/s':>9} {'P50/SHA':>8}")
    print(f"{'one SHA-256 over the prompt (reference)':<54} {sha:>9.2f} {'':>9} {'':>9} {1.0:>8.2f}")
    for label, p50, p99, rate in rows:
        print(f"{label:<54} {p50:>9.2f} {p99:>9.2f} {rate:>9,.0f} {p50 / sha:>8.2f}")
    print(f"(ledger on: {credited} of the next {len(unheld)} decisions credited a pending holding; "
          f"{len(ledger_on.pending)} entries held)")
    print(f"{'stage (each timed alone)':<54} {'median µs':>9} {'':>9} {'':>9} {'x SHA':>8}")
    for label, us in stages:
        print(f"  {label:<52} {us:>9.2f} {'':>9} {'':>9} {us / sha:>8.2f}")
    print(f"{'split of the daemon decision (P50 ' + format(rows[0][1], '.2f') + ' µs)':<54} "
          f"{'median µs':>9} {'share':>9} {'':>9} {'x SHA':>8}")
    for label, us in split:
        print(f"  {label:<52} {us:>9.2f} {us / rows[0][1]:>9.0%} {'':>9} {us / sha:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=10_000_000, help="view entries in total (all shards and groups)")
    parser.add_argument("--levels", type=int, default=5, help="index.levels (the paper's benchmark: five)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--context-tokens", type=int, default=None,
                        help="index.context_tokens (default: the config's); 16384 gives the paper's reach, "
                             "without the long lengths")
    parser.add_argument("--repeat", type=int, default=5000, help="samples per case")
    parser.add_argument("--rounds", type=int, default=10,
                        help="the SHA-256 reference and the decision cases alternate in this many rounds")
    parser.add_argument("--in-flight", type=int, default=64,
                        help="each decision's request ends this many decisions later (Router.on_aborted, untimed "
                             "except in dec/s), as in a daemon with that many requests in flight; 0: never")
    parser.add_argument("--running", type=int, default=0,
                        help="each own-region worker reports this many running requests (set_local's running): "
                             "the score then adds their occupancy (score.occupancy_ms_per_running each), as on a "
                             "busy edge; 0: none, the occupancy term off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", default="testbed-3continent,census-64x8")
    parser.add_argument("--huge-page-views", choices=("on", "off", "both"), default="on",
                        help="make the views on transparent huge pages as the edge daemon does (on); both: also "
                             "the same view on 4 KiB pages, its decisions a case of the same rounds")
    args = parser.parse_args()
    # The machine is shared: a loaded run shows up in P99 and decisions/s first.
    print("load average (1/5/15 min): %.2f %.2f %.2f on %d CPUs" % (*os.getloadavg(), os.cpu_count() or 0))
    for name in args.configs.split(","):
        bench_config(name.strip(), args)


if __name__ == "__main__":
    main()
