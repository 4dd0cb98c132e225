"""Projected CPU seconds of the Fig. 12 sweep, from a few of its points measured at full size.

    python tools/sim_projection.py [--sample-rates 200,3000] [--workloads mixed,wildchat,lmsys]
                                   [--schemes ...] [--jobs 2]

For each workload and sample rate, the point is simulated exactly as the sweep runs it (same
window: ``experiments.point_duration``, same seed, every scheme replaying one generated
stream), and the CPU seconds per simulated request are taken per scheme, plus the stream's
generation per request. Every point of the sweep (``experiments.FIG12_RATES``) is then costed
at the per-request figure of the sample rate nearest to it in log scale, times its expected
arrivals (rate x window). Per-request cost is nearly flat across the overloaded rates (the
arrivals are cheap; the cost is paid as each request completes), which is why two samples
suffice; the wall time on ``--jobs`` quiet cores is the total divided by the cores.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from kvcompassd.core.config import load_config
from kvcompassd.sim.cli import resolve_deployment
from kvcompassd.sim.engine import SimSettings, request_window, simulate
from kvcompassd.sim.experiments import FIG12_FULL_S, FIG12_RATES, REQUESTS_PER_POINT, WORKLOADS3, _sizes, point_duration
from kvcompassd.sim.policy import Topology
from kvcompassd.sim.schemes import DEFAULT_EVICTION, PAPER_SCHEMES, make_policy, make_workload, region_weights


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sample-rates", default="200,3000")
    ap.add_argument("--workloads", default=",".join(WORKLOADS3))
    ap.add_argument("--schemes", default=",".join(PAPER_SCHEMES))
    ap.add_argument("--jobs", type=int, default=2, help="cores the sweep would run on")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    topo = Topology.from_config(load_config(resolve_deployment("census-64x8")))
    weights = region_weights(topo)
    full_s, warmup_s = _sizes(False, FIG12_FULL_S, 2.0)
    samples = [float(r) for r in args.sample_rates.split(",") if r]
    schemes = [s for s in args.schemes.split(",") if s]
    workloads = [w for w in args.workloads.split(",") if w]
    per_req: dict[tuple[str, float, str], float] = {}  # (workload, rate, scheme or "stream") -> CPU-s per request
    started = time.perf_counter()
    for wl in workloads:
        for rate in samples:
            d = point_duration(rate, full_s, warmup_s, REQUESTS_PER_POINT)
            cpu = time.process_time()
            stream = request_window(make_workload(wl, rate, weights, seed=args.seed), duration_s=d)
            per_req[wl, rate, "stream"] = (time.process_time() - cpu) / len(stream)
            for scheme in schemes:
                cpu = time.process_time()
                res = simulate(topo, make_policy(scheme, topo, seed=args.seed), stream,
                               settings=SimSettings(eviction=DEFAULT_EVICTION[wl], seed=args.seed), duration_s=d)
                per_req[wl, rate, scheme] = (time.process_time() - cpu) / res.completed
                print(f"  {wl:9s} {rate:6g} req/s {d:5.2f} s {scheme:18s} {res.completed:6d} req "
                      f"{1 / per_req[wl, rate, scheme]:6.0f} req/CPU-s", flush=True)
    total: dict[str, float] = dict.fromkeys([*schemes, "stream"], 0.0)
    for wl in workloads:
        for rate in FIG12_RATES:
            nearest = min(samples, key=lambda s: abs(math.log(rate / s)))
            n = rate * point_duration(rate, full_s, warmup_s, REQUESTS_PER_POINT)
            for name in total:
                total[name] += n * per_req[wl, nearest, name]
    print(f"Fig. 12 projection from samples at {args.sample_rates} req/s "
          f"(measured in {time.perf_counter() - started:.0f} s wall, load {os.getloadavg()[0]:.1f}):")
    for name, cpu_s in total.items():
        print(f"  {name:18s} {cpu_s:8.0f} CPU-s")
    grand = sum(total.values())
    print(f"  {'total':18s} {grand:8.0f} CPU-s = {grand / args.jobs / 60:.1f} min on {args.jobs} quiet cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
