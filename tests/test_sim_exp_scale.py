"""The ``scale`` experiment (sim/exp_scale.py) at a small size: every scheme at every rate in a
process of its own, with latency, false lookups, peak RSS and CPU per simulated request."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvcompassd.core.config import load_config
from kvcompassd.sim import experiments
from kvcompassd.sim import exp_scale
from kvcompassd.sim.exp_scale import SCALE_DEPLOYMENT, SCALE_SCHEMES, lambda0, pool_scale
from kvcompassd.sim.policy import Topology

CONFIG = Path(__file__).resolve().parents[1] / "config"


def test_scale_runs_each_scheme_alone_and_reports_its_costs(tmp_path, capsys):
    assert experiments.main(["scale", "--quick", "--deployment", "northamerica-11", "--rates", "60",
                             "--jobs", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "scale" / "summary.json").read_text())
    assert sorted(r["scheme"] for r in rows) == sorted(SCALE_SCHEMES)
    for r in rows:
        assert r["rate"] == 60 and r["deployment"] == "northamerica-11"
        assert r["simulated_requests"] >= r["requests"] > 0
        assert 0 < r["peak_rss_gib"] < 4 and r["cpu_ms_per_request"] > 0 and r["setup_cpu_s"] >= 0
        assert 0 <= r["false_lookup_rate"] <= 1 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0
        assert r["lambda0_fraction"] == pytest.approx(60 / r["lambda0"])
    out = capsys.readouterr().out
    assert "CPU ms/req" in out and "peak RSS GiB" in out and "kvcompass" in out
    text = (tmp_path / "scale" / "scale.md").read_text()
    runs, pooled = text.split("## Pooled over seeds")
    assert runs.count("\n| ") == 1 + len(rows) and pooled.count("\n| ") == 1 + len(rows)  # one seed: one line each


def test_the_scale_fleet_is_the_shipped_1024_by_64_census_with_a_shard_per_region():
    cfg = load_config(CONFIG / f"{SCALE_DEPLOYMENT}.toml")
    assert (len(cfg.workers), len(cfg.region_names()), cfg.shards) == (1024, 64, 64)
    assert cfg.index.initial_capacity == 0  # tables sized from their expected entries
    lam0 = lambda0(Topology.from_config(cfg), sample=2000)
    assert 9_000 < lam0 < 12_500  # the 0.75 and 1.13 lambda0: ~8,000 and ~12,000 req/s


def _run_row(scheme: str, seed: int, ttft: list[float], *, false_rate: float, cpu_s: float, simulated: int,
             rss: float) -> dict:
    """A run's row as measured_point logs it (the keys pooling reads)."""
    return {"scheme": scheme, "seed": seed, "rate": 100.0, "workload": "mixed", "load": 0.75, "lambda0": 133.3,
            "lambda0_fraction": 0.75, "window": "0.5-2", "warmup_s": 0.5, "duration_s": 2.0, "measured_s": 1.5,
            "requests": len(ttft), "throughput_tok_s": 500.0, "ttft_p99_ms": float(np.percentile(ttft, 99)), "ttft_mean_ms": float(np.mean(ttft)),
            "false_lookup_rate": false_rate, "peak_rss_gib": rss, "cpu_s": cpu_s, "simulated_requests": simulated,
            "cpu_ms_per_request": 1000 * cpu_s / simulated, "setup_cpu_s": 1.0, "requests_ge32k": 0,
            "_ttft_ms": ttft, "_tokens": 1000.0, "_span_s": 2.0, "_ge32k_prompt": 0, "_ge32k_reused": 0}


def test_runs_pool_over_seeds_as_one_sample_not_an_average_of_seeds():
    slow = list(np.linspace(100, 1000, 100))  # seed 0: a long tail
    fast = [50.0] * 300  # seed 1: three times the requests, no tail
    rows = [_run_row("kvcompass", 0, slow, false_rate=0.01, cpu_s=2.0, simulated=120, rss=1.5),
            _run_row("kvcompass", 1, fast, false_rate=0.0, cpu_s=3.0, simulated=380, rss=2.5)]
    (p,) = pool_scale(rows)
    both = np.array(slow + fast)
    assert p["requests"] == 400 and p["seeds"] == "0,1"
    assert p["ttft_p99_ms"] == pytest.approx(np.percentile(both, 99)) and p["ttft_mean_ms"] == pytest.approx(both.mean())
    assert p["false_lookup_rate"] == pytest.approx(0.01 * 100 / 400)  # over all measured requests
    assert p["cpu_ms_per_request"] == pytest.approx(1000 * 5.0 / 500)  # over all simulated requests
    assert p["peak_rss_gib"] == 2.5  # the worst run


def test_pool_from_pools_runs_logged_by_separate_invocations(tmp_path, capsys):
    logs = []
    for name, rows in (("a", [_run_row("dynamo", s, [80.0 + s] * 50, false_rate=0.0, cpu_s=1.0, simulated=60,
                                       rss=1.0) for s in (0, 1, 2)]),
                       ("b", [_run_row("kvcompass", s, [70.0 + s] * 50, false_rate=0.0, cpu_s=2.0, simulated=60,
                                       rss=2.0) for s in (0, 1, 2)])):
        path = tmp_path / name / "points.jsonl"
        path.parent.mkdir()
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        logs.append(str(path))
    assert exp_scale.main(["--pool-from", *logs, "--out", str(tmp_path / "pooled")]) == 0
    pooled = {p["scheme"]: p for p in json.loads((tmp_path / "pooled" / "pooled.json").read_text())}
    assert set(pooled) == {"dynamo", "kvcompass"}
    assert pooled["kvcompass"]["seeds"] == "0,1,2" and pooled["kvcompass"]["requests"] == 150
    assert pooled["kvcompass"]["ttft_mean_ms"] == pytest.approx(71.0)
    assert "| kvcompass | 100 | 0.75 | 0,1,2 | 150 |" in capsys.readouterr().out
