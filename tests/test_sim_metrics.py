"""Metrics on hand-made results, and the CLI end to end on a small run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvcompassd.sim.cli import main
from kvcompassd.sim.engine import RECORD_FIELDS, SimResult
from kvcompassd.sim.metrics import load_factor_peak, load_factors, reuse_by_length_table, summarize
from kvcompassd.sim.policy import FALSE_NO_VRAM_ROOM


def result(n: int = 100) -> SimResult:
    rec = {f: np.zeros(n) for f in RECORD_FIELDS}
    rec["id"] = np.arange(n)
    rec["arrival_s"] = np.linspace(0, 9.9, n)
    rec["ttft_ms"] = np.arange(1, n + 1, dtype=float)  # 1..100 ms
    rec["e2e_ms"] = rec["ttft_ms"] * 10
    rec["finish_s"] = rec["arrival_s"] + 0.05
    rec["prompt_tokens"] = np.full(n, 1000)
    rec["output_tokens"] = np.full(n, 10)
    rec["reused_tokens"] = np.full(n, 400)
    rec["claimed_tokens"] = np.where(np.arange(n) < 5, 800, 400)  # 5 false lookups
    rec["dram_tokens"] = np.full(n, 100)
    rec["edge_region"] = np.zeros(n)
    rec["worker_region"] = np.where(np.arange(n) % 4 == 0, 1, 0)
    rec["remote_only"] = np.where(np.arange(n) < 10, 1, np.where(np.arange(n) < 40, 0, -1))
    # Of the 5 false lookups (claimed 800, reused 400): 2 lost in flight, 1 within a page, 2 view
    # ahead: one the policy explained as a keyless false hit, one as its pending ledger's
    rec["false_cause"] = np.array([1, 1, 2, 7, 6] + [0] * (n - 5))
    bins = np.array([[1.0, 1.0], [1.0, 1.0], [2.0, 4.0]])  # worker 2 is the hot one
    return SimResult("x", rec, bins, 5.0, 1.0)


def test_reuse_by_prompt_length_by_hand_and_beside_dynamo():
    r = result()
    # Prompts of 1,000 / 10,000 / 40,000 / 131,072 tokens; reuse 400, 5,000, 10,000, 131,072.
    r.records["prompt_tokens"] = np.resize([1000, 10_000, 40_000, 131_072], 100)
    r.records["reused_tokens"] = np.resize([400, 5000, 10_000, 131_072], 100)
    s = summarize(r)
    assert (s.requests_lt8k, s.requests_8k_32k, s.requests_ge32k) == (25, 25, 50)
    assert s.reuse_lt8k == pytest.approx(0.4) and s.reuse_8k_32k == pytest.approx(0.5)
    assert s.reuse_ge32k == pytest.approx(141_072 / 171_072)
    empty = summarize(result())  # every prompt 1,000 tokens: the long buckets are empty
    assert empty.requests_ge32k == 0 and np.isnan(empty.reuse_ge32k)
    rows = [dict(s.as_dict(), scheme="kvcompass", workload="long", rate=2.0),
            dict(s.as_dict(), scheme="dynamo", workload="long", rate=2.0, reuse_ge32k=0.8)]
    table = reuse_by_length_table(rows, "t")
    line = next(x for x in table.splitlines() if "| kvcompass |" in x)
    assert "82.5 (50) | +2.5" in line and "40.0 (25) | +0.0" in line


def test_summary_by_hand():
    s = summarize(result())
    assert s.ttft_p50_ms == pytest.approx(50.5)
    assert s.ttft_p99_ms == pytest.approx(99.01)
    assert s.hit_rate == pytest.approx(0.4)
    assert s.recomputed_tokens == 100 * 600 and s.reused_tokens == 100 * 400
    assert s.dram_share_of_reuse == pytest.approx(0.25)
    assert s.false_lookup_rate == pytest.approx(0.05)
    assert s.false_lookup_rate_claimed == pytest.approx(0.05)
    assert s.false_lost_in_flight == pytest.approx(0.02) and s.false_within_page == pytest.approx(0.01)
    assert s.false_view_ahead == pytest.approx(0.02)
    assert s.false_keyless == pytest.approx(0.01) and s.false_index_behind == 0.0 and s.false_view_behind == 0.0
    assert s.false_pending == pytest.approx(0.01)
    assert s.false_no_vram_room == 0.0


def test_a_dram_copy_without_vram_to_reload_into_is_its_own_cause():
    r = result()
    r.records["claimed_tokens"][5] = 800  # a sixth false lookup: the holder had no VRAM free
    r.records["false_cause"][5] = FALSE_NO_VRAM_ROOM
    s = summarize(r)
    assert s.false_lookup_rate == pytest.approx(0.06) and s.false_no_vram_room == pytest.approx(0.01)
    assert s.false_lost_in_flight == pytest.approx(0.02)  # the other causes as they were
    assert s.cross_region_share == pytest.approx(0.25)
    assert s.remote_only_share == pytest.approx(10 / 40)
    # Totals per worker 2, 2, 6 -> mean 10/3 -> peak 6 / (10/3) = 1.8
    assert s.load_factor_peak == pytest.approx(1.8)


def test_throughput_is_every_token_over_first_arrival_to_last_completion():
    res = result()
    res.records["finish_s"][-1] = 19.9  # one straggler stretches the run to 19.9 s
    s = summarize(res, warmup_s=5.0)
    assert s.throughput_tok_s == pytest.approx(100 * 1010 / 19.9)  # warm-up requests included
    assert s.output_tok_s == pytest.approx(100 * 10 / 19.9)
    # The window [5.0, 9.9] s holds the 49 measured requests that finished inside it
    assert s.window_tok_s == pytest.approx(49 * 1010 / 4.9)


def test_false_lookup_causes_are_nan_when_the_truth_is_not_tracked():
    res = result()
    res.records["false_cause"] = np.full(100, -1)
    s = summarize(res)
    assert s.false_lookup_rate == pytest.approx(0.05)
    assert np.isnan(s.false_lost_in_flight) and np.isnan(s.false_within_page) and np.isnan(s.false_view_ahead)


def test_load_factors_per_bin_and_warmup():
    res = result()
    lf = load_factors(res)
    assert lf[:, 0] == pytest.approx([0.75, 0.75, 1.5])
    assert load_factor_peak(res, warmup_s=5.0) == pytest.approx(4.0 / 2.0)


def test_warmup_excludes_early_requests():
    s = summarize(result(), warmup_s=5.0)
    assert s.requests == 50 and s.ttft_p50_ms == pytest.approx(75.5)


def test_cli_writes_tables_and_plots(tmp_path):
    out = tmp_path / "run"
    rc = main(["--deployment", "northamerica-11", "--workload", "lmsys", "--schemes", "load-balance-oracle,consistent-hash",
               "--rates", "40,80", "--requests", "80", "--out", str(out), "--track-cross-region"])
    assert rc == 0
    rows = json.loads((out / "summary.json").read_text())
    assert [(r["scheme"], r["rate"]) for r in rows] == [("load-balance-oracle", 40), ("consistent-hash", 40),
                                                        ("load-balance-oracle", 80), ("consistent-hash", 80)]
    assert all(r["requests"] == 80 for r in rows)
    for name in ("summary.csv", "summary.md", "p99_ttft_vs_rate.png", "ttft_box.png", "e2e_box.png",
                 "throughput.png", "load_factor.png"):
        assert (out / name).stat().st_size > 0
    assert "| load-balance-oracle | 40 |" in (out / "summary.md").read_text()


def test_cli_rejects_unknown_scheme(tmp_path):
    with pytest.raises(SystemExit, match="unknown scheme"):
        main(["--schemes", "nope", "--requests", "5", "--out", str(tmp_path)])
