"""tools/sim_seeds.py: seed lists, the per-seed comparison, and one short real run."""

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "sim_seeds.py"
_spec = importlib.util.spec_from_file_location("sim_seeds", TOOL)
sim_seeds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim_seeds)


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


def test_a_short_run_reports_every_seed(tmp_path) -> None:
    out = tmp_path / "seeds.json"
    run = subprocess.run([sys.executable, str(TOOL), "--workload", "lmsys", "--rate", "20", "--duration", "2",
                          "--seeds", "0-1", "--schemes", "kvcompass,dynamo", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "dynamo / kvcompass P99:" in run.stdout and "/2 seeds" in run.stdout, run.stdout
    body = json.loads(out.read_text())
    assert sorted((r["seed"], r["scheme"]) for r in body["rows"]) == [
        (0, "dynamo"), (0, "kvcompass"), (1, "dynamo"), (1, "kvcompass")]
    assert body["compare"]["dynamo"]["seeds"] == 2
    # Different seeds draw different request streams; the schemes of one seed replay the same one.
    tokens = {(r["seed"], r["scheme"]): r["reused_tokens"] + r["recomputed_tokens"] for r in body["rows"]}
    assert tokens[(0, "kvcompass")] == tokens[(0, "dynamo")] and tokens[(1, "kvcompass")] == tokens[(1, "dynamo")]
    assert tokens[(0, "kvcompass")] != tokens[(1, "kvcompass")]
