"""Benchmark index sync on loopback: prefix events per second through agent -> maintenance ->
edge, and the delay from an event's report to its visibility at the edges (P50/P99).

Real ``kvcompassd maintenance`` processes (one per shard) and a real ``kvcompassd edge``; this
process plays the agent of worker ``us-0`` (engine batches of ``--report-events`` events, keys routed
by ``key % shards``), and ``--edges`` subscriber processes play edges: each holds an
``EdgeIndexView`` fed by the maintenance units' update streams exactly as the edge daemon
does, and stamps when each report became visible (``time.monotonic``, the machine-wide clock
the agent stamps the sends with).

How visibility is seen in a keyless view: a lookup of a key that is absent returns some other
entry's value, so a fresh key's arrival cannot be observed. A key that is present is looked up
exactly, so every report ends with a *probe*: a ``TierChanged`` (VRAM -> DRAM) of a key
registered before the timed phase. A shard applies a report in one call and ships it in one
batch, so the probe turns visible exactly when the report's other events do.

The workload is a stream of engine batches (``--report-events`` events each, the last one the
probe); this process hands them one by one to the real agent's ``ReportCoalescer``, which
gathers them per shard for the window's ``--report-delay-ms`` (default ``[sync] report_delay_ms``,
20 ms; figures before it took a trailing window were at a 1 ms min-gap pacer) and sends the
reports. A batch's delay runs from when it was handed to the agent, so the coalescing wait is
counted.

References, measured in the same run: the in-process core applying the same engine batches,
one at a time (``MaintenanceShard.apply`` + ``flush`` + ``EdgeSync.on_batch``), as event
objects and as columns (``apply_columns``, the path a maintenance unit runs on a decoded
report; 3-4x faster). The columns rate is the issue's reference. A third figure applies the
reports the agent actually sent (coalesced, so fewer and larger) in process as columns: "vs
as sent" compares with the faster of that and the columns rate.

Two modes per run: ``max`` hands batches over as fast as the transport accepts (the sync path's
throughput; its delays are mostly queueing) and ``paced`` offers each ``--paced-fraction`` of
the in-process columns rate (the issue's target: >= 30 % of it with P99 < 50 ms). At the end
the real edge's views are read back with admin ``lookup`` queries: every key must hold the
right value.

    .venv/bin/python tools/bench_sync.py [--quick] [--events 100000] [--shards 2] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import uvloop  # noqa: E402

from benchlib import Cluster, cpu_seconds, load_average, median, percentile, quiet_logs  # noqa: E402

from kvcompassd.core.config import load_config  # noqa: E402
from kvcompassd.core.events import IndexEventColumns, PrefixCached, Tier, TierChanged  # noqa: E402
from kvcompassd.core.index import EdgeIndexView, MaintenanceShard, table_capacities  # noqa: E402
from kvcompassd.core.layout import IndexLayout  # noqa: E402
from kvcompassd.core.sync import SNAPSHOT_MESSAGES, EdgeSync  # noqa: E402
from kvcompassd.daemon import daemon_transport, split_address, tls_files  # noqa: E402
from kvcompassd.launcher import DeploymentSpec  # noqa: E402
from kvcompassd.reports import DEFAULT_REPORT_DELAY_S, ReportCoalescer  # noqa: E402
from kvcompassd.transport import QuicNode  # noqa: E402
from kvcompassd.wire import (  # noqa: E402
    AdminAnswered,
    AdminQueried,
    ErrorReported,
    NodeIdentity,
    PrefixEventsReported,
    ResyncRequested,
    Role,
    SnapshotResumeRequested,
    UpdateBatchPublished,
    WorkerRegistered,
    encode,
)

WORKER = "us-0"
SEND_BUFFER_BYTES = 1 << 20  # the agent waits while more than this is unacknowledged
ADMIN_KEYS_PER_QUERY = 4000  # AdminQueried.args holds at most 4096 items


# ---- the workload ---------------------------------------------------------------------------


class Workload:
    """Reports per shard: ``report_events - 1`` fresh keys cached in VRAM, then one probe."""

    def __init__(self, layout: IndexLayout, shards: int, events: int, report_events: int, seed: int):
        rng = random.Random(seed)
        slot = layout.slot(WORKER)
        self.group, shift = slot.group, 2 * slot.field
        self.vram_value, self.dram_value = int(Tier.VRAM) << shift, int(Tier.DRAM) << shift
        reports_per_shard = max(1, events // (report_events * shards))
        fresh = report_events - 1

        def key(shard: int) -> int:
            return rng.randrange(1, (1 << 62) // shards) * shards + shard

        self.probes = [[key(s) for _ in range(reports_per_shard)] for s in range(shards)]
        self.keys = [[key(s) for _ in range(reports_per_shard * fresh)] for s in range(shards)]
        # Global send order: round-robin over shards, report by report.
        self.reports: list[tuple[int, int, tuple]] = []  # (shard, index in shard, events)
        for r in range(reports_per_shard):
            for s in range(shards):
                events = tuple(PrefixCached(WORKER, k, Tier.VRAM) for k in self.keys[s][r * fresh:(r + 1) * fresh])
                self.reports.append((s, r, events + (TierChanged(WORKER, self.probes[s][r], Tier.DRAM),)))
        self.events = sum(len(e) for _, _, e in self.reports)

    def probe_registrations(self, shard: int) -> list[PrefixCached]:
        return [PrefixCached(WORKER, k, Tier.VRAM) for k in self.probes[shard]]


# ---- the in-process reference ---------------------------------------------------------------


def in_process_rate(cfg, layout: IndexLayout, work: Workload, reports=None) -> float:
    """Events/s of the core alone: apply + flush + the edge's sync step (``EdgeSync.on_batch``), per report.

    ``reports=None`` applies the workload's engine batches' event objects one by one
    (``MaintenanceShard.apply``); given ``(shard, IndexEventColumns)`` pairs, it applies those
    reports as columns (``apply_columns``, what a maintenance unit runs on a decoded report):
    the engine batches one by one, or the reports the agent actually sent (coalesced)."""
    shards = [MaintenanceShard(layout, s, cfg.shards, epoch=1, initial_capacity=table_capacities(cfg, layout),
                               fingerprint_bits=cfg.index.fingerprint_bits, max_load=cfg.index.max_load)
              for s in range(cfg.shards)]
    view = EdgeIndexView(layout, cfg.shards, edge="edge-ref")
    sync = EdgeSync(view)
    for s, shard in enumerate(shards):
        shard.apply(work.probe_registrations(s))
        shard.flush()
        sync.on_snapshot(shard.snapshot(), now=0.0)
    columns = reports is not None
    if reports is None:
        reports = [(s, events) for s, _, events in work.reports]
    start = time.perf_counter()
    for s, events in reports:
        shard = shards[s]
        if columns:
            shard.apply_columns(WORKER, events)
        else:
            shard.apply(events)
        outcome = sync.on_batch(shard.flush(), now=0.0)
        if not outcome.applied:
            raise RuntimeError(f"in-process view refused a batch: {outcome.reason}")
    elapsed = time.perf_counter() - start
    for s in range(cfg.shards):
        got = view.view(s, work.group).lookup_many(np.asarray(work.keys[s], dtype=np.uint64))
        if not (got == work.vram_value).all():
            raise RuntimeError("in-process view disagrees with the events applied")
    return work.events / elapsed


# ---- a subscribing edge (its own process) ---------------------------------------------------


def edge_process(config: str, tls_dir: str, edge_id: str, probes: list[list[int]], group: int,
                 before: int, after: int, conn, profile: str | None = None) -> None:
    import cProfile

    import uvloop

    quiet_logs()
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    uvloop.run(_edge_main(config, tls_dir, edge_id, probes, group, before, after, conn))
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)


async def _edge_main(config, tls_dir, edge_id, probes, group, before, after, conn) -> None:
    cfg = load_config(config)
    layout = IndexLayout.from_config(cfg)
    view = EdgeIndexView(layout, cfg.shards, edge=edge_id)
    sync = EdgeSync(view)  # the edge's own protocol; this process moves its messages
    seen = [[0.0] * len(p) for p in probes]
    next_probe = [0] * cfg.shards
    armed = False
    all_seen = asyncio.Event()
    peers = {}

    def check(shard: int) -> None:
        shard_view = view.view(shard, group)
        if not armed or shard_view is None:
            return
        now = time.monotonic()
        i, keys = next_probe[shard], probes[shard]
        while i < len(keys) and shard_view.lookup(keys[i]) == after:
            seen[shard][i] = now
            i += 1
        next_probe[shard] = i
        if all(n == len(p) for n, p in zip(next_probe, probes)):
            all_seen.set()

    def resync(request: ResyncRequested | SnapshotResumeRequested | None) -> None:
        peer = peers.get(request.shard) if request is not None else None
        if peer is not None and peer.is_connected:
            peer.send_encoded(encode(request))

    def on_message(peer, message, channel) -> None:
        if isinstance(message, UpdateBatchPublished):
            resync(sync.on_batch(message, now=time.monotonic()).send)
            check(message.shard)
        elif isinstance(message, SNAPSHOT_MESSAGES):  # whole, or a transfer's header or chunk
            resync(sync.on_snapshot_message(message, now=time.monotonic()).send)
            check(message.shard)

    def on_peer_state(peer, connected: bool) -> None:
        if not connected:
            return
        for shard, p in peers.items():
            if p is peer:
                peer.send_encoded(encode(sync.subscription(shard, now=time.monotonic())))

    node = QuicNode(NodeIdentity(Role.EDGE, edge_id), tls_files(tls_dir, edge_id), on_message=on_message,
                    on_peer_state=on_peer_state, options=daemon_transport(cfg))
    for m in cfg.maintenance:
        peers[m.shard] = node.peer(split_address(m.quic, m.id), expected_role=Role.MAINTENANCE, expected_id=m.id)
    # Ready once every probe is registered (VRAM) in this edge's views.
    while True:
        if view.ready and all(
                (v := view.view(s, group)) is not None and all(v.lookup(k) == before for k in probes[s])
                for s in range(cfg.shards)):
            break
        await asyncio.sleep(0.01)
    armed = True
    conn.send("ready")
    for s in range(cfg.shards):
        check(s)
    await all_seen.wait()
    conn.send(seen)
    await node.close()


# ---- the agent and the run ------------------------------------------------------------------


async def connect_all(node: QuicNode, cfg, timeout: float = 60.0):
    peers = {}
    for m in cfg.maintenance:
        peer = node.peer(split_address(m.quic, m.id), expected_role=Role.MAINTENANCE, expected_id=m.id)
        await peer.wait_connected(timeout)
        peers[m.shard] = peer
    return peers


class Admin:
    """One admin connection to a daemon, kept open for repeated queries."""

    def __init__(self, cluster: Cluster):
        self.node = QuicNode(NodeIdentity(Role.ADMIN, "admin"), tls_files(cluster.tls_dir, "admin"),
                             on_message=lambda *a: None)

    async def open(self, address: str, role: Role):
        peer = self.node.peer(split_address(address, "admin target"), expected_role=role)
        await peer.wait_connected(60.0)
        return peer

    @staticmethod
    async def ask(peer, what: str, args: dict) -> dict:
        async with peer.open_stream() as exchange:
            await exchange.send(AdminQueried(what, args))
            async for reply in exchange:
                if isinstance(reply, AdminAnswered):
                    if "error" in reply.body:
                        raise RuntimeError(reply.body["error"])
                    return reply.body
                if isinstance(reply, ErrorReported):
                    raise RuntimeError(f"{reply.code}: {reply.detail}")
        raise RuntimeError("exchange closed without an answer")


async def wait_edge_caught_up(admin_peer, work: Workload, shards: int) -> float:
    """Poll the real edge until the last probe of every shard is visible; the monotonic time."""
    pending = set(range(shards))
    while pending:
        for s in list(pending):
            body = await Admin.ask(admin_peer, "lookup", {"shard": s, "group": work.group, "keys": [work.probes[s][-1]]})
            if body["values"][0] == work.dram_value:
                pending.discard(s)
        if pending:
            await asyncio.sleep(0.002)
    return time.monotonic()


async def verify_real_edge(admin_peer, work: Workload, shards: int) -> tuple[int, int]:
    """(checked, wrong) over every key and probe of the run, read from the real edge's views."""
    checked = wrong = 0
    for s in range(shards):
        for keys, expected in ((work.keys[s], work.vram_value), (work.probes[s], work.dram_value)):
            for i in range(0, len(keys), ADMIN_KEYS_PER_QUERY):
                chunk = keys[i:i + ADMIN_KEYS_PER_QUERY]
                body = await Admin.ask(admin_peer, "lookup", {"shard": s, "group": work.group, "keys": chunk})
                checked += len(chunk)
                wrong += sum(v != expected for v in body["values"])
    return checked, wrong


async def one_run(args, run: int, mode: str, fraction: float | None, reference_rate: float | None) -> dict:
    # The subscriber edges are in the config's [[edges]] (a maintenance unit serves no update
    # stream to an edge that is not), after the kvcompassd edge (edges[0]), which runs only
    # with --real-edge. They listen on no address, so no edge relays a region's live batches
    # ([sync] relay = false): the unit sends every edge its own, the path this bench measures.
    spec = DeploymentSpec(workers={"us": 2}, one_way_ms={}, shards=args.shards, wan=False,
                          edges_per_region=1 + args.edges, sync={"relay": False})
    cluster = Cluster(spec, initial_capacity=args.initial_capacity,
                      profile_dir=None if args.profile is None else Path(args.profile) / f"run{run}-{mode.replace(' ', '')}",
                      host=args.host, max_datagram_size=args.max_datagram_size)
    cfg = cluster.cfg
    edge_ids = [e.id for e in cfg.edges[1:]]
    layout = IndexLayout.from_config(cfg)
    work = Workload(layout, cfg.shards, args.events, args.report_events, seed=run)
    batches = [(s, IndexEventColumns.from_events(events)) for s, _, events in work.reports]
    ref_rate = in_process_rate(cfg, layout, work)
    columns_rate = in_process_rate(cfg, layout, work, batches)
    offered = None if fraction is None else fraction * (reference_rate or columns_rate)
    ctx = multiprocessing.get_context("spawn")
    edges = []
    agent = admin = None
    try:
        for m in cfg.maintenance:
            cluster.spawn("maintenance", m.id)
        if args.real_edge:
            cluster.spawn("edge", cfg.edges[0].id)
        agent = QuicNode(NodeIdentity(Role.AGENT, WORKER), tls_files(cluster.tls_dir, WORKER),
                         on_message=lambda peer, msg, ch: print(f"agent got {msg}", file=sys.stderr),
                         options=daemon_transport(cfg))
        peers = await connect_all(agent, cfg)
        seq = 0
        for s, peer in peers.items():
            peer.send_encoded(encode(WorkerRegistered(WORKER, 1)))
            regs = work.probe_registrations(s)
            for i in range(0, len(regs), 4096):
                seq += 1
                peer.send_encoded(encode(PrefixEventsReported(WORKER, seq, tuple(regs[i:i + 4096]))))
        for edge_id in edge_ids:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=edge_process, daemon=True,
                               args=(str(cluster.config_path), str(cluster.tls_dir), edge_id, work.probes,
                                     work.group, work.vram_value, work.dram_value, child,
                                     None if cluster.profile_dir is None else str(cluster.profile_dir / f"{edge_id}.prof")))
            proc.start()
            edges.append((proc, parent))
        for _proc, pipe in edges:
            if not await asyncio.to_thread(pipe.poll, 90):
                raise TimeoutError("a subscriber edge did not get ready")
            pipe.recv()
        admin_peer = None
        if args.real_edge:
            await cluster.wait_http(f"http://{cfg.edges[0].http}/health", ready_key="ready")
            admin = Admin(cluster)
            admin_peer = await admin.open(cfg.edges[0].quic, Role.EDGE)
        # The agent: the real agent's coalescer, handed one engine batch at a time.
        sent_reports: list[tuple[int, IndexEventColumns]] = []

        def send_report(shard: int, report: PrefixEventsReported) -> bool:
            sent_reports.append((shard, report.events))
            peers[shard].send_encoded(encode(report))
            return True

        reports = ReportCoalescer(WORKER, cfg.shards, send_report, delay_s=args.report_delay_ms / 1000.0)
        reports.seq = seq
        mnt_pids = [cluster.procs[f"maintenance:{m.id}"].pid for m in cfg.maintenance]
        edge_pids = [proc.pid for proc, _ in edges]
        cpu_before = [cpu_seconds(p) for p in mnt_pids], [cpu_seconds(p) for p in edge_pids]
        sent_at = [0.0] * len(batches)
        interval = None if offered is None else args.report_events / offered
        start = time.monotonic()
        for i, (s, columns) in enumerate(batches):
            peer = peers[s]
            if interval is not None:
                wait = start + i * interval - time.monotonic()
                if wait > 0.0005:
                    await asyncio.sleep(wait)
            else:
                while peer.unacknowledged_bytes > SEND_BUFFER_BYTES:
                    await asyncio.sleep(0.0005)
            sent_at[i] = time.monotonic()
            reports.add(s, columns)
        real_edge_done = None
        if admin_peer is not None:
            real_edge_done = await asyncio.wait_for(wait_edge_caught_up(admin_peer, work, cfg.shards), 120)
        seen_by_edge = []
        for _proc, pipe in edges:
            if not await asyncio.to_thread(pipe.poll, 120):
                raise TimeoutError("a subscriber edge never saw every report")
            seen_by_edge.append(pipe.recv())
        mnt_cpu = sum(cpu_seconds(p) for p in mnt_pids) - sum(cpu_before[0])
        edge_cpu = (sum(cpu_seconds(p) for p in edge_pids) - sum(cpu_before[1])) / len(edge_pids)
        checked = wrong = 0
        if admin_peer is not None:
            checked, wrong = await verify_real_edge(admin_peer, work, cfg.shards)
    finally:
        for proc, _ in edges:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
        if agent is not None:
            await agent.close()
        if admin is not None:
            await admin.node.close()
        cluster.stop()
    # A report is visible at every edge when the last subscriber sees it.
    delays, last_visible = [], 0.0
    for i, (s, r, _) in enumerate(work.reports):
        visible = max(seen[s][r] for seen in seen_by_edge)
        delays.append((visible - sent_at[i]) * 1000.0)
        last_visible = max(last_visible, visible)
    if args.verbose:
        vis = sorted(max(seen[s][r] for seen in seen_by_edge) - start for s, r, _ in work.reports)
        print("    sends end at %.3f s; visible at quantiles 0/10/50/90/100: %s" % (
            sent_at[-1] - start, " ".join(f"{percentile(vis, q):.3f}" for q in (0, 10, 50, 90, 100))))
    # The same events in the reports the agent sent, applied in process: coalesced reports are
    # cheaper to apply too, so the reference is the faster of the two ways.
    sent_rate = in_process_rate(cfg, layout, work, sent_reports)
    return {
        "mode": mode,
        "offered": offered,
        "sent_rate": sent_rate,
        "reports_sent": len(sent_reports),
        "rate": work.events / (last_visible - start),
        "ref_rate": ref_rate,
        "columns_rate": columns_rate,
        "best_rate": max(columns_rate, sent_rate),
        "p50": percentile(delays, 50),
        "p99": percentile(delays, 99),
        "real_edge_lag_ms": None if real_edge_done is None else (real_edge_done - last_visible) * 1000.0,
        "mnt_us": mnt_cpu / work.events * 1e6,
        "edge_us": edge_cpu / work.events * 1e6,
        "checked": checked,
        "wrong": wrong,
        "events": work.events,
    }


async def main_async(args) -> None:
    quiet_logs()
    points = [("max", None)] if "max" in args.modes else []
    if "paced" in args.modes:
        points += [(f"paced {f:g}", f) for f in args.paced_fraction]
    results: dict[str, list[dict]] = {label: [] for label, _ in points}
    for run in range(args.runs):
        for mode, fraction in points:
            # Paced offers a share of the in-process rate measured so far (the median over runs).
            reference = median([r["columns_rate"] for rs in results.values() for r in rs]) if any(results.values()) else None
            result = await one_run(args, run, mode, fraction, reference)
            results[mode].append(result)
            print(f"  run {run + 1} {mode:10}: {result['rate']:,.0f} ev/s (in-process columns {result['columns_rate']:,.0f}, "
                  f"as sent {result['sent_rate']:,.0f} in {result['reports_sent']} reports), "
                  f"P50 {result['p50']:.1f} ms, P99 {result['p99']:.1f} ms, CPU/event maintenance {result['mnt_us']:.1f} us "
                  f"subscriber edge {result['edge_us']:.1f} us, real edge wrong {result['wrong']}/{result['checked']}, "
                  f"load average {load_average()}", flush=True)
    ref = median([r["ref_rate"] for rs in results.values() for r in rs])
    columns_ref = median([r["columns_rate"] for rs in results.values() for r in rs])
    print()
    print(f"index sync on loopback: {args.shards} maintenance processes, {args.edges} subscriber edge(s)"
          f"{' + 1 kvcompassd edge' if args.real_edge else ''}, {args.events:,} events in reports of "
          f"{args.report_events}; medians of {args.runs} runs; load average {load_average()}")
    header = (f"{'mode':<24}{'events/s':>10}{'vs objects':>12}{'vs columns':>12}{'vs as sent':>15}"
              f"{'P50 ms':>9}{'P99 ms':>9}{'reports':>9}{'mnt CPU us/ev':>15}{'edge CPU us/ev':>16}"
              f"{'real edge lag ms':>18}{'real edge keys':>22}")
    print(header)
    print("-" * len(header))
    print(f"{'in-process, objects':<24}{ref:>10,.0f}{1.0:>12.2f}{ref / columns_ref:>12.2f}{1e6 / ref:>75.1f} (all of it)")
    print(f"{'in-process, columns':<24}{columns_ref:>10,.0f}{columns_ref / ref:>12.2f}{1.0:>12.2f}"
          f"{1e6 / columns_ref:>75.1f} (all of it)")
    for mode, fraction in points:
        rs = results[mode]
        rate = median([r["rate"] for r in rs])
        target_ref = median([r["best_rate"] for r in rs])
        label = "max (unpaced)" if fraction is None else f"paced {fraction:g}: {median([r['offered'] for r in rs]):,.0f}/s"
        lag = median([r["real_edge_lag_ms"] for r in rs if r["real_edge_lag_ms"] is not None])
        wrong = sum(r["wrong"] for r in rs)
        checked = sum(r["checked"] for r in rs)
        keys = f"{checked - wrong:,}/{checked:,} right" if checked else "-"
        print(f"{label:<24}{rate:>10,.0f}{rate / ref:>12.2f}{rate / columns_ref:>12.2f}{rate / target_ref:>15.2f}"
              f"{median([r['p50'] for r in rs]):>9.1f}{median([r['p99'] for r in rs]):>9.1f}"
              f"{median([r['reports_sent'] for r in rs]):>9.0f}{median([r['mnt_us'] for r in rs]):>15.1f}"
              f"{median([r['edge_us'] for r in rs]):>16.1f}{lag:>18.1f}{keys:>22}")
    print("\nin-process, objects: the engine batches' event objects applied one by one (MaintenanceShard.apply); "
          "in-process, columns: the same engine batches applied as columns (apply_columns), as a maintenance unit "
          "applies a decoded report: the issue's reference (target: vs columns >= 0.30 with P99 < 50 ms) and the "
          "base of the paced rates. vs as sent: against the faster of that and the same run's reports as the agent "
          "sent them (coalesced) applied in process as columns. reports: reports the agent sent. "
          "events/s: events / (last engine batch visible at every subscriber edge - first handed to the agent); "
          "delays: engine batch handed to the agent -> visible in the slowest subscriber edge's view; real edge lag: "
          "when the kvcompassd edge process showed the last report (polled over admin QUIC) after the subscribers "
          "did. CPU per event: utime+stime of the maintenance processes (summed) and of one subscriber edge over the "
          "timed phase; their inverse is the rate one free core could sustain, whatever else loads the machine.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=200_000)
    p.add_argument("--report-events", type=int, default=64,
                   help="events per engine batch handed to the agent (incl. the probe)")
    p.add_argument("--report-delay-ms", type=float, default=DEFAULT_REPORT_DELAY_S * 1000.0,
                   help="the agent's report coalescing delay (0: one report per loop turn)")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--edges", type=int, default=1, help="subscriber edge processes the bench runs")
    p.add_argument("--real-edge", action=argparse.BooleanOptionalAction, default=True,
                   help="also run a kvcompassd edge process and verify its views at the end")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--modes", nargs="+", choices=("max", "paced"), default=["max", "paced"])
    p.add_argument("--paced-fraction", type=float, nargs="+", default=[0.3],
                   help="paced mode offers these shares of the in-process columns rate (one row each)")
    # Sized for the steady state (as config/production-3region.toml advises): a table's growth is
    # a one-time rebuild that ships a snapshot, not the update stream this measures.
    p.add_argument("--initial-capacity", type=int, default=262144, help="entries per Ludo table before growth")
    p.add_argument("--host", default=None,
                   help="run every daemon on this address instead of 127.0.0.1 (a LAN address of this machine: "
                        "QUIC then sizes datagrams for a network path, 1200 bytes, instead of loopback's 16 KiB)")
    p.add_argument("--max-datagram-size", type=int, default=0,
                   help="the cluster's [cluster] max_datagram_size (0: by path, 16 KiB on loopback)")
    p.add_argument("--profile", metavar="DIR", help="run the daemons under cProfile, writing DIR/<run>/<mode>.<id>.prof")
    p.add_argument("--verbose", action="store_true", help="print each run's visibility timeline")
    p.add_argument("--quick", action="store_true", help="small sizes (~1 minute)")
    args = p.parse_args()
    if args.quick:
        args.events = min(args.events, 20_000)
    # The agent runs under uvloop, as the agent daemon does (kvcompassd.daemon.serve_forever).
    uvloop.run(main_async(args))


if __name__ == "__main__":
    main()
