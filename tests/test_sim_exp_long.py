"""fig_long at a tiny size: its rows, windows, capacity and reuse-by-length table."""

from __future__ import annotations

import json

import pytest

from kvcompassd.sim import experiments
from kvcompassd.sim.exp_long import main, no_reuse_capacity, report, run_long, targets_table


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


def _pooled(scheme, p99, thr, reuse, workload="long@testbed-3continent", load=0.5):
    return {"workload": workload, "load": load, "scheme": scheme, "rate": 1.0, "lambda0": 2.0, "window": "30-130",
            "warmup_s": 30.0, "seeds": [0, 1, 2], "requests": 300, "measured_s": [100.0] * 3,
            "ttft_p99_ms": p99, "ttft_mean_ms": p99 / 3, "throughput_tok_s": thr, "reuse_ge32k": reuse,
            "requests_ge32k": 300, "seed_p99_ms": [p99] * 3}


def test_targets_table_checks_each_point_within_one_percent_and_two_reuse_points():
    pooled = [_pooled("kvcompass", 10_100.0, 99_100.0, 0.41), _pooled("dynamo", 10_000.0, 100_000.0, 0.43),
              _pooled("chord", 20_000.0, 90_000.0, 0.10),
              _pooled("kvcompass", 10_200.0, 98_900.0, 0.30, load=1.0), _pooled("dynamo", 10_000.0, 100_000.0, 0.33,
                                                                               load=1.0)]
    table = targets_table(pooled)
    met, missed = [line for line in table.splitlines() if line.startswith("| long@")]
    # 1 % above the best P99, 0.9 % below the best throughput, 2 points under Dynamo: met.
    assert "| 10.10 / 10.00 (dynamo) | yes |" in met and "| 99.1 / 100.0 (dynamo) | yes |" in met
    assert met.endswith("| 41.0 / 43.0 | yes |")
    assert "| 10.20 / 10.00 (dynamo) | NO |" in missed and "| 98.9 / 100.0 (dynamo) | NO |" in missed
    assert missed.endswith("| 30.0 / 33.0 | NO |")
    assert "met at 1/2 points (P99), 1/2 (throughput), 1/2 (>=32K reuse)" in table


def test_one_command_pools_seeds_of_the_mooncake_trace_and_prints_windows(tmp_path, capsys):
    assert main(["--deployments", "testbed-3continent", "--workloads", "mooncake", "--schemes", "kvcompass,dynamo",
                 "--loads", "0.5", "--seeds", "0-1", "--requests-per-point", "4", "--warmup", "1",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert sorted((r["scheme"], r["seed"]) for r in rows) == [("dynamo", 0), ("dynamo", 1), ("kvcompass", 0),
                                                             ("kvcompass", 1)]
    assert all(r["workload"] == "mooncake@testbed-3continent" for r in rows)
    pooled = json.loads((tmp_path / "pooled.json").read_text())
    assert {p["scheme"]: p["requests"] for p in pooled} == {
        s: sum(r["requests"] for r in rows if r["scheme"] == s) for s in ("kvcompass", "dynamo")}
    assert all(p["seeds"] == [0, 1] for p in pooled)
    # lambda0 of the trace: 14 workers over its mean prompt's prefill.
    assert pooled[0]["lambda0"] == pytest.approx(no_reuse_capacity("testbed-3continent", workload="mooncake"))
    assert "mooncake@testbed-3continent at 0.5 x lambda0" in out and "warm-up 1 s + measured" in out
    assert "seeds 0,1" in out and "| mooncake@testbed-3continent | 0.5 (" in out
    assert (tmp_path / "targets.md").read_text() in out


def test_a_missing_trace_stops_the_command_naming_the_file(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        main(["--workloads", "mooncake", "--trace", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path)])


def test_saved_runs_pool_again_with_a_scheme_rerun_replacing_its_runs(tmp_path, capsys):
    common = ["--deployments", "testbed-3continent", "--workloads", "mooncake", "--loads", "0.5", "--seeds", "0",
              "--requests-per-point", "4", "--warmup", "1"]
    assert main(common + ["--schemes", "kvcompass,dynamo", "--out", str(tmp_path / "all")]) == 0
    assert main(common + ["--schemes", "kvcompass", "--out", str(tmp_path / "rerun")]) == 0
    capsys.readouterr()
    assert main(["--pool-from", str(tmp_path / "all"), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "pooled.json").read_text() == (tmp_path / "all" / "pooled.json").read_text()
    # The rerun's kvcompass run replaces the first one's (marked here to tell them apart).
    rerun = tmp_path / "rerun" / "runs.jsonl"
    row = json.loads(rerun.read_text())
    row["_ttft_ms"] = [1e6] * len(row["_ttft_ms"])
    rerun.write_text(json.dumps(row) + "\n")
    assert main(["--pool-from", str(tmp_path / "all"), str(tmp_path / "rerun"), "--out", str(tmp_path / "merged")]) == 0
    pooled = {p["scheme"]: p for p in json.loads((tmp_path / "merged" / "pooled.json").read_text())}
    first = {p["scheme"]: p for p in json.loads((tmp_path / "all" / "pooled.json").read_text())}
    assert pooled["kvcompass"]["ttft_p99_ms"] == 1e6 and pooled["dynamo"] == first["dynamo"]
    assert "| mooncake@testbed-3continent | 0.5 (" in capsys.readouterr().out
    rerun.write_text(rerun.read_text() + "{not json\n")
    with pytest.raises(SystemExit, match=r"runs.jsonl:2: not a saved run"):
        main(["--pool-from", str(tmp_path / "rerun"), "--out", str(tmp_path / "bad")])
    with pytest.raises(SystemExit, match="no runs saved there"):
        main(["--pool-from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "bad")])


def _write_trace(path, n: int) -> None:
    """A Mooncake-format trace of ``n`` small records, one every 100 ms (uneven: two share a time)."""
    times = [100 * i for i in range(n)]
    times[3] = times[2]
    lines = [json.dumps({"timestamp": t, "input_length": 1024, "output_length": 4, "hash_ids": [i, 10_000 + i]})
             for i, t in enumerate(times)]
    path.write_text("\n".join(lines) + "\n")


def test_a_trace_too_short_for_the_warmup_keeps_its_measured_arrivals(tmp_path):
    from kvcompassd.sim.exp_long import trace_warmup_s
    from kvcompassd.sim.schemes import mooncake_stream

    trace = tmp_path / "short.jsonl"
    _write_trace(trace, 12)
    arrivals = [r.arrival_s for r in mooncake_stream(trace, 20.0, {"us": 1.0})]
    # Long enough: the warm-up asked for. Too short: the last 4 records measured, the 8 before warm up.
    assert trace_warmup_s(trace, 20.0, requests_per_point=4, warmup_s=0.1) == 0.1
    assert trace_warmup_s(trace, 20.0, requests_per_point=4, warmup_s=60.0) == arrivals[8]
    assert sum(a >= arrivals[8] for a in arrivals) == 4
    assert trace_warmup_s(trace, 20.0, requests_per_point=12, warmup_s=60.0) == 0.0

    rows = run_long(tmp_path / "out", deployments=("testbed-3continent",), schemes=("kvcompass", "dynamo"),
                    fractions=(0.5,), requests_per_point=4, warmup_s=60.0, workloads=("mooncake",), trace=trace)
    for r in rows:
        # Before, the 60 s warm-up outlasted the replay: the pooled point measured nothing.
        assert r["requests"] == len(r["_ttft_ms"]) == 4
        assert r["warmup_s"] < 60.0 and r["window"].startswith(f"{r['warmup_s']:.1f}-")
    pooled = json.loads((tmp_path / "out" / "pooled.json").read_text())
    assert [p["requests"] for p in pooled] == [4, 4]
