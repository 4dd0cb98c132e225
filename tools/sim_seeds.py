"""Schemes at one operating point over several seeds AND windows: is a ratio a seed's, or a window's?

    python tools/sim_seeds.py [--deployment testbed-3continent] [--workload wildchat] [--rate 150]
                              [--durations 60 | --durations 7.5,20 --warmup 5] [--seeds 0-4]
                              [--schemes kvcompass,dynamo] [--metric ttft_p99_ms] [--jobs 2] [--out seeds.json]
    python tools/sim_seeds.py --rows out/a/summary.json out/b/points.jsonl [--workload mixed] [--rate 3000]

Each seed draws a different request stream (arrivals, prompts, sessions); every scheme replays
the same stream of a seed. A window is a run's arrival seconds (``--durations``) with its warm-up
excluded (``--warmup``, default a quarter of each duration, as the experiments' fixed-size
points): the Fig. 12 sweep's 3000 req/s point is ``--durations 7.5 --warmup 5`` (a 2.5 s measured
window), the full point ``--durations 20 --warmup 5``. ``--rows`` reads runs already made (any
``summary.json`` or ``points.jsonl`` of ``kvcompassd sim`` or an experiment) instead of running.

Prints each run's metric per scheme with its window and seed, then for every other scheme against
the first the ratio other / first of ``--metric`` (P99 TTFT by default: above 1, the first is
lower) per seed and window, its spread (min / median / max, mean +- s.d.) within each window and
over all seeds and windows together, and how many runs the first scheme wins. Near a fleet's knee
a P99 moves by tens of per cent from one seed to the next, and past capacity it grows with the
window: a ratio that flips with either is a tie, not a result, and a quoted ratio names the
window and seeds it came from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from kvcompassd.sim.cli import grid_points, resolve_deployment, run_points
from kvcompassd.sim.engine import SimSettings
from kvcompassd.sim.schemes import DEFAULT_EVICTION

# Metrics where more is better: there the first scheme wins a run when the ratio other / first is below 1.
HIGHER_IS_BETTER = frozenset({"throughput_tok_s", "output_tok_s", "window_tok_s", "hit_rate"})


def parse_seeds(spec: str) -> list[int]:
    """``"0-4"`` or ``"0,2,7"`` (or a mix: ``"0-2,9"``) as a sorted list of distinct seeds."""
    seeds: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise argparse.ArgumentTypeError(f"seeds must look like 0-4 or 0,2,7, got {spec!r}") from None
        if first < 0 or last < first:
            raise argparse.ArgumentTypeError(f"bad seed range {part!r}")
        seeds.update(range(first, last + 1))
    if not seeds:
        raise argparse.ArgumentTypeError("no seeds given")
    return sorted(seeds)


def parse_durations(spec: str) -> list[float]:
    """``"7.5,20"``: distinct positive durations (virtual seconds of arrivals), in the given order."""
    try:
        values = [float(p) for p in spec.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"durations must look like 7.5,20, got {spec!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"durations must be positive seconds, got {spec!r}")
    return list(dict.fromkeys(values))


def window_of(row: dict) -> tuple[float, float]:
    """(warm-up s, measured s) of a summary row; rows written before ``measured_s`` was recorded
    give it as their duration less their warm-up."""
    warmup = float(row.get("warmup_s") or 0.0)
    measured = row.get("measured_s")
    if measured is None:
        if row.get("duration_s") is None:
            raise ValueError(f"row of {row.get('scheme')!r} (seed {row.get('seed')}) records no window")
        measured = float(row["duration_s"]) - warmup
    return warmup, float(measured)


def window_label(window: tuple[float, float]) -> str:
    return f"warm-up {window[0]:g} s + measured {window[1]:g} s"


def compare(rows: list[dict], lead: str, metric: str = "ttft_p99_ms") -> dict[str, dict]:
    """Per scheme other than ``lead``, over rows of ONE window: per-seed ratios other / lead of
    ``metric``, the seeds ``lead`` wins (strictly better) and the median ratio."""
    by_seed: dict[int, dict[str, float]] = {}
    for r in rows:
        by_seed.setdefault(int(r["seed"]), {})[r["scheme"]] = float(r[metric])
    schemes = list(dict.fromkeys(r["scheme"] for r in rows if r["scheme"] != lead))
    out: dict[str, dict] = {}
    for scheme in schemes:
        ratios = {seed: v[scheme] / v[lead] for seed, v in sorted(by_seed.items())
                  if scheme in v and lead in v and v[lead] > 0}
        wins = sum((v < 1.0) if metric in HIGHER_IS_BETTER else (v > 1.0) for v in ratios.values())
        out[scheme] = {"ratios": ratios, "lead_wins": wins, "seeds": len(ratios),
                       "median_ratio": statistics.median(ratios.values()) if ratios else None}
    return out


def stats(values: list[float]) -> dict:
    """min / median / max and mean +- sample s.d. (0 for one value) of ``values``."""
    if not values:
        return {"n": 0, "min": None, "median": None, "max": None, "mean": None, "sd": None}
    return {"n": len(values), "min": min(values), "median": statistics.median(values), "max": max(values),
            "mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0}


def spread(rows: list[dict], lead: str, metric: str = "ttft_p99_ms") -> dict[str, dict]:
    """Per scheme other than ``lead``: its ratios to ``lead`` (``compare``) within each window,
    their ``stats`` per window, and ``stats`` over every (seed, window) run together, with the
    runs ``lead`` wins."""
    windows = sorted({window_of(r) for r in rows}, key=lambda w: (w[0] + w[1], w))
    per_window = {w: compare([r for r in rows if window_of(r) == w], lead, metric) for w in windows}
    schemes = list(dict.fromkeys(r["scheme"] for r in rows if r["scheme"] != lead))
    out: dict[str, dict] = {}
    for scheme in schemes:
        mine = {window_label(w): per_window[w][scheme] for w in windows if scheme in per_window[w]}
        every = [ratio for v in mine.values() for ratio in v["ratios"].values()]
        out[scheme] = {
            "windows": {label: {**stats(list(v["ratios"].values())), "ratios": v["ratios"],
                                "lead_wins": v["lead_wins"]} for label, v in mine.items()},
            "all": {**stats(every), "lead_wins": sum(v["lead_wins"] for v in mine.values()),
                    "seeds": sorted({s for v in mine.values() for s in v["ratios"]}), "windows": len(mine)},
        }
    return out


def _fmt_stats(s: dict) -> str:
    if not s["n"]:
        return "no runs"
    return (f"min {s['min']:.3f}  median {s['median']:.3f}  max {s['max']:.3f}  "
            f"mean {s['mean']:.3f} +- {s['sd']:.3f} (n={s['n']})")


def _fmt_value(v: float) -> str:
    return f"{v:20,.0f}" if abs(v) >= 100 else f"{v:20.4g}"


def render(rows: list[dict], lead: str, metric: str) -> str:
    """The per-run table (each run's window and seed beside its figures) and the spread of every
    scheme's ratio to ``lead``."""
    schemes = [lead, *dict.fromkeys(r["scheme"] for r in rows if r["scheme"] != lead)]
    runs = sorted({(window_of(r), int(r["seed"])) for r in rows}, key=lambda k: (k[0][0] + k[0][1], k))
    points = sorted({(r.get("deployment"), r.get("workload"), r.get("rate")) for r in rows}, key=str)
    better = "higher" if metric in HIGHER_IS_BETTER else "lower"
    lines = [f"point: {', '.join(f'{d} / {w} at {float(rate):g} req/s' for d, w, rate in points)}; "
             f"metric {metric} ({better} is better)",
             f"{'window':36s} {'seed':>4s} {'n':>7s} " + " ".join(f"{s:>20s}" for s in schemes)]
    for window, seed in runs:
        mine = {r["scheme"]: r for r in rows if window_of(r) == window and int(r["seed"]) == seed}
        n = mine[lead]["requests"] if lead in mine else ""
        cells = [_fmt_value(mine[s][metric]) if s in mine else f"{'-':>20s}" for s in schemes]
        lines.append(f"{window_label(window):36s} {seed:4d} {n:>7} " + " ".join(cells))
    for scheme, v in spread(rows, lead, metric).items():
        lines.append(f"{scheme} / {lead} {metric}:")
        for label, s in v["windows"].items():
            per_seed = ", ".join(f"seed {seed} {ratio:.3f}" for seed, ratio in s["ratios"].items())
            lines.append(f"  {label}: {per_seed}; {lead} {better} at {s['lead_wins']}/{s['n']} seeds; "
                         f"{_fmt_stats(s)}")
        a = v["all"]
        lines.append(f"  over all {a['n']} runs ({len(a['seeds'])} seeds, {a['windows']} windows): {_fmt_stats(a)}; "
                     f"{lead} {better} at {a['lead_wins']}/{a['n']} runs")
    return "\n".join(lines) + "\n"


def read_rows(paths: list[Path]) -> list[dict]:
    """Summary rows from ``summary.json`` (a list) or ``points.jsonl`` (one per line) files."""
    rows: list[dict] = []
    for path in paths:
        text = path.read_text()
        if path.suffix == ".jsonl":
            rows += [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            body = json.loads(text)
            rows += body["rows"] if isinstance(body, dict) else body
    return rows


def run(deployment: str, workload: str, rate: float, schemes: list[str], seeds: list[int], durations: list[float],
        warmup: float | None, jobs: int = 1, log: Path | None = None) -> list[dict]:
    """Every scheme at every (seed, duration), the schemes of a (seed, duration) on one stream;
    ``log`` gets each run's summary as it finishes (JSON lines, readable with ``--rows``)."""
    cfg = resolve_deployment(deployment)
    points = []
    for seed in seeds:
        settings = SimSettings(eviction=DEFAULT_EVICTION[workload], seed=seed)
        for duration in durations:
            w = duration / 4 if warmup is None else warmup
            if not 0 <= w < duration:
                raise SystemExit(f"warm-up {w:g} s leaves nothing of a {duration:g} s run to measure")
            points += grid_points(cfg, workload, schemes, [rate], seed=seed, duration_s=duration, warmup_s=w,
                                  settings=settings)
    return [summary for summary, _ in run_points(points, jobs=jobs, log=log)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deployment", default="testbed-3continent")
    ap.add_argument("--workload", default=None, choices=sorted(DEFAULT_EVICTION),
                    help="default: wildchat (with --rows: every workload in the files)")
    ap.add_argument("--rate", type=float, default=None, help="req/s; default 150 (with --rows: every rate)")
    ap.add_argument("--durations", "--duration", type=parse_durations, default=[60.0],
                    help="virtual seconds of arrivals per run, comma-separated windows (default 60)")
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds excluded at the start of every run (default: a quarter of its duration)")
    ap.add_argument("--seeds", type=parse_seeds, default=parse_seeds("0-4"))
    ap.add_argument("--schemes", default="kvcompass,dynamo", help="comma-separated; the first is compared with the rest")
    ap.add_argument("--metric", default="ttft_p99_ms",
                    help="summary field whose ratio is reported (ttft_p99_ms, e2e_p99_ms, throughput_tok_s, ...)")
    ap.add_argument("--rows", type=Path, nargs="+", default=None,
                    help="read these summary.json / points.jsonl files instead of running")
    ap.add_argument("--jobs", type=int, default=1, help="simulations in parallel processes (results unchanged)")
    ap.add_argument("--out", type=Path, default=None,
                    help="also write the rows and the spread as JSON (and each run as it ends to OUT.points.jsonl)")
    args = ap.parse_args(argv)
    schemes = [s for s in args.schemes.split(",") if s]
    if len(schemes) < 2:
        ap.error("give at least two schemes")
    if args.rows is not None:
        rows = [r for r in read_rows(args.rows) if r["scheme"] in schemes
                and (args.workload is None or r.get("workload") == args.workload)
                and (args.rate is None or float(r["rate"]) == args.rate)]
        if len({(r.get("deployment"), r.get("workload"), float(r["rate"])) for r in rows}) > 1:
            ap.error("the rows hold several (deployment, workload, rate) points: pick one with --workload/--rate")
    else:
        rows = run(args.deployment, args.workload or "wildchat", 150.0 if args.rate is None else args.rate, schemes,
                   args.seeds, args.durations, args.warmup, jobs=args.jobs,
                   log=None if args.out is None else args.out.with_suffix(".points.jsonl"))
    if not any(r["scheme"] == schemes[0] for r in rows):
        ap.error(f"no runs of {schemes[0]!r} to compare with")
    try:
        sys.stdout.write(render(rows, schemes[0], args.metric))
        result = spread(rows, schemes[0], args.metric)
    except (KeyError, ValueError) as exc:
        raise SystemExit(f"sim_seeds: rows cannot be compared: {exc}") from None
    if args.out is not None:
        args.out.write_text(json.dumps({"lead": schemes[0], "metric": args.metric, "spread": result, "rows": rows},
                                       indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
