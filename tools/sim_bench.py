"""Simulator speed: simulated requests per wall-clock and per CPU second on a deployment, per scheme.

    python tools/sim_bench.py [--deployment census-64x8] [--workload mixed] [--rate 600]
                              [--duration 5] [--repeats 3] [--schemes random,kvcompass,...]

Prints the median over repeats for each scheme and its ratio to random forwarding (the
cheapest policy: it reads no feed, measured in the same run), so the figures compare on any machine. On a shared machine
quote the CPU-second rate (process time): wall time there measures the neighbours. The request
stream is generated once per repeat, outside the timing, as the sweeps replay it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from kvcompassd.core.config import load_config
from kvcompassd.sim.cli import resolve_deployment
from kvcompassd.sim.engine import SimSettings, request_window, simulate
from kvcompassd.sim.policy import Topology
from kvcompassd.sim.schemes import DEFAULT_EVICTION, PAPER_SCHEMES, make_policy, make_workload, region_weights


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deployment", default="census-64x8")
    ap.add_argument("--workload", default="mixed")
    ap.add_argument("--rate", type=float, default=600.0)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--schemes", default=",".join(("random", *PAPER_SCHEMES, "load-balance-oracle")))
    ap.add_argument("--page-tokens", type=int, default=None, help="engine page size of the simulated caches")
    args = ap.parse_args(argv)
    topo = Topology.from_config(load_config(resolve_deployment(args.deployment)), page_tokens=args.page_tokens)
    weights = region_weights(topo)
    schemes = [s for s in args.schemes.split(",") if s]
    if "random" not in schemes:
        schemes.insert(0, "random")
    t0 = time.perf_counter()
    rates: dict[str, list[float]] = {s: [] for s in schemes}
    cpu_rates: dict[str, list[float]] = {s: [] for s in schemes}
    for rep in range(args.repeats):
        stream = request_window(make_workload(args.workload, args.rate, weights, seed=rep), duration_s=args.duration)
        for scheme in schemes:
            t, c = time.perf_counter(), time.process_time()
            res = simulate(topo, make_policy(scheme, topo, seed=rep), stream,
                           settings=SimSettings(eviction=DEFAULT_EVICTION[args.workload], seed=rep),
                           duration_s=args.duration)
            rates[scheme].append(res.completed / (time.perf_counter() - t))
            cpu_rates[scheme].append(res.completed / max(time.process_time() - c, 1e-9))
    ref, cpu_ref = statistics.median(rates["random"]), statistics.median(cpu_rates["random"])
    print(f"{args.deployment} / {args.workload} at {args.rate:g} req/s for {args.duration:g} virtual s, "
          f"page {topo.block_size} tokens, "
          f"median of {args.repeats} (wall {time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f})")
    print(f"{'scheme':24s} {'req/wall s':>10s} {'vs random':>10s} {'req/CPU s':>10s} {'vs random':>10s}")
    for scheme in schemes:
        med, cpu_med = statistics.median(rates[scheme]), statistics.median(cpu_rates[scheme])
        print(f"{scheme:24s} {med:10.0f} {med / ref:10.2f} {cpu_med:10.0f} {cpu_med / cpu_ref:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
