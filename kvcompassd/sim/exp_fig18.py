"""Fig. 18 (paper App. C): TTFT under prefill-decode disaggregated serving.

    python -m kvcompassd.sim.experiments fig18 [--quick] [--seed S] [--out out/experiments]

The paper's setup: the three-region testbed with 7 prefill and 3 decode RTX 5090 instances
(``config/testbed-3continent-pd.toml``), the hot-skew Mixed workload (``mixed-hot``:
``synthetic.MIXED_HOT_SKEW``) at 24 req/s. Every scheme picks the prefill worker: KVCompass,
random dispatch, round robin, consistent hashing and SGLang's cache-aware router (one per
region's edge, its approximate tree fed only by its own dispatches), each baseline both over the
whole fleet (WAN-blind) and per region (``-regional``). The decode worker is drawn
at random within the prefill's region from one stream identical for all schemes
(``sim.disaggregated``), so the schemes differ only in prefill routing.

Writes ``fig18/summary.{md,json,csv}`` (median and P99 TTFT per scheme, each baseline's ratios to
KVCompass beside the paper's ranges, the measured window) and ``fig18/ttft_cdf.png``, and prints
the table. The window: ``FULL_S`` virtual seconds of arrivals (``QUICK_S`` with ``--quick``), of
which the first quarter warms the caches and sessions and is not measured.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .cli import grid_points, resolve_deployment, run_points
from .engine import SimResult, SimSettings
from .schemes import DEFAULT_EVICTION

DEPLOYMENT = "testbed-3continent-pd"
WORKLOAD = "mixed-hot"
RATE = 24.0  # req/s, the paper's Fig. 18 operating point
BASELINES = ("random", "sglang-cache-aware", "round-robin", "consistent-hash")
# Each baseline twice: WAN-blind over the whole fleet's prefill workers (as the simulator's other
# baselines), and "-regional", every edge dispatching only among its own region's (a stock
# per-region prefill-decode balancer). The paper does not say which its testbed ran.
SCHEMES = (*BASELINES, *(f"{b}-regional" for b in BASELINES), "kvcompass")
# 240 s: ~4,300 measured requests (~43 above the P99); ~120 CPU-s for the nine schemes.
FULL_S = 240.0
QUICK_S = 40.0
# The paper's Fig. 18 text: KVCompass's median TTFT is 1.25-1.69x below every baseline's, its
# P99 1.3-15.7x below.
PAPER_MEDIAN_RATIOS = (1.25, 1.69)
PAPER_P99_RATIOS = (1.3, 15.7)
LABELS = {"random": "Random", "sglang-cache-aware": "Cache-aware", "round-robin": "Round-robin",
          "consistent-hash": "Consistent-hash", "kvcompass": "KVCompass"}
LABELS.update({f"{b}-regional": f"{LABELS[b]} (regional)" for b in BASELINES})


def run_fig18(out: Path, *, duration_s: float = FULL_S, warmup_s: float | None = None, seed: int = 0,
              schemes: Sequence[str] = SCHEMES, rate: float = RATE, deployment: str = DEPLOYMENT,
              jobs: int = 1, progress: bool = False, page_tokens: int | None = None,
              policy_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Run every scheme on one request stream and write the table and the CDF under ``out``.
    Returns one row per scheme. ``warmup_s`` defaults to a quarter of ``duration_s``."""
    if "kvcompass" not in schemes:
        raise SystemExit("fig18 compares every scheme to KVCompass: include 'kvcompass' in --schemes")
    warmup_s = duration_s / 4.0 if warmup_s is None else warmup_s
    cfg_path = resolve_deployment(deployment)
    settings = SimSettings(eviction=DEFAULT_EVICTION[WORKLOAD], seed=seed)
    points = grid_points(cfg_path, WORKLOAD, schemes, [rate], seed=seed, duration_s=duration_s, warmup_s=warmup_s,
                         settings=settings, page_tokens=page_tokens, policy_options=policy_options,
                         run_progress=progress and jobs <= 1)
    done = run_points(points, jobs=jobs, progress=progress, desc="fig18", log=out / "points.jsonl")
    results = {p.scheme: result for p, (_, result) in zip(points, done)}
    rows = table_rows(results, warmup_s=warmup_s, duration_s=duration_s, seed=seed, rate=rate,
                      deployment=cfg_path.stem)
    write(rows, results, out, warmup_s=warmup_s)
    return rows


def _measured_ttft(result: SimResult, warmup_s: float) -> np.ndarray:
    r = result.records
    return r["ttft_ms"][r["arrival_s"] >= warmup_s]


def table_rows(results: dict[str, SimResult], *, warmup_s: float, duration_s: float, seed: int, rate: float,
               deployment: str) -> list[dict[str, Any]]:
    """Median and P99 TTFT of each scheme's measured requests and its ratios to KVCompass's."""
    stats = {}
    for scheme, result in results.items():
        ttft = _measured_ttft(result, warmup_s)
        if not len(ttft):
            raise SystemExit(f"fig18: no request of {scheme} arrived after the {warmup_s:g} s warm-up")
        r = result.records
        measured = r["arrival_s"] >= warmup_s
        stats[scheme] = {
            "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "requests": int(len(ttft)),
            "hit_rate": float(r["reused_tokens"][measured].sum() / max(1, r["prompt_tokens"][measured].sum())),
            "cross_region_share": float((r["edge_region"][measured] != r["worker_region"][measured]).mean()),
            "transfer_ms_mean": float(r["transfer_ms"][measured].mean()) if "transfer_ms" in r else float("nan"),
        }
    kvc = stats["kvcompass"]
    rows = []
    for scheme, s in stats.items():
        rows.append({
            "scheme": scheme, **s,
            "median_ratio_to_kvcompass": s["ttft_p50_ms"] / kvc["ttft_p50_ms"],
            "p99_ratio_to_kvcompass": s["ttft_p99_ms"] / kvc["ttft_p99_ms"],
            "rate": rate, "deployment": deployment, "workload": WORKLOAD, "seed": seed,
            "warmup_s": warmup_s, "measured_s": duration_s - warmup_s,
        })
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    first = rows[0]
    lines = [
        f"# Fig. 18: TTFT under prefill-decode disaggregation ({first['workload']}, {first['rate']:g} req/s, "
        f"{first['deployment']})",
        "",
        f"Window: {first['warmup_s']:g} s warm-up, then {first['measured_s']:g} s of arrivals measured "
        f"(seed {first['seed']}); decode worker drawn at random in the prefill's region, same draws for every scheme.",
        "",
        "| scheme | n | TTFT P50 ms | TTFT P99 ms | P50 / KVCompass | P99 / KVCompass | hit % | x-region | "
        "KV transfer ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['scheme']} | {r['requests']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                     f"{r['median_ratio_to_kvcompass']:.2f}x | {r['p99_ratio_to_kvcompass']:.2f}x | "
                     f"{r['hit_rate']:.1%} | {r['cross_region_share']:.1%} | {r['transfer_ms_mean']:.1f} |")
    groups = (("fleet-wide baselines", [r for r in rows if r["scheme"] in BASELINES]),
              ("regional baselines", [r for r in rows if r["scheme"].endswith("-regional")]),
              ("other baselines", [r for r in rows if r["scheme"] != "kvcompass" and r["scheme"] not in BASELINES
                                   and not r["scheme"].endswith("-regional")]))
    lines.append("")
    for label, base in groups:
        if not base:
            continue
        med = [r["median_ratio_to_kvcompass"] for r in base]
        p99 = [r["p99_ratio_to_kvcompass"] for r in base]
        lines.append(
            f"- {label} over KVCompass: median {min(med):.2f}-{max(med):.2f}x (paper: "
            f"{PAPER_MEDIAN_RATIOS[0]:g}-{PAPER_MEDIAN_RATIOS[1]:g}x), P99 {min(p99):.2f}-{max(p99):.2f}x (paper: "
            f"{PAPER_P99_RATIOS[0]:g}-{PAPER_P99_RATIOS[1]:g}x).")
    return "\n".join(lines) + "\n"


def write(rows: list[dict[str, Any]], results: dict[str, SimResult], out: Path, *, warmup_s: float) -> None:
    import csv

    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(rows, indent=1, default=float))
    (out / "summary.md").write_text(markdown(rows))
    with open(out / "summary.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.2, 3.0))
    colours = {b: f"C{i}" for i, b in enumerate((*BASELINES, "kvcompass"))}
    for scheme, result in results.items():
        ttft = np.sort(_measured_ttft(result, warmup_s))
        regional = scheme.endswith("-regional")  # dashed, in its fleet-wide counterpart's colour
        ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=LABELS.get(scheme, scheme),
                color=colours.get(scheme.removesuffix("-regional")), linestyle="--" if regional else "-")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("CDF")
    ax.legend(fontsize=6)
    ax.set_title("Prefill-decode disaggregated serving", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=150)
    plt.close(fig)


def fig18(args) -> list[dict[str, Any]]:
    """The ``experiments`` entry point (``args``: its parsed command line)."""
    duration = QUICK_S if args.quick else FULL_S
    rate = (args.rates or [RATE])[0]
    options = {} if getattr(args, "fingerprint_bits", None) is None else {"fingerprint_bits": args.fingerprint_bits}
    rows = run_fig18(args.out / "fig18", duration_s=duration, seed=args.seed, schemes=args.schemes or SCHEMES,
                     rate=rate, jobs=args.jobs, progress=args.progress, page_tokens=getattr(args, "page_tokens", None),
                     policy_options=options)
    print(markdown(rows), end="")
    return rows
