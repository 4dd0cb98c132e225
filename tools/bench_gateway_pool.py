"""Pool several runs of ``tools/bench_gateway.py --json FILE`` and check issue 30's targets on them.

Each run's JSON holds, per mode (its label: ``zero-delay ...`` or ``service (VRAM N tokens/worker)``),
arm and concurrency, the figures bench_gateway prints. This prints, per mode, concurrency and
arm, every run's value and the median over the runs (the pooled figure) for throughput, P99,
throughput ÷ direct, added P50 and CPU per request, then the targets that compare kvcompassd
with the other arms present in the runs:

- service mode: kvcompassd's pooled throughput >= each router's and its pooled P99 <= each
  router's, at every VRAM size and concurrency (and how many single runs it held in);
- zero-delay: kvcompassd's edge CPU per request <= the router's, its added P50 at c = 1 <= the
  router's, its throughput ÷ direct >= the router's (pooled medians).

An arm's pooled figures are over the runs that hold it; the single-run counts pair the arms
run by run, over the runs that hold both.

    python tools/bench_gateway_pool.py run1.json run2.json run3.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

KVCOMPASSD = "kvcompassd"

# (figure key, column heading, format, better: "high" / "low"); cpu_us is the router's own process
FIGURES = (("rps", "req/s", ".1f", "high"), ("p99_ms", "P99 ms", ".0f", "low"), ("ratio", "÷direct", ".2f", "high"),
           ("added_p50_ms", "+P50 ms", "+.2f", "low"), ("reuse", "reuse", ".2f", "high"),
           ("cpu_us", "router CPU us/req", ".0f", "low"))
HIGHER_IS_BETTER = {key: better == "high" for key, _, _, better in FIGURES}


def load_runs(paths: list[Path]) -> list[dict]:
    runs = []
    for path in paths:
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"bench_gateway_pool: cannot read {path}: {exc}") from None
    return runs


def edge_cpu_us(figures: dict) -> float:
    """The router's own CPU per request: kvcompassd's edge, another arm's router process."""
    return figures.get("cpu_us.edge", figures.get("cpu_us.router", math.nan))


def value(figures: dict, key: str) -> float:
    v = edge_cpu_us(figures) if key == "cpu_us" else figures.get(key, math.nan)
    return float(v) if isinstance(v, (int, float)) else math.nan


def pooled(runs: list[dict]) -> dict:
    """mode -> c -> arm -> figure -> [per-run values], and ``"run"`` -> the runs' positions
    (runs lacking the arm add nothing)."""
    table: dict = {}
    for position, run in enumerate(runs):
        for mode, arms in run.items():
            for arm, result in arms.items():
                for c, figures in result.get("by_c", {}).items():
                    slot = table.setdefault(mode, {}).setdefault(int(c), {}).setdefault(arm, {})
                    slot.setdefault("run", []).append(position)
                    for key in HIGHER_IS_BETTER:
                        slot.setdefault(key, []).append(value(figures, key))
    return table


def median(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else math.nan


def _fmt(v: float, spec: str) -> str:
    return "nan" if v != v else format(v, spec)


def report(table: dict, n_runs: int) -> list[str]:
    lines = [f"bench_gateway_pool: {n_runs} run(s); each cell: the runs' values / their median"]
    for mode in sorted(table):
        lines.append(f"\n== {mode}")
        for c in sorted(table[mode]):
            for arm, figures in sorted(table[mode][c].items(), key=lambda kv: kv[0] != KVCOMPASSD):
                cells = []
                for key, heading, spec, _ in FIGURES:
                    vals = figures[key]
                    cells.append(f"{heading} {' '.join(_fmt(v, spec) for v in vals)} / {_fmt(median(vals), spec)}")
                lines.append(f"  c={c:<3} {arm:<13} " + "; ".join(cells))
    return lines


def _as_good(ours: float, theirs: float, key: str) -> bool:
    """Ours at least as good as theirs on figure ``key`` (False if either is NaN)."""
    return ours >= theirs if HIGHER_IS_BETTER[key] else ours <= theirs


def _per_run_held(ours: dict, theirs: dict, key: str) -> tuple[int, int]:
    """In how many runs holding both arms (with the figure) ours was at least as good."""
    their_value = dict(zip(theirs["run"], theirs[key]))
    pairs = [(a, their_value[run]) for run, a in zip(ours["run"], ours[key]) if run in their_value]
    pairs = [(a, b) for a, b in pairs if a == a and b == b]
    return sum(_as_good(a, b, key) for a, b in pairs), len(pairs)


def targets(table: dict) -> list[str]:
    lines = ["\ntargets (kvcompassd against each other arm, pooled medians; 'runs' = single runs it held in):"]
    for mode in sorted(table):
        service = mode.startswith("service")
        for c in sorted(table[mode]):
            arms = table[mode][c]
            ours = arms.get(KVCOMPASSD)
            if ours is None:
                continue
            for arm, theirs in sorted(arms.items()):
                if arm == KVCOMPASSD:
                    continue
                if service:
                    checks = [("throughput", "rps"), ("P99", "p99_ms")]
                else:
                    checks = [("throughput ÷ direct", "ratio"), ("router CPU per request", "cpu_us")]
                    if c == 1:
                        checks.append(("added P50", "added_p50_ms"))
                for name, key in checks:
                    a, b = median(ours[key]), median(theirs[key])
                    met = _as_good(a, b, key)
                    held, paired = _per_run_held(ours, theirs, key)
                    lines.append(f"  {mode} c={c} vs {arm}: {name} {a:.4g} against {b:.4g}: "
                                 f"{'met' if met else 'NOT met'} (runs {held}/{paired})")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="bench_gateway.py --json outputs, one per run")
    args = p.parse_args(argv)
    runs = load_runs(args.runs)
    table = pooled(runs)
    print("\n".join(report(table, len(runs)) + targets(table)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
