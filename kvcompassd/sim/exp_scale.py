"""The ``scale`` experiment: the 1,024-worker, 64-region census fleet (one shard per region) for
KVCompass, Dynamo and the central directory at 0.75 and 1.13 lambda0 on Mixed, with what each
run costs the machine simulating it.

    python -m kvcompassd.sim.experiments scale [--quick] [--jobs 1] [--schemes ...] [--rates ...]
    python -m kvcompassd.sim.exp_scale [--seeds 0-2] [--duration 3] [--jobs 2] [--schemes ...] [--rates ...]
    python -m kvcompassd.sim.exp_scale --pool-from DIR/points.jsonl [DIR2/points.jsonl ...]

The second form runs every (scheme, rate) at each seed and prints the figures pooled over the
seeds (``pool_scale``: the P99 and mean of every seed's measured TTFTs together, as
``exp_long.pool``; false lookups over all measured requests; the highest peak RSS; CPU over all
simulated requests); ``--pool-from`` pools the runs logged by earlier invocations (e.g. schemes
run at different times) without running anything.

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
import json
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
from .exp_long import _pool_inputs, _seeds, pool
from .policy import Topology
from .schemes import DEFAULT_EVICTION, prompt_lengths, region_weights

__all__ = ["SCALE_DEPLOYMENT", "SCALE_FRACTIONS", "SCALE_SCHEMES", "lambda0", "measured_point", "pool_scale",
           "run_scale", "scale"]

SCALE_DEPLOYMENT = "census-1024x64"
SCALE_SCHEMES = ("kvcompass", "dynamo", "central-directory")
SCALE_FRACTIONS = (0.75, 1.13)  # of lambda0
SCALE_WORKLOAD = "mixed"
COLUMNS = (("scheme", "scheme", "{}"), ("seed", "seed", "{}"), ("rate", "req/s", "{:.0f}"),
           ("lambda0_fraction", "x lambda0", "{:.2f}"),
           ("requests", "measured", "{}"), ("ttft_p99_ms", "TTFT P99 ms", "{:.0f}"),
           ("ttft_mean_ms", "TTFT mean ms", "{:.1f}"), ("false_lookup_rate", "false lookups", "{:.2%}"),
           ("peak_rss_gib", "peak RSS GiB", "{:.2f}"), ("cpu_ms_per_request", "CPU ms/req", "{:.2f}"),
           ("simulated_requests", "simulated", "{}"), ("setup_cpu_s", "setup CPU s", "{:.1f}"))
POOLED_COLUMNS = (("scheme", "scheme", "{}"), ("rate", "req/s", "{:.0f}"), ("load", "x lambda0", "{:.2f}"),
                  ("seeds", "seeds", "{}"), ("requests", "measured", "{}"), ("ttft_p99_ms", "TTFT P99 ms", "{:.0f}"),
                  ("ttft_mean_ms", "TTFT mean ms", "{:.1f}"), ("false_lookup_rate", "false lookups", "{:.3%}"),
                  ("peak_rss_gib", "peak RSS GiB", "{:.2f}"), ("cpu_ms_per_request", "CPU ms/req", "{:.2f}"),
                  ("seed_p99_ms", "P99 per seed ms", "{}"))


def lambda0(topo: Topology, workload: str = SCALE_WORKLOAD, *, seed: int = 0, sample: int = 20_000) -> float:
    """The fleet's no-reuse capacity in req/s: workers / mean prefill time of a request."""
    lengths = itertools.islice(prompt_lengths(workload, 1000.0, region_weights(topo), seed=seed), sample)
    beta = float(np.mean(topo.prefill_ms_per_token))
    service_s = float(np.mean([n * beta for n in lengths])) / 1000.0
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
                   peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30,
                   **_pool_inputs(result, point.warmup_s))  # "_" keys: what pooling over seeds reads
    return summary


def run_isolated(points: list[GridPoint], *, jobs: int = 1, log: Path | None = None,
                 label=None) -> list[dict[str, Any]]:
    """Every point in a process of its own (spawned, one task each: RSS and CPU are the point's);
    ``label(row)`` completes each row before it is logged."""
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
            if label is not None:
                label(out[i])
            if log is not None:
                with open(log, "a") as fh:
                    fh.write(json.dumps(out[i], default=float) + "\n")
    return out  # type: ignore[return-value]


def scale_table(rows: list[dict[str, Any]], columns=COLUMNS) -> str:
    head = "| " + " | ".join(label for _, label, _ in columns) + " |"
    lines = [head, "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(fmt.format(r[key]) for key, _, fmt in columns) + " |")
    return "\n".join(lines)


def pool_scale(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (scheme, load) over its seeds: ``exp_long.pool``'s TTFTs (P99 and mean of every
    measured request of every seed together), false lookups over all measured requests, the
    highest peak RSS of any run, and CPU over all simulated requests."""
    pooled = pool(rows)
    for p in pooled:
        mine = [r for r in rows if (r["workload"], r["load"], r["scheme"]) == (p["workload"], p["load"], p["scheme"])]
        measured = sum(int(r["requests"]) for r in mine)
        p.update(false_lookup_rate=sum(r["false_lookup_rate"] * int(r["requests"]) for r in mine) / max(1, measured),
                 peak_rss_gib=max(r["peak_rss_gib"] for r in mine),
                 cpu_ms_per_request=1000.0 * sum(r["cpu_s"] for r in mine)
                 / max(1, sum(int(r["simulated_requests"]) for r in mine)),
                 seed_p99_ms=" / ".join(f"{v:.0f}" for v in p["seed_p99_ms"]),
                 seeds=",".join(map(str, p["seeds"])))
    return sorted(pooled, key=lambda p: (p["load"], p["scheme"]))


def run_scale(cfg_path: Path, schemes, *, seeds, rates=None, duration_s: float = 3.0, warmup_s: float | None = None,
              jobs: int = 1, out: Path, policy_options: dict | None = None,
              page_tokens: int | None = None) -> tuple[list[dict[str, Any]], float, str]:
    """Every scheme at every rate (default: SCALE_FRACTIONS of the first seed's lambda0) at every
    seed, each run alone in a fresh process; returns the runs' rows, lambda0 and the title."""
    topo = Topology.from_config(load_config(cfg_path))
    lam0 = lambda0(topo, seed=seeds[0])
    rates = list(rates) if rates else [round(f * lam0) for f in SCALE_FRACTIONS]
    warmup_s = duration_s / 4.0 if warmup_s is None else warmup_s
    points = [p for seed in seeds
              for p in grid_points(cfg_path, SCALE_WORKLOAD, schemes, rates, seed=seed, duration_s=duration_s,
                                   warmup_s=warmup_s,
                                   settings=SimSettings(eviction=DEFAULT_EVICTION[SCALE_WORKLOAD], seed=seed),
                                   policy_options=policy_options, page_tokens=page_tokens)]
    rows = run_isolated(points, jobs=jobs, log=out / "points.jsonl",
                        label=lambda r: _label(r, lam0, duration_s, warmup_s))
    title = (f"scale: {SCALE_WORKLOAD} on {topo.n_workers} workers x {len(topo.regions)} regions "
             f"({cfg_path.stem}), lambda0 = {lam0:.0f} req/s, {duration_s:g} s of arrivals, first {warmup_s:g} s "
             f"not measured, seeds {','.join(map(str, seeds))}")
    return rows, lam0, title


def _label(r: dict[str, Any], lam0: float, duration_s: float, warmup_s: float) -> None:
    r["lambda0"] = lam0
    r["lambda0_fraction"] = r["load"] = r["rate"] / lam0
    r["window"] = f"{warmup_s:g}-{duration_s:g}"


def _write(rows: list[dict[str, Any]], out: Path, title: str) -> str:
    """summary.* (every run), scale.md (the runs' table, then the pooled one) and pooled.json."""
    from .experiments import _save

    public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    _save(public, out, title)
    pooled = pool_scale(rows)
    (out / "pooled.json").write_text(json.dumps(pooled, indent=1, default=float))
    text = (f"# {title}\n\n## Every run\n\n{scale_table(rows)}\n\n## Pooled over seeds\n\n"
            f"{scale_table(pooled, POOLED_COLUMNS)}\n")
    (out / "scale.md").write_text(text)
    return text


def scale(args) -> list[dict[str, Any]]:
    from .experiments import KVCOMPASS_OPTIONS, PAGE_TOKENS, _sizes

    deployment = getattr(args, "deployment", None) or SCALE_DEPLOYMENT
    cfg_path = resolve_deployment(deployment)
    duration, warmup = _sizes(args.quick, 3.0, 0.5)
    out = args.out / "scale"
    started = time.perf_counter()
    rows, _, title = run_scale(cfg_path, args.schemes or SCALE_SCHEMES, seeds=[args.seed], rates=args.rates,
                               duration_s=duration, warmup_s=warmup, jobs=args.jobs, out=out,
                               policy_options=KVCOMPASS_OPTIONS, page_tokens=PAGE_TOKENS[0])
    print(_write(rows, out, title))
    print(f"({len(rows)} points in {time.perf_counter() - started:.0f} s wall, {args.jobs} at a time)")
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]


def main(argv: list[str] | None = None) -> int:
    """The scale experiment over seeds, or the pooled table of earlier runs' logs."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvcompassd.sim.exp_scale", description=__doc__.splitlines()[0])
    ap.add_argument("--deployment", default=SCALE_DEPLOYMENT)
    ap.add_argument("--schemes", type=lambda t: [x for x in t.split(",") if x], default=list(SCALE_SCHEMES))
    ap.add_argument("--rates", type=lambda t: [float(x) for x in t.split(",") if x], default=None,
                    help="req/s (default: 0.75 and 1.13 x lambda0 of the first seed)")
    ap.add_argument("--seeds", type=_seeds, default=_seeds("0-2"))
    ap.add_argument("--duration", type=float, default=3.0, help="virtual seconds of arrivals per run")
    ap.add_argument("--warmup", type=float, default=None, help="seconds not measured (default: a quarter)")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel processes (results unchanged)")
    ap.add_argument("--out", type=Path, default=Path("out/scale"))
    ap.add_argument("--pool-from", type=Path, nargs="+", default=None, metavar="POINTS_JSONL",
                    help="pool these earlier runs' points.jsonl logs instead of running")
    args = ap.parse_args(argv)
    if args.pool_from:
        rows = [json.loads(line) for path in args.pool_from for line in path.read_text().splitlines() if line]
        title = f"scale: pooled from {', '.join(map(str, args.pool_from))}"
    else:
        if args.duration <= 0 or (args.warmup is not None and not 0 <= args.warmup < args.duration):
            ap.error("--duration must be > 0 and --warmup in [0, duration)")
        rows, _, title = run_scale(resolve_deployment(args.deployment), args.schemes, seeds=args.seeds,
                                   rates=args.rates, duration_s=args.duration, warmup_s=args.warmup,
                                   jobs=args.jobs, out=args.out)
    print(_write(rows, args.out, title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
