"""The ``scale`` experiment (sim/exp_scale.py) at a small size: every scheme at every rate in a
process of its own, with latency, false lookups, peak RSS and CPU per simulated request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcompassd.core.config import load_config
from kvcompassd.sim import experiments
from kvcompassd.sim.exp_scale import SCALE_DEPLOYMENT, SCALE_SCHEMES, lambda0
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
    assert (tmp_path / "scale" / "scale.md").read_text().count("\n| ") == 1 + len(rows)


def test_the_scale_fleet_is_the_shipped_1024_by_64_census_with_a_shard_per_region():
    cfg = load_config(CONFIG / f"{SCALE_DEPLOYMENT}.toml")
    assert (len(cfg.workers), len(cfg.region_names()), cfg.shards) == (1024, 64, 64)
    assert cfg.index.initial_capacity == 0  # tables sized from their expected entries
    lam0 = lambda0(Topology.from_config(cfg), sample=2000)
    assert 9_000 < lam0 < 12_500  # the 0.75 and 1.13 lambda0: ~8,000 and ~12,000 req/s
