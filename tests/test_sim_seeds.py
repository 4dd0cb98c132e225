"""tools/sim_seeds.py: seed lists, the per-seed comparison, and one short real run."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tool_loader import load_tool

TOOL = Path(__file__).resolve().parent.parent / "tools" / "sim_seeds.py"
sim_seeds = load_tool("sim_seeds")


def test_seed_lists_take_ranges_and_lists() -> None:
    assert sim_seeds.parse_seeds("0-4") == [0, 1, 2, 3, 4]
    assert sim_seeds.parse_seeds("3,1,1") == [1, 3]
    assert sim_seeds.parse_seeds("0-2, 9") == [0, 1, 2, 9]
    for bad in ("", "4-2", "a", "-1", "1-x"):
        with pytest.raises(argparse.ArgumentTypeError):
            sim_seeds.parse_seeds(bad)


def test_compare_counts_the_seeds_the_first_scheme_wins() -> None:
    rows = [{"seed": s, "scheme": scheme, "ttft_p99_ms": p99} for s, scheme, p99 in [
        (0, "kvcompass", 100.0), (0, "dynamo", 110.0),
        (1, "kvcompass", 120.0), (1, "dynamo", 100.0),
        (2, "kvcompass", 90.0), (2, "dynamo", 90.0),   # a tie is not a win
        (3, "kvcompass", 50.0),                        # a seed the other scheme did not run
    ]]
    verdict = sim_seeds.compare(rows, "kvcompass")
    assert set(verdict) == {"dynamo"}
    v = verdict["dynamo"]
    assert v["ratios"] == pytest.approx({0: 1.1, 1: 100 / 120, 2: 1.0})
    assert v["lead_wins"] == 1 and v["seeds"] == 3 and v["median_ratio"] == pytest.approx(1.0)


def test_durations_are_positive_and_distinct() -> None:
    assert sim_seeds.parse_durations("7.5,20,7.5") == [7.5, 20.0]
    for bad in ("", "0", "-1", "a", "5,x"):
        with pytest.raises(argparse.ArgumentTypeError):
            sim_seeds.parse_durations(bad)


def test_a_row_names_its_window_even_from_before_measured_s_was_recorded() -> None:
    assert sim_seeds.window_of({"warmup_s": 5.0, "measured_s": 2.5, "duration_s": 7.5}) == (5.0, 2.5)
    assert sim_seeds.window_of({"warmup_s": 5.0, "duration_s": 20.0}) == (5.0, 15.0)
    with pytest.raises(ValueError, match="records no window"):
        sim_seeds.window_of({"scheme": "dynamo", "seed": 0, "warmup_s": 0.0, "duration_s": None})


def _row(seed: int, measured: float, scheme: str, p99: float, tok_s: float = 1.0) -> dict:
    return {"seed": seed, "warmup_s": 5.0, "measured_s": measured, "scheme": scheme, "ttft_p99_ms": p99,
            "throughput_tok_s": tok_s, "requests": 100, "rate": 3000.0, "workload": "mixed",
            "deployment": "census-64x8"}


def test_spread_is_over_seeds_within_each_window_and_over_all_runs() -> None:
    # A short window that flatters the lead (ratios 1.5, 2.1) and a long one that does less (1.2, 1.1).
    rows = [_row(0, 2.5, "kvcompass", 100.0), _row(0, 2.5, "chord", 150.0),
            _row(1, 2.5, "kvcompass", 100.0), _row(1, 2.5, "chord", 210.0),
            _row(0, 15.0, "kvcompass", 1000.0), _row(0, 15.0, "chord", 1200.0),
            _row(1, 15.0, "kvcompass", 1000.0), _row(1, 15.0, "chord", 1100.0)]
    v = sim_seeds.spread(rows, "kvcompass")["chord"]
    assert list(v["windows"]) == ["warm-up 5 s + measured 2.5 s", "warm-up 5 s + measured 15 s"]
    short, full = v["windows"].values()
    assert short["ratios"] == pytest.approx({0: 1.5, 1: 2.1})
    assert (short["min"], short["median"], short["max"]) == pytest.approx((1.5, 1.8, 2.1))
    assert short["sd"] == pytest.approx(0.6 / 2 ** 0.5)
    assert (full["min"], full["max"], full["mean"]) == pytest.approx((1.1, 1.2, 1.15))
    every = v["all"]
    assert every["n"] == 4 and every["seeds"] == [0, 1] and every["windows"] == 2 and every["lead_wins"] == 4
    assert (every["min"], every["median"], every["max"]) == pytest.approx((1.1, 1.35, 2.1))
    text = sim_seeds.render(rows, "kvcompass", "ttft_p99_ms")
    assert "over all 4 runs (2 seeds, 2 windows): min 1.100  median 1.350  max 2.100" in text
    assert "census-64x8 / mixed at 3000 req/s" in text


def test_a_higher_is_better_metric_counts_the_lead_ahead_below_one() -> None:
    rows = [_row(0, 2.5, "kvcompass", 1.0, tok_s=200.0), _row(0, 2.5, "dynamo", 1.0, tok_s=100.0),
            _row(1, 2.5, "kvcompass", 1.0, tok_s=100.0), _row(1, 2.5, "dynamo", 1.0, tok_s=120.0)]
    v = sim_seeds.spread(rows, "kvcompass", "throughput_tok_s")["dynamo"]
    assert v["all"]["lead_wins"] == 1 and v["all"]["n"] == 2
    assert "higher is better" in sim_seeds.render(rows, "kvcompass", "throughput_tok_s")


def test_a_short_run_reports_every_seed_and_window_and_rereads_its_rows(tmp_path) -> None:
    out = tmp_path / "seeds.json"
    run = subprocess.run([sys.executable, str(TOOL), "--workload", "lmsys", "--rate", "20", "--durations", "1.5,2",
                          "--warmup", "0.5", "--seeds", "0-1", "--schemes", "kvcompass,dynamo", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "dynamo / kvcompass ttft_p99_ms:" in run.stdout, run.stdout
    assert "warm-up 0.5 s + measured 1 s: seed 0 " in run.stdout and "/2 seeds" in run.stdout, run.stdout
    assert "over all 4 runs (2 seeds, 2 windows):" in run.stdout and "/4 runs" in run.stdout, run.stdout
    body = json.loads(out.read_text())
    assert sorted((r["seed"], r["measured_s"], r["scheme"]) for r in body["rows"]) == [
        (s, m, scheme) for s in (0, 1) for m in (1.0, 1.5) for scheme in ("dynamo", "kvcompass")]
    assert all(r["warmup_s"] == 0.5 and r["arrivals_s"] == r["measured_s"] + 0.5 for r in body["rows"])
    assert body["spread"]["dynamo"]["all"]["n"] == 4
    # Different seeds draw different request streams; the schemes of one seed replay the same one.
    tokens = {(r["seed"], r["measured_s"], r["scheme"]): r["reused_tokens"] + r["recomputed_tokens"]
              for r in body["rows"]}
    for s in (0, 1):
        assert tokens[(s, 1.5, "kvcompass")] == tokens[(s, 1.5, "dynamo")]
    assert tokens[(0, 1.5, "kvcompass")] != tokens[(1, 1.5, "kvcompass")]
    # The rows it wrote, read back with --rows, give the same report without running anything.
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps(body["rows"]))
    again = subprocess.run([sys.executable, str(TOOL), "--rows", str(summary), "--schemes", "kvcompass,dynamo"],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert again.stdout == run.stdout
