"""Prefix affinity and reuse through one edge whose configured prefill rate (beta) is right, 5x
too high or 5x too low: does the edge's cost model correct itself?

A loopback cluster of ``--workers`` emulated workers (``kvcompassd emulate-worker``, worker i
with ``--seed i+1`` so who served a request is read off its output tokens), their agents, one
maintenance unit and one edge. The workers run the cluster config's true timing; the edge,
agents and maintenance unit read a copy of it whose every worker's ``prefill_ms_per_token`` is
multiplied by the ``--beta-errors`` factor. Each factor gets a fresh cluster.

Load: a closed loop POSTing ``/generate`` with one of ``--groups`` shared prefixes of
``--prefix-chars`` bytes plus a unique suffix of ``--suffix-chars`` bytes, ``max_new_tokens``
``--max-new-tokens``, at each ``--concurrency`` for ``--seconds`` after a ``--warmup`` that is
not measured (the edge learns its rates in it); every worker's cache flushed before each point.
Per factor and concurrency: req/s, latency P50/P99, prefix affinity (the share of a group's
requests served by the group's top worker, request-weighted; 1/workers = spread evenly) and
reuse (the share of requests whose group prefix the serving worker had cached), the
prefill rates the edge learned (its ``kvcompass_learned_prefill_ms_per_token`` gauge), and how
many of the measured window's decisions the copy price (``--score copy_weight=...``) was added
to and moved (``kvcompass_copy_charged_decisions``; 0 with the weight off, or on older code),
and the workers' balance: each one's share of the requests and how many groups it was the top
worker of, busiest first (``bench_edge.worker_balance``).

Run it against other code (e.g. an older commit's tree) with ``PYTHONPATH`` pointing there: the
daemons it starts inherit it.

    .venv/bin/python tools/bench_affinity.py --time-scale 0 --concurrency 16 64 --seconds 8
    .venv/bin/python tools/bench_affinity.py --time-scale 1 --vram-tokens 16384 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp  # noqa: E402
import uvloop  # noqa: E402

from bench_edge import Prompts, WhoServed, closed_loop, flush_caches  # noqa: E402
from benchlib import Cluster, load_average, median, quiet_logs, setting_parser  # noqa: E402

from kvcompassd.core.config import dump_config  # noqa: E402
from kvcompassd.launcher import DeploymentSpec  # noqa: E402

_LEARNED = re.compile(r'^kvcompass_learned_prefill_ms_per_token\{worker="([^"]+)"\} (\S+)$', re.M)
_COPY_CHARGED = re.compile(r'^kvcompass_copy_charged_decisions\{outcome="([^"]+)"\} (\S+)$', re.M)
_DECISIONS = re.compile(r'^kvcompass_decisions_total\{outcome="[^"]+"\} (\S+)$', re.M)


async def start(args, beta_error: float, *, score: dict | None = None,
                workers_only: bool = False) -> tuple[Cluster, str, dict[str, int]]:
    """A fresh cluster; ``score`` overrides fields of the edge's ``[score]``; ``workers_only``
    starts the emulated workers and nothing of the plane (for a direct round-robin reference),
    and returns no edge URL."""
    spec = DeploymentSpec(workers={"us": args.workers}, one_way_ms={}, shards=1, wan=False,
                          max_running=args.max_running, vram_kv_tokens=args.vram_tokens,
                          dram_kv_tokens=args.dram_tokens, prefill_ms_per_token=args.beta,
                          decode_ms_per_token=args.decode_ms)
    cluster = Cluster(spec)
    true_config = cluster.config_path.with_name("cluster-true.toml")
    true_config.write_text(cluster.config_path.read_text())
    cfg = cluster.cfg
    wrong = replace(cfg, workers=tuple(replace(w, prefill_ms_per_token=w.prefill_ms_per_token * beta_error)
                                       for w in cfg.workers), score=replace(cfg.score, **(score or {})))
    cluster.config_path.write_text(dump_config(wrong))
    seeds = {w.id: i + 1 for i, w in enumerate(cfg.workers)}
    for w in cfg.workers:
        # The workers' own timing is the true one: spawn reads cluster.config_path, so swap it.
        cluster.config_path, edge_config = true_config, cluster.config_path
        cluster.spawn("emulate-worker", w.id, "--time-scale", str(args.time_scale), "--seed", str(seeds[w.id]))
        cluster.config_path = edge_config
    if workers_only:
        for w in cfg.workers:
            await cluster.wait_http(f"{w.http}/v1/loads")
        return cluster, "", seeds
    for m in cfg.maintenance:
        cluster.spawn("maintenance", m.id)
    cluster.spawn("edge", cfg.edges[0].id)
    for w in cfg.workers:
        cluster.spawn("agent", w.id)
    for w in cfg.workers:
        await cluster.wait_http(f"{w.http}/v1/loads")
    url = f"http://{cfg.edges[0].http}"
    await cluster.wait_http(f"{url}/health", ready_key="ready")
    await asyncio.sleep(1.5)  # agents register and report load within a poll period
    return cluster, url, seeds


async def edge_metrics(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
        return await resp.text()


def learned_rates(metrics: str) -> dict[str, float]:
    return {worker: float(value) for worker, value in _LEARNED.findall(metrics)}


def copy_counts(metrics: str) -> dict[str, int]:
    """The edge's decisions so far, and those the copy price (score.copy_weight) was added to,
    by whether it moved them: {"decisions", "moved", "kept"}."""
    counts = {"moved": 0, "kept": 0, **{o: int(float(v)) for o, v in _COPY_CHARGED.findall(metrics)}}
    counts["decisions"] = int(sum(float(v) for v in _DECISIONS.findall(metrics)))
    return counts


async def run(args) -> dict:
    results: dict = collections.defaultdict(list)
    for run_no in range(args.runs):
        # ABBA over runs: the machine's load drifts, and the order spreads it over the factors.
        for beta_error in (args.beta_errors if run_no % 2 == 0 else list(reversed(args.beta_errors))):
            cluster, url, seeds = await start(args, beta_error, score=dict(args.score))
            try:
                who = WhoServed(seeds, args.max_new_tokens)
                worker_urls = [w.http for w in cluster.cfg.workers]
                for concurrency in args.concurrency:
                    prompts = Prompts(args.groups, args.prefix_chars, args.suffix_chars,
                                      seed=run_no * 1000 + concurrency)
                    await flush_caches(worker_urls)
                    await closed_loop([url], concurrency, args.warmup, prompts, args.max_new_tokens, who)
                    load_before = os.getloadavg()[0]
                    before = copy_counts(await edge_metrics(url))
                    r = await closed_loop([url], concurrency, args.seconds, prompts, args.max_new_tokens, who)
                    r["load"] = (load_before, os.getloadavg()[0])
                    metrics = await edge_metrics(url)
                    r["copy"] = {k: n - before[k] for k, n in copy_counts(metrics).items()}  # the window's own
                    rates = learned_rates(metrics)
                    r["learned"] = median(list(rates.values())) if rates else float("nan")
                    r["learned_range"] = (min(rates.values()), max(rates.values())) if rates else (float("nan"),) * 2
                    results[(beta_error, concurrency)].append(r)
                    print(f"  run {run_no + 1} beta x{beta_error:g} c={concurrency:<3} {r['rps']:7.1f} req/s  "
                          f"P50 {r['p50_ms']:8.2f} ms  P99 {r['p99_ms']:8.2f} ms  affinity {r['affinity']:.2f}  "
                          f"reuse {r['reuse']:.2f}  learned beta {r['learned']:.4f} "
                          f"({r['learned_range'][0]:.4f}-{r['learned_range'][1]:.4f})  errors {r['errors']}  "
                          f"attribution mismatches {r['mismatched']}  copy price moved {r['copy']['moved']} "
                          f"kept {r['copy']['kept']} of {r['copy']['decisions']} decisions  "
                          f"worker shares {'/'.join(f'{x:.2f}' for x in r['worker_shares'])} "
                          f"(groups {'/'.join(map(str, r['groups_per_worker']))})  "
                          f"load {r['load'][0]:.1f}->{r['load'][1]:.1f}",
                          flush=True)
            finally:
                cluster.stop()
    return results


def report(args, results: dict) -> None:
    print()
    print(f"prefix affinity through one edge: {args.workers} emulated workers at --time-scale {args.time_scale:g} "
          f"(true beta {args.beta} ms/token), {args.groups} groups ({args.prefix_chars}-byte prefix + "
          f"{args.suffix_chars}-byte suffix), {args.vram_tokens} VRAM tokens per worker, max_new_tokens "
          f"{args.max_new_tokens}, {args.warmup:g} s warmup + {args.seconds:g} s per point; medians of {args.runs} "
          f"run(s); load average {load_average()}")
    header = (f"{'beta x':>7}{'conc':>5}{'req/s':>9}{'vs x1':>7}{'P50 ms':>10}{'P99 ms':>10}{'affinity':>9}"
              f"{'reuse':>7}{'vs x1':>7}{'learned beta':>13}{'load':>12}")
    print(header)
    print("-" * len(header))
    for concurrency in args.concurrency:
        right = results.get((1.0, concurrency))
        base = median([r["rps"] for r in right]) if right else float("nan")
        base_reuse = median([r["reuse"] for r in right]) if right else float("nan")
        for beta_error in args.beta_errors:
            rs = results[(beta_error, concurrency)]
            rps = median([r["rps"] for r in rs])
            print(f"{beta_error:>7g}{concurrency:>5}{rps:>9.1f}{rps / base:>7.2f}"
                  f"{median([r['p50_ms'] for r in rs]):>10.2f}{median([r['p99_ms'] for r in rs]):>10.2f}"
                  f"{median([r['affinity'] for r in rs]):>9.2f}{median([r['reuse'] for r in rs]):>7.2f}"
                  f"{median([r['reuse'] for r in rs]) - base_reuse:>+7.2f}{median([r['learned'] for r in rs]):>13.4f}"
                  f"{min(r['load'][0] for r in rs):>6.1f}-{max(r['load'][1] for r in rs):<5.1f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--time-scale", type=float, default=0.0, help="the workers' (0: no delays, 1: A100 model)")
    p.add_argument("--beta", type=float, default=0.085, help="the workers' true prefill ms per token")
    p.add_argument("--decode-ms", type=float, default=12.0, help="the workers' decode ms per token at batch 1")
    p.add_argument("--beta-errors", type=float, nargs="+", default=[1.0, 5.0, 0.2],
                   help="the edge's configured beta as a multiple of the true one")
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--vram-tokens", type=int, default=65536)
    p.add_argument("--dram-tokens", type=int, default=0)
    p.add_argument("--score", type=setting_parser("score"), nargs="+", action="extend", default=[],
                   metavar="FIELD=VALUE",
                   help="override fields of the edge's [score] (e.g. learned_rate_bound=1 to keep the configured beta)")
    p.add_argument("--prefix-chars", type=int, default=1500)
    p.add_argument("--suffix-chars", type=int, default=500)
    p.add_argument("--max-new-tokens", type=int, default=8)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    quiet_logs()
    report(args, uvloop.run(run(args)))


if __name__ == "__main__":
    main()
