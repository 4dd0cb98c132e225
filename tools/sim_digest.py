"""Fingerprints of simulation results, to check that a speed change leaves every decision alone.

    python tools/sim_digest.py --out before.json [--points mixed:3000:2,wildchat:200:5] [--schemes ...]
    python tools/sim_digest.py --compare before.json [--out after.json]

For each (workload, rate, duration) point and scheme, runs the census-64x8 simulation (or
``--deployment``) and hashes every per-request record column, the load bins and the event
counters (SHA-256 of the raw bytes). ``--compare`` reruns the points and schemes of a saved file
and lists the runs whose digest differs; the exit status is 1 if any does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import numpy as np

from kvcompassd.core.config import load_config
from kvcompassd.sim.cli import resolve_deployment
from kvcompassd.sim.engine import SimResult, SimSettings, request_window, simulate
from kvcompassd.sim.policy import Topology
from kvcompassd.sim.schemes import DEFAULT_EVICTION, PAPER_SCHEMES, make_policy, make_workload, region_weights


def digest(res: SimResult) -> str:
    h = hashlib.sha256()
    for name in sorted(res.records):
        h.update(name.encode())
        h.update(np.ascontiguousarray(res.records[name]).tobytes())
    h.update(np.ascontiguousarray(res.load_bins).tobytes())
    h.update(f"{res.events_delivered}/{res.events_lost}/{sorted(res.extra.items())}".encode())
    return h.hexdigest()


def run(deployment: str, points: list[str], schemes: list[str], seed: int) -> dict[str, dict]:
    topo = Topology.from_config(load_config(resolve_deployment(deployment)))
    weights = region_weights(topo)
    out: dict[str, dict] = {}
    for point in points:
        workload, rate, duration = point.split(":")
        stream = request_window(make_workload(workload, float(rate), weights, seed=seed), duration_s=float(duration))
        for scheme in schemes:
            cpu = time.process_time()
            res = simulate(topo, make_policy(scheme, topo, seed=seed), stream,
                           settings=SimSettings(eviction=DEFAULT_EVICTION[workload], seed=seed),
                           duration_s=float(duration))
            cpu = time.process_time() - cpu
            out[f"{point}/{scheme}"] = {"digest": digest(res), "requests": res.completed, "cpu_s": round(cpu, 2)}
            print(f"{point:20s} {scheme:20s} {res.completed:7d} req {cpu:7.1f} CPU-s {out[f'{point}/{scheme}']['digest'][:16]}",
                  flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deployment", default="census-64x8")
    ap.add_argument("--points", default="mixed:3000:2,wildchat:200:5", help="workload:rate:duration_s, comma-separated")
    ap.add_argument("--schemes", default=",".join(("load-balance-oracle", *PAPER_SCHEMES)))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the digests as JSON")
    ap.add_argument("--compare", default=None, help="rerun a saved file's points and schemes and compare")
    args = ap.parse_args(argv)
    if args.compare:
        saved = json.loads(open(args.compare).read())
        deployment, seed = saved["deployment"], saved["seed"]
        points, schemes = saved["points"], saved["schemes"]
    else:
        deployment, seed = args.deployment, args.seed
        points = [p for p in args.points.split(",") if p]
        schemes = [s for s in args.schemes.split(",") if s]
    runs = run(deployment, points, schemes, seed)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"deployment": deployment, "seed": seed, "points": points, "schemes": schemes, "runs": runs},
                      fh, indent=1)
    if not args.compare:
        return 0
    differ = [k for k, v in runs.items() if v["digest"] != saved["runs"][k]["digest"]]
    for k in differ:
        print(f"DIFFERS: {k}")
    print("all identical" if not differ else f"{len(differ)} of {len(runs)} runs differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
