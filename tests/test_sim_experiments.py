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


def test_fig14_quick_writes_heatmap_and_peaks(tmp_path):
    assert main(["fig14", "--quick", "--out", str(tmp_path), "--schemes", "load-balance-oracle,consistent-hash",
                 "--rates", "60", "--page-tokens", "64"]) == 0
    rows = json.loads((tmp_path / "fig14" / "summary.json").read_text())
    assert {r["scheme"] for r in rows} == {"load-balance-oracle", "consistent-hash"}
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
    assert len((tmp_path / "table4" / "table4.md").read_text().splitlines()) == 2 + len(rows)
    logged = (tmp_path / "table4" / "points.jsonl").read_text().splitlines()
    assert len(logged) == len(rows)


@pytest.mark.slow
def test_table5_quick_splits_every_false_lookup_by_cause(tmp_path):
    assert main(["table5", "--quick", "--out", str(tmp_path), "--rates", "300", "--page-tokens", "64"]) == 0
    rows = json.loads((tmp_path / "table5" / "summary.json").read_text())
    assert sorted(r["workload"] for r in rows) == ["lmsys", "mixed", "wildchat"]
    assert any(r["false_lookup_rate"] > 0 for r in rows)
    for r in rows:  # with the exact cache map tracked, the two causes cover every false lookup
        causes = r["false_lost_in_flight"] + r["false_within_page"] + r["false_view_ahead"]
        assert causes == pytest.approx(r["false_lookup_rate"])
        # KVCompass explains each stale or false entry by the index that was behind, or neither,
        # or its own pending ledger.
        explained = r["false_index_behind"] + r["false_view_behind"] + r["false_keyless"] + r["false_pending"]
        assert explained == pytest.approx(r["false_view_ahead"])
    assert len((tmp_path / "table5" / "table5.md").read_text().splitlines()) == 2 + len(rows)
