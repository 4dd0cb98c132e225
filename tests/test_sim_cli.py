"""``kvcompassd sim`` with a trace a user brings: it runs, and a bad trace stops it naming the
file and line before any simulation (never a silent fall-back to the bundled traces)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcompassd.sim.cli import main
from kvcompassd.sim.experiments import main as experiments_main

FORMAT = Path(__file__).parent / "data" / "mooncake_format"


def test_sim_replays_a_users_trace_file(tmp_path, capsys):
    assert main(["--trace", str(FORMAT / "good.jsonl"), "--deployment", "testbed-3continent",
                 "--schemes", "dynamo,random", "--rates", "20", "--requests", "6", "--no-plots",
                 "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert [r["scheme"] for r in rows] == ["dynamo", "random"]
    assert all(r["requests"] == 6 and r["workload"] == "mooncake" for r in rows)
    printed = capsys.readouterr().out
    assert "good.jsonl (Mooncake format)" in printed
    # A run cut by --requests measured up to its last arrival, with no warm-up: that window is printed.
    assert all(r["arrivals"] == 6 and r["warmup_s"] == 0.0 and r["measured_s"] == r["arrivals_s"] > 0 for r in rows)
    assert f"Window: seed 0; warm-up 0 s + measured {rows[0]['measured_s']:g} s; 6 measured requests." in printed
    logged = [json.loads(line) for line in (tmp_path / "points.jsonl").read_text().splitlines()]
    assert [r["scheme"] for r in logged] == ["dynamo", "random"]  # each run as it ended


def test_sim_trace_block_size_is_a_flag(tmp_path):
    argv = ["--trace", str(FORMAT / "good_block16.jsonl"), "--deployment", "testbed-3continent",
            "--schemes", "random", "--rates", "20", "--requests", "6", "--no-plots", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match=r"good_block16\.jsonl:1: .*block size 512"):
        main(argv)
    assert main([*argv, "--trace-block-tokens", "16"]) == 0


@pytest.mark.parametrize(("args", "message"), [
    (["--trace", "{fmt}/bad_block_count.jsonl"], r"bad_block_count\.jsonl:4: field 'hash_ids'"),
    (["--trace", "{fmt}/nope.jsonl"], r"nope\.jsonl' does not exist"),
    (["--trace", "{fmt}/good.jsonl", "--workload", "mixed"], "workload 'mooncake', not 'mixed'"),
    (["--workload", "mooncake", "--traces", "{fmt}/missing-dir"], "missing-dir' does not exist"),
    (["--workload", "mooncake", "--traces", "{fmt}/good.jsonl"], "is a file, not a directory"),
    (["--workload", "mixed", "--traces", "{fmt}/good.jsonl"], "is a file, not a directory"),
])
def test_sim_bad_trace_arguments_stop_before_any_run(tmp_path, args, message):
    argv = [a.format(fmt=FORMAT) for a in args]
    with pytest.raises(SystemExit, match=message):
        main([*argv, "--schemes", "random", "--rates", "20", "--requests", "6", "--no-plots",
              "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_experiments_take_a_trace_file_and_reject_a_bad_one(tmp_path):
    assert experiments_main(["fig19", "--quick", "--trace", str(FORMAT / "good.jsonl"), "--out", str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "fig19" / "summary.json").read_text())["runs"]
    # First turns: records 1, 2 and 4; the others extend an earlier prompt with its answer.
    assert all(r["first_turns"] == 3 for r in runs)
    with pytest.raises(SystemExit, match=r"bad_json\.jsonl:3: not JSON"):
        experiments_main(["fig19", "--quick", "--trace", str(FORMAT / "bad_json.jsonl"), "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="is a file, not a directory"):
        experiments_main(["fig19", "--quick", "--traces", str(FORMAT / "good.jsonl"), "--out", str(tmp_path)])
