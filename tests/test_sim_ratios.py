"""tools/sim_ratios.py: KVCompass against each baseline, printed with the window it was measured over."""

import json

from tool_loader import load_tool

sim_ratios = load_tool("sim_ratios")


def _row(scheme: str, p99: float, **window) -> dict:
    return {"scheme": scheme, "workload": "mixed", "rate": 3000.0, "ttft_p99_ms": p99, "throughput_tok_s": 1000.0,
            "hit_rate": 0.5, "load_factor_peak": 1.1, "seed": 0, **window}


def test_ratios_are_printed_with_their_window(tmp_path, capsys) -> None:
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps([_row("kvcompass", 100.0, warmup_s=5.0, measured_s=2.5, requests=7500),
                                   _row("dynamo", 133.0, warmup_s=5.0, measured_s=2.5, requests=7500)]))
    assert sim_ratios.main([str(summary)]) == 0
    printed = capsys.readouterr().out
    assert "window: seed 0; warm-up 5 s + measured 2.5 s; 7,500 measured requests" in printed, printed
    assert "| dynamo | 133 | 1.33x | 1.3x |" in printed, printed


def test_a_row_from_before_measured_s_gives_its_window_from_its_duration(tmp_path, capsys) -> None:
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps([_row("kvcompass", 100.0, warmup_s=5.0, duration_s=20.0, requests=45000),
                                   _row("chord", 292.0, warmup_s=5.0, duration_s=20.0, requests=45000)]))
    assert sim_ratios.main([str(summary)]) == 0
    printed = capsys.readouterr().out
    assert "warm-up 5 s + measured 15 s; 45,000 measured requests" in printed, printed
