"""fig_long at a tiny size: its rows, windows, capacity and reuse-by-length table."""

from __future__ import annotations

import json

import pytest

from kvcompassd.sim import experiments
from kvcompassd.sim.exp_long import no_reuse_capacity, report, run_long


def test_fig_long_is_registered_as_an_experiment():
    assert experiments.EXPERIMENTS["fig_long"].__module__ == "kvcompassd.sim.exp_long"


def test_capacity_follows_the_fleet_and_its_servable_prompts():
    testbed = no_reuse_capacity("testbed-3continent", sessions=300)
    census = no_reuse_capacity("census-64x8", sessions=300)
    # 14 workers at beta 0.085 on ~60 K-token prompts (capped at the testbed's 96 K VRAM): ~2.8 req/s;
    # 64 workers on ~64 K-token prompts: ~12 req/s.
    assert 2.2 < testbed < 3.4 and 9.5 < census < 14.5
    assert no_reuse_capacity("testbed-3continent", sessions=300) == testbed  # seeded


def test_fig_long_tiny_run_reports_every_scheme_its_window_and_reuse_by_length(tmp_path):
    rows = run_long(tmp_path, deployments=("testbed-3continent",), schemes=("kvcompass", "dynamo"), fractions=(0.5,),
                    requests_per_point=10, warmup_s=2.0, capacity_sessions=300, paper_reach=True)
    assert [r["scheme"] for r in rows] == ["kvcompass", "dynamo", "kvcompass-paper-reach"]
    for r in rows:
        assert r["load"] == 0.5 and r["rate"] == pytest.approx(0.5 * r["lambda0"], abs=1e-3)
        assert r["window"] == f"2-{2.0 + 10 / r['rate']:.0f}"
        # Every prompt of the workload is >= 32 K tokens: the long bucket holds them all.
        assert r["requests"] == r["requests_ge32k"] > 0 and r["requests_lt8k"] == r["requests_8k_32k"] == 0
        assert 0.0 <= r["reuse_ge32k"] <= 1.0
    assert rows[0]["requests"] == rows[1]["requests"] == rows[2]["requests"]  # one request stream for all
    table = (tmp_path / "reuse_by_length.md").read_text()
    assert "| long@testbed-3continent | " in table and "| dynamo |" in table
    assert json.loads((tmp_path / "summary.json").read_text())[0]["scheme"] == "kvcompass"
    text = report(rows)
    assert "testbed-3continent at 0.5 x lambda0" in text and f"arrivals {rows[0]['window']} s measured" in text
    assert "seed 0" in text and text.count("P99 TTFT") == 3
