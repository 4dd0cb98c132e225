"""``kvcompassd sim``: run schemes over a deployment and a workload at one or more rates.

Example::

    python -m kvcompassd.sim.cli --deployment census-64x8 --workload mixed \\
        --schemes kvcompass,dynamo,load-balance-oracle --rates 1000,3000 --duration 20 --warmup 5 --out out/sim

Your own Mooncake-format trace (JSON lines: ``timestamp`` ms, ``input_length``,
``output_length``, ``hash_ids``; ``--trace-block-tokens`` tokens per id, 512 as Mooncake's)::

    python -m kvcompassd.sim.cli --trace my_trace.jsonl --deployment testbed-3continent \\
        --schemes kvcompass,dynamo --rates 50 --requests 2000

Writes ``summary.csv``, ``summary.json``, ``summary.md`` and PNG plots into ``--out``
(``requests-<scheme>-<rate>.csv`` too with ``--per-request``), and ``points.jsonl`` as each run
ends, so a long grid cut short keeps what it measured (``tools/sim_seeds.py --rows`` reads it).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from kvcompassd.core.config import load_config

from . import plots
from .engine import SimResult, SimSettings, request_window, simulate, sparse_collections
from .metrics import load_factors, reuse_by_length_table, summarize
from .policy import Topology
from .schemes import (ALL_SCHEMES, DEFAULT_EVICTION, WORKLOADS, make_policy, make_workload, region_weights,
                      traces_dir)
from .synthetic import servable_prompt_tokens
from .workloads import MOONCAKE_BLOCK_TOKENS, Request, WorkloadError, read_mooncake

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"


def resolve_deployment(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.is_file():
        return p
    cand = CONFIG_DIR / f"{name_or_path}.toml"
    if cand.is_file():
        return cand
    raise SystemExit(f"no deployment {name_or_path!r}: not a file and not {cand}")


def check_workload_sources(workload: str, *, traces: str | None = None, trace: str | None = None,
                           trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> None:
    """Read and check the files a workload replays before any simulation starts, so a missing
    file or a malformed line stops the command with the file and line named (``WorkloadError``),
    never a silent fall-back to the bundled traces."""
    if trace is not None:
        if workload != "mooncake":
            raise WorkloadError(f"--trace replays a Mooncake-format file as workload 'mooncake', not {workload!r}")
        read_mooncake(trace, block_tokens=trace_block_tokens)
    elif traces is not None or workload in ("mooncake", "azure-conv", "azure-code"):
        traces_dir(traces)


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvcompassd sim", description="Simulate KVCompass and the baselines.")
    ap.add_argument("--deployment", default="census-64x8", help="config name under config/ or a TOML path")
    ap.add_argument("--workload", default=None, choices=WORKLOADS,
                    help="default: mixed, or mooncake with --trace")
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
    ap.add_argument("--traces", default=None,
                    help="directory holding mooncake/synthetic_trace.jsonl and azure_llm_2023/AzureLLMInferenceTrace_"
                         "{conv,code}.csv (default: the traces the package ships)")
    ap.add_argument("--trace", default=None, metavar="FILE",
                    help="replay this Mooncake-format JSONL file (timestamp ms, input_length, output_length, "
                         "hash_ids) as the workload; --rates rescales its inter-arrival gaps")
    ap.add_argument("--trace-block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS,
                    help=f"tokens per hash id of --trace (default {MOONCAKE_BLOCK_TOKENS}, as Mooncake's traces)")
    ap.add_argument("--page-tokens", type=int, default=None,
                    help="engine page size of the simulated caches (default: the index block size)")
    ap.add_argument("--out", type=Path, default=Path("out/sim"))
    ap.add_argument("--per-request", action="store_true", help="also write per-request CSVs")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--progress", action="store_true", help="tqdm progress bars")
    ap.add_argument("--jobs", type=int, default=1, help="simulations run in parallel processes (results unchanged)")
    return ap


@dataclass(frozen=True, slots=True)
class GridPoint:
    """One simulation of a grid: everything a worker process needs, picklable."""

    cfg_path: Path
    workload: str
    scheme: str
    rate: float
    seed: int
    duration_s: float | None
    max_requests: int | None
    warmup_s: float
    settings: SimSettings
    regions_by: str
    traces: str | None
    policy_options: dict[str, Any]
    page_tokens: int | None
    trace: str | None = None  # a Mooncake-format file replayed as workload "mooncake"
    trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS


# One request stream per process, reused while consecutive points share (workload, rate, ...):
# the schemes of one grid point replay the same stream, so it is generated once, not per scheme.
_STREAM_CACHE: dict[tuple, list[Request]] = {}


def _stream(point: GridPoint, topo: Topology) -> list[Request]:
    """The requests ``simulate`` would pull from the generator: arrival-ordered, those before
    ``duration_s`` and at most ``max_requests`` of them (so a replay equals a fresh run)."""
    key = (point.cfg_path, point.workload, point.rate, point.seed, point.duration_s, point.max_requests,
           point.regions_by, point.traces, point.page_tokens, point.trace, point.trace_block_tokens)
    cached = _STREAM_CACHE.get(key)
    if cached is not None:
        return cached
    _STREAM_CACHE.clear()
    gen = make_workload(point.workload, point.rate, region_weights(topo, point.regions_by), seed=point.seed,
                        traces=point.traces, trace=point.trace, trace_block_tokens=point.trace_block_tokens,
                        max_prompt_tokens=servable_prompt_tokens(topo.config))
    stream = request_window(gen, duration_s=point.duration_s, max_requests=point.max_requests)
    _STREAM_CACHE[key] = stream
    return stream


def _run_point(point: GridPoint) -> tuple[dict[str, Any], SimResult]:
    cfg = load_config(point.cfg_path)
    topo = Topology.from_config(cfg, page_tokens=point.page_tokens)
    options = point.policy_options if point.scheme.startswith("kvcompass") else {}
    policy = make_policy(point.scheme, topo, seed=point.seed, **options)
    with sparse_collections():  # a stream, like a run (simulate), is many objects that live long
        stream = _stream(point, topo)
    cpu = time.process_time()
    result = simulate(topo, policy, stream, settings=point.settings,
                      max_requests=point.max_requests, duration_s=point.duration_s)
    cpu = time.process_time() - cpu  # the simulation's own CPU: wall time on a shared machine is the neighbours'
    result.scheme = point.scheme
    summary = summarize(result, warmup_s=point.warmup_s).as_dict()
    summary.update(rate=point.rate, workload=point.workload, deployment=cfg.name, seed=point.seed,
                   duration_s=point.duration_s, warmup_s=point.warmup_s,
                   **measured_window(stream, duration_s=point.duration_s, warmup_s=point.warmup_s),
                   cpu_s=cpu, sim_requests_per_cpu_s=result.completed / max(cpu, 1e-9), **result.extra)
    return summary, result


def measured_window(stream: Sequence[Request], *, duration_s: float | None, warmup_s: float) -> dict[str, Any]:
    """The window a run measured, recorded beside its figures: ``arrivals_s`` virtual seconds of
    arrivals (``duration_s``, or up to the last arrival of a run cut by ``--requests``), of which
    the first ``warmup_s`` are excluded and the remaining ``measured_s`` measured;
    ``arrivals`` requests in all (``requests``, the measured ones, is the summary's)."""
    last = stream[-1].arrival_s if stream else 0.0
    arrivals_s = duration_s if duration_s is not None else last
    return {"arrivals": len(stream), "arrivals_s": float(arrivals_s),
            "measured_s": max(float(arrivals_s) - warmup_s, 0.0)}


def window_text(rows: Sequence[dict[str, Any]]) -> str:
    """One line naming the windows and seeds ``rows`` were measured over, e.g. "seed 0; warm-up
    5 s + measured 2.5-15 s; 7,500-75,000 measured requests" (a range where points differ)."""
    def value(r: dict[str, Any], key: str) -> Any:
        if key == "measured_s" and r.get(key) is None and r.get("duration_s") is not None:
            return r["duration_s"] - (r.get("warmup_s") or 0.0)  # a row written before measured_s was
        return r.get(key)

    def span(key: str, fmt: str) -> str:
        values = sorted({value(r, key) for r in rows if value(r, key) is not None})
        if not values:
            return "?"
        lo, hi = fmt.format(values[0]), fmt.format(values[-1])
        return lo if lo == hi else f"{lo}-{hi}"

    seeds = sorted({r["seed"] for r in rows if r.get("seed") is not None})
    seed = "seed ?" if not seeds else (f"seed {seeds[0]}" if len(seeds) == 1 else
                                        "seeds " + ",".join(str(s) for s in seeds))
    return (f"{seed}; warm-up {span('warmup_s', '{:g}')} s + measured {span('measured_s', '{:g}')} s; "
            f"{span('requests', '{:,}')} measured requests")


def run_points(points: Sequence[GridPoint], *, jobs: int = 1, progress: bool = False, desc: str = "sim",
               log: Path | None = None) -> list[tuple[dict[str, Any], SimResult]]:
    """Run independent simulations, in ``jobs`` processes when > 1. Every point builds its
    own workers, policy (seeded from the point) and request stream, so the results do not
    depend on ``jobs`` nor on which process ran what; they come back in ``points`` order.
    ``log``: each summary is appended there (JSON lines) as its point finishes, so a sweep cut
    short keeps what it measured."""
    outer = None
    if progress:
        from tqdm import tqdm

        outer = tqdm(total=len(points), unit="run", desc=desc)

    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")

    def done(point: GridPoint, summary: dict[str, Any]) -> None:
        if log is not None:
            with open(log, "a") as fh:
                fh.write(json.dumps(summary, default=float) + "\n")
        if outer is not None:
            outer.update(1)
            outer.set_postfix(scheme=point.scheme, rate=point.rate, p99=f"{summary['ttft_p99_ms']:.0f}ms")

    out: list[tuple[dict[str, Any], SimResult] | None] = [None] * len(points)
    if jobs <= 1 or len(points) <= 1:
        for i, point in enumerate(points):
            out[i] = _run_point(point)
            done(point, out[i][0])
    else:
        # Costliest first (longest-processing-time order balances the processes); among equal
        # costs the given order, so points of one (workload, rate) stay adjacent and a process
        # mostly reuses its cached stream.
        def cost(i: int) -> float:
            p = points[i]
            n = p.rate * p.duration_s if p.duration_s is not None else float("inf")
            return min(n, p.max_requests if p.max_requests is not None else float("inf"))

        order = sorted(range(len(points)), key=lambda i: (-cost(i), i))
        ctx = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
        with ProcessPoolExecutor(max_workers=min(jobs, len(points)), mp_context=ctx) as pool:
            futures = {pool.submit(_run_point, points[i]): i for i in order}
            for fut in as_completed(futures):
                i = futures[fut]
                out[i] = fut.result()
                done(points[i], out[i][0])
    if outer is not None:
        outer.close()
    return out  # type: ignore[return-value]


def grid_points(cfg_path: Path, workload: str, schemes: Sequence[str], rates: Sequence[float], *, seed: int = 0,
                duration_s: float | None = None, max_requests: int | None = None, warmup_s: float = 0.0,
                settings: SimSettings | None = None, regions_by: str = "workers", traces: str | None = None,
                policy_options: dict[str, Any] | None = None, page_tokens: int | None = None,
                run_progress: bool = False, trace: str | None = None,
                trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[GridPoint]:
    """Every scheme at every rate (rate-major), all replaying one request stream per rate.
    ``run_progress`` shows a bar inside each run (serial runs only)."""
    if duration_s is None and max_requests is None:
        raise SystemExit("give --duration or --requests")
    base = dataclasses.replace(settings or SimSettings(eviction=DEFAULT_EVICTION[workload], seed=seed),
                               progress=run_progress)
    return [GridPoint(Path(cfg_path), workload, scheme, float(rate), seed, duration_s, max_requests, warmup_s, base,
                   regions_by, traces, dict(policy_options or {}), page_tokens,
                   None if trace is None else str(trace), trace_block_tokens)
            for rate in rates for scheme in schemes]


def run_grid(cfg_path: Path, workload: str, schemes: Sequence[str], rates: Sequence[float], *, seed: int = 0,
             duration_s: float | None = None, max_requests: int | None = None, warmup_s: float = 0.0,
             settings: SimSettings | None = None, regions_by: str = "workers", traces: str | None = None,
             progress: bool = False, policy_options: dict[str, Any] | None = None,
             page_tokens: int | None = None, trace: str | None = None,
             trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS, jobs: int = 1,
             log: Path | None = None) -> tuple[list[dict[str, Any]], dict[tuple[str, float], SimResult]]:
    """Every scheme at every rate on fresh workers and the same request stream (same seed);
    ``log``: each summary appended as its run ends (``run_points``)."""
    points = grid_points(cfg_path, workload, schemes, rates, seed=seed, duration_s=duration_s,
                         max_requests=max_requests, warmup_s=warmup_s, settings=settings, regions_by=regions_by,
                         traces=traces, policy_options=policy_options, page_tokens=page_tokens,
                         run_progress=progress and jobs <= 1, trace=trace, trace_block_tokens=trace_block_tokens)
    done = run_points(points, jobs=jobs, progress=progress, desc=f"{workload}@{Path(cfg_path).stem}", log=log)
    rows = [summary for summary, _ in done]
    results = {(p.scheme, p.rate): result for p, (_, result) in zip(points, done)}
    return rows, results


def write_outputs(rows: list[dict[str, Any]], results: dict[tuple[str, float], SimResult], out: Path, *,
                  title: str, warmup_s: float = 0.0, per_request: bool = False,
                  make_plots: bool = True) -> None:
    """``warmup_s``: excluded seconds at the start of every point."""
    out.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / "summary.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    (out / "summary.json").write_text(json.dumps(rows, indent=1, default=float))
    (out / "summary.md").write_text(markdown_table(rows, title))
    (out / "reuse_by_length.md").write_text(reuse_by_length_table(rows, f"{title}: reuse by prompt length"))
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
        plots.p99_vs_rate(rows, out / "p99_ttft_vs_rate.png", title=f"{title}: P99 TTFT", window=window_text(rows))
    top = rates[len(rates) // 2]
    window = window_text([r for r in rows if r["rate"] == top])
    at = {s: res for (s, r), res in results.items() if r == top}
    mask = {s: res.records["arrival_s"] >= warmup_s for s, res in at.items()}
    plots.boxes({s: res.records["ttft_ms"][mask[s]] for s, res in at.items()}, out / "ttft_box.png",
                ylabel="TTFT (ms)", title=f"{title}: TTFT at {top:g} req/s", window=window)
    plots.boxes({s: res.records["e2e_ms"][mask[s]] for s, res in at.items()}, out / "e2e_box.png",
                ylabel="E2E Latency (ms)", title=f"{title}: E2E at {top:g} req/s", window=window)
    thr = {r["scheme"]: r["throughput_tok_s"] / 1e6 for r in rows if r["rate"] == top}
    plots.bars(thr, out / "throughput.png", ylabel="Throughput (Mtok/s)", title=f"{title}: throughput at {top:g} req/s",
               window=window)
    lf = {s: load_factors(res, warmup_s) for s, res in at.items()}
    peaks = {r["scheme"]: r["load_factor_peak"] for r in rows if r["rate"] == top}
    plots.heatmaps(lf, peaks, out / "load_factor.png", title=f"{title}: per-worker load factor at {top:g} req/s",
                   window=window)


# The window of each row (seed, warm-up, measured seconds, measured requests) sits beside its figures.
WINDOW_COLUMNS = (("seed", "seed", "{}"), ("warmup_s", "warm-up s", "{:g}"), ("measured_s", "measured s", "{:g}"),
                  ("requests", "n", "{}"))
COLUMNS = (("scheme", "scheme", "{}"), ("rate", "req/s", "{:g}"), *WINDOW_COLUMNS,
           ("ttft_p50_ms", "TTFT P50 ms", "{:.0f}"), ("ttft_p99_ms", "TTFT P99 ms", "{:.0f}"),
           ("e2e_p99_ms", "E2E P99 ms", "{:.0f}"), ("throughput_tok_s", "Ktok/s", "{:.1f}"),
           ("hit_rate", "hit %", "{:.1%}"), ("load_factor_peak", "LF peak", "{:.2f}"),
           ("false_lookup_rate", "false lookups", "{:.2%}"), ("cross_region_share", "x-region", "{:.1%}"),
           ("lookup_ms_mean", "lookup ms", "{:.1f}"), ("sim_requests_per_wall_s", "sim req/s", "{:.0f}"))


def markdown_table(rows: list[dict[str, Any]], title: str,
                   extra_columns: Sequence[tuple[str, str, str]] = ()) -> str:
    """``COLUMNS`` and then ``extra_columns`` (key, header, format) of each row."""
    columns = (*COLUMNS, *extra_columns)
    lines = [f"# {title}", "", "| " + " | ".join(c[1] for c in columns) + " |",
             "|" + "---|" * len(columns)]
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key, "")
            if key == "throughput_tok_s":
                v = v / 1000.0
            cells.append(fmt.format(v) if v != "" else "")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Window: {window_text(rows)}."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    unknown = [s for s in schemes if s not in ALL_SCHEMES]
    if unknown:
        raise SystemExit(f"unknown scheme(s) {unknown}; known: {', '.join(ALL_SCHEMES)}")
    workload = args.workload or ("mooncake" if args.trace is not None else "mixed")
    try:
        check_workload_sources(workload, traces=args.traces, trace=args.trace,
                               trace_block_tokens=args.trace_block_tokens)
    except WorkloadError as exc:
        raise SystemExit(f"kvcompassd sim: {exc}") from None
    eviction = DEFAULT_EVICTION[workload] if args.eviction == "auto" else args.eviction
    settings = SimSettings(eviction=eviction, update_delay_ms=args.update_delay_ms, update_loss=args.update_loss,
                           wan_jitter=args.wan_jitter, seed=args.seed, track_truth=args.track_cross_region)
    cfg_path = resolve_deployment(args.deployment)
    rows, results = run_grid(cfg_path, workload, schemes, args.rates, seed=args.seed, duration_s=args.duration,
                             max_requests=args.requests, warmup_s=args.warmup, settings=settings,
                             regions_by=args.regions_by, traces=args.traces, progress=args.progress,
                             page_tokens=args.page_tokens, jobs=args.jobs, trace=args.trace,
                             trace_block_tokens=args.trace_block_tokens, log=args.out / "points.jsonl")
    source = workload if args.trace is None else f"{Path(args.trace).name} (Mooncake format)"
    title = f"{source} on {cfg_path.stem}"
    write_outputs(rows, results, args.out, title=title, warmup_s=args.warmup, per_request=args.per_request,
                  make_plots=not args.no_plots)
    sys.stdout.write(markdown_table(rows, title))
    print(f"wrote {args.out}/summary.csv, summary.json, summary.md" + ("" if args.no_plots else " and PNG plots"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
