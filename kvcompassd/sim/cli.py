"""``kvcompassd sim``: run schemes over a deployment and a workload at one or more rates.

Example::

    python -m kvcompassd.sim.cli --deployment census-64x8 --workload mixed \\
        --schemes kvcompass,dynamo,oracle --rates 1000,3000 --duration 20 --warmup 5 --out out/sim

Writes ``summary.csv``, ``summary.json``, ``summary.md`` and PNG plots into ``--out``
(``requests-<scheme>-<rate>.csv`` too with ``--per-request``).
"""

from __future__ import annotations

import argparse
import dataclasses
import csv
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvcompassd.core.config import load_config

from . import plots
from .engine import SimResult, SimSettings, simulate
from .metrics import load_factors, summarize
from .policy import Topology
from .schemes import ALL_SCHEMES, DEFAULT_EVICTION, WORKLOADS, make_policy, make_workload, region_weights

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"


def resolve_deployment(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.is_file():
        return p
    cand = CONFIG_DIR / f"{name_or_path}.toml"
    if cand.is_file():
        return cand
    raise SystemExit(f"no deployment {name_or_path!r}: not a file and not {cand}")


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvcompassd sim", description="Simulate KVCompass and the baselines.")
    ap.add_argument("--deployment", default="census-64x8", help="config name under config/ or a TOML path")
    ap.add_argument("--workload", default="mixed", choices=WORKLOADS)
    ap.add_argument("--schemes", default="kvcompass,central-directory,planetserve,consistent-hash,chord,skywalker,dynamo",
                    help=f"comma-separated, from {', '.join(ALL_SCHEMES)}")
    ap.add_argument("--rates", type=_floats, default=[1000.0], help="comma-separated req/s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration", type=float, default=None, help="virtual seconds of arrivals")
    ap.add_argument("--requests", type=int, default=None, help="max requests per run")
    ap.add_argument("--warmup", type=float, default=0.0, help="virtual seconds excluded from the metrics")
    ap.add_argument("--eviction", choices=("auto", "lru", "lfu"), default="auto")
    ap.add_argument("--regions-by", choices=("workers", "population"), default="workers")
    ap.add_argument("--update-delay-ms", type=float, default=0.0)
    ap.add_argument("--update-loss", type=float, default=0.0)
    ap.add_argument("--wan-jitter", type=float, default=0.0, help="fraction, e.g. 0.5 for +-50%%")
    ap.add_argument("--track-cross-region", action="store_true", help="measure the cross-region-only hit share")
    ap.add_argument("--traces", default=None, help="directory holding mooncake/ and azure_llm_2023/")
    ap.add_argument("--page-tokens", type=int, default=None,
                    help="engine page size of the simulated caches (default: the index block size)")
    ap.add_argument("--out", type=Path, default=Path("out/sim"))
    ap.add_argument("--per-request", action="store_true", help="also write per-request CSVs")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--progress", action="store_true", help="tqdm progress bars")
    return ap


def run_grid(cfg_path: Path, workload: str, schemes: Sequence[str], rates: Sequence[float], *, seed: int = 0,
             duration_s: float | None = None, max_requests: int | None = None, warmup_s: float = 0.0,
             settings: SimSettings | None = None, regions_by: str = "workers", traces: str | None = None,
             progress: bool = False, policy_options: dict[str, Any] | None = None,
             page_tokens: int | None = None) -> tuple[list[dict[str, Any]], dict[tuple[str, float], SimResult]]:
    """Every scheme at every rate on fresh workers and the same request stream (same seed)."""
    if duration_s is None and max_requests is None:
        raise SystemExit("give --duration or --requests")
    cfg = load_config(cfg_path)
    topo = Topology.from_config(cfg, page_tokens=page_tokens)
    weights = region_weights(topo, regions_by)
    base = settings or SimSettings(eviction=DEFAULT_EVICTION[workload], seed=seed)
    rows: list[dict[str, Any]] = []
    results: dict[tuple[str, float], SimResult] = {}
    outer = None
    if progress:
        from tqdm import tqdm

        outer = tqdm(total=len(schemes) * len(rates), unit="run", desc=f"{workload}@{cfg.name}")
    for rate in rates:
        for scheme in schemes:
            options = (policy_options or {}) if scheme.startswith("kvcompass") else {}
            policy = make_policy(scheme, topo, seed=seed, **options)
            s = dataclasses.replace(base, progress=progress)
            result = simulate(topo, policy, make_workload(workload, rate, weights, seed=seed, traces=traces),
                              settings=s, max_requests=max_requests, duration_s=duration_s)
            result.scheme = scheme
            summary = summarize(result, warmup_s=warmup_s).as_dict()
            summary.update(rate=rate, workload=workload, deployment=cfg.name, seed=seed, **result.extra)
            rows.append(summary)
            results[(scheme, rate)] = result
            if outer is not None:
                outer.update(1)
                outer.set_postfix(scheme=scheme, rate=rate, p99=f"{summary['ttft_p99_ms']:.0f}ms")
    if outer is not None:
        outer.close()
    return rows, results


def write_outputs(rows: list[dict[str, Any]], results: dict[tuple[str, float], SimResult], out: Path, *,
                  title: str, warmup_s: float = 0.0, per_request: bool = False, make_plots: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / "summary.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    (out / "summary.json").write_text(json.dumps(rows, indent=1, default=float))
    (out / "summary.md").write_text(markdown_table(rows, title))
    if per_request:
        for (scheme, rate), res in results.items():
            cols = list(res.records)
            with open(out / f"requests-{scheme}-{rate:g}.csv", "w", newline="") as fh:
                w = csv.writer(fh)
                w.writerow(cols)
                w.writerows(zip(*(res.records[c].tolist() for c in cols)))
    if not make_plots:
        return
    rates = sorted({r["rate"] for r in rows})
    if len(rates) > 1:
        plots.p99_vs_rate(rows, out / "p99_ttft_vs_rate.png", title=f"{title}: P99 TTFT")
    top = rates[len(rates) // 2]
    at = {s: res for (s, r), res in results.items() if r == top}
    mask = {s: res.records["arrival_s"] >= warmup_s for s, res in at.items()}
    plots.boxes({s: res.records["ttft_ms"][mask[s]] for s, res in at.items()}, out / "ttft_box.png",
                ylabel="TTFT (ms)", title=f"{title}: TTFT at {top:g} req/s")
    plots.boxes({s: res.records["e2e_ms"][mask[s]] for s, res in at.items()}, out / "e2e_box.png",
                ylabel="E2E Latency (ms)", title=f"{title}: E2E at {top:g} req/s")
    thr = {r["scheme"]: r["throughput_tok_s"] / 1e6 for r in rows if r["rate"] == top}
    plots.bars(thr, out / "throughput.png", ylabel="Throughput (Mtok/s)", title=f"{title}: throughput at {top:g} req/s")
    lf = {s: load_factors(res, warmup_s) for s, res in at.items()}
    peaks = {r["scheme"]: r["load_factor_peak"] for r in rows if r["rate"] == top}
    plots.heatmaps(lf, peaks, out / "load_factor.png", title=f"{title}: per-worker load factor at {top:g} req/s")


COLUMNS = (("scheme", "scheme", "{}"), ("rate", "req/s", "{:g}"), ("requests", "n", "{}"),
           ("ttft_p50_ms", "TTFT P50 ms", "{:.0f}"), ("ttft_p99_ms", "TTFT P99 ms", "{:.0f}"),
           ("e2e_p99_ms", "E2E P99 ms", "{:.0f}"), ("throughput_tok_s", "Ktok/s", "{:.1f}"),
           ("hit_rate", "hit %", "{:.1%}"), ("load_factor_peak", "LF peak", "{:.2f}"),
           ("false_lookup_rate", "false lookups", "{:.2%}"), ("cross_region_share", "x-region", "{:.1%}"),
           ("lookup_ms_mean", "lookup ms", "{:.1f}"), ("sim_requests_per_wall_s", "sim req/s", "{:.0f}"))


def markdown_table(rows: list[dict[str, Any]], title: str) -> str:
    lines = [f"# {title}", "", "| " + " | ".join(c[1] for c in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            v = r.get(key, "")
            if key == "throughput_tok_s":
                v = v / 1000.0
            cells.append(fmt.format(v) if v != "" else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    unknown = [s for s in schemes if s not in ALL_SCHEMES]
    if unknown:
        raise SystemExit(f"unknown scheme(s) {unknown}; known: {', '.join(ALL_SCHEMES)}")
    eviction = DEFAULT_EVICTION[args.workload] if args.eviction == "auto" else args.eviction
    settings = SimSettings(eviction=eviction, update_delay_ms=args.update_delay_ms, update_loss=args.update_loss,
                           wan_jitter=args.wan_jitter, seed=args.seed, track_truth=args.track_cross_region)
    cfg_path = resolve_deployment(args.deployment)
    rows, results = run_grid(cfg_path, args.workload, schemes, args.rates, seed=args.seed, duration_s=args.duration,
                             max_requests=args.requests, warmup_s=args.warmup, settings=settings,
                             regions_by=args.regions_by, traces=args.traces, progress=args.progress,
                             page_tokens=args.page_tokens)
    title = f"{args.workload} on {cfg_path.stem}"
    write_outputs(rows, results, args.out, title=title, warmup_s=args.warmup, per_request=args.per_request,
                  make_plots=not args.no_plots)
    sys.stdout.write(markdown_table(rows, title))
    print(f"wrote {args.out}/summary.csv, summary.json, summary.md" + ("" if args.no_plots else " and PNG plots"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
