"""What makes the latency tail through one edge under cache pressure (issue 30.8).

The cluster of ``tools/bench_affinity.py`` (``--workers`` emulated workers with the A100 timing
model, one edge), VRAM of ``--vram-tokens`` per worker (8,192: fewer than the groups' prefixes),
a closed loop of ``--concurrency`` clients for ``--seconds`` after a ``--warmup``. Every request
is recorded (its group, the worker that served it read off its output tokens, the tokens it
reused, its latency), and every ``--poll-ms`` each worker's ``/v1/loads`` (its queue and running
requests). The slowest ``--tail`` percent of requests are then put down to one cause each:

- ``stale``: a miss the edge had credited as a hit (its view or pending ledger still listed a
  prefix the worker had evicted: it chose the worker for a reuse that was not there);
- ``evicted``: a miss on the worker that had served the group's previous request with a hit
  (its prefix was evicted in between: eviction churn);
- ``spread``: a miss elsewhere (the edge sent the group to a worker without its prefix);
- ``queued``: a hit that waited behind a queue on its worker (the worker's load reading nearest
  its arrival showed one): holder overload;
- ``other``: a hit with no queue in sight (decode batch, host noise).

It prints the shares of each cause in the tail and in all requests, each one's mean latency,
each worker's share of the requests and of the tail, and the queue readings behind the tail.

    .venv/bin/python tools/bench_tail.py --vram-tokens 8192 --concurrency 64 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp  # noqa: E402
import uvloop  # noqa: E402

from bench_affinity import start  # noqa: E402
from bench_edge import Prompts, WhoServed, flush_caches  # noqa: E402
from benchlib import load_average, percentile, quiet_logs  # noqa: E402


async def poll_loads(worker_urls: dict[str, str], period_s: float, stop: asyncio.Event,
                     readings: dict[str, list[tuple[float, float, int]]]) -> None:
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            for worker, url in worker_urls.items():
                try:
                    async with session.get(f"{url}/v1/loads") as resp:
                        load = (await resp.json())["loads"][0]
                except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
                    continue
                readings[worker].append((time.monotonic(), float(load.get("estimated_queue_ms", 0.0)),
                                         int(load.get("num_running_reqs", 0))))
            await asyncio.sleep(period_s)


async def closed_loop(url: str, args, prompts: Prompts, who: WhoServed, seconds: float) -> list[dict]:
    records: list[dict] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        stop_at = time.monotonic() + seconds

        async def client() -> None:
            while time.monotonic() < stop_at:
                group, text = prompts.next()
                body = {"text": text, "sampling_params": {"max_new_tokens": args.max_new_tokens}, "stream": True}
                sent = time.monotonic()
                first = None
                data: dict = {}
                try:
                    # Streamed, so that the first token's arrival is known: when the worker had the
                    # prompt computed (and a later request of its group could have reused it).
                    async with session.post(url + "/generate", json=body) as resp:
                        ok = resp.status == 200
                        async for line in resp.content:
                            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                                continue
                            if first is None:
                                first = time.monotonic()
                            data = json.loads(line[5:])
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    ok = False
                if ok and data:
                    meta = data.get("meta_info") or {}
                    info = meta.get("kvcompass") or {}
                    records.append({"group": group, "text": text, "output_ids": data.get("output_ids"),
                                    "cached": int(meta.get("cached_tokens") or 0),
                                    "claimed": int(info.get("claimed_tokens") or 0),
                                    "pending": bool(info.get("pending")),
                                    "sent": sent, "first": first if first is not None else time.monotonic(),
                                    "latency_ms": (time.monotonic() - sent) * 1000.0})

        await asyncio.gather(*(client() for _ in range(args.concurrency)))
    for r in records:
        r["worker"] = who(r.pop("text"), r.pop("output_ids"))
    return records


def classify(records: list[dict], shared: int, readings: dict[str, list[tuple[float, float, int]]]) -> None:
    last_hit_on: dict[int, str | None] = {}
    for r in sorted(records, key=lambda r: r["sent"]):
        hit = r["cached"] >= shared
        series = readings.get(r["worker"], [])
        at = bisect.bisect_right([t for t, _, _ in series], r["sent"]) - 1
        r["queue_ms"], r["running"] = (series[at][1], series[at][2]) if at >= 0 else (0.0, 0)
        if not hit and r["claimed"] > r["cached"]:
            r["cause"] = "stale-ledger" if r["pending"] else "stale-view"  # credited a prefix the worker lacked
        elif not hit:
            r["cause"] = "evicted" if last_hit_on.get(r["group"]) == r["worker"] else "spread"
        else:
            r["cause"] = "queued" if r["queue_ms"] > 0.0 else "other"
            last_hit_on[r["group"]] = r["worker"]


def _mean_latency(records: list[dict]) -> float:
    return sum(r["latency_ms"] for r in records) / len(records) if records else float("nan")


def report(args, records: list[dict]) -> None:
    latencies = sorted(r["latency_ms"] for r in records)
    cut = percentile(latencies, 100.0 - args.tail)
    tail = [r for r in records if r["latency_ms"] >= cut]
    print(f"\ntail through one edge: {args.workers} workers at --time-scale {args.time_scale:g}, {args.vram_tokens} "
          f"VRAM tokens each, c={args.concurrency}, {args.groups} groups ({args.prefix_chars}+{args.suffix_chars} "
          f"bytes), {args.seconds:g} s; load average {load_average()}")
    print(f"{len(records)} requests, P50 {percentile(latencies, 50):.0f} ms, P99 {percentile(latencies, 99):.0f} ms; "
          f"tail = slowest {args.tail:g} % ({len(tail)} requests, >= {cut:.0f} ms)")
    print(f"{'cause':<13}{'tail share':>11}{'all share':>10}{'mean ms (tail)':>15}{'mean ms (all)':>14}")
    for cause in ("stale-view", "stale-ledger", "evicted", "spread", "queued", "other"):
        in_tail = [r for r in tail if r["cause"] == cause]
        in_all = [r for r in records if r["cause"] == cause]
        print(f"{cause:<13}{len(in_tail) / max(1, len(tail)):>11.2f}{len(in_all) / max(1, len(records)):>10.2f}"
              f"{_mean_latency(in_tail):>15.0f}{_mean_latency(in_all):>14.0f}")
    by_worker = collections.Counter(r["worker"] for r in records)
    tail_by_worker = collections.Counter(r["worker"] for r in tail)
    print("per worker (share of requests / of the tail): " + ", ".join(
        f"{w} {by_worker[w] / len(records):.2f}/{tail_by_worker[w] / max(1, len(tail)):.2f}" for w in sorted(by_worker, key=str)))
    for cause in ("stale-view", "stale-ledger"):
        # Was the group's previous request on that worker done (its prompt computed) when this one was sent?
        done = inflight = none = 0
        for r in records:
            if r["cause"] != cause:
                continue
            before = [q for q in records if q["group"] == r["group"] and q["worker"] == r["worker"]
                      and q["sent"] < r["sent"]]
            if not before:
                none += 1
                continue
            q = max(before, key=lambda q: q["sent"])
            if q["first"] <= r["sent"]:
                done += 1
            else:
                inflight += 1
        print(f"{cause}: previous request of the group on that worker had its first token before it was sent {done}, "
              f"not yet {inflight}, none {none}")
    queued = sorted(r["queue_ms"] for r in tail)
    print(f"worker queue reading at a tail request's arrival: P50 {percentile(queued, 50):.0f} ms, "
          f"max {queued[-1] if queued else float('nan'):.0f} ms; running P50 "
          f"{percentile([r['running'] for r in tail], 50):.0f}")


async def run(args) -> None:
    cluster, url, seeds = await start(args, 1.0)
    try:
        who = WhoServed(seeds, args.max_new_tokens)
        worker_urls = {w.id: w.http for w in cluster.cfg.workers}
        prompts = Prompts(args.groups, args.prefix_chars, args.suffix_chars, seed=7)
        await flush_caches(list(worker_urls.values()))
        await closed_loop(url, args, prompts, who, args.warmup)
        readings: dict[str, list] = collections.defaultdict(list)
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_loads(worker_urls, args.poll_ms / 1000.0, stop, readings))
        records = await closed_loop(url, args, prompts, who, args.seconds)
        stop.set()
        await poller
        print("load readings per worker:", {w: len(v) for w, v in readings.items()},
              "running P50 of all readings:", percentile([x[2] for v in readings.values() for x in v], 50))
        classify(records, prompts.shared_tokens, readings)
        report(args, records)
    finally:
        cluster.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--beta", type=float, default=0.085)
    p.add_argument("--decode-ms", type=float, default=12.0)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--vram-tokens", type=int, default=8192)
    p.add_argument("--dram-tokens", type=int, default=0)
    p.add_argument("--prefix-chars", type=int, default=1500)
    p.add_argument("--suffix-chars", type=int, default=500)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--poll-ms", type=float, default=50.0)
    p.add_argument("--tail", type=float, default=1.0, help="percent of slowest requests")
    args = p.parse_args()
    quiet_logs()
    uvloop.run(run(args))


if __name__ == "__main__":
    main()
