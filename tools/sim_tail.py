"""The cache-pressure comparison of ``tools/bench_tail.py`` in the simulator: the same real core
on a virtual clock, so its figures do not move with the machine's load (issue 30.8).

``--workers`` simulated workers in one region (the A100 timing model, ``--vram-tokens`` of VRAM
each), a closed loop of ``--clients`` sending prompts of ``--groups`` shared prefixes of
``--prefix-tokens`` plus a unique suffix of ``--suffix-tokens``, ``--output-tokens`` each, for
``--requests`` requests per seed (the first ``--warmup`` not measured). Each ``--variants`` entry is KVCompass with one ``[score]``
override of the pending ledger (``refute``: ``pending_refute``, the default; ``first-token``:
``pending_from_first_token`` alone; ``refute+first-token``: both; ``estimated``: neither, the
ledger before; ``no-ledger``: ``pending_hold_ms = 0``); ``round-robin`` is the reference and
``sglang-cache-aware`` the simulator's model of SGLang's cache-aware router. It prints, per
variant, the medians over ``--seeds`` of throughput, TTFT and end-to-end P50/P99, reuse (the
share of requests that reused their group's prefix) and the false-claim share, with ratios to
the reference and to ``estimated``.

    .venv/bin/python tools/sim_tail.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import numpy as np

from kvcompassd.launcher import DeploymentSpec, build_cluster
from kvcompassd.sim.engine import SimSettings, simulate
from kvcompassd.sim.kvcompass_policy import KVCompassPolicy
from kvcompassd.sim.policy import Topology
from kvcompassd.sim.schemes import make_policy
from kvcompassd.sim.workloads import Request

VARIANTS = {  # None: a baseline scheme of the simulator, by that name
    "round-robin": None,
    "sglang-cache-aware": None,
    "refute": {"pending_refute": True, "pending_from_first_token": False},
    "refute+first-token": {"pending_refute": True, "pending_from_first_token": True},
    "first-token": {"pending_refute": False, "pending_from_first_token": True},
    "estimated": {"pending_refute": False, "pending_from_first_token": False},
    "no-ledger": {"pending_hold_ms": 0.0},
}


def requests(args, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 30000, args.prefix_tokens, dtype=np.uint32) for _ in range(args.groups)]
    out = []
    for i in range(args.requests):
        group = int(rng.integers(args.groups))
        tokens = np.concatenate([prefixes[group], rng.integers(0, 30000, args.suffix_tokens, dtype=np.uint32)])
        out.append(Request(i, 0.0, "us", group, tokens, args.output_tokens))  # the clients pace them
    return out


def run_one(args, variant: str, seed: int) -> dict:
    spec = DeploymentSpec(workers={"us": args.workers}, one_way_ms={}, shards=1, wan=False,
                          max_running=args.max_running, vram_kv_tokens=args.vram_tokens, dram_kv_tokens=0,
                          prefill_ms_per_token=args.beta, decode_ms_per_token=args.decode_ms)
    cfg = build_cluster(spec, name="simtail")
    override = VARIANTS[variant]
    if override is not None:
        cfg = replace(cfg, score=replace(cfg.score, **override))
    topo = Topology.from_config(cfg)
    policy = KVCompassPolicy(topo, seed=seed) if override is not None else make_policy(variant, topo, seed=seed)
    result = simulate(topo, policy, requests(args, seed), settings=SimSettings(clients=args.clients, seed=seed))
    # The first --warmup requests (a cold start: every client's first prompt at once) are not measured.
    keep = result.records["id"] >= args.warmup
    rec = {k: v[keep] for k, v in result.records.items()}
    arrival, finish = rec["arrival_s"], rec["finish_s"]
    span = float(finish.max() - arrival.min())
    reused, claimed = rec["reused_tokens"], rec["claimed_tokens"]
    shared = args.prefix_tokens // 16 * 16
    return {
        "rps": len(finish) / span,
        "ttft_p50": float(np.percentile(rec["ttft_ms"], 50)), "ttft_p99": float(np.percentile(rec["ttft_ms"], 99)),
        "e2e_p50": float(np.percentile(rec["e2e_ms"], 50)), "e2e_p99": float(np.percentile(rec["e2e_ms"], 99)),
        "reuse": float(np.mean(reused >= shared)),
        "false": float(np.mean(claimed > reused)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                   default=["round-robin", "sglang-cache-aware", "refute", "estimated"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--warmup", type=int, default=500, help="first requests not measured")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=1500)
    p.add_argument("--suffix-tokens", type=int, default=500)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--vram-tokens", type=int, default=8192)
    p.add_argument("--beta", type=float, default=0.085)
    p.add_argument("--decode-ms", type=float, default=12.0)
    p.add_argument("--max-running", type=int, default=64)
    args = p.parse_args()
    results: dict[str, list[dict]] = {v: [] for v in args.variants}
    for seed in args.seeds:
        for variant in args.variants:
            began = time.perf_counter()
            r = run_one(args, variant, seed)
            results[variant].append(r)
            print(f"  seed {seed} {variant:<19} {r['rps']:7.1f} req/s  TTFT P50/P99 {r['ttft_p50']:7.0f}/{r['ttft_p99']:7.0f}"
                  f"  e2e P50/P99 {r['e2e_p50']:7.0f}/{r['e2e_p99']:7.0f} ms  reuse {r['reuse']:.2f}  false claims "
                  f"{r['false']:.3f}  ({time.perf_counter() - began:.0f} s wall)", flush=True)
    print(f"\nsimulated cache pressure: {args.workers} workers, {args.vram_tokens} VRAM tokens each, {args.clients} "
          f"clients, {args.groups} groups ({args.prefix_tokens}+{args.suffix_tokens} tokens), {args.output_tokens} "
          f"output tokens, {args.requests} requests ({args.warmup} not measured); medians of seeds {args.seeds}")
    med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in results.items()}
    ref = med.get("round-robin")
    est = med.get("estimated")
    header = (f"{'variant':<20}{'req/s':>8}{'x rr':>6}{'x est':>7}{'TTFT P50':>9}{'TTFT P99':>9}{'e2e P50':>8}"
              f"{'e2e P99':>8}{'P99 x rr':>9}{'P99 x est':>10}{'reuse':>7}{'false':>7}")
    print(header)
    print("-" * len(header))
    for v in args.variants:
        m = med[v]
        print(f"{v:<20}{m['rps']:>8.1f}{m['rps'] / ref['rps'] if ref else float('nan'):>6.2f}"
              f"{m['rps'] / est['rps'] if est else float('nan'):>7.2f}{m['ttft_p50']:>9.0f}{m['ttft_p99']:>9.0f}"
              f"{m['e2e_p50']:>8.0f}{m['e2e_p99']:>8.0f}{m['e2e_p99'] / ref['e2e_p99'] if ref else float('nan'):>9.2f}"
              f"{m['e2e_p99'] / est['e2e_p99'] if est else float('nan'):>10.2f}{m['reuse']:>7.2f}{m['false']:>7.3f}")


if __name__ == "__main__":
    main()
