"""Benchmark the serving path: closed-loop load through one edge process versus straight to the
workers, back to back in the same run (and through ``smg``, the SGLang model gateway, when it
is installed).

A loopback cluster of ``--workers`` zero-delay emulated workers (``kvcompassd emulate-worker
--time-scale 0``, each with its own ``--seed`` so its output tokens say who served), their
agents, one maintenance unit and two edge processes: ``edge-us`` reaching its own-region
workers over plain HTTP (the default) and ``edge-us-quic`` started with ``--no-local-http``
(every forward over QUIC to the worker's agent, the cross-region path without WAN delay).

Load: non-streaming SGLang ``/generate`` requests, ``--groups`` prefix groups (a shared prefix
of ``--prefix-chars`` bytes, then a unique suffix), closed loop at each ``--concurrency``
for ``--seconds``. Per path and concurrency: requests/s, latency P50/P99 and what the path
adds over the direct one, the router's CPU time per request (``/proc/<pid>/stat`` utime+stime
before/after; for the QUIC path also with the agents' CPU, which then does the worker's HTTP),
prefix affinity: the share of each group's requests that went to the group's top worker, and
reuse: the share of requests whose group prefix the serving worker had cached. Each worker's
VRAM (``--vram-tokens``) holds half of the groups' prefixes, so routing decides reuse; every
point starts from empty caches (``/flush_cache``) and a ``--warmup`` that is not measured.
"direct" sends round-robin over the workers (a router that costs nothing and knows nothing),
with nothing of the plane running: its points come before the plane starts and after it stops,
in reverse order. ``tools/bench_gateway.py`` is the comparison against the public routers; this
tool adds the QUIC path.

    .venv/bin/python tools/bench_edge.py [--quick] [--runs 3] [--seconds 8] [--concurrency 1 16 64]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp  # noqa: E402
import uvloop  # noqa: E402

from benchlib import Cluster, cpu_seconds, load_average, median, percentile, quiet_logs  # noqa: E402

from kvcompassd.core.config import EdgeConfig, dump_config  # noqa: E402
from kvcompassd.emulator.server import output_tokens  # noqa: E402
from kvcompassd.launcher import DeploymentSpec  # noqa: E402

QUIC_EDGE = "edge-us-quic"


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_cpu_seconds(pid: int) -> float:
    """CPU of a process and its descendants (smg may run its router in a child)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry)] = int(fields[1])
    family, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        for child, parent in parents.items():
            if parent == p and child not in family:
                family.add(child)
                frontier.append(child)
    total = 0.0
    for p in family:
        try:
            total += cpu_seconds(p)
        except OSError:
            pass
    return total


class Prompts:
    """Prompts of ``groups`` prefix groups: shared prefix + unique suffix (printable ASCII)."""

    def __init__(self, groups: int, prefix_chars: int, suffix_chars: int, seed: int):
        rng = random.Random(seed)
        alphabet = "abcdefghijklmnopqrstuvwxyz ,."
        self.prefixes = ["".join(rng.choice(alphabet) for _ in range(prefix_chars)) for _ in range(groups)]
        self.suffix_chars = suffix_chars
        # What a hit on the group's prefix reuses: whole 16-token engine pages of it.
        self.shared_tokens = prefix_chars // 16 * 16
        self.rng = rng
        self.counter = itertools.count()

    def next(self) -> tuple[int, str]:
        group = self.rng.randrange(len(self.prefixes))
        n = next(self.counter)
        suffix = f" q{n} " + "".join(self.rng.choice("abcdefghij") for _ in range(self.suffix_chars))
        return group, self.prefixes[group] + suffix


class WhoServed:
    """Which worker produced an output: each worker runs with its own seed (``seeds``)."""

    def __init__(self, seeds: dict[str, int], max_new_tokens: int):
        self.seeds, self.max_new_tokens = seeds, max_new_tokens

    def __call__(self, text: str, output_ids: list[int]) -> str | None:
        prompt = list(text.encode())
        for worker, seed in self.seeds.items():
            if output_tokens(prompt, self.max_new_tokens, seed) == output_ids:
                return worker
        return None


async def closed_loop(urls: list[str], concurrency: int, seconds: float, prompts: Prompts, max_new_tokens: int,
                      who: WhoServed) -> dict:
    """``concurrency`` clients, each sending its next request when the last one returns."""
    latencies: list[float] = []
    served: list[tuple[int, str | None, str | None]] = []  # (group, worker by seed, worker claimed)
    cached: list[int] = []
    errors = 0
    rr = itertools.cycle(urls)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        stop_at = time.monotonic() + seconds

        async def client() -> None:
            nonlocal errors
            while time.monotonic() < stop_at:
                group, text = prompts.next()
                body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens}}
                start = time.perf_counter()
                try:
                    async with session.post(next(rr) + "/generate", json=body) as resp:
                        data = await resp.json(content_type=None)
                        ok = resp.status == 200
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    ok = False
                if not ok:
                    errors += 1
                    continue
                latencies.append(time.perf_counter() - start)
                meta = data.get("meta_info") or {}
                claimed = meta.get("kvcompass", {}).get("worker")
                served.append((group, data.get("output_ids"), text, claimed))
                cached.append(int(meta.get("cached_tokens") or 0))

        began = time.monotonic()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.monotonic() - began
    # Attribution after the timed part: it costs the client CPU.
    per_group: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    mismatched = 0
    for group, output_ids, text, claimed in served:
        worker = who(text, output_ids)
        if claimed is not None and claimed != worker:
            mismatched += 1
        per_group[group][worker] += 1
    top = sum(c.most_common(1)[0][1] for c in per_group.values())
    shares, homes = worker_balance(per_group)
    return {
        "requests": len(latencies),
        "rps": len(latencies) / elapsed,
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "affinity": top / max(1, len(served)),
        "reuse": sum(c >= prompts.shared_tokens for c in cached) / max(1, len(cached)),
        "errors": errors,
        "mismatched": mismatched,
        "worker_shares": shares,
        "groups_per_worker": homes,
    }


def worker_balance(per_group: dict[int, collections.Counter]) -> tuple[list[float], list[int]]:
    """How the load fell on the workers, busiest first: each worker's share of the requests, and
    how many groups had it as their top worker (to tell groups placed unevenly from groups
    spread over several workers). Unattributed requests (worker None) count in no worker's
    share, a worker that served none is not listed, and a group's ties go to the worker seen
    first."""
    served: collections.Counter = collections.Counter()
    homes: collections.Counter = collections.Counter()
    for counts in per_group.values():
        attributed = {w: n for w, n in counts.items() if w is not None}
        served.update(attributed)
        if attributed:
            homes[max(attributed, key=attributed.__getitem__)] += 1
    total = sum(served.values())
    shares = sorted((n / total for n in served.values()), reverse=True) if total else []
    return shares, sorted((homes[w] for w in served), reverse=True)


async def flush_caches(worker_urls: list[str]) -> None:
    """Empty every worker's prefix cache; the agents withdraw its entries from the index."""
    async with aiohttp.ClientSession() as session:
        for url in worker_urls:
            async with session.post(f"{url}/flush_cache") as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{url}/flush_cache answered {resp.status}")
    await asyncio.sleep(0.3)  # the withdrawals reach the edges' views


async def start_cluster(args) -> tuple[Cluster, dict[str, str], dict[str, int]]:
    """The cluster's files and its workers; the plane (``start_plane``) runs only for its paths."""
    spec = DeploymentSpec(workers={"us": args.workers}, one_way_ms={}, shards=1, wan=False,
                          max_running=args.max_running, vram_kv_tokens=args.vram_tokens,
                          dram_kv_tokens=args.dram_tokens)
    cluster = Cluster(spec)
    cfg = cluster.cfg
    quic_edge = EdgeConfig(QUIC_EDGE, "us", http=f"127.0.0.1:{free_port()}",
                           quic=f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}")
    cluster.cfg = cfg = replace(cfg, edges=cfg.edges + (quic_edge,))
    cluster.config_path.write_text(dump_config(cfg))
    from kvcompassd import certs
    from kvcompassd.wire import Role

    certs.issue(cluster.tls_dir, cluster.tls_dir, role=Role.EDGE, node_id=QUIC_EDGE)
    seeds = {w.id: i + 1 for i, w in enumerate(cfg.workers)}
    for w in cfg.workers:
        cluster.spawn("emulate-worker", w.id, "--time-scale", "0", "--seed", str(seeds[w.id]))
    for w in cfg.workers:
        await cluster.wait_http(f"{w.http}/v1/loads")
    urls = {"edge-http": f"http://{cfg.edges[0].http}", "edge-quic": f"http://{quic_edge.http}"}
    return cluster, urls, seeds


def plane_keys(cluster: Cluster) -> list[str]:
    cfg = cluster.cfg
    return ([f"maintenance:{m.id}" for m in cfg.maintenance] + [f"edge:{e.id}" for e in cfg.edges]
            + [f"agent:{w.id}" for w in cfg.workers])


async def start_plane(cluster: Cluster, urls: dict[str, str]) -> None:
    cfg = cluster.cfg
    for m in cfg.maintenance:
        cluster.spawn("maintenance", m.id)
    cluster.spawn("edge", cfg.edges[0].id)
    cluster.spawn("edge", QUIC_EDGE, "--no-local-http")
    for w in cfg.workers:
        cluster.spawn("agent", w.id)
    for url in urls.values():
        await cluster.wait_http(f"{url}/health", ready_key="ready")
    await asyncio.sleep(1.5)  # agents register and report load within a poll period


def stop_processes(cluster: Cluster, keys: list[str]) -> None:
    """Stop (SIGTERM, then SIGKILL) and forget the processes under ``keys``."""
    procs = [cluster.procs.pop(key) for key in keys if key in cluster.procs]
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def start_smg(cluster: Cluster, args) -> tuple[subprocess.Popen, str] | None:
    binary = shutil.which("smg") or str(Path(sys.executable).parent / "smg")
    if not Path(binary).exists():
        return None
    port = free_port()
    argv = [binary, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", args.smg_policy,
            "--log-level", "warn", "--worker-urls", *[w.http for w in cluster.cfg.workers]]
    with open(cluster.workdir / "logs" / "smg.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    cluster.procs["smg:smg"] = proc
    url = f"http://127.0.0.1:{port}"
    try:
        await cluster.wait_http(f"{url}/health", timeout=60)
    except (TimeoutError, RuntimeError) as exc:
        print(f"smg did not come up ({exc}); running without it", file=sys.stderr)
        proc.kill()
        cluster.procs.pop("smg:smg", None)
        return None
    return proc, url


async def run_once(args, run: int, results: dict) -> None:
    """Direct at every concurrency with only the workers running, then the plane (and smg) up for
    the routed paths, then the plane stopped and direct again in reverse order (ABBA): the
    agents and edges must not burn the machine on the direct traffic's KV events."""
    cluster, edge_urls, seeds = await start_cluster(args)
    try:
        cfg = cluster.cfg
        worker_urls = [w.http for w in cfg.workers]
        who = WhoServed(seeds, args.max_new_tokens)

        async def point(name, urls, concurrency, router_pids, helper_pids) -> None:
            # Same prompt stream for every path at this concurrency; warm the caches first.
            prompts = Prompts(args.groups, args.prefix_chars, args.suffix_chars, seed=run * 1000 + concurrency)
            await flush_caches(worker_urls)  # no path inherits the caches the previous one left
            await closed_loop(urls, concurrency, args.warmup, prompts, args.max_new_tokens, who)
            cpu0 = sum(tree_cpu_seconds(p) for p in router_pids)
            helper0 = sum(cpu_seconds(p) for p in helper_pids)
            r = await closed_loop(urls, concurrency, args.seconds, prompts, args.max_new_tokens, who)
            r["cpu_us"] = (sum(tree_cpu_seconds(p) for p in router_pids) - cpu0) / max(1, r["requests"]) * 1e6 if router_pids else float("nan")
            r["helper_us"] = (sum(cpu_seconds(p) for p in helper_pids) - helper0) / max(1, r["requests"]) * 1e6 if helper_pids else float("nan")
            results[(name, concurrency)].append(r)
            print(f"  run {run + 1} c={concurrency:<3} {name:<10} {r['rps']:8.0f} req/s  P50 {r['p50_ms']:6.2f} ms  "
                  f"P99 {r['p99_ms']:6.2f} ms  CPU {r['cpu_us']:6.0f} us/req  affinity {r['affinity']:.2f}  reuse {r['reuse']:.2f}  "
                  f"errors {r['errors']}  attribution mismatches {r['mismatched']}", flush=True)

        for concurrency in args.concurrency:
            await point("direct", worker_urls, concurrency, [], [])
        await start_plane(cluster, edge_urls)
        paths: dict[str, tuple[list[str], list[int], list[int]]] = {
            # name: (urls, pids whose CPU is the router's, pids of the path's helpers)
            "edge-http": ([edge_urls["edge-http"]], [cluster.procs[f"edge:{cfg.edges[0].id}"].pid], []),
            "edge-quic": ([edge_urls["edge-quic"]], [cluster.procs[f"edge:{QUIC_EDGE}"].pid],
                          [cluster.procs[f"agent:{w.id}"].pid for w in cfg.workers]),
        }
        if args.smg:
            started = await start_smg(cluster, args)
            if started is not None:
                paths["smg"] = ([started[1]], [started[0].pid], [])
            elif run == 0:
                print("smg is not installed or did not start: no peer row", file=sys.stderr)
        # What each router burns with no requests (keepalives, queue-vector datagrams, health checks).
        idle_pids = {name: pids + helpers for name, (_, pids, helpers) in paths.items() if pids}
        before = {name: sum(tree_cpu_seconds(p) for p in pids) for name, pids in idle_pids.items()}
        await asyncio.sleep(args.idle_seconds)
        for name, pids in idle_pids.items():
            results[("idle", name)].append((sum(tree_cpu_seconds(p) for p in pids) - before[name]) / args.idle_seconds)
        for concurrency in args.concurrency:
            for name, (urls, router_pids, helper_pids) in paths.items():
                await point(name, urls, concurrency, router_pids, helper_pids)
        stop_processes(cluster, plane_keys(cluster) + ["smg:smg"])
        for concurrency in reversed(args.concurrency):
            await point("direct", worker_urls, concurrency, [], [])
    finally:
        cluster.stop()


def report(args, results: dict) -> None:
    names = list(dict.fromkeys(name for name, _ in results if name != "idle"))
    print()
    print(f"serving path on loopback: {args.workers} zero-delay emulated workers, {args.groups} prefix groups "
          f"({args.prefix_chars}-byte prefix, {args.vram_tokens} VRAM tokens per worker), /generate max_new_tokens={args.max_new_tokens}, {args.seconds:g} s "
          f"per point; medians of {args.runs} run(s); load average {load_average()}")
    header = (f"{'conc':>4} {'path':<10}{'req/s':>9}{'vs direct':>10}{'P50 ms':>9}{'P99 ms':>9}{'+P50 ms':>9}"
              f"{'+P99 ms':>9}{'CPU us/req':>11}{'+agents':>9}{'affinity':>9}{'reuse':>7}")
    print(header)
    print("-" * len(header))
    for concurrency in args.concurrency:
        direct = results.get(("direct", concurrency))
        d_rps = median([r["rps"] for r in direct])
        d_p50 = median([r["p50_ms"] for r in direct])
        d_p99 = median([r["p99_ms"] for r in direct])
        for name in names:
            rs = results.get((name, concurrency))
            if not rs:
                continue
            rps, p50, p99 = (median([r[k] for r in rs]) for k in ("rps", "p50_ms", "p99_ms"))
            cpu, helper = median([r["cpu_us"] for r in rs]), median([r["helper_us"] for r in rs])
            affinity = median([r["affinity"] for r in rs])
            added = "" if name == "direct" else f"{p50 - d_p50:>9.2f}{p99 - d_p99:>9.2f}"
            print(f"{concurrency:>4} {name:<10}{rps:>9.0f}{rps / d_rps:>10.2f}{p50:>9.2f}{p99:>9.2f}"
                  f"{added or '':>18}{_num(cpu):>11}{_num(cpu + helper if helper == helper else float('nan')):>9}"
                  f"{'' if name == 'direct' else f'{affinity:.2f}':>9}{median([r['reuse'] for r in rs]):>7.2f}")
    idle = ", ".join(f"{name} {median(results[key]) * 1000:.0f} ms/s" for key in results if key[0] == "idle"
                     for name in [key[1]])
    print(f"\nidle CPU with no requests (router, and agents for edge-quic): {idle}")
    print("affinity: share of a prefix group's requests served by that group's top worker (request-weighted; "
          f"{1 / args.workers:.2f} = spread evenly). CPU: the router process (edge / smg); +agents adds the agents' "
          "CPU, which do the worker's HTTP on the QUIC path. Direct: round-robin over the workers. reuse: share of "
          "requests whose group prefix was found in the serving worker's cache (meta_info.cached_tokens).")


def _num(x: float) -> str:
    return "-" if x != x else f"{x:.0f}"


async def main_async(args) -> None:
    quiet_logs()
    results: dict = collections.defaultdict(list)
    for run in range(args.runs):
        await run_once(args, run, results)
    report(args, results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--max-running", type=int, default=64, help="each emulated worker's batch limit")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds per path and concurrency")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each point")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--idle-seconds", type=float, default=2.0, help="CPU of the idle routers is sampled this long")
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--vram-tokens", type=int, default=16384,
                   help="each worker's VRAM cache: 16 groups' prefixes of the default size, so where a group "
                        "goes decides whether its prefix is reused")
    p.add_argument("--dram-tokens", type=int, default=0)
    p.add_argument("--prefix-chars", type=int, default=1024)
    p.add_argument("--suffix-chars", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--smg", action=argparse.BooleanOptionalAction, default=True, help="also measure smg if installed")
    p.add_argument("--smg-policy", default="cache_aware")
    p.add_argument("--quick", action="store_true", help="one run of 2 s points (~1-2 minutes)")
    args = p.parse_args()
    if args.quick:
        args.runs, args.seconds, args.warmup = 1, 2.0, 1.0
    uvloop.run(main_async(args))


if __name__ == "__main__":
    main()
