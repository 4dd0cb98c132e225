"""What one edge and one maintenance shard need at a fleet size you name, from per-unit costs
measured on this machine, with the formulas, and the first resource to break.

    python tools/scale_projection.py --workers 10000 --regions 100 [--shards 100] [--load 0.75]
        [--edges-per-region 1] [--edge-cores 1] [--shard-cores 1] [--nic-gbps 10]
        [--edge-memory-gib 64] [--quick]

Measured here, each printed with what was measured:

- apply: an edge's CPU per index update (``EdgeSync.on_batch`` of real update batches into views
  of the target fleet's region-group tables holding ``--apply-entries`` entries, one C call per
  batch) and a maintenance unit's (``MaintenanceShard.apply_columns`` + ``flush``), on batches of
  ``--batch-events`` random registrations and evictions; and again on batches of
  ``--small-batch-events`` (what a region's stream carries per flush at 10,000 x 100), the line
  through the two giving the cost per batch (``t_batch``, bytes_batch) and per update (``t_update``);
- per-edge-region streams (``kvcompassd.core.streams``): the share of the fleet's updates each
  edge region's stream carries, from registrations of the workload's prompts by random workers
  of the target fleet (``share_edge``: the most-served region's; the sum over regions);
- wire: bytes per index update of those batches as ``kvcompassd.wire`` encodes them, raw and
  compressed as the daemons send them (``encode(..., compress=True)``: zlib);
- the write load: a KVCompass simulation (``--sim-workers`` x ``--sim-regions``, a census-shaped
  fleet from ``kvcompassd.sim.geo.census_fleet``, Mixed at ``--load`` x lambda0, caches cut to
  1/``--sim-cache-divisor`` of an A100's so they fill and evict within ``--sim-seconds``), counted
  after its first half: blocks stored per request, registrations per stored block, index updates
  per registration (registrations, tier moves, evictions);
- registered lengths per cached prompt: the registration lengths (``LevelPlan``) of the simulated
  fleet and of the target fleet (census_fleet at ``--workers`` x ``--regions``) that the
  workload's prompts cover, averaged over ``--prompt-sample`` prompts;
- decision time versus fleet size: the real ``Router.decide`` (the daemon's settings) on views
  built by tools/bench_forward.py's ``build_view`` for census fleets of ``--decision-sizes``
  workers (and the target's, up to 16,384) with the target's workers per region (16 to 416
  regions), P50 over ``--decisions`` decisions, fitted as a + b x W;

Times are CPU time of the measuring thread (``time.thread_time_ns``), so a busy machine's
neighbours do not inflate them (they still slow caches and memory).
- view bytes per entry: the keyless views' memory over their entries, in the apply measurement's
  tables.

Projection for W workers in R regions, S shards, E edges per region, load f (formulas printed):

    lambda_w  = f x lambda0_w                      requests/s per worker (lambda0_w = 1 / (mean prompt x beta))
    reg_blk   = reg_blk_sim x len_target / len_sim registrations per stored block at R regions
    U_w       = lambda_w x blocks_per_req x reg_blk x updates_per_reg     index updates/s per worker
    U         = W x U_w                             updates/s every edge applies (each edge follows every shard)
    edge apply cores   = U x t_edge
    edge inbound       = U x bytes_per_update x 8   (raw; compressed likewise)
    shard apply cores  = U / S x t_shard
    shard egress       = U / S x bytes_per_update x 8 x R x E
    view per edge      = W x cache_blocks_w x reg_blk x bytes_per_entry     (every cache full)
    decision cores     = W x lambda_w / (R x E) x (a + b x W)
    queue broadcasts   = (R - 1) x bytes(vector of W/R workers) x 8 / Delta       inbound per edge

and with per-edge-region streams (printed beside; what the daemons send by default, and what the
limits table uses unless ``--streams full``), a flush every F s (``--flush-ms``; at most one batch
per shard's stream per flush):

    U_e   = U x share_edge, B_e = S x min(1 / F, U_e / S)
    edge apply cores   = U_e x t_update + B_e x t_batch
    edge inbound       = (U_e x bytes_update + B_e x bytes_batch) x 8   (compressed: zlib_update, zlib_batch)
    shard apply cores  = U / S x t_unit_streams   (measured: the full tables and every region's stream)
    shard egress       = (U / S x sum of shares x bytes_update + min(1 / F, U / S) x R x bytes_batch) x 8 x E
    view per edge      = (as above) x share_edge

Each is compared with its limit; the first to break is the one furthest over (or nearest) its
limit, and for each the fleet size (same workers per region) at which it reaches its limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import statistics
import sys
import time
import tomllib
import zlib
from pathlib import Path

import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_forward import build_view  # noqa: E402

from kvcompassd.core.config import ClusterConfig, parse_config  # noqa: E402
from kvcompassd.core.events import EventOp, IndexEventColumns, PrefixCached, PrefixEvicted, TierChanged  # noqa: E402
from kvcompassd.core.index import EdgeIndexView, MaintenanceShard  # noqa: E402
from kvcompassd.core.layout import IndexLayout  # noqa: E402
from kvcompassd.core.levels import LevelPlan  # noqa: E402
from kvcompassd.core.messages import QueueVectorBroadcast  # noqa: E402
from kvcompassd.core.router import Router  # noqa: E402
from kvcompassd.core.streams import ShardStreams  # noqa: E402
from kvcompassd.core.sync import EdgeSync  # noqa: E402
from kvcompassd.engine.kvevents import BlockStored  # noqa: E402
from kvcompassd.sim.engine import SimSettings, simulate  # noqa: E402
from kvcompassd.sim.exp_scale import lambda0  # noqa: E402
from kvcompassd.sim.geo import DEPLOYMENTS, census_fleet, render_toml  # noqa: E402
from kvcompassd.sim.kvcompass_policy import KVCompassPolicy  # noqa: E402
from kvcompassd.sim.policy import Topology  # noqa: E402
from kvcompassd.sim.schemes import DEFAULT_EVICTION, make_workload, prompt_lengths, region_weights  # noqa: E402
from kvcompassd.wire import COMPRESSED_TAG, PROTOCOL_VERSION, compress_encoded, encode  # noqa: E402

WAN_DATAGRAM_BYTES = 1200  # what the daemons send WAN peers: a batch that fits one is sent uncompressed
BASE = "census-128x16"
WORKLOAD = "mixed"
GIB = 2**30


def fleet_config(workers: int, regions: int, *, shards: int | None = None) -> ClusterConfig:
    """A census-shaped fleet of exactly ``workers`` x ``regions`` as the config loader reads it."""
    spec = census_fleet(DEPLOYMENTS[BASE], workers=workers, regions=regions, shards=shards)
    return parse_config(tomllib.loads(render_toml(spec, over_budget=True)), spec.name)


# ----------------------------------------------------------------------------- apply and wire


def _wrapped(payload: bytes) -> int:
    """Bytes of a compressed message around ``payload`` (``wire.compress_encoded``'s wrapper)."""
    return len(msgpack.packb([PROTOCOL_VERSION, COMPRESSED_TAG, payload], use_bin_type=True))


def measure_apply(cfg: ClusterConfig, *, entries: int, batch_events: int, batches: int, seed: int,
                  small_batch_events: int = 4) -> dict:
    """CPU µs per index update at an edge and at the shard, and bytes per update on the wire,
    into ``entries`` entries spread over the fleet's region-group tables."""
    layout = IndexLayout.from_config(cfg)
    table_entries = max(1024, entries // len(layout.groups))
    rng = np.random.default_rng(seed)
    # No growth while measuring (a growth ships a snapshot): room for twice each table's share of the new keys.
    capacity = int((table_entries + 4 * batch_events * batches // len(layout.groups) + 8192) / cfg.index.max_load)
    shard = MaintenanceShard(layout, 0, 1, epoch=1, initial_capacity=capacity,
                             fingerprint_bits=cfg.index.fingerprint_bits, max_load=cfg.index.max_load)
    held: dict[str, list[int]] = {}
    for g in layout.groups:  # fill every table through the batch insert (no event API for a bulk fill)
        keys = np.unique(rng.integers(0, 1 << 63, size=table_entries, dtype=np.uint64))
        owner = rng.integers(0, len(g.workers), size=keys.size)
        values = np.uint64(1) << (2 * owner).astype(np.uint64)
        shard._tables[g.group].insert_many(keys, values)
        shard._tables[g.group].take_updates()
        for f, w in enumerate(g.workers):
            held[w] = keys[owner == f][:4096].tolist()
    view = EdgeIndexView(layout, 1, edge="edge-projection")
    sync = EdgeSync(view)
    sync.on_snapshot(shard.snapshot(), now=0.0)
    workers = list(layout.worker_ids)
    clock = itertools.count(0.0)

    def run(batch_events: int, batches: int) -> dict:
        shard_ns = updates = raw = packed = level9 = context = sent = 0
        published = []
        recent: list[bytes] = []  # the stream's last batches: a per-stream compression context's dictionary
        for _ in range(batches):
            # One flush's worth: a few workers' reports, half registrations of new prefixes, half
            # evictions of ones they hold (the steady state's mix is near one to one).
            spread = min(8, len(workers), batch_events)
            for w in rng.choice(workers, size=spread, replace=False).tolist():
                n = batch_events // spread
                new = rng.integers(0, 1 << 63, size=n - n // 2, dtype=np.uint64)
                gone = [held[w].pop() for _ in range(min(n // 2, len(held[w])))]
                keys = np.concatenate([new, np.array(gone, dtype=np.uint64)])
                ops = bytes([EventOp.CACHED_VRAM]) * new.size + bytes([EventOp.EVICTED]) * len(gone)
                cols = IndexEventColumns(ops, keys.astype("<u8").tobytes())
                t0 = time.thread_time_ns()
                outcome = shard.apply_columns(w, cols)
                shard_ns += time.thread_time_ns() - t0
                updates += outcome.applied
            t0 = time.thread_time_ns()
            batch = shard.flush()
            shard_ns += time.thread_time_ns() - t0
            published.append(batch)
            plain = encode(batch)
            raw += len(plain)
            packed += len(compress_encoded(plain))
            # What else the data allows: zlib at its best level, and with the stream's previous
            # batches as a preset dictionary (a compression context kept per stream, which the
            # one-shot encoding cannot use); and what a 1,200-byte WAN path is sent today
            # (EncodedMessage compresses only what spans several datagrams).
            level9 += min(len(plain), _wrapped(zlib.compress(plain, 9)))
            deflate = zlib.compressobj(9, zdict=b"".join(recent)[-32768:]) if recent else zlib.compressobj(9)
            context += min(len(plain), _wrapped(deflate.compress(plain) + deflate.flush()))
            sent += len(plain) if len(plain) <= WAN_DATAGRAM_BYTES else len(compress_encoded(plain))
            recent = (recent + [plain])[-8:]
        # The edge's side afterwards, back to back, as an edge process that does only this would
        # (interleaved with the shard's work above, the edge's tables and code are cold: the
        # small batches then cost ~3x more; an edge that also decides sits in between).
        t0 = time.thread_time_ns()
        for batch in published:
            step = sync.on_batch(batch, now=next(clock))
            if not step.applied:
                raise RuntimeError(f"the edge refused a batch: {step.reason}")
        edge_ns = time.thread_time_ns() - t0
        return {"edge_ns": edge_ns, "shard_ns": shard_ns, "updates": updates, "raw": raw, "packed": packed,
                "level9": level9, "context": context, "sent": sent, "batches": batches}

    big = run(batch_events, batches)
    # Small batches, a few workers' one event each (what a region's stream carries per flush at
    # 10,000 x 100): the per-batch cost is the intercept of a line through the two batch sizes.
    small = run(small_batch_events, batches)
    updates = big["updates"]
    per_batch = [(m["updates"] / m["batches"], m["edge_ns"] / 1000 / m["batches"], m["raw"] / m["batches"],
                  m["packed"] / m["batches"]) for m in (small, big)]
    (n1, t1, b1, z1), (n2, t2, b2, z2) = per_batch
    t_update = (t2 - t1) / (n2 - n1)
    bytes_update = (b2 - b1) / (n2 - n1)
    zlib_update = (z2 - z1) / (n2 - n1)
    compression = {name: {k: m[k] / m["raw"] for k in ("packed", "level9", "context", "sent")}
                   | {"updates_per_batch": m["updates"] / m["batches"], "raw_per_batch": m["raw"] / m["batches"]}
                   for name, m in (("small", small), ("big", big))}
    entries = shard.entries()
    view_bytes = sum(v["memory_bytes"] for v in view.stats())
    return {"edge_us": big["edge_ns"] / 1000 / updates, "shard_us": big["shard_ns"] / 1000 / updates, "updates": updates,
            "bytes_raw": big["raw"] / updates, "bytes_zlib": big["packed"] / updates,
            "view_bytes_per_entry": view_bytes / entries, "table_entries": table_entries, "groups": len(layout.groups),
            "load": entries / sum(t.slots for t in shard._tables),
            "t_update_us": t_update, "t_batch_us": max(0.0, t1 - t_update * n1),
            "bytes_update": bytes_update, "bytes_batch": max(0.0, b1 - bytes_update * n1),
            "zlib_update": zlib_update, "zlib_batch": max(0.0, z1 - zlib_update * n1), "compression": compression,
            "small_updates_per_batch": n1, "big_updates_per_batch": n2, "small_edge_us": small["edge_ns"] / 1000 / small["updates"]}


def measure_filtering(cfg: ClusterConfig, prompt_lengths: list[int], *, seed: int) -> dict:
    """The share of the fleet's index updates each edge region's stream carries
    (``kvcompassd.core.streams``): one registration per length of random prompts cached by
    random workers, through a one-shard ``ShardStreams`` of the fleet (the share does not depend
    on the shard count)."""
    layout, plan = IndexLayout.from_config(cfg), LevelPlan.from_config(cfg)
    # Tables sized so that none grows while timed (growth is a one-off, not the steady state).
    capacity = max(64, int(4 * sum(np.searchsorted(plan.registration_lengths(), n, side="right")
                                   for n in prompt_lengths) / len(layout.groups)))
    streams = ShardStreams(layout, plan, 0, 1, epoch=1, initial_capacity=capacity, fingerprint_bits=0)
    registered = np.array(plan.registration_lengths(), dtype=np.uint32)
    rng = np.random.default_rng(seed)
    workers = list(layout.worker_ids)
    apply_ns = reports = 0
    for tokens in prompt_lengths:
        lengths = registered[: int(np.searchsorted(registered, tokens, side="right"))]
        if lengths.size == 0:
            continue
        keys = rng.integers(0, 1 << 63, size=lengths.size, dtype=np.uint64)
        cols = IndexEventColumns(bytes([EventOp.CACHED_VRAM]) * lengths.size, keys.astype("<u8").tobytes(),
                                 lengths.astype("<u4").tobytes())
        # One prompt's registrations as one report, as the unit applies it: the full tables and
        # every region's stream.
        t0 = time.thread_time_ns()
        streams.apply_columns(workers[int(rng.integers(len(workers)))], cols)
        apply_ns += time.thread_time_ns() - t0
        reports += 1
    total = streams.applied[None]
    shares = {r: streams.applied[r] / total for r in streams.filtered}
    worst = max(shares, key=shares.get)
    return {"total": total, "mean": float(np.mean(list(shares.values()))), "max": shares[worst], "worst": worst,
            "min": min(shares.values()), "sum": float(sum(shares.values())), "regions": len(shares),
            "unit_us_per_update": apply_ns / 1000 / total, "events_per_report": total / max(1, reports)}


def decision_regions(workers: int, target_workers: int, target_regions: int) -> int:
    """Regions of a decision-timing fleet: the target's workers per region, 16 to 416 regions."""
    return min(16 * 26, max(16, round(workers * target_regions / target_workers)))


# ----------------------------------------------------------------------------- write load


class CountingPolicy(KVCompassPolicy):
    """KVCompass counting, from ``since`` on, the engine's stored blocks and the index events."""

    since = math.inf
    # Each delivery to a shard as an event of its own, applied on arrival (_shard_apply), where
    # this counts it; the policy's default holds them at the shard until its flush.
    _deliveries_held_by_shards = False

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.blocks = 0
        self.by_type = {PrefixCached: 0, TierChanged: 0, PrefixEvicted: 0}
        self.requests = 0

    def on_cache_events(self, worker_index, events, *, now):
        if now >= self.since:
            self.blocks += sum(len(e.block_hashes) for e in events if type(e) is BlockStored)
        super().on_cache_events(worker_index, events, now=now)

    def _shard_apply(self, s, events, now):
        if now >= self.since:
            for ev in events:
                self.by_type[type(ev)] += 1
        super()._shard_apply(s, events, now)

    def route(self, req, *, now):
        if now >= self.since:
            self.requests += 1
        return super().route(req, now=now)


def measure_writes(cfg: ClusterConfig, *, load: float, seconds: float, cache_divisor: int, seed: int) -> dict:
    small = [dataclasses.replace(w, vram_kv_tokens=max(4096, w.vram_kv_tokens // cache_divisor),
                                 dram_kv_tokens=w.dram_kv_tokens // cache_divisor) for w in cfg.workers]
    cfg = dataclasses.replace(cfg, workers=tuple(small))
    topo = Topology.from_config(cfg)
    lam0 = lambda0(topo, seed=seed, sample=5000)
    policy = CountingPolicy(topo, seed=seed)
    policy.since = seconds / 2
    requests = make_workload(WORKLOAD, load * lam0, region_weights(topo), seed=seed)
    simulate(topo, policy, requests, settings=SimSettings(eviction=DEFAULT_EVICTION[WORKLOAD], seed=seed),
             duration_s=seconds)
    regs = policy.by_type[PrefixCached]
    total = sum(policy.by_type.values())
    if not (policy.blocks and regs and policy.requests):
        raise RuntimeError("the simulation stored nothing after its first half: give it more --sim-seconds")
    return {"blocks_per_request": policy.blocks / policy.requests, "reg_per_block": regs / policy.blocks,
            "updates_per_reg": total / regs, "requests": policy.requests, "lambda0": lam0,
            "mix": {t.__name__: n for t, n in policy.by_type.items()}}


def lengths_per_prompt(cfg: ClusterConfig, prompts: list[int]) -> float:
    plan = LevelPlan.from_config(cfg)
    lengths = np.array(plan.registration_lengths())
    return float(np.mean(np.searchsorted(lengths, np.array(prompts), side="right")))


# ----------------------------------------------------------------------------- decisions


def measure_decisions(sizes: list[int], regions_of, *, entries: int, decisions: int, tokens: int,
                      seed: int) -> list[dict]:
    out = []
    rng = np.random.default_rng(seed)
    for workers in sizes:
        regions = regions_of(workers)
        # At most 16 shards: a decision reads one table per (key, group) whatever the shard count,
        # and build_view gives every table room for 1,024 entries more.
        cfg = fleet_config(workers, regions, shards=min(regions, 16))
        prompt = rng.integers(0, 128_256, size=tokens, dtype=np.uint32)
        view, _, total = build_view(cfg, entries, prompt, seed)
        region = cfg.region_names()[0]
        router = Router(cfg, region, view, now=0.0)  # the daemon's settings
        for w in cfg.workers_in(region):
            router.queues.set_local(w.id, 0.0, now=0.0)
        clock = itertools.count(0.0, 0.01)
        for _ in range(min(50, decisions)):
            router.decide(prompt, now=next(clock))
        samples = []
        for _ in range(decisions):
            t0 = time.thread_time_ns()
            router.decide(prompt, now=next(clock))
            samples.append(time.thread_time_ns() - t0)
        out.append({"workers": workers, "regions": regions, "p50_us": statistics.median(samples) / 1000,
                    "p99_us": float(np.percentile(samples, 99)) / 1000, "entries": total,
                    "view_bytes_per_entry": sum(v["memory_bytes"] for v in view.stats()) / max(1, total)})
        del view, router
    return out


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    if len(xs) == 1:
        return 0.0, ys[0] / xs[0]
    b, a = np.polyfit(np.array(xs, dtype=float), np.array(ys, dtype=float), 1)
    return float(a), float(b)


def broadcast_bytes(cfg: ClusterConfig, per_region: int) -> int:
    vector = tuple((f"{cfg.workers[0].region}-{i}", 12.5) for i in range(per_region))
    regions = cfg.region_names()
    return len(encode(QueueVectorBroadcast(regions[0], regions[1], 1.0, vector)))


# ----------------------------------------------------------------------------- projection


@dataclasses.dataclass
class Units:
    lambda0_w: float
    blocks_per_request: float
    reg_per_block: float  # at the target's region count
    updates_per_reg: float
    edge_us: float
    shard_us: float
    bytes_raw: float
    bytes_zlib: float
    view_bytes_per_entry: float
    cache_blocks_w: float
    decision_a_us: float
    decision_b_us: float
    broadcast_bytes_per_worker: float
    broadcast_overhead_bytes: float
    period_s: float
    # Per-edge-region streams (kvcompassd.core.streams); the defaults are one stream for all.
    share_edge: float = 1.0  # updates the most-served edge receives, over all the fleet's
    share_regions_sum: float | None = None  # sum over edge regions of their shares (None: R, no filter)
    t_batch_us: float = 0.0  # an edge's CPU per batch, beyond t_edge per update
    bytes_per_batch: float = 0.0  # a batch's bytes beyond bytes_per_update each
    zlib_per_batch: float = 0.0  # the same, compressed (bytes_zlib is then per update)
    # The unit's CPU per update into its full tables and every region's stream, measured as a
    # whole (ShardStreams.apply_columns); None: t_shard x (1 + sum of shares).
    shard_us_all_streams: float | None = None
    flush_s: float = 0.002  # the maintenance unit's batch_delay_s: at most one batch per stream per flush


def project(u: Units, workers: float, regions: int, shards: int, edges: int, load: float) -> dict:
    lam_w = load * u.lambda0_w
    u_w = lam_w * u.blocks_per_request * u.reg_per_block * u.updates_per_reg
    fleet = workers * u_w
    shares = regions if u.share_regions_sum is None else u.share_regions_sum
    edge_updates = fleet * u.share_edge  # what the most-served edge receives
    # Each shard's stream to an edge carries at most one batch per flush, and none without updates.
    edge_batches = shards * min(1.0 / u.flush_s, edge_updates / shards) if u.t_batch_us or u.bytes_per_batch else 0.0
    per_edge_requests = workers * lam_w / (regions * edges)
    vector_bytes = u.broadcast_overhead_bytes + u.broadcast_bytes_per_worker * workers / regions
    # A shard sends each region's edges that region's stream: its updates, and its batches' overhead.
    shard_stream_bytes = (fleet / shards * shares * u.bytes_raw
                          + min(1.0 / u.flush_s, fleet / shards) * regions * u.bytes_per_batch)
    shard_stream_zlib = (fleet / shards * shares * u.bytes_zlib
                         + min(1.0 / u.flush_s, fleet / shards) * regions * u.zlib_per_batch)
    return {
        "updates_per_worker_s": u_w,
        "edge_updates_s": edge_updates,
        "edge_batches_s": edge_batches,
        "edge_apply_cores": (edge_updates * u.edge_us + edge_batches * u.t_batch_us) / 1e6,
        "edge_inbound_gbps": (edge_updates * u.bytes_raw + edge_batches * u.bytes_per_batch) * 8 / 1e9,
        "edge_inbound_zlib_gbps": (edge_updates * u.bytes_zlib + edge_batches * u.zlib_per_batch) * 8 / 1e9,
        # Filtered: the full tables plus every region's stream, each applying its share of the updates.
        "shard_apply_cores": fleet / shards * (u.shard_us_all_streams if u.shard_us_all_streams is not None else
                                               u.shard_us * (1 if u.share_regions_sum is None else 1 + shares)) / 1e6,
        "shard_egress_gbps": shard_stream_bytes * 8 * edges / 1e9,
        "shard_egress_zlib_gbps": shard_stream_zlib * 8 * edges / 1e9,
        "view_gib": workers * u.cache_blocks_w * u.reg_per_block * u.share_edge * u.view_bytes_per_entry / GIB,
        "decision_us": u.decision_a_us + u.decision_b_us * workers,
        "decision_cores": per_edge_requests * (u.decision_a_us + u.decision_b_us * workers) / 1e6,
        "broadcast_mbps": (regions - 1) * vector_bytes * 8 / u.period_s / 1e6,
    }


RESOURCES = (  # (key, what, limit option, unit)
    ("edge_apply_cores", "edge: applying index updates", "edge_cores", "cores"),
    ("decision_cores", "edge: forwarding decisions", "edge_cores", "cores"),
    ("edge_inbound_gbps", "edge: inbound sync (raw)", "nic_gbps", "Gbit/s"),
    ("view_gib", "edge: views of every shard", "edge_memory_gib", "GiB"),
    ("shard_apply_cores", "maintenance shard: applying reports", "shard_cores", "cores"),
    ("shard_egress_gbps", "maintenance shard: egress to every edge (raw)", "nic_gbps", "Gbit/s"),
)


def breaking_point(u: Units, key: str, limit: float, regions: int, shards: int, edges: int, load: float,
                   workers: int) -> float:
    """Workers (same workers per region, shards per worker) at which ``key`` reaches ``limit``."""
    def at(w: float) -> float:
        scale = w / workers
        return project(u, w, max(1, round(regions * scale)), max(1, round(shards * scale)), edges, load)[key]

    lo, hi = 1.0, float(workers)
    if at(hi) < limit:
        while at(hi) < limit and hi < 1e9:
            lo, hi = hi, hi * 2
        if hi >= 1e9:
            return math.inf
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at(mid) < limit else (lo, mid)
    return hi


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=10_000)
    ap.add_argument("--regions", type=int, default=100)
    ap.add_argument("--shards", type=int, default=None, help="index shards (default: one per region)")
    ap.add_argument("--edges-per-region", type=int, default=1)
    ap.add_argument("--load", type=float, default=0.75, help="offered load as a fraction of lambda0")
    ap.add_argument("--edge-cores", type=float, default=1.0, help="limit: cores an edge gives each of apply and decide")
    ap.add_argument("--shard-cores", type=float, default=1.0, help="limit: cores of one maintenance unit")
    ap.add_argument("--nic-gbps", type=float, default=10.0, help="limit: a node's network, Gbit/s each way")
    ap.add_argument("--edge-memory-gib", type=float, default=64.0, help="limit: an edge's memory for views")
    ap.add_argument("--apply-entries", type=int, default=4_000_000,
                    help="apply: index entries the views hold, over the target fleet's region-group tables")
    ap.add_argument("--batch-events", type=int, default=512, help="apply: index events per batch")
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--sim-workers", type=int, default=32)
    ap.add_argument("--sim-regions", type=int, default=16)
    ap.add_argument("--sim-seconds", type=float, default=6.0)
    ap.add_argument("--sim-cache-divisor", type=int, default=64)
    ap.add_argument("--prompt-sample", type=int, default=4000)
    ap.add_argument("--decision-sizes", default="128,1024,4096",
                    help="workers of the fleets decisions are timed on (the target's too, up to 16,384 workers)")
    ap.add_argument("--decision-entries", type=int, default=1_000_000, help="view entries of those fleets")
    ap.add_argument("--decisions", type=int, default=400)
    ap.add_argument("--tokens", type=int, default=4096, help="decision prompt length")
    ap.add_argument("--small-batch-events", type=int, default=4,
                    help="apply: events per batch of the second, small-batch run (per-batch cost)")
    ap.add_argument("--streams", choices=("full", "region"), default="region",
                    help="what the limits table projects: per-edge-region streams (kvcompassd.core.streams, "
                         "the daemons' default) or one stream for every edge ([sync] edge_streams = \"full\")")
    ap.add_argument("--flush-ms", type=float, default=2.0, help="the maintenance unit's batch delay")
    ap.add_argument("--updates-per-worker-s", type=float, default=None,
                    help="project this write load (index updates per worker per second) instead of the "
                         "simulated one (its blocks per request are scaled to give it)")
    ap.add_argument("--quick", action="store_true", help="small measurements (a smoke run; figures are rough)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.apply_entries, args.batches, args.sim_seconds, args.prompt_sample = 200_000, 30, 3.0, 500
        args.decision_sizes, args.decision_entries, args.decisions = "32,128", 20_000, 50
    W, R = args.workers, args.regions
    S = args.shards or R
    E = args.edges_per_region
    started = time.perf_counter()
    print(f"load average (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")

    target = fleet_config(W, R, shards=S)
    sim_cfg = fleet_config(args.sim_workers, args.sim_regions)
    apply = measure_apply(target, entries=args.apply_entries, batch_events=args.batch_events, batches=args.batches,
                          seed=args.seed, small_batch_events=args.small_batch_events)
    writes = measure_writes(sim_cfg, load=args.load, seconds=args.sim_seconds, cache_divisor=args.sim_cache_divisor,
                            seed=args.seed)
    topo = Topology.from_config(sim_cfg)
    prompts = list(itertools.islice(prompt_lengths(WORKLOAD, 1000.0, region_weights(topo), seed=args.seed),
                                    args.prompt_sample))
    len_sim, len_target = lengths_per_prompt(sim_cfg, prompts), lengths_per_prompt(target, prompts)
    filtering = measure_filtering(target, prompts[: max(50, args.prompt_sample // 10)], seed=args.seed)
    sizes = [int(x) for x in args.decision_sizes.split(",") if x]
    if not args.quick and W <= 16_384 and W not in sizes:
        sizes.append(W)
    dec = measure_decisions(sorted(sizes), lambda w: decision_regions(w, W, R), entries=args.decision_entries,
                            decisions=args.decisions, tokens=args.tokens, seed=args.seed)
    a, b = fit_line([d["workers"] for d in dec], [d["p50_us"] for d in dec])
    bc_small, bc_big = broadcast_bytes(target, 1), broadcast_bytes(target, 101)
    worker = target.workers[0]
    lam0_w = writes["lambda0"] / args.sim_workers  # per worker: the fleets share the A100 model and workload
    units = Units(
        lambda0_w=lam0_w, blocks_per_request=writes["blocks_per_request"],
        reg_per_block=writes["reg_per_block"] * len_target / len_sim, updates_per_reg=writes["updates_per_reg"],
        edge_us=apply["edge_us"], shard_us=apply["shard_us"], bytes_raw=apply["bytes_raw"],
        bytes_zlib=apply["bytes_zlib"], view_bytes_per_entry=apply["view_bytes_per_entry"],
        cache_blocks_w=(worker.vram_kv_tokens + worker.dram_kv_tokens) / target.index.block_size,
        decision_a_us=a, decision_b_us=b, broadcast_bytes_per_worker=(bc_big - bc_small) / 100,
        broadcast_overhead_bytes=bc_small - (bc_big - bc_small) / 100,
        period_s=target.score.broadcast_period_ms / 1000.0)
    if args.updates_per_worker_s:
        simulated = project(units, W, R, S, E, args.load)["updates_per_worker_s"]
        units = dataclasses.replace(units, blocks_per_request=units.blocks_per_request * args.updates_per_worker_s
                                    / simulated)
        print(f"write load set by --updates-per-worker-s: {args.updates_per_worker_s:g} updates/s per worker "
              f"(the simulation gave {simulated:.0f}): blocks_per_req scaled to {units.blocks_per_request:.1f}")
    full_units = units
    region_units = dataclasses.replace(
        units, share_edge=filtering["max"], share_regions_sum=filtering["sum"], edge_us=apply["t_update_us"],
        t_batch_us=apply["t_batch_us"], bytes_raw=apply["bytes_update"], bytes_per_batch=apply["bytes_batch"],
        bytes_zlib=apply["zlib_update"], zlib_per_batch=apply["zlib_batch"], flush_s=args.flush_ms / 1000,
        shard_us_all_streams=filtering["unit_us_per_update"])
    p_full, p_region = project(full_units, W, R, S, E, args.load), project(region_units, W, R, S, E, args.load)
    units, p = (region_units, p_region) if args.streams == "region" else (full_units, p_full)

    print("\n== measured on this machine")
    print(f"apply ({apply['groups']} region-group tables of {apply['table_entries']:,} entries, {apply['updates']:,} "
          f"updates in {args.batches} batches of {args.batch_events} events):")
    print(f"  t_edge  = {full_units.edge_us:.3f} CPU µs per update (EdgeSync.on_batch)")
    print(f"  t_shard = {full_units.shard_us:.3f} CPU µs per update (MaintenanceShard.apply_columns + flush)")
    print(f"  per batch and per update (a line through batches of {apply['small_updates_per_batch']:.0f} and "
          f"{apply['big_updates_per_batch']:.0f} updates): t_batch = {apply['t_batch_us']:.2f} µs, t_update = "
          f"{apply['t_update_us']:.3f} µs; bytes_batch = {apply['bytes_batch']:.0f}, bytes_update = "
          f"{apply['bytes_update']:.1f} (small batches alone: {apply['small_edge_us']:.3f} µs per update)")
    print(f"  bytes_per_entry = {full_units.view_bytes_per_entry:.1f} view bytes per entry (those tables, at load "
          f"{apply['load']:.2f})")
    print(f"  bytes_per_update = {full_units.bytes_raw:.1f} raw, {full_units.bytes_zlib:.1f} compressed "
          f"(x{full_units.bytes_zlib / full_units.bytes_raw:.2f}; wire.encode of UpdateBatchPublished)")
    print(f"  compressed per batch and per update (the same line): zlib_batch = {apply['zlib_batch']:.0f}, "
          f"zlib_update = {apply['zlib_update']:.1f} bytes")
    print("  compression of update batches, compressed size over raw (zlib level 1 as wire.encode(compress=True) / "
          "level 9 / level 9 with the stream's previous batches as a preset dictionary / as sent to a WAN peer today, "
          f"which compresses only a batch over {WAN_DATAGRAM_BYTES} bytes):")
    for name in ("small", "big"):
        c = apply["compression"][name]
        print(f"    batches of {c['updates_per_batch']:.0f} updates ({c['raw_per_batch']:,.0f} bytes raw): "
              f"x{c['packed']:.2f} / x{c['level9']:.2f} / x{c['context']:.2f} / x{c['sent']:.2f}")
    mix = ", ".join(f"{k} {v:,}" for k, v in writes["mix"].items())
    print(f"write load (KVCompass simulation, {args.sim_workers} workers x {args.sim_regions} regions, {WORKLOAD} at "
          f"{args.load:g} x lambda0 = {args.load * writes['lambda0']:.0f} req/s, caches / {args.sim_cache_divisor}, "
          f"{args.sim_seconds:g} s, second half: {writes['requests']:,} requests; {mix}):")
    print(f"  blocks_per_req  = {full_units.blocks_per_request:.1f} stored blocks per request")
    print(f"  reg_blk_sim     = {writes['reg_per_block']:.3f} registrations per stored block")
    print(f"  updates_per_reg = {full_units.updates_per_reg:.2f} index updates per registration")
    print(f"  lambda0_w       = {lam0_w:.2f} req/s per worker (1 / (mean prompt x beta))")
    print(f"registered lengths per cached prompt ({len(prompts):,} {WORKLOAD} prompts): len_sim = {len_sim:.1f} at "
          f"{args.sim_regions} regions, len_target = {len_target:.1f} at {R} regions -> reg_blk = "
          f"{full_units.reg_per_block:.3f}")
    print(f"per-edge-region streams (kvcompassd.core.streams, {filtering['total']:,} registrations of "
          f"{max(50, args.prompt_sample // 10)} {WORKLOAD} prompts by random workers of the target fleet): an edge "
          f"receives {filtering['mean']:.1%} of the fleet's updates on average (x{1 / filtering['mean']:.1f} fewer), "
          f"{filtering['max']:.1%} at most ({filtering['worst']}: x{1 / filtering['max']:.1f} fewer), "
          f"{filtering['min']:.1%} at least; all {filtering['regions']} regions' streams together "
          f"{filtering['sum']:.2f} x the full stream")
    print(f"  the unit's apply into the full tables and all {filtering['regions']} regions' streams "
          f"(ShardStreams.apply_columns, one report per prompt, {filtering['events_per_report']:.0f} events): "
          f"{filtering['unit_us_per_update']:.2f} CPU µs per update, against t_shard x (1 + sum of shares) = "
          f"{full_units.shard_us * (1 + filtering['sum']):.2f} (one C call per report edits the full table and "
          f"each stream's table an event reaches: the rest is those edits, in tables mostly cold in the cache)")
    print("decision time, Router.decide (daemon settings), CPU µs P50 / P99:")
    for d in dec:
        print(f"  {d['workers']:>6} workers x {d['regions']:>4} regions, {d['entries']:>10,} entries: "
              f"{d['p50_us']:8.1f} / {d['p99_us']:8.1f}   ({d['view_bytes_per_entry']:.1f} view bytes per entry)")
    print(f"  fit: decision_us = {a:.1f} + {b * 1000:.3f} x W / 1000")
    print(f"queue broadcast: {full_units.broadcast_overhead_bytes:.0f} + {full_units.broadcast_bytes_per_worker:.1f} x workers "
          f"bytes, every {full_units.period_s * 1000:g} ms to each other region")

    print(f"\n== projected: {W:,} workers x {R} regions, {S} shards, {E} edge(s) per region, load {args.load:g} x lambda0")
    print(f"  lambda_w = {args.load:g} x {lam0_w:.2f} = {args.load * lam0_w:.2f} req/s per worker")
    print(f"  U_w = lambda_w x blocks_per_req x reg_blk x updates_per_reg = {p['updates_per_worker_s']:,.0f} updates/s "
          f"per worker; U = W x U_w = {W * p['updates_per_worker_s']:,.0f}/s")
    pf = p_full
    print("  -- one stream for every edge ([sync] edge_streams = \"full\"):")
    print(f"  edge apply        = U x t_edge                          = {pf['edge_apply_cores']:8.2f} cores")
    print(f"  edge inbound      = U x bytes_per_update x 8           = {pf['edge_inbound_gbps']:8.2f} Gbit/s raw, "
          f"{pf['edge_inbound_zlib_gbps']:.2f} compressed")
    print(f"  edge views        = W x cache_blocks_w x reg_blk x bytes_per_entry = {pf['view_gib']:8.1f} GiB "
          f"(cache_blocks_w = {full_units.cache_blocks_w:,.0f}, every cache full)")
    print(f"  decision          = a + b x W                           = {pf['decision_us']:8.1f} µs P50")
    print(f"  edge decisions    = W x lambda_w / (R x E) x decision   = {pf['decision_cores']:8.2f} cores")
    print(f"  queue broadcasts  = (R - 1) x bytes(W/R workers) x 8 / Delta = {pf['broadcast_mbps']:8.1f} Mbit/s inbound per edge")
    print(f"  shard apply       = U / S x t_shard                     = {pf['shard_apply_cores']:8.2f} cores")
    print(f"  shard egress      = U / S x bytes_per_update x 8 x R x E = {pf['shard_egress_gbps']:8.2f} Gbit/s raw, "
          f"{pf['shard_egress_zlib_gbps']:.2f} compressed")

    pr, ru = p_region, region_units
    print(f"  -- per-edge-region streams (kvcompassd.core.streams; what the daemons send by default), flush every "
          f"{args.flush_ms:g} ms:")
    print(f"  U_e = U x share_edge = {W * pr['updates_per_worker_s']:,.0f} x {ru.share_edge:.4f} = "
          f"{pr['edge_updates_s']:,.0f} updates/s; B_e = S x min(1 / flush, U_e / S) = {pr['edge_batches_s']:,.0f} batches/s")
    print(f"  edge apply        = U_e x t_update + B_e x t_batch      = {pr['edge_apply_cores']:8.2f} cores")
    print(f"  edge inbound      = (U_e x bytes_update + B_e x bytes_batch) x 8 = {pr['edge_inbound_gbps']:8.2f} Gbit/s raw, "
          f"{pr['edge_inbound_zlib_gbps']:.2f} compressed (U_e x zlib_update + B_e x zlib_batch)")
    print(f"  edge views        = W x cache_blocks_w x reg_blk x share_edge x bytes_per_entry = {pr['view_gib']:8.1f} GiB")
    print(f"  shard apply       = U / S x t_unit_streams               = {pr['shard_apply_cores']:8.2f} cores "
          f"(t_unit_streams = {ru.shard_us_all_streams:.2f} µs measured; t_shard x (1 + sum of shares) would give "
          f"{pr['updates_per_worker_s'] * W / S * full_units.shard_us * (1 + ru.share_regions_sum) / 1e6:.2f})")
    print(f"  shard egress      = (U / S x sum of shares x bytes_update + min(1 / flush, U / S) x R x bytes_batch) "
          f"x 8 x E = {pr['shard_egress_gbps']:8.2f} Gbit/s raw, {pr['shard_egress_zlib_gbps']:.2f} compressed")
    slower = [(ms, project(dataclasses.replace(region_units, flush_s=ms / 1000), W, R, S, E, args.load))
              for ms in (5.0, 20.0, 50.0) if ms > args.flush_ms]
    if slower:
        print("  a longer flush (fewer, fuller batches; that much more staleness): " + "; ".join(
            f"{ms:g} ms: edge apply {q['edge_apply_cores']:.2f} cores, inbound {q['edge_inbound_gbps']:.2f} Gbit/s, "
            f"shard egress {q['shard_egress_gbps']:.2f} Gbit/s" for ms, q in slower))
    if args.streams == "region":
        print("  (the limits below: per-edge-region streams)")

    limits = {"edge_cores": args.edge_cores, "shard_cores": args.shard_cores, "nic_gbps": args.nic_gbps,
              "edge_memory_gib": args.edge_memory_gib}
    rows = []
    for key, what, limit_name, unit in RESOURCES:
        limit = limits[limit_name]
        rows.append((p[key] / limit, what, p[key], limit, unit,
                     breaking_point(units, key, limit, R, S, E, args.load, W)))
    rows.sort(key=lambda r: (-r[0], r[5]))
    print(f"\n== against the limits (--{'/--'.join(n.replace('_', '-') for n in limits)}), most used first")
    print(f"  {'resource':<46} {'need':>10} {'limit':>10} {'used':>7} {'reaches its limit at':>22}")
    for used, what, need, limit, unit, at in rows:
        where = "never (< 1e9 workers)" if math.isinf(at) else f"{at:,.0f} workers"
        print(f"  {what:<46} {need:>10.2f} {limit:>7g} {unit:<2} {used:>6.0%} {where:>22}")
    first = rows[0]
    verdict = "breaks first" if first[0] >= 1 else "is the first to break, when the fleet grows"
    print(f"\nfirst resource to break: {first[1]} ({first[0]:.0%} of its limit at {W:,} workers) {verdict}")
    print(f"(measured and projected in {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
