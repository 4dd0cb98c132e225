"""tools/fleet_false_lookups.py on one small shipped fleet: it simulates KVCompass there, prints
the fleet's row with its window, and fails (exit 1) only above the 0.2 % target."""

from __future__ import annotations

from pathlib import Path
from tool_loader import load_tool

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    return load_tool("fleet_false_lookups")


def test_a_fleet_is_simulated_with_its_own_bits_and_reported_against_the_target(capsys):
    tool = _tool()
    config = ROOT / "config" / "northamerica-11.toml"
    row = tool.measure(config, fraction=0.5, duration_s=1.0, min_requests=150, seed=0)
    assert (row["workers"], row["regions"], row["bits"]) == (11, 4, 11)
    assert row["requests"] > 0 and row["duration_s"] >= 150 / row["rate"] / 0.75  # long enough for the requests
    assert 0.0 <= row["false_claimed"] and 0.0 <= row["false"] <= 1.0
    code = tool.main(["--configs", str(config), "--fraction", "0.5", "--duration", "1", "--min-requests", "150"])
    out = capsys.readouterr().out
    assert code == (0 if row["false"] <= 0.002 else 1)  # the same run again: same figure, same verdict
    assert "| northamerica-11.toml | 11 x 4 | 4 | 11 |" in out and "worst:" in out
