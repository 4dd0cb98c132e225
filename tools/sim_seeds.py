"""Schemes at one operating point over several workload seeds: is a P99 difference a seed's?

    python tools/sim_seeds.py [--deployment testbed-3continent] [--workload wildchat] [--rate 150]
                              [--duration 60] [--seeds 0-4] [--schemes kvcompass,dynamo] [--jobs 2]
                              [--out seeds.json]

Each seed draws a different request stream (arrivals, prompts, sessions); every scheme replays
the same stream of a seed, with the experiments' warm-up (a quarter of the duration). Prints each
seed's P99 TTFT and throughput per scheme, then, for every other scheme against the first, the
ratio of their P99s (other / first: above 1, the first is lower) per seed, how many seeds the
first wins, and the median ratio. Near a fleet's knee a P99 moves by tens of per cent from one
seed to the next; a comparison that flips with the seed is a tie, not a result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from kvcompassd.sim.cli import resolve_deployment, run_grid
from kvcompassd.sim.engine import SimSettings
from kvcompassd.sim.schemes import DEFAULT_EVICTION


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


def compare(rows: list[dict], lead: str) -> dict[str, dict]:
    """Per scheme other than ``lead``: per-seed P99 ratios other / lead, the seeds ``lead`` wins
    (strictly lower P99), and the median ratio. ``rows``: summaries with seed, scheme, ttft_p99_ms."""
    by_seed: dict[int, dict[str, float]] = {}
    for r in rows:
        by_seed.setdefault(int(r["seed"]), {})[r["scheme"]] = float(r["ttft_p99_ms"])
    schemes = list(dict.fromkeys(r["scheme"] for r in rows if r["scheme"] != lead))
    out: dict[str, dict] = {}
    for scheme in schemes:
        ratios = {seed: p99[scheme] / p99[lead] for seed, p99 in sorted(by_seed.items())
                  if scheme in p99 and lead in p99 and p99[lead] > 0}
        out[scheme] = {"ratios": ratios, "lead_wins": sum(v > 1.0 for v in ratios.values()),
                       "seeds": len(ratios), "median_ratio": statistics.median(ratios.values()) if ratios else None}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deployment", default="testbed-3continent")
    ap.add_argument("--workload", default="wildchat", choices=sorted(DEFAULT_EVICTION))
    ap.add_argument("--rate", type=float, default=150.0)
    ap.add_argument("--duration", type=float, default=60.0, help="virtual seconds of arrivals per run")
    ap.add_argument("--seeds", type=parse_seeds, default=parse_seeds("0-4"))
    ap.add_argument("--schemes", default="kvcompass,dynamo", help="comma-separated; the first is compared with the rest")
    ap.add_argument("--jobs", type=int, default=1, help="simulations in parallel processes (results unchanged)")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows and the comparison as JSON")
    args = ap.parse_args(argv)
    schemes = [s for s in args.schemes.split(",") if s]
    if len(schemes) < 2:
        ap.error("give at least two schemes")
    cfg = resolve_deployment(args.deployment)
    rows: list[dict] = []
    for seed in args.seeds:
        settings = SimSettings(eviction=DEFAULT_EVICTION[args.workload], seed=seed)
        got, _ = run_grid(cfg, args.workload, schemes, [args.rate], seed=seed, duration_s=args.duration,
                          warmup_s=args.duration / 4, settings=settings, jobs=args.jobs)
        rows += got
    print(f"{args.deployment} / {args.workload} at {args.rate:g} req/s, {args.duration:g} s per run, "
          f"seeds {args.seeds[0]}..{args.seeds[-1]} ({len(args.seeds)})")
    print(f"{'seed':>4s} " + " ".join(f"{s + ' P99 ms':>22s} {'Ktok/s':>7s}" for s in schemes))
    for seed in args.seeds:
        mine = {r["scheme"]: r for r in rows if r["seed"] == seed}
        print(f"{seed:4d} " + " ".join(f"{mine[s]['ttft_p99_ms']:22.1f} {mine[s]['throughput_tok_s'] / 1e3:7.1f}"
                                       for s in schemes))
    lead = schemes[0]
    verdict = compare(rows, lead)
    for scheme, v in verdict.items():
        per_seed = ", ".join(f"{r:.3f}" for r in v["ratios"].values())
        print(f"{scheme} / {lead} P99: {per_seed}; {lead} lower at {v['lead_wins']}/{v['seeds']} seeds, "
              f"median ratio {v['median_ratio']:.3f}")
    if args.out is not None:
        args.out.write_text(json.dumps({"rows": rows, "compare": verdict}, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
