"""The ``scale`` experiment: the 1,024-worker, 64-region census fleet (one shard per region) for
KVCompass, Dynamo and the central directory at 0.75 and 1.13 lambda0 on Mixed, with what each
run costs the machine simulating it.

    python -m kvcompassd.sim.experiments scale [--quick] [--jobs 1] [--schemes ...] [--rates ...]

lambda0 is the fleet's no-reuse capacity, workers / (mean prompt x beta) over 20,000 sampled
requests (as ``fig9``): ~10,700 req/s here, so the points are ~8,000 and ~12,100 req/s (``--rates``
gives absolute rates instead). Each (scheme, rate) runs alone in a fresh process, so its peak RSS
is its own: printed per point are P99 and mean TTFT, the false-lookup rate (requests whose worker
reused less than the policy claimed), peak RSS, the simulation's CPU per simulated request (the
run only; the policy's and workers' construction is ``setup CPU s``) and simulated requests.
``--deployment`` runs another fleet (tests use a small one).
"""

from __future__ import annotations

import itertools
import multiprocessing
import resource
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np

from kvcompassd.core.config import load_config

from .cli import GridPoint, _run_point, grid_points, resolve_deployment
from .engine import SimSettings
from .policy import Topology
from .schemes import DEFAULT_EVICTION, make_workload, region_weights

__all__ = ["SCALE_DEPLOYMENT", "SCALE_FRACTIONS", "SCALE_SCHEMES", "lambda0", "measured_point", "scale"]

SCALE_DEPLOYMENT = "census-1024x64"
SCALE_SCHEMES = ("kvcompass", "dynamo", "central-directory")
SCALE_FRACTIONS = (0.75, 1.13)  # of lambda0
SCALE_WORKLOAD = "mixed"
COLUMNS = (("scheme", "scheme", "{}"), ("rate", "req/s", "{:.0f}"), ("lambda0_fraction", "x lambda0", "{:.2f}"),
           ("requests", "measured", "{}"), ("ttft_p99_ms", "TTFT P99 ms", "{:.0f}"),
           ("ttft_mean_ms", "TTFT mean ms", "{:.1f}"), ("false_lookup_rate", "false lookups", "{:.2%}"),
           ("peak_rss_gib", "peak RSS GiB", "{:.2f}"), ("cpu_ms_per_request", "CPU ms/req", "{:.2f}"),
           ("simulated_requests", "simulated", "{}"), ("setup_cpu_s", "setup CPU s", "{:.1f}"))


def lambda0(topo: Topology, workload: str = SCALE_WORKLOAD, *, seed: int = 0, sample: int = 20_000) -> float:
    """The fleet's no-reuse capacity in req/s: workers / mean prefill time of a request."""
    requests = itertools.islice(make_workload(workload, 1000.0, region_weights(topo), seed=seed), sample)
    beta = float(np.mean(topo.prefill_ms_per_token))
    service_s = float(np.mean([r.prompt_tokens * beta for r in requests])) / 1000.0
    return topo.n_workers / service_s


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measured_point(point: GridPoint) -> dict[str, Any]:
    """One point in this (fresh) process: its summary plus CPU and the process's peak RSS."""
    started = _cpu_s()
    summary, result = _run_point(point)
    total = _cpu_s() - started
    run_cpu = summary["cpu_s"]
    summary.update(simulated_requests=result.completed, cpu_ms_per_request=1000.0 * run_cpu / max(1, result.completed),
                   setup_cpu_s=total - run_cpu,
                   peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30)
    return summary


def run_isolated(points: list[GridPoint], *, jobs: int = 1, log: Path | None = None) -> list[dict[str, Any]]:
    """Every point in a process of its own (spawned, one task each: RSS and CPU are the point's)."""
    out: list[dict[str, Any] | None] = [None] * len(points)
    ctx = multiprocessing.get_context("spawn")
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
    with ProcessPoolExecutor(max_workers=max(1, min(jobs, len(points))), mp_context=ctx,
                             max_tasks_per_child=1) as pool:
        futures = {pool.submit(measured_point, p): i for i, p in enumerate(points)}
        for fut in as_completed(futures):
            i = futures[fut]
            out[i] = fut.result()
            if log is not None:
                import json

                with open(log, "a") as fh:
                    fh.write(json.dumps(out[i], default=float) + "\n")
    return out  # type: ignore[return-value]


def scale_table(rows: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(label for _, label, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(fmt.format(r[key]) for key, _, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def scale(args) -> list[dict[str, Any]]:
    from .experiments import KVCOMPASS_OPTIONS, PAGE_TOKENS, _save, _sizes

    deployment = getattr(args, "deployment", None) or SCALE_DEPLOYMENT
    cfg_path = resolve_deployment(deployment)
    topo = Topology.from_config(load_config(cfg_path))
    lam0 = lambda0(topo, seed=args.seed)
    rates = list(args.rates) if args.rates else [round(f * lam0) for f in SCALE_FRACTIONS]
    duration, warmup = _sizes(args.quick, 3.0, 0.5)
    points = grid_points(cfg_path, SCALE_WORKLOAD, args.schemes or SCALE_SCHEMES, rates, seed=args.seed,
                         duration_s=duration, warmup_s=warmup,
                         settings=SimSettings(eviction=DEFAULT_EVICTION[SCALE_WORKLOAD], seed=args.seed),
                         policy_options=KVCOMPASS_OPTIONS, page_tokens=PAGE_TOKENS[0])
    out = args.out / "scale"
    started = time.perf_counter()
    rows = run_isolated(points, jobs=args.jobs, log=out / "points.jsonl")
    for r in rows:
        r["lambda0"] = lam0
        r["lambda0_fraction"] = r["rate"] / lam0
    title = (f"scale: {SCALE_WORKLOAD} on {topo.n_workers} workers x {len(topo.regions)} regions "
             f"({deployment}), lambda0 = {lam0:.0f} req/s, {duration:g} s of arrivals, first {warmup:g} s not measured")
    _save(rows, out, title)
    table = scale_table(rows)
    (out / "scale.md").write_text(f"# {title}\n\n{table}\n")
    print(title)
    print(table)
    print(f"({len(points)} points in {time.perf_counter() - started:.0f} s wall, {args.jobs} at a time)")
    return rows
