"""Measure ``edge --workers N`` (issue 30.3): the view's memory in a second process, and the
edge's CPU per request with one front-door process and with N.

Memory (in-process, no daemons): a ``SharedViewWriter`` holding ``--entries`` entries over 2
shards; a second process (spawned) maps every image read-only, reads each page, and reports its
proportional and private memory from ``/proc/<pid>/smaps`` for those mappings, plus its whole
USS (``smaps_rollup`` Private_*) before and after mapping. The private share of the mapped view
is what a second front door adds (target: at most 5 % of the view).

Decision: ``Router.decide`` over the private view and over the mapped one in one process, rounds
interleaved, 2,000-token prompts: what a front door adds per request (the sequence lock).

CPU: a loopback cluster of ``--cluster-workers`` zero-delay emulated workers (as
``tools/bench_edge.py``), one maintenance unit, their agents, and ``edge-us`` started with
``--workers 1``, then ``--workers N``, then N, then 1 (ABBA) per run; closed-loop ``/generate``
load at each ``--concurrency``; CPU per request = user+system time of the edge process and its
front-door children over the requests served, and their idle CPU with no requests (each process's
keepalives and timers, which weigh on the per-request figure at a loaded host's few requests/s).
On a 2-core host the requests/s of N processes cannot scale past the cores the workers and agents
leave; the CPU per request says what N cores would do (target: N processes' CPU per request no
higher than one process's).

    .venv/bin/python tools/bench_edge_workers.py [--entries 2000000] [--decision-rounds 20] [--workers 2]
        [--runs 1] [--seconds 6] [--concurrency 16]

``--strace-seconds S`` adds, after each measured window, one of S seconds with ``strace -c -f -p``
attached to every process of the edge (its CPU is not measured: strace slows it), and prints the
system calls each process made per request the edge served, in total and the most frequent:

    .venv/bin/python tools/bench_edge_workers.py --entries 0 --decision-rounds 0 --sharing-rounds 0 \
        --runs 1 --seconds 8 --concurrency 16 --strace-seconds 5

To run another checkout's daemons (code before and after), set ``PYTHONPATH`` to it and run
this tool from a directory that is not a checkout: ``python -m kvcompassd`` imports the working
directory's package before ``PYTHONPATH``'s.

Routing quality of N processes against one (each keeps its own dispatch charges and pending
ledger, see kvcompassd/edge_workers.py): the same ABBA at the workers' A100 timing under cache
pressure, where the charges and the ledger decide where a group goes:

    .venv/bin/python tools/bench_edge_workers.py --entries 0 --decision-rounds 0 --time-scale 1
        --vram-tokens 16384 --concurrency 16 64 --seconds 20 --runs 2
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from bench_edge import Prompts, WhoServed, closed_loop, flush_caches, tree_cpu_seconds  # noqa: E402
from benchlib import Cluster, cpu_seconds, load_average, median, quiet_logs  # noqa: E402

from kvcompassd.launcher import DeploymentSpec  # noqa: E402

SHARDS = 2


def _layout(entries: int):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from clusters import make_cluster

    from kvcompassd.core.layout import IndexLayout

    cfg = make_cluster({"us": 4}, shards=SHARDS, initial_capacity=max(64, entries // SHARDS * 21 // 20))
    return cfg, IndexLayout.from_config(cfg)


def _cluster_config(entries: int):
    from kvcompassd.core.index import MaintenanceShard

    cfg, layout = _layout(entries)
    shards = [MaintenanceShard(layout, s, SHARDS, epoch=1, initial_capacity=cfg.index.initial_capacity)
              for s in range(SHARDS)]
    return cfg, layout, shards


def _uss(pid: int) -> int:
    total = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        head = line.split()
        if head and head[0] in ("Private_Clean:", "Private_Dirty:"):
            total += int(head[1]) * 1024
    return total


def _mapped(pid: int, prefix: str) -> dict[str, int]:
    out = collections.Counter()
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            inside = len(head) >= 6 and f"/{prefix}-" in head[5]
        elif inside and head[0] in ("Rss:", "Pss:", "Private_Clean:", "Private_Dirty:"):
            out[head[0].rstrip(":")] += int(head[1]) * 1024
    return dict(out)


def _reader(directory: str, entries: int, conn) -> None:
    from kvcompassd.shared_view import SharedViewReader

    cfg, layout = _layout(entries)
    probe = np.arange(0, 1 << 62, (1 << 62) // 10_000, dtype=np.uint64)  # made before the first reading
    conn.send(_uss(os.getpid()))
    conn.recv()
    reader = SharedViewReader(layout, SHARDS, directory, edge="edge-us")
    reader.begin()
    for st in reader.state:
        for v in st.views.values():
            np.frombuffer(v._image, dtype=np.uint8)[::4096].sum()  # every page
            v.lookup_many(probe)
    conn.send(_uss(os.getpid()))
    conn.recv()


def measure_memory(entries: int) -> None:
    from kvcompassd.core.events import IndexEventColumns, PrefixCached, Tier
    from kvcompassd.shared_view import SharedViewWriter

    cfg, layout, shards = _cluster_config(entries)
    writer = SharedViewWriter(layout, SHARDS, edge="edge-us")
    try:
        rng = np.random.default_rng(1)
        keys = rng.integers(0, 1 << 62, entries, dtype=np.uint64)
        for s, shard in enumerate(shards):
            mine = keys[keys % SHARDS == s]
            op = IndexEventColumns.from_events([PrefixCached("us-0", 2, Tier.VRAM)]).ops[:1]
            for i in range(0, len(mine), 100_000):  # batches within a message's size limit
                part = mine[i:i + 100_000]
                shard.apply_columns("us-0", IndexEventColumns(op * len(part), part.astype("<u8").tobytes()))
                shard.flush()
            snap = shard.snapshot()
            outcome = writer.install_tables(s, snap.epoch, snap.seq, snap.tables)
            assert outcome.applied, outcome.reason
        view_bytes = writer.image_bytes()
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_reader, args=(writer.directory_name, entries, child))
        proc.start()
        uss_before = parent.recv()
        parent.send("map")
        uss_after = parent.recv()
        mapped = _mapped(proc.pid, writer.prefix)
        parent.send("done")
        proc.join()
        private = mapped.get("Private_Clean", 0) + mapped.get("Private_Dirty", 0)
        print(f"view: {entries:,} entries over {SHARDS} shards, images {view_bytes / 2**20:.1f} MiB")
        print(f"second process, its mappings of the images: Rss {mapped.get('Rss', 0) / 2**20:.1f} MiB, "
              f"Pss {mapped.get('Pss', 0) / 2**20:.1f} MiB, private {private / 2**20:.2f} MiB "
              f"= {private / view_bytes:.2%} of the view")
        print(f"second process, whole USS: {uss_before / 2**20:.1f} MiB before mapping, {uss_after / 2**20:.1f} MiB "
              f"after: +{(uss_after - uss_before) / 2**20:.2f} MiB = {(uss_after - uss_before) / view_bytes:.2%} of the view")
    finally:
        writer.close()


def measure_decisions(entries: int, rounds: int, per_round: int) -> None:
    """The only work a front door adds to a request's decision: the sequence lock around the C
    call. Router.decide over the private view and over the mapped one, in one process, rounds
    interleaved (ABBA), same prompts."""
    import time

    from kvcompassd.core.events import IndexEventColumns, PrefixCached, Tier
    from kvcompassd.core.index import EdgeIndexView
    from kvcompassd.core.router import Router
    from kvcompassd.shared_view import SharedViewReader, SharedViewWriter, share_router_view

    cfg, layout, shards = _cluster_config(entries)
    private = EdgeIndexView(layout, SHARDS, edge="edge-us")
    writer = SharedViewWriter(layout, SHARDS, edge="edge-us")
    try:
        keys = np.random.default_rng(2).integers(0, 1 << 62, entries, dtype=np.uint64)
        op = IndexEventColumns.from_events([PrefixCached("us-1", 2, Tier.VRAM)]).ops[:1]
        for s, shard in enumerate(shards):
            mine = keys[keys % SHARDS == s]
            for i in range(0, len(mine), 100_000):
                part = mine[i:i + 100_000]
                shard.apply_columns("us-1", IndexEventColumns(op * len(part), part.astype("<u8").tobytes()))
                shard.flush()
            snap = shard.snapshot()
            assert private.install_tables(s, snap.epoch, snap.seq, snap.tables).applied
            assert writer.install_tables(s, snap.epoch, snap.seq, snap.tables).applied
        reader = SharedViewReader(layout, SHARDS, writer.directory_name, edge="edge-us")
        routers = {"private view": Router(cfg, "us", private, now=0.0), "mapped view": Router(cfg, "us", reader, now=0.0)}
        share_router_view(routers["mapped view"], reader)
        rng = np.random.default_rng(3)
        prompts = [rng.integers(0, 30000, 2000, dtype=np.uint32) for _ in range(64)]
        samples: dict[str, list[float]] = {name: [] for name in routers}
        for r in range(rounds):
            for name in (("private view", "mapped view") if r % 2 == 0 else ("mapped view", "private view")):
                router = routers[name]
                t0 = time.process_time()
                for i in range(per_round):
                    router.decide(prompts[i % len(prompts)], now=0.0)
                samples[name].append((time.process_time() - t0) / per_round * 1e6)
        for name, values in samples.items():
            print(f"Router.decide over the {name}: median {median(values):.1f} us CPU per decision "
                  f"({rounds} rounds of {per_round}, 2,000-token prompts, {entries:,} entries); "
                  f"load average {load_average()}")
    finally:
        writer.close()


def measure_sharing(requests: int, rounds: int) -> None:
    """What sharing a request's charge and ledger credit costs (``SharedCharges``,
    ``SharedLedger``): per request, the deciding process sends its dispatch's charge and credit,
    its first token and its end (six frames over a SOCK_SEQPACKET socket pair, as the control
    sockets carry them), and the other process receives and applies them. CPU per request on each
    side, rounds interleaved with the same operations unshared (the deciding process alone)."""
    import socket
    import time

    import msgpack

    from kvcompassd.core.index import EdgeIndexView
    from kvcompassd.core.pending import PendingHoldings
    from kvcompassd.core.queues import QueueEstimates
    from kvcompassd.core.router import Router
    from kvcompassd.edge_workers import MAX_FRAME, SharedCharges, SharedLedger, _pack

    cfg, layout = _layout(1000)
    r = Router(cfg, "us", EdgeIndexView(layout, SHARDS, edge="edge-us"), now=0.0)

    def ledger():
        return PendingHoldings(r.lookup.group_lengths, r.lookup.query_lengths, r.layout.worker_group, hold_s=1.0,
                               refute_misses=True)

    keys = np.arange(1, len(r.lookup.query_lengths) + 1, dtype=np.uint64) * 7919
    prompt_len = int(r.lookup.query_lengths[-1])
    workers = [w.id for w in cfg.workers]
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)

    def send(frame):
        mine.send(_pack(*frame))

    samples: dict[str, list[float]] = {"alone": [], "sender": [], "receiver": []}
    for rnd in range(rounds):
        for shared in ((False, True) if rnd % 2 == 0 else (True, False)):
            queues, pending = QueueEstimates(cfg, "us", now=0.0), ledger()
            if shared:
                queues, pending = SharedCharges(queues, send, origin=0), SharedLedger(pending, send, origin=0)
                other_q = SharedCharges(QueueEstimates(cfg, "us", now=0.0), lambda f: None, origin=1)
                other_l = SharedLedger(ledger(), lambda f: None, origin=1)
            t0 = time.process_time()
            received = 0.0
            for i in range(requests):
                now = i * 1e-3
                k = keys + np.uint64(i * 1000)
                worker = i % len(workers)
                handle = queues.note_dispatched(workers[worker], 50.0, now=now)
                pending.note_sent(worker, k, prompt_len, 0, ready_at=now + 0.05, now=now, dispatch=handle)
                queues.retire_prefill(handle, now=now + 0.0005)
                pending.mark_ready(handle, now=now + 0.0005)
                queues.retire(handle, now=now + 0.0008)
                pending.refute(handle, prompt_len)
                if shared:  # the other process's side, timed apart
                    t1 = time.process_time()
                    for _ in range(6):
                        frame = msgpack.unpackb(theirs.recv(MAX_FRAME), raw=False)
                        (other_q if frame[0] in ("charge", "first_token", "retired") else other_l).apply_frame(
                            frame, now=now + 0.001)
                    received += time.process_time() - t1
            total = time.process_time() - t0
            if shared:
                samples["sender"].append((total - received) / requests * 1e6)
                samples["receiver"].append(received / requests * 1e6)
            else:
                samples["alone"].append(total / requests * 1e6)
    print(f"a request's charge and ledger credit, CPU per request (medians of {rounds} rounds of {requests:,}): "
          f"unshared {median(samples['alone']):.1f} us; shared, the deciding process "
          f"{median(samples['sender']):.1f} us and each other process {median(samples['receiver']):.1f} us; "
          f"load average {load_average()}")


def edge_processes(pid: int) -> list[int]:
    """The edge process and its children (the front doors of ``--workers N``)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    return [pid, *map(int, children)]


def strace_counts(path: Path) -> dict[str, int]:
    """System calls by name from ``strace -c`` output (its summary table)."""
    counts: dict[str, int] = {}
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) < 5 or not fields[0][0].isdigit() or fields[-1] == "total":
            continue
        counts[fields[-1]] = int(fields[3])
    return counts


async def strace_window(pid: int, seconds: float, load) -> tuple[list[dict[str, int]], int]:
    """``strace -c -f -p`` on each of the edge's processes while ``load`` runs a closed loop of
    ``seconds``: (each process's calls by name, requests served)."""
    pids = edge_processes(pid)
    with tempfile.TemporaryDirectory(prefix="kvbench-strace-") as tmp:
        outs = [Path(tmp) / f"{p}.txt" for p in pids]
        tracers = [subprocess.Popen(["strace", "-c", "-f", "-o", str(out), "-p", str(p)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p, out in zip(pids, outs)]
        await asyncio.sleep(0.5)  # attached
        r = await load(seconds)
        for tracer in tracers:
            tracer.send_signal(signal.SIGINT)  # detach: strace writes its table
        for tracer in tracers:
            tracer.wait(30)
        return [strace_counts(out) if out.exists() else {} for out in outs], r["requests"]


def print_strace(n: int, concurrency: int, counts: list[dict[str, int]], requests: int) -> None:
    for k, calls in enumerate(counts):
        per = {name: c / max(1, requests) for name, c in calls.items()}
        top = sorted(per.items(), key=lambda item: -item[1])[:6]
        print(f"    strace --workers {n} c={concurrency} process {k}: {sum(per.values()):.1f} system calls per request "
              f"({requests} requests): " + ", ".join(f"{name} {v:.2f}" for name, v in top)
              + f"; getpid {per.get('getpid', 0.0):.2f}", flush=True)


async def start_edge(cluster: Cluster, workers: int) -> int:
    edge = cluster.cfg.edges[0]
    proc = cluster.spawn("edge", edge.id, "--workers", str(workers))
    await cluster.wait_http(f"http://{edge.http}/health", ready_key="ready")
    return proc.pid


def stop_edge(cluster: Cluster) -> None:
    key = f"edge:{cluster.cfg.edges[0].id}"
    proc = cluster.procs.pop(key)
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


async def measure_cpu(args) -> None:
    spec = DeploymentSpec(workers={"us": args.cluster_workers}, one_way_ms={}, shards=1, wan=False,
                          max_running=64, vram_kv_tokens=args.vram_tokens, dram_kv_tokens=0,
                          **({"prefill_ms_per_token": args.beta} if args.beta else {}))
    results: dict = collections.defaultdict(list)
    for run in range(args.runs):
        cluster = Cluster(spec)
        try:
            cfg = cluster.cfg
            seeds = {w.id: i + 1 for i, w in enumerate(cfg.workers)}
            for w in cfg.workers:
                cluster.spawn("emulate-worker", w.id, "--time-scale", str(args.time_scale), "--seed", str(seeds[w.id]))
            for m in cfg.maintenance:
                cluster.spawn("maintenance", m.id)
            for w in cfg.workers:
                cluster.spawn("agent", w.id)
            for w in cfg.workers:
                await cluster.wait_http(f"{w.http}/v1/loads")
            who = WhoServed(seeds, args.max_new_tokens)
            url = f"http://{cfg.edges[0].http}"
            for n in (1, args.workers, args.workers, 1):
                pid = await start_edge(cluster, n)
                await asyncio.sleep(1.0)  # agents report load to the new edge
                # What the processes burn with no requests (keepalives, timers, readings copied):
                # at the few requests/s of a loaded 2-core host it weighs on the CPU per request.
                idle0 = tree_cpu_seconds(pid)
                await asyncio.sleep(args.idle_seconds)
                idle_rate = (tree_cpu_seconds(pid) - idle0) / args.idle_seconds
                results[("idle", n)].append(idle_rate)
                for concurrency in args.concurrency:
                    prompts = Prompts(8, 1500, 500, seed=run * 1000 + concurrency)
                    await flush_caches([w.http for w in cfg.workers])
                    await closed_loop([url], concurrency, args.warmup, prompts, args.max_new_tokens, who)
                    processes = edge_processes(pid)
                    cpu0, each0 = tree_cpu_seconds(pid), [cpu_seconds(p) for p in processes]
                    r = await closed_loop([url], concurrency, args.seconds, prompts, args.max_new_tokens, who)
                    r["cpu_us"] = (tree_cpu_seconds(pid) - cpu0) / max(1, r["requests"]) * 1e6
                    each = [(cpu_seconds(p) - c) / max(1, r["requests"]) * 1e6 for p, c in zip(processes, each0)]
                    results[(n, concurrency)].append(r)
                    print(f"  run {run + 1} --workers {n} c={concurrency:<3} {r['rps']:8.1f} req/s  "
                          f"P50 {r['p50_ms']:6.2f} ms  P99 {r['p99_ms']:7.2f} ms  CPU {r['cpu_us']:6.0f} us/req  "
                          f"idle {idle_rate * 1000:5.1f} ms/s  affinity {r['affinity']:.2f}  "
                          f"reuse {r['reuse']:.2f}  errors {r['errors']}  load {load_average()}"
                          + (f"  (by process: {' / '.join(f'{c:.0f}' for c in each)})" if n > 1 else ""), flush=True)
                    if args.strace_seconds:
                        counts, served = await strace_window(
                            pid, args.strace_seconds,
                            lambda s: closed_loop([url], concurrency, s, prompts, args.max_new_tokens, who))
                        print_strace(n, concurrency, counts, served)
                stop_edge(cluster)
        finally:
            cluster.stop()
    print(f"\nedge CPU per request (edge process + front-door children), medians of {2 * args.runs} windows "
          f"each; workers at --time-scale {args.time_scale:g}, {args.vram_tokens} VRAM tokens; "
          f"load average {load_average()}")
    print(f"{'conc':>4} {'workers':>8}{'req/s':>9}{'P50 ms':>9}{'P99 ms':>9}{'CPU us/req':>11}{'idle ms/s':>10}"
          f"{'affinity':>9}{'reuse':>7}")
    for concurrency in args.concurrency:
        for n in sorted({1, args.workers}):
            rs = results[(n, concurrency)]
            print(f"{concurrency:>4} {n:>8}{median([r['rps'] for r in rs]):>9.1f}{median([r['p50_ms'] for r in rs]):>9.2f}"
                  f"{median([r['p99_ms'] for r in rs]):>9.2f}{median([r['cpu_us'] for r in rs]):>11.0f}"
                  f"{median(results[('idle', n)]) * 1000:>10.1f}{median([r['affinity'] for r in rs]):>9.2f}"
                  f"{median([r['reuse'] for r in rs]):>7.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", type=int, default=2_000_000, help="view size for the memory measure (0: skip)")
    p.add_argument("--workers", type=int, default=2, help="front-door processes to compare with one")
    p.add_argument("--cluster-workers", type=int, default=4, help="emulated workers behind the edge")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16])
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--idle-seconds", type=float, default=3.0, help="idle CPU is sampled this long per setting")
    p.add_argument("--runs", type=int, default=1, help="0: memory only")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--time-scale", type=float, default=0.0,
                   help="the emulated workers' (0: no delays, CPU per request; 1: the A100 model, routing quality)")
    p.add_argument("--vram-tokens", type=int, default=200_000, help="KV-cache tokens per emulated worker")
    p.add_argument("--beta", type=float, default=0.0, help="prefill ms per token of the workers (0: the spec's)")
    p.add_argument("--decision-rounds", type=int, default=20, help="0: skip the per-decision measure")
    p.add_argument("--sharing-rounds", type=int, default=10, help="0: skip the charge and ledger sharing measure")
    p.add_argument("--strace-seconds", type=float, default=0.0,
                   help="after each measured window, one this long under strace -c -f (0: none; see above)")
    args = p.parse_args()
    quiet_logs()
    if args.entries:
        measure_memory(args.entries)
    if args.decision_rounds:
        measure_decisions(max(args.entries, 100_000), args.decision_rounds, 500)
    if args.sharing_rounds:
        measure_sharing(2000, args.sharing_rounds)
    if args.runs:
        asyncio.run(measure_cpu(args))


if __name__ == "__main__":
    main()
