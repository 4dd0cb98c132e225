"""``fig_long`` (issue 28): every scheme on long-context sessions (``synthetic.LongContextWorkload``:
documents and coding agents of 32 K-128 K tokens) at 0.25, 0.5, 1 and 1.5 x the fleet's no-reuse
capacity, on the testbed and census-64x8.

    python -m kvcompassd.sim.experiments fig_long [--quick] [--seed 0] [--schemes ...] [--jobs N] [--paper-reach]

The targets table of issue 28 over seeds, with the Mooncake trace too, is this module's own command::

    python -m kvcompassd.sim.exp_long [--deployments testbed-3continent,census-64x8] [--workloads long,mooncake]
        [--trace FILE] [--loads 0.25,0.5,1,1.5] [--seeds 0-2] [--requests-per-point 1200] [--warmup 60]
        [--schemes ...] [--jobs N] [--out DIR]
    python -m kvcompassd.sim.exp_long --pool-from DIR [DIR ...] --out DIR   # pool saved runs again

Each (fleet, workload, load) replays one request stream per seed for every scheme, at the rate
of the first seed's lambda0 (the Mooncake trace: its own arrivals rescaled to that rate, a seed
changing only which region each conversation enters; its lambda0 from the file's mean prompt,
uncapped). Pooled over seeds (``pool``): the P99 of all seeds' measured TTFTs together,
throughput as all their tokens over all their spans, >=32 K reuse as all reused over all prompt
tokens; ``targets_table`` checks KVCompass against the best other scheme at each point.

``--paper-reach`` adds ``kvcompass-paper-reach``: KVCompass with the paper's indexed lengths only
(to 16 K; ``KVCompassPolicy(context_tokens=...)``), on the same requests, for the before/after.

The no-reuse capacity is the one Fig. 9 uses, lambda0 = workers / (mean prompt x mean beta),
with the mean prompt of the workload as that fleet serves it (the testbed's prompts are capped
at what its 96 K-token VRAM holds; ``synthetic.servable_prompt_tokens``); decode adds ~1 % to a
long request's work and is left out. A point replays one request stream for every scheme: a
warm-up (``WARMUP_S``, 60 s: caches start empty, and a document or repository is asked for
again within tens of seconds) and then about ``REQUESTS_PER_POINT`` measured arrivals (1,200;
``--quick``: 120 after 20 s). A trace too short for both at a high rate keeps the measured
arrivals and warms up on the records before them (``trace_warmup_s``). Past capacity the backlog, and with it the P99, grows with the
window, so every table line says which window it measured.

Printed and written under ``--out/fig_long/``: per deployment and load, each scheme's P99 and
mean TTFT, throughput (every token of the run over its duration) and reuse by prompt length
(<8 K, 8-32 K, >=32 K) beside Dynamo's exact match (``metrics.reuse_by_length_table``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvcompassd.core.config import load_config

from .cli import grid_points, markdown_table, resolve_deployment, run_points
from .engine import SimSettings
from .metrics import reuse_by_length_table
from .policy import Topology
from .schemes import DEFAULT_EVICTION, PAPER_SCHEMES, region_weights, traces_dir
from .synthetic import LongContextParams, LongContextWorkload, servable_prompt_tokens
from .workloads import MOONCAKE_BLOCK_TOKENS, read_mooncake

LOAD_FRACTIONS = (0.25, 0.5, 1.0, 1.5)
DEPLOYMENTS = ("testbed-3continent", "census-64x8")
WORKLOADS = ("long", "mooncake")
REQUESTS_PER_POINT = 1_200
WARMUP_S = 60.0
COLUMNS = (("load", "x lambda0", "{:g}"), ("window", "window (s)", "{}"), ("ttft_mean_ms", "TTFT mean ms", "{:.0f}"),
           ("reuse_ge32k", ">=32K reuse", "{:.1%}"))


def no_reuse_capacity(deployment: str, *, seed: int = 0, sessions: int = 2000, workload: str = "long",
                      trace: str | Path | None = None, trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> float:
    """lambda0 (req/s): the fleet's workers over the mean no-reuse prefill of a request.
    ``workload="long"``: the long-context sessions as the fleet serves them; ``"mooncake"``: the
    records of ``trace`` (default the bundled Mooncake trace), every prompt as the file gives it."""
    cfg = load_config(resolve_deployment(deployment))
    topo = Topology.from_config(cfg)
    if workload == "long":
        workload_gen = LongContextWorkload(1.0, region_weights(topo), seed=seed,
                                           params=LongContextParams(max_prompt_tokens=servable_prompt_tokens(cfg)))
        mean_prompt = workload_gen.mean_prompt_tokens(sessions, seed=seed)
    elif workload == "mooncake":
        path = trace if trace is not None else _bundled_trace()
        mean_prompt = float(np.mean([r.input_length for r in read_mooncake(path, block_tokens=trace_block_tokens)]))
    else:
        raise ValueError(f"fig_long runs workloads {WORKLOADS}, not {workload!r}")
    service_s = mean_prompt * float(np.mean(topo.prefill_ms_per_token)) / 1000.0
    return topo.n_workers / service_s


def trace_warmup_s(path: str | Path | None, rate: float, *, requests_per_point: int, warmup_s: float,
                   block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> float:
    """The warm-up a replay of a Mooncake-format trace (default the bundled one) at ``rate`` can
    give: ``warmup_s``, or less when the file would end before ``requests_per_point`` arrivals
    past it. Then its last ``requests_per_point`` records are measured and those before them warm
    the caches (none, for a file no longer than that). A trace replayed at 1.5 x the census fleet's
    lambda0 ends after 54 s: a 60 s warm-up measured nothing. Arrival times as ``mooncake_stream``
    rescales them."""
    recs = read_mooncake(path if path is not None else _bundled_trace(), block_tokens=block_tokens)
    if len(recs) <= requests_per_point:
        return 0.0
    span_s = (recs[-1].timestamp_ms - recs[0].timestamp_ms) / 1000.0
    factor = ((len(recs) - 1) / span_s) / rate  # mooncake_stream's native rate over the target rate
    first_measured_s = recs[len(recs) - requests_per_point].timestamp_ms / 1000.0 * factor
    return min(warmup_s, first_measured_s)


def _seconds(s: float) -> str:
    return f"{s:g}" if float(s).is_integer() else f"{s:.1f}"


def _bundled_trace() -> Path:
    return traces_dir() / "mooncake" / "synthetic_trace.jsonl"


def run_long(out: Path, *, deployments: Sequence[str] = DEPLOYMENTS, schemes: Sequence[str] = PAPER_SCHEMES,
             fractions: Sequence[float] = LOAD_FRACTIONS, requests_per_point: int = REQUESTS_PER_POINT,
             warmup_s: float = WARMUP_S, seed: int = 0, jobs: int = 1, progress: bool = False,
             page_tokens: int | None = None, capacity_sessions: int = 2000, paper_reach: bool = False,
             seeds: Sequence[int] | None = None, workloads: Sequence[str] = ("long",),
             trace: str | Path | None = None, trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[dict]:
    """Every (deployment, workload, load, seed, scheme) point; rows carry ``load`` (x lambda0),
    ``lambda0`` and ``window`` (the measured arrivals' seconds) besides the summary.
    ``paper_reach`` adds ``kvcompass-paper-reach``: KVCompass with the paper's indexed lengths
    only (no long lengths), on the same requests. ``seeds`` (default ``[seed]``): one request
    stream per seed, every scheme on it, at the rate of the first seed's lambda0. ``workloads``:
    ``long`` and/or ``mooncake`` (``trace``, or the bundled Mooncake trace).

    With more than one run per point (seeds), ``pooled.md`` / ``targets.md`` hold the pooled
    figures (``pool``) and the targets' check (``targets_table``)."""
    seeds = [seed] if seeds is None else list(seeds)
    points, meta = [], []
    for deployment in deployments:
        cfg_path = resolve_deployment(deployment)
        for workload in workloads:
            lam0 = no_reuse_capacity(deployment, seed=seeds[0], sessions=capacity_sessions, workload=workload,
                                     trace=trace, trace_block_tokens=trace_block_tokens)
            for fraction in fractions:
                rate = round(fraction * lam0, 3)
                warm = warmup_s if workload != "mooncake" else trace_warmup_s(
                    trace, rate, requests_per_point=requests_per_point, warmup_s=warmup_s,
                    block_tokens=trace_block_tokens)
                duration = warm + requests_per_point / rate
                for run_seed in seeds:
                    settings = SimSettings(eviction=DEFAULT_EVICTION[workload], seed=run_seed)
                    common = dict(seed=run_seed, duration_s=duration, warmup_s=warm, settings=settings,
                                  page_tokens=page_tokens, trace=trace if workload == "mooncake" else None,
                                  trace_block_tokens=trace_block_tokens)
                    mine = grid_points(cfg_path, workload, schemes, [rate], run_progress=progress and jobs <= 1,
                                       **common)
                    if paper_reach:
                        block = load_config(cfg_path).index.block_size  # a context below every length adds none
                        mine += [dataclasses.replace(p, scheme="kvcompass", policy_options={"context_tokens": block})
                                 for p in grid_points(cfg_path, workload, ["kvcompass"], [rate], **common)]
                    points += mine
                    meta += [(deployment, workload, fraction, lam0, warm, duration)] * len(mine)
    done = run_points(points, jobs=jobs, progress=progress, desc="fig_long", log=out / "points.jsonl")
    rows = []
    for point, (summary, result), (deployment, workload, fraction, lam0, warm, duration) in zip(points, done, meta):
        scheme = "kvcompass-paper-reach" if "context_tokens" in point.policy_options else summary["scheme"]
        rows.append(dict(summary, scheme=scheme, load=fraction, lambda0=lam0, window=f"{_seconds(warm)}-{duration:.0f}",
                         workload=f"{workload}@{deployment}", **_pool_inputs(result, warm)))
    out.mkdir(parents=True, exist_ok=True)
    public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    (out / "summary.md").write_text(markdown_table(public, "fig_long: long-context sessions", COLUMNS))
    (out / "reuse_by_length.md").write_text(reuse_by_length_table(public, "fig_long: reuse by prompt length"))
    (out / "summary.json").write_text(json.dumps(public, indent=1, default=float))
    # Every run with what pooling needs (its TTFTs, tokens, span): ``--pool-from`` pools them again
    # with runs made later (one scheme rerun on new code, the others kept).
    (out / "runs.jsonl").write_text("".join(json.dumps(r, default=float) + "\n" for r in rows))
    write_pooled(out, rows)
    return rows


def write_pooled(out: Path, rows: Sequence[dict]) -> list[dict]:
    """``pooled.json`` and ``targets.md`` under ``out`` from ``rows`` (``pool``)."""
    pooled = pool(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pooled.json").write_text(json.dumps(pooled, indent=1, default=float))
    (out / "targets.md").write_text(targets_table(pooled))
    return pooled


def read_runs(dirs: Sequence[Path]) -> list[dict]:
    """The runs ``run_long`` saved (``runs.jsonl``) under each of ``dirs``; a run of a later
    directory replaces an earlier one of the same workload, load, seed and scheme (a scheme rerun
    on new code over the others' runs). Order: first appearance."""
    runs: dict[tuple, dict] = {}
    for d in dirs:
        path = Path(d) / "runs.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no runs saved there (run_long writes runs.jsonl)")
        for n, line in enumerate(path.read_text().splitlines(), 1):
            try:
                row = json.loads(line)
                key = (row["workload"], row["load"], row["seed"], row["scheme"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a saved run ({exc})") from None
            runs[key] = row
    return list(runs.values())


def _pool_inputs(result, warmup_s: float) -> dict:
    """What pooling a run with others needs: its measured TTFTs and reuse by length, and the
    tokens and span its throughput is (``metrics.summarize``'s definition)."""
    r = result.records
    m = r["arrival_s"] >= warmup_s
    long_prompt = m & (r["prompt_tokens"] >= 32768)
    return {"_ttft_ms": r["ttft_ms"][m].tolist(),
            "_tokens": float(r["prompt_tokens"].sum() + r["output_tokens"].sum()),
            "_span_s": max(float(r["finish_s"].max() - r["arrival_s"].min()), 1e-9) if len(r["id"]) else 1e-9,
            "_ge32k_prompt": int(r["prompt_tokens"][long_prompt].sum()),
            "_ge32k_reused": int(r["reused_tokens"][long_prompt].sum())}


def pool(rows: Sequence[dict]) -> list[dict]:
    """Per (workload@deployment, load, scheme), over its seeds: the P99 (and mean) TTFT of every
    measured request of every seed together, throughput as all their tokens over all their spans,
    >=32 K reuse as all reused over all prompt tokens of those requests, and each seed's P99 and
    window beside them."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["load"], r["scheme"]), []).append(r)
    out = []
    for (workload, load, scheme), mine in groups.items():
        ttft = np.concatenate([np.asarray(r["_ttft_ms"], dtype=float) for r in mine])
        prompt = sum(r["_ge32k_prompt"] for r in mine)
        out.append({
            "workload": workload, "load": load, "scheme": scheme, "rate": mine[0]["rate"],
            "lambda0": mine[0]["lambda0"], "window": mine[0]["window"], "warmup_s": mine[0]["warmup_s"],
            "seeds": [int(r["seed"]) for r in mine], "requests": int(ttft.size),
            "measured_s": [float(r["measured_s"]) for r in mine],
            "ttft_p99_ms": float(np.percentile(ttft, 99)) if ttft.size else float("nan"),
            "ttft_mean_ms": float(ttft.mean()) if ttft.size else float("nan"),
            "throughput_tok_s": sum(r["_tokens"] for r in mine) / sum(r["_span_s"] for r in mine),
            "reuse_ge32k": sum(r["_ge32k_reused"] for r in mine) / prompt if prompt else float("nan"),
            "requests_ge32k": sum(int(r["requests_ge32k"]) for r in mine),
            "seed_p99_ms": [float(r["ttft_p99_ms"]) for r in mine],
        })
    return out


def targets_table(pooled: Sequence[dict], lead: str = "kvcompass", tolerance: float = 0.01,
                  reference: str = "dynamo") -> str:
    """The issue-28 targets, per (workload@deployment, load), on the pooled figures: does ``lead``
    have the lowest P99 TTFT (within ``tolerance``: at most 1 % above the best other scheme's)
    and the highest throughput (at least 1 % below the best other's at worst), and its >=32 K
    reuse beside ``reference``'s exact match (the target: within 2 points)."""
    lines = ["# fig_long targets (pooled over seeds)", "",
             f"{lead} against the best other scheme at each point; met = within {100 * tolerance:g} %; "
             f">=32K reuse target: within 2 points of {reference}.", "",
             "| workload | x lambda0 (req/s) | seeds | window s | requests | P99 TTFT s: lead / best other (scheme) | "
             "P99 met | Ktok/s: lead / best other (scheme) | thr met | >=32K reuse %: lead / "
             f"{reference} | reuse met |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    met = {"p99": 0, "thr": 0, "reuse": 0, "points": 0}
    for workload, load in dict.fromkeys((p["workload"], p["load"]) for p in pooled):
        mine = {p["scheme"]: p for p in pooled if (p["workload"], p["load"]) == (workload, load)}
        first = mine.get(lead)
        others = [p for s, p in mine.items() if s != lead and s != f"{lead}-paper-reach"]
        if first is None or not others:
            continue
        best_p99 = min(others, key=lambda p: p["ttft_p99_ms"])
        best_thr = max(others, key=lambda p: p["throughput_tok_s"])
        p99_ok = first["ttft_p99_ms"] <= (1 + tolerance) * best_p99["ttft_p99_ms"]
        thr_ok = first["throughput_tok_s"] >= (1 - tolerance) * best_thr["throughput_tok_s"]
        ref = mine.get(reference)
        reuse_ok = ref is not None and first["reuse_ge32k"] - ref["reuse_ge32k"] >= -0.02 - 1e-12
        ref_reuse = f"{100 * ref['reuse_ge32k']:.1f}" if ref is not None else "-"
        met["points"] += 1
        met["p99"] += p99_ok
        met["thr"] += thr_ok
        met["reuse"] += reuse_ok
        lines.append(
            f"| {workload} | {load:g} ({first['rate']:g}) | {','.join(map(str, first['seeds']))} | "
            f"{first['window']} | {first['requests']} | {first['ttft_p99_ms'] / 1e3:.2f} / "
            f"{best_p99['ttft_p99_ms'] / 1e3:.2f} ({best_p99['scheme']}) | {'yes' if p99_ok else 'NO'} | "
            f"{first['throughput_tok_s'] / 1e3:.1f} / {best_thr['throughput_tok_s'] / 1e3:.1f} ({best_thr['scheme']}) | "
            f"{'yes' if thr_ok else 'NO'} | {100 * first['reuse_ge32k']:.1f} / {ref_reuse} | "
            f"{'yes' if reuse_ok else 'NO'} |")
    lines += ["", f"met at {met['p99']}/{met['points']} points (P99), {met['thr']}/{met['points']} (throughput), "
              f"{met['reuse']}/{met['points']} (>=32K reuse)"]
    return "\n".join(lines) + "\n"


def pooled_report(pooled: Sequence[dict]) -> str:
    """Per point: its window (warm-up and measured seconds per seed), then each scheme's pooled
    P99 / mean TTFT, throughput and >=32 K reuse, with every seed's own P99."""
    lines = []
    for workload, load in dict.fromkeys((p["workload"], p["load"]) for p in pooled):
        mine = [p for p in pooled if (p["workload"], p["load"]) == (workload, load)]
        first = mine[0]
        measured = ", ".join(f"{m:.0f}" for m in first["measured_s"])
        lines.append(f"{workload} at {load:g} x lambda0 = {first['rate']:g} req/s (lambda0 {first['lambda0']:.2f}): "
                     f"arrivals {first['window']} s, warm-up {first['warmup_s']:g} s + measured {measured} s, "
                     f"seeds {','.join(map(str, first['seeds']))}, {first['requests']} measured requests pooled")
        for p in mine:
            seeds = " ".join(f"{v / 1e3:.2f}" for v in p["seed_p99_ms"])
            reuse = f"{100 * p['reuse_ge32k']:5.1f}%" if p["requests_ge32k"] else "    -"
            lines.append(f"  {p['scheme']:<22} P99 TTFT {p['ttft_p99_ms'] / 1e3:7.2f} s (seeds {seeds})  "
                         f"mean {p['ttft_mean_ms'] / 1e3:6.2f} s  {p['throughput_tok_s'] / 1e3:7.1f} Ktok/s  "
                         f">=32K reuse {reuse}")
    return "\n".join(lines)


def report(rows: list[dict]) -> str:
    """The lines ``fig_long`` prints: per deployment and load, its window, then each scheme."""
    lines = []
    for key in dict.fromkeys((r["deployment"], r["load"]) for r in rows):
        mine = [r for r in rows if (r["deployment"], r["load"]) == key]
        first = mine[0]
        lines.append(f"{key[0]} at {key[1]:g} x lambda0 = {first['rate']:g} req/s (lambda0 {first['lambda0']:.2f}): "
                     f"arrivals {first['window']} s measured, {first['requests']} requests, seed {first['seed']}")
        for r in mine:
            lines.append(f"  {r['scheme']:<18} P99 TTFT {r['ttft_p99_ms']:>9.0f} ms  mean {r['ttft_mean_ms']:>8.0f} ms  "
                         f"{r['throughput_tok_s'] / 1e3:>7.1f} Ktok/s  reuse <8K {_pct(r, 'lt8k')}  "
                         f"8-32K {_pct(r, '8k_32k')}  >=32K {_pct(r, 'ge32k')}")
    return "\n".join(lines)


def _pct(row: dict, suffix: str) -> str:
    return f"{100 * row[f'reuse_{suffix}']:5.1f}%" if row[f"requests_{suffix}"] else "    -"


def fig_long(args) -> list[dict]:
    """``python -m kvcompassd.sim.experiments fig_long``: one seed (``--seed``), the long-context
    workload; the whole targets table (seeds, the Mooncake trace) is this module's own command."""
    quick = args.quick
    rows = run_long(args.out / "fig_long", schemes=args.schemes or PAPER_SCHEMES, seed=args.seed, jobs=args.jobs,
                    progress=args.progress, requests_per_point=120 if quick else REQUESTS_PER_POINT,
                    warmup_s=20.0 if quick else WARMUP_S, paper_reach=args.paper_reach)
    print(report(rows))
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]


def _seeds(spec: str) -> list[int]:
    """``"0-2"`` or ``"0,2,7"`` (or a mix) as sorted distinct seeds."""
    import argparse

    seeds: set[int] = set()
    try:
        for part in (p.strip() for p in spec.split(",") if p.strip()):
            lo, sep, hi = part.partition("-")
            first, last = int(lo), int(hi) if sep else int(lo)
            if first < 0 or last < first:
                raise ValueError
            seeds.update(range(first, last + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must look like 0-2 or 0,2,7, got {spec!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("no seeds given")
    return sorted(seeds)


def _names(spec: str) -> list[str]:
    return [x for x in spec.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    """The issue-28 targets table in one command (see the module docstring)."""
    import argparse
    import sys

    from .workloads import WorkloadError

    ap = argparse.ArgumentParser(prog="python -m kvcompassd.sim.exp_long",
                                 description="fig_long over seeds: the issue-28 targets table")
    ap.add_argument("--deployments", type=_names, default=list(DEPLOYMENTS))
    ap.add_argument("--workloads", type=_names, default=list(WORKLOADS), help=f"from {', '.join(WORKLOADS)}")
    ap.add_argument("--schemes", type=_names, default=list(PAPER_SCHEMES))
    ap.add_argument("--loads", type=lambda t: [float(x) for x in _names(t)], default=list(LOAD_FRACTIONS),
                    help="multiples of the fleet's no-reuse capacity lambda0")
    ap.add_argument("--seeds", type=_seeds, default=_seeds("0-2"))
    ap.add_argument("--requests-per-point", type=int, default=REQUESTS_PER_POINT,
                    help="measured arrivals per run (after the warm-up)")
    ap.add_argument("--warmup", type=float, default=WARMUP_S, help="virtual seconds excluded at the start of every run")
    ap.add_argument("--trace", default=None, metavar="FILE",
                    help="workload mooncake replays this Mooncake-format JSONL file (default: the bundled trace)")
    ap.add_argument("--trace-block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS)
    ap.add_argument("--paper-reach", action="store_true", help="also KVCompass with the paper's lengths only")
    ap.add_argument("--jobs", type=int, default=1, help="simulations in parallel processes (results unchanged)")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("out/fig_long_targets"))
    ap.add_argument("--pool-from", type=Path, nargs="+", metavar="DIR",
                    help="run nothing: pool the runs saved under these --out directories (a later one's run "
                         "replaces an earlier one's of the same workload, load, seed and scheme) into --out")
    args = ap.parse_args(argv)
    if args.pool_from:
        try:
            pooled = write_pooled(args.out, read_runs(args.pool_from))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"fig_long: {exc}") from None
        sys.stdout.write(pooled_report(pooled) + "\n\n" + targets_table(pooled))
        return 0
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        ap.error(f"unknown workloads {bad}; fig_long runs {', '.join(WORKLOADS)}")
    if args.requests_per_point < 1 or not args.warmup >= 0:
        ap.error("--requests-per-point must be >= 1 and --warmup >= 0")
    try:
        if "mooncake" in args.workloads:
            read_mooncake(args.trace if args.trace is not None else traces_dir() / "mooncake" / "synthetic_trace.jsonl",
                          block_tokens=args.trace_block_tokens)
    except WorkloadError as exc:
        raise SystemExit(f"fig_long: {exc}") from None
    rows = run_long(args.out, deployments=args.deployments, schemes=args.schemes, fractions=args.loads,
                    requests_per_point=args.requests_per_point, warmup_s=args.warmup, seeds=args.seeds,
                    jobs=args.jobs, progress=args.progress, paper_reach=args.paper_reach, workloads=args.workloads,
                    trace=args.trace, trace_block_tokens=args.trace_block_tokens)
    pooled = pool(rows)
    sys.stdout.write(pooled_report(pooled) + "\n\n" + targets_table(pooled))
    print(f"fig_long: {len(rows)} runs -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
