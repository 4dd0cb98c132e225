"""tools/bench_gateway_pool.py: runs pooled by median, and the targets judged on the pooled figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tool_loader import load_tool

SERVICE = "service (VRAM 8192 tokens/worker)"
ZERO = "zero-delay (VRAM 200000 tokens/worker)"


@pytest.fixture(scope="module")
def tool():
    return load_tool("bench_gateway_pool")


def _figures(rps, p99, *, ratio=1.0, added_p50=0.0, reuse=1.0, cpu=None, edge=True):
    out = {"rps": rps, "p99_ms": p99, "ratio": ratio, "added_p50_ms": added_p50, "reuse": reuse}
    if cpu is not None:
        out["cpu_us.edge" if edge else "cpu_us.router"] = cpu
        if edge:
            out["cpu_us.agents"] = 10 * cpu  # not the router's own process: never compared
    return out


def _run(ours: dict, theirs: dict, mode: str = SERVICE) -> dict:
    return {mode: {"kvcompassd": {"by_c": ours}, "vllm-router": {"by_c": theirs}}}


def _write(tmp_path: Path, runs: list[dict]) -> list[Path]:
    paths = []
    for i, run in enumerate(runs):
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps(run))  # (bench_gateway's JSON: concurrency keys become strings)
        paths.append(path)
    return paths


def test_pooled_figures_are_the_runs_medians(tool, tmp_path):
    runs = [_run({16: _figures(60, 500)}, {16: _figures(50, 700)}),
            _run({16: _figures(70, 400)}, {16: _figures(55, 600)}),
            _run({16: _figures(62, 900)}, {16: _figures(52, 650)})]
    table = tool.pooled(tool.load_runs(_write(tmp_path, runs)))
    ours = table[SERVICE][16]["kvcompassd"]
    assert ours["rps"] == [60, 70, 62]
    assert tool.median(ours["rps"]) == 62
    assert tool.median(ours["p99_ms"]) == 500
    assert tool.median(table[SERVICE][16]["vllm-router"]["p99_ms"]) == 650


def test_service_target_is_judged_on_medians_and_counts_single_runs(tool, tmp_path):
    # The third run's P99 is worse than the router's, the pooled median is not.
    runs = [_run({16: _figures(60, 500)}, {16: _figures(50, 700)}),
            _run({16: _figures(70, 400)}, {16: _figures(55, 600)}),
            _run({16: _figures(62, 900)}, {16: _figures(52, 650)})]
    lines = tool.targets(tool.pooled(tool.load_runs(_write(tmp_path, runs))))
    throughput = [line for line in lines if "throughput" in line]
    p99 = [line for line in lines if "P99" in line]
    assert len(throughput) == 1 and "62 against 52: met (runs 3/3)" in throughput[0]
    assert len(p99) == 1 and "500 against 650: met (runs 2/3)" in p99[0]


def test_a_target_the_median_misses_is_reported_not_met(tool, tmp_path):
    runs = [_run({64: _figures(40, 3000)}, {64: _figures(45, 2000)})] * 3
    lines = tool.targets(tool.pooled(tool.load_runs(_write(tmp_path, runs))))
    assert any("throughput 40 against 45: NOT met (runs 0/3)" in line for line in lines)
    assert any("P99 3000 against 2000: NOT met (runs 0/3)" in line for line in lines)


def test_zero_delay_compares_the_routers_own_process_and_the_added_p50_at_c1(tool, tmp_path):
    ours = {1: _figures(500, 5, ratio=0.6, added_p50=1.5, cpu=900), 16: _figures(900, 30, ratio=0.5, cpu=600)}
    theirs = {1: _figures(800, 2, ratio=0.9, added_p50=0.2, cpu=400, edge=False),
              16: _figures(1500, 20, ratio=0.85, cpu=300, edge=False)}
    lines = tool.targets(tool.pooled(tool.load_runs(_write(tmp_path, [_run(ours, theirs, ZERO)]))))
    assert any("c=1 vs vllm-router: router CPU per request 900 against 400: NOT met" in line for line in lines)
    assert any("c=1 vs vllm-router: added P50 1.5 against 0.2: NOT met" in line for line in lines)
    assert not any("c=16" in line and "added P50" in line for line in lines)
    assert any("c=16 vs vllm-router: throughput ÷ direct 0.5 against 0.85: NOT met" in line for line in lines)


def test_an_arm_missing_from_a_run_is_compared_over_the_runs_that_hold_it(tool, tmp_path):
    only_ours = {SERVICE: {"kvcompassd": {"by_c": {16: _figures(61, 500)}}}}
    runs = [only_ours, _run({16: _figures(60, 500)}, {16: _figures(50, 700)})]
    table = tool.pooled(tool.load_runs(_write(tmp_path, runs)))
    assert table[SERVICE][16]["vllm-router"]["rps"] == [50]
    assert tool.median(table[SERVICE][16]["kvcompassd"]["rps"]) == 60.5
    # Single runs pair by run: the router's one run against ours of the same run (500 <= 700).
    assert any("P99 500 against 700: met (runs 1/1)" in line for line in tool.targets(table))


def test_an_unreadable_run_is_a_clear_error(tool, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match="cannot read"):
        tool.load_runs([bad])
