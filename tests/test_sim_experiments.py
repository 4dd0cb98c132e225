"""Experiment commands that are cheap enough for CI."""

from __future__ import annotations

import json

import pytest

from kvcompassd.sim.experiments import main


def test_fig19_cross_region_only_share_on_mooncake(tmp_path):
    # No --traces: the experiment finds the Mooncake trace the package ships.
    assert main(["fig19", "--quick", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "fig19" / "summary.json").read_text())
    runs = summary["runs"]
    assert len(runs) == 3
    for r in runs:
        assert r["hits"] == r["local"] + r["remote_only"] > 0
        assert r["first_turns"] > r["hits"]
    assert 0.0 < summary["mean_remote_only_share"] < 1.0
    assert (tmp_path / "fig19" / "fig19.png").stat().st_size > 0


def test_fig14_quick_writes_heatmap_and_peaks(tmp_path, capsys):
    assert main(["fig14", "--quick", "--out", str(tmp_path), "--schemes", "load-balance-oracle,consistent-hash",
                 "--rates", "60", "--page-tokens", "64"]) == 0
    rows = json.loads((tmp_path / "fig14" / "summary.json").read_text())
    assert {r["scheme"] for r in rows} == {"load-balance-oracle", "consistent-hash"}
    # Every row records the window it measured (fig14 --quick: 3 s of arrivals, the first 0.75 s excluded) ...
    for r in rows:
        assert (r["seed"], r["warmup_s"], r["arrivals_s"], r["measured_s"]) == (0, 0.75, 3.0, 2.25)
        assert 0 < r["requests"] < r["arrivals"]
    # ... and prints it beside every point, as do the tables it writes.
    n = rows[0]["requests"]
    printed = capsys.readouterr().out
    assert "# fig14: mixed on census-64x8" in printed
    assert "| seed | warm-up s | measured s | n |" in printed
    assert f"| 0 | 0.75 | 2.25 | {n} |" in printed
    window = f"Window: seed 0; warm-up 0.75 s + measured 2.25 s; {n:,} measured requests."
    assert window in printed
    assert window in (tmp_path / "fig14" / "mixed" / "summary.md").read_text()
    assert window in (tmp_path / "fig14" / "summary.md").read_text()
    assert all(r["load_factor_peak"] >= 1.0 for r in rows)
    assert (tmp_path / "fig14" / "mixed" / "load_factor.png").stat().st_size > 0
    logged = [json.loads(line) for line in (tmp_path / "fig14" / "points.jsonl").read_text().splitlines()]
    assert sorted(r["scheme"] for r in logged) == sorted(r["scheme"] for r in rows)


def test_fig15_quick_is_closed_loop_and_relative_to_the_full_system(tmp_path):
    assert main(["fig15", "--quick", "--out", str(tmp_path), "--schemes", "kvcompass,kvcompass-no-load",
                 "--rates", "40", "--page-tokens", "64", "--clients-per-worker", "1"]) == 0
    rows = json.loads((tmp_path / "fig15" / "summary.json").read_text())
    assert [r["scheme"] for r in rows] == ["kvcompass", "kvcompass-no-load"]
    assert all(r["clients"] == 14 for r in rows)  # 1 per worker of the 14-worker testbed
    assert rows[0]["throughput_vs_full"] == 1.0 and rows[1]["throughput_vs_full"] > 0
    assert (tmp_path / "fig15" / "ablation.png").stat().st_size > 0
    # The table says what moves the ablations: DRAM's share of reuse, migrations and why not.
    table = (tmp_path / "fig15" / "summary.md").read_text().splitlines()
    header = [c.strip() for c in table[2].strip("|").split("|")]
    assert header[-5:] == ["vs full", "DRAM % of reuse", "migrations", "hot, no idle worker", "hot, no remote match"]
    first = [c.strip() for c in table[4].strip("|").split("|")]
    assert first[0] == "kvcompass" and first[-5] == "1.000"
    assert first[-3:] == [str(rows[0][k]) for k in ("migrations", "hot_misses_no_idle_worker",
                                                    "hot_misses_no_remote_match")]


def test_fig19_prints_and_records_its_window(tmp_path, capsys):
    assert main(["fig19", "--quick", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "fig19" / "summary.json").read_text())
    assert summary["window"]["trace"] == "synthetic_trace.jsonl" and summary["window"]["seeds"] == [0, 1, 2]
    assert summary["window"]["records"] > summary["window"]["first_turns"] > 0
    printed = capsys.readouterr().out
    assert "fig19 window: whole trace synthetic_trace.jsonl (" in printed and "seeds 0-2 (3)" in printed
    assert printed.count("fig19: seed ") == 3
    assert "Window: whole trace synthetic_trace.jsonl" in (tmp_path / "fig19" / "summary.md").read_text()


def test_sweep_points_keep_the_warm_up_and_shorten_only_the_measured_part():
    from kvcompassd.sim.experiments import point_duration

    assert point_duration(200.0, 20.0, 5.0, 7_500) == 20.0
    assert point_duration(6000.0, 20.0, 5.0, 7_500) == 5.0 + 7_500 / 6000.0
    assert point_duration(6000.0, 20.0, 5.0, 0) == point_duration(6000.0, 20.0, 5.0, None) == 20.0


@pytest.mark.slow
def test_table4_quick_runs_every_variant_in_one_pool(tmp_path):
    assert main(["table4", "--quick", "--out", str(tmp_path), "--rates", "40", "--page-tokens", "64",
                 "--jobs", "2"]) == 0
    rows = json.loads((tmp_path / "table4" / "summary.json").read_text())
    assert [r["variant"] for r in rows] == ["base", "jitter 25%", "jitter 50%", "jitter 100%", "loss 10%",
                                            "loss 20%", "loss 30%", "delay 100 ms", "delay 200 ms", "delay 300 ms"]
    table = (tmp_path / "table4" / "table4.md").read_text().splitlines()
    assert len(table) == 2 + len(rows) + 2  # header, rule, rows, blank, window line
    assert table[0].startswith("| variant | scheme | seed | warm-up s | measured s | n |")
    assert table[-1] == f"Window: seed 0; warm-up 0.5 s + measured 1.5 s; {rows[0]['requests']:,} measured requests."
    logged = (tmp_path / "table4" / "points.jsonl").read_text().splitlines()
    assert len(logged) == len(rows)


@pytest.mark.slow
def test_table5_quick_splits_every_false_lookup_by_cause(tmp_path):
    assert main(["table5", "--quick", "--out", str(tmp_path), "--rates", "300", "--page-tokens", "64"]) == 0
    rows = json.loads((tmp_path / "table5" / "summary.json").read_text())
    assert sorted(r["workload"] for r in rows) == ["lmsys", "mixed", "wildchat"]
    assert any(r["false_lookup_rate"] > 0 for r in rows)
    for r in rows:  # with the exact cache map tracked, the two causes cover every false lookup
        causes = r["false_lost_in_flight"] + r["false_no_vram_room"] + r["false_within_page"] + r["false_view_ahead"]
        assert causes == pytest.approx(r["false_lookup_rate"])
        # KVCompass explains each stale or false entry by the index that was behind, or neither,
        # or its own pending ledger.
        explained = r["false_index_behind"] + r["false_view_behind"] + r["false_keyless"] + r["false_pending"]
        assert explained == pytest.approx(r["false_view_ahead"])
    table = (tmp_path / "table5" / "table5.md").read_text().splitlines()
    assert len(table) == 2 + len(rows) + 2  # header, rule, rows, blank, window line
    assert all(line.count("|") == table[0].count("|") for line in table[1:-2])
    assert "| seed | warm-up s | measured s | n |" in table[0] and table[-1].startswith("Window: seed 0; warm-up 0.5 s")
