"""What makes the latency tail through one edge under cache pressure, and does the edge's fix hold
against a reference measured in the same run (issue 30.8).

The cluster of ``tools/bench_affinity.py`` (``--workers`` emulated workers with the A100 timing
model, one edge), VRAM of ``--vram-tokens`` per worker (8,192: fewer than the groups' prefixes
and the running requests' prompts), a closed loop of ``--concurrency`` streaming clients for
``--seconds`` after a ``--warmup``. Each of ``--variants`` gets a fresh cluster and every worker's
cache flushed, in ABBA order over ``--runs`` (the machine's load drifts; the order spreads it):

- ``direct``: client-side round robin straight to the workers, nothing of the plane running;
- ``refute``: the edge as configured by default (``[score] pending_refute``: a response that
  reused less than its worker was credited with ends that credit in the pending ledger);
- ``refute+first-token`` / ``first-token``: with ``pending_from_first_token`` too / alone (the
  ledger credits a dispatch from its first token, not from the estimate);
- ``estimated``: neither (the ledger before: credited from the estimated end of the prefill,
  held 1 s whatever the responses say).

Every request is recorded (its group, the worker that served it read off its output tokens, the
tokens it reused and was credited with, its first token and its end), and every ``--poll-ms``
each worker's ``/v1/loads``. The slowest ``--tail`` percent of an edge's requests are put down to
one cause each:

- ``stale-view`` / ``stale-ledger``: a miss the edge had credited as a hit, from its index view
  or from its pending ledger (the response's ``kvcompass.pending``): it chose the worker for a
  reuse that was not there (evicted, not yet computed, or never cached);
- ``evicted``: a miss on the worker that had served the group's previous request with a hit
  (its prefix was evicted in between: eviction churn);
- ``spread``: a miss elsewhere (the edge sent the group to a worker without its prefix);
- ``queued``: a hit that waited behind a queue on its worker (the worker's load reading nearest
  its arrival showed one): holder overload;
- ``other``: a hit with no queue in sight (decode batch, host noise).

It prints one line per window (with the load average at its start and end: the figures move
with the machine's load), then per variant the medians over runs of req/s, P50, P99, reuse and
affinity, with their ratios to ``direct`` and of each ledger to ``estimated``, and the causes
behind the tail of the last window of each edge variant.

    .venv/bin/python tools/bench_tail.py --vram-tokens 8192 --concurrency 64 --seconds 20 --runs 2

``--score FIELD=VALUE ...`` sets fields of every edge variant's ``[score]`` on top of its own
(``tools/bench_affinity.py``'s option), to read the causes under another setting.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import itertools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp  # noqa: E402
import uvloop  # noqa: E402

from bench_affinity import start  # noqa: E402
from bench_edge import Prompts, WhoServed, flush_caches  # noqa: E402
from benchlib import median, percentile, quiet_logs, setting_parser  # noqa: E402

VARIANTS: dict[str, dict | None] = {
    "direct": None,
    "refute": {"pending_refute": True, "pending_from_first_token": False},
    "refute+first-token": {"pending_refute": True, "pending_from_first_token": True},
    "first-token": {"pending_refute": False, "pending_from_first_token": True},
    "estimated": {"pending_refute": False, "pending_from_first_token": False},
}
CAUSES = ("stale-view", "stale-ledger", "evicted", "spread", "queued", "other")


def load_now() -> float:
    return os.getloadavg()[0]


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


async def closed_loop(urls: list[str], args, prompts: Prompts, who: WhoServed, seconds: float) -> tuple[list[dict], float]:
    """``args.concurrency`` streaming clients for ``seconds``, round robin over ``urls``; the
    records and the window's length."""
    records: list[dict] = []
    rr = itertools.cycle(urls)
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
                    async with session.post(next(rr) + "/generate", json=body) as resp:
                        ok = resp.status == 200
                        async for line in resp.content:
                            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                                continue
                            if first is None:
                                first = time.monotonic()
                            data = json.loads(line[5:])
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    ok = False
                ended = time.monotonic()
                if ok and data:
                    meta = data.get("meta_info") or {}
                    info = meta.get("kvcompass") or {}
                    records.append({"group": group, "text": text, "output_ids": data.get("output_ids"),
                                    "cached": int(meta.get("cached_tokens") or 0),
                                    "claimed": int(info.get("claimed_tokens") or 0),
                                    "pending": bool(info.get("pending")),
                                    "sent": sent, "first": first if first is not None else ended,
                                    "latency_ms": (ended - sent) * 1000.0})
                elif not ok:
                    records.append({"error": True, "sent": sent})

        began = time.monotonic()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        elapsed = time.monotonic() - began
    for r in records:
        if "text" in r:
            r["worker"] = who(r.pop("text"), r.pop("output_ids"))
    return records, elapsed


def classify(records: list[dict], shared: int, readings: dict[str, list[tuple[float, float, int]]]) -> None:
    last_hit_on: dict[int, str | None] = {}
    times = {w: [t for t, _, _ in series] for w, series in readings.items()}
    previous: dict[tuple[int, str | None], dict] = {}
    for r in sorted(records, key=lambda r: r["sent"]):
        hit = r["cached"] >= shared
        series = readings.get(r["worker"], [])
        at = bisect.bisect_right(times.get(r["worker"], []), r["sent"]) - 1
        r["queue_ms"], r["running"] = (series[at][1], series[at][2]) if at >= 0 else (0.0, 0)
        # Had the group's previous request on this worker had its first token (its prompt
        # computed there) when this one was sent?
        before = previous.get((r["group"], r["worker"]))
        r["previous_computed"] = None if before is None else before["first"] <= r["sent"]
        previous[(r["group"], r["worker"])] = r
        if not hit and r["claimed"] > r["cached"]:
            r["cause"] = "stale-ledger" if r["pending"] else "stale-view"  # credited a prefix the worker lacked
        elif not hit:
            r["cause"] = "evicted" if last_hit_on.get(r["group"]) == r["worker"] else "spread"
        else:
            r["cause"] = "queued" if r["queue_ms"] > 0.0 else "other"
            last_hit_on[r["group"]] = r["worker"]


def summarize(records: list[dict], elapsed: float, shared: int, tail_percent: float) -> dict:
    served = [r for r in records if not r.get("error")]
    latencies = sorted(r["latency_ms"] for r in served)
    ttfts = sorted((r["first"] - r["sent"]) * 1000.0 for r in served)
    per_group: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in served:
        per_group[r["group"]][r["worker"]] += 1
    top = sum(c.most_common(1)[0][1] for c in per_group.values())
    cut = percentile(latencies, 100.0 - tail_percent)
    out = {
        "requests": len(served), "errors": len(records) - len(served), "rps": len(served) / elapsed,
        "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99),
        "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
        "mean_ms": sum(latencies) / len(latencies) if latencies else float("nan"),
        "reuse": sum(r["cached"] >= shared for r in served) / max(1, len(served)),
        "affinity": top / max(1, len(served)),
        "tail": [r for r in served if r["latency_ms"] >= cut], "cut_ms": cut, "records": served,
    }
    for cause in ("stale-view", "stale-ledger"):
        out[cause] = sum(r.get("cause") == cause for r in served) / max(1, len(served))
    return out


async def measure(args, variant: str, run_no: int) -> dict:
    score = VARIANTS[variant]
    if score is not None:
        score = {**score, **dict(args.score)}
    cluster, url, seeds = await start(args, 1.0, score=score, workers_only=score is None)
    try:
        who = WhoServed(seeds, args.max_new_tokens)
        worker_urls = {w.id: w.http for w in cluster.cfg.workers}
        urls = list(worker_urls.values()) if score is None else [url]
        prompts = Prompts(args.groups, args.prefix_chars, args.suffix_chars, seed=7 + run_no)
        await flush_caches(list(worker_urls.values()))
        await closed_loop(urls, args, prompts, who, args.warmup)
        readings: dict[str, list] = collections.defaultdict(list)
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_loads(worker_urls, args.poll_ms / 1000.0, stop, readings))
        load_before, wall_before = load_now(), time.strftime("%H:%M:%S", time.gmtime())
        records, elapsed = await closed_loop(urls, args, prompts, who, args.seconds)
        load_after = load_now()
        stop.set()
        await poller
    finally:
        cluster.stop()
    served = [r for r in records if not r.get("error")]
    classify(served, prompts.shared_tokens, readings)
    out = summarize(records, elapsed, prompts.shared_tokens, args.tail)
    out.update(variant=variant, run=run_no, load=(load_before, load_after), began=wall_before)
    return out


def _line(w: dict) -> str:
    return (f"  run {w['run'] + 1} {w['variant']:<18} {w['began']} UTC load {w['load'][0]:5.1f}->{w['load'][1]:5.1f}  "
            f"{w['rps']:6.1f} req/s  P50 {w['p50_ms']:6.0f}  P99 {w['p99_ms']:6.0f}  mean {w['mean_ms']:6.0f} ms  "
            f"TTFT P50 {w['ttft_p50_ms']:5.0f}  P99 {w['ttft_p99_ms']:5.0f} ms  "
            f"reuse {w['reuse']:.2f}  affinity {w['affinity']:.2f}  stale view/ledger "
            f"{w['stale-view']:.2f}/{w['stale-ledger']:.2f}  errors {w['errors']}")


def causes(w: dict) -> None:
    tail, records = w["tail"], w["records"]
    print(f"\n{w['variant']} (run {w['run'] + 1}): tail = slowest {len(tail)} requests (>= {w['cut_ms']:.0f} ms)")
    print(f"  {'cause':<13}{'tail share':>11}{'all share':>10}{'mean ms (tail)':>15}{'mean ms (all)':>14}"
          f"{'prev. computed':>16}")
    for cause in CAUSES:
        in_tail = [r for r in tail if r["cause"] == cause]
        in_all = [r for r in records if r["cause"] == cause]
        computed = [r["previous_computed"] for r in in_all if r["previous_computed"] is not None]
        print(f"  {cause:<13}{len(in_tail) / max(1, len(tail)):>11.2f}{len(in_all) / max(1, len(records)):>10.2f}"
              f"{_mean(in_tail):>15.0f}{_mean(in_all):>14.0f}"
              f"{(sum(computed) / len(computed) if computed else float('nan')):>16.2f}")
    by_worker = collections.Counter(r["worker"] for r in records)
    tail_by_worker = collections.Counter(r["worker"] for r in tail)
    print("  per worker (share of requests / of the tail): " + ", ".join(
        f"{k} {by_worker[k] / len(records):.2f}/{tail_by_worker[k] / max(1, len(tail)):.2f}"
        for k in sorted(by_worker, key=str)))
    queued = sorted(r["queue_ms"] for r in tail)
    print(f"  worker queue reading at a tail request's arrival: P50 {percentile(queued, 50):.0f} ms, max "
          f"{queued[-1] if queued else float('nan'):.0f} ms; running P50 {percentile([r['running'] for r in tail], 50):.0f}")


def _mean(records: list[dict]) -> float:
    return sum(r["latency_ms"] for r in records) / len(records) if records else float("nan")


def report(args, windows: list[dict]) -> None:
    print(f"\ntail through one edge under cache pressure: {args.workers} workers at --time-scale {args.time_scale:g}, "
          f"{args.vram_tokens} VRAM tokens each, c={args.concurrency}, {args.groups} groups ({args.prefix_chars}+"
          f"{args.suffix_chars} bytes), max_new_tokens {args.max_new_tokens}, {args.warmup:g} s warmup + "
          f"{args.seconds:g} s per window; medians of {args.runs} run(s)")
    by_variant = collections.defaultdict(list)
    for w in windows:
        by_variant[w["variant"]].append(w)
    med = {v: {k: median([w[k] for w in ws]) for k in ("rps", "p50_ms", "p99_ms", "mean_ms", "reuse", "affinity",
                                                          "stale-view", "stale-ledger")}
           for v, ws in by_variant.items()}
    loads = {v: (min(w["load"][0] for w in ws), max(w["load"][1] for w in ws)) for v, ws in by_variant.items()}
    header = (f"{'variant':<19}{'req/s':>7}{'x direct':>9}{'P50 ms':>8}{'P99 ms':>8}{'P99/direct':>11}{'mean ms':>8}"
              f"{'reuse':>7}{'affinity':>9}{'stale view':>11}{'stale ledger':>13}{'load':>13}")
    print(header)
    print("-" * len(header))
    direct = med.get("direct")
    for v in args.variants:
        if v not in med:
            continue
        m = med[v]
        rps_ratio = m["rps"] / direct["rps"] if direct else float("nan")
        p99_ratio = m["p99_ms"] / direct["p99_ms"] if direct else float("nan")
        print(f"{v:<19}{m['rps']:>7.1f}{rps_ratio:>9.2f}{m['p50_ms']:>8.0f}{m['p99_ms']:>8.0f}{p99_ratio:>11.2f}"
              f"{m['mean_ms']:>8.0f}{m['reuse']:>7.2f}{m['affinity']:>9.2f}{m['stale-view']:>11.2f}"
              f"{m['stale-ledger']:>13.2f}{f'{loads[v][0]:.1f}-{loads[v][1]:.1f}':>13}")
    e = med.get("estimated")
    for v in args.variants:
        if e is None or v in ("estimated", "direct") or v not in med:
            continue
        o = med[v]
        print(f"{v} / estimated: req/s {o['rps'] / e['rps']:.2f}, P50 {o['p50_ms'] / e['p50_ms']:.2f}, "
              f"P99 {o['p99_ms'] / e['p99_ms']:.2f}, reuse {o['reuse'] - e['reuse']:+.2f}, "
              f"stale claims {o['stale-view'] + o['stale-ledger']:.2f} vs {e['stale-view'] + e['stale-ledger']:.2f}")
    for v in args.variants:
        if VARIANTS[v] is not None and by_variant.get(v):
            causes(by_variant[v][-1])


async def run(args) -> list[dict]:
    windows = []
    for run_no in range(args.runs):
        order = args.variants if run_no % 2 == 0 else list(reversed(args.variants))
        for variant in order:
            try:
                w = await measure(args, variant, run_no)
            except (RuntimeError, TimeoutError) as exc:  # a cluster that did not come up (a loaded host)
                print(f"  run {run_no + 1} {variant}: no window ({str(exc).splitlines()[0]}); load {load_now():.1f}",
                      flush=True)
                continue
            print(_line(w), flush=True)
            windows.append(w)
    return windows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["direct", "refute", "estimated"])
    p.add_argument("--runs", type=int, default=1, help="each variant once per run, in ABBA order")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--beta", type=float, default=0.085)
    p.add_argument("--decode-ms", type=float, default=12.0)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--vram-tokens", type=int, default=8192)
    p.add_argument("--dram-tokens", type=int, default=0)
    p.add_argument("--prefix-chars", type=int, default=1500)
    p.add_argument("--suffix-chars", type=int, default=500)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--poll-ms", type=float, default=50.0)
    p.add_argument("--tail", type=float, default=5.0, help="percent of slowest requests")
    p.add_argument("--score", type=setting_parser("score"), nargs="+", action="extend", default=[],
                   metavar="FIELD=VALUE",
                   help="[score] settings of every edge variant, on top of its own")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    quiet_logs()
    report(args, uvloop.run(run(args)))


if __name__ == "__main__":
    main()
