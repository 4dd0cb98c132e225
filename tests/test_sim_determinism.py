"""The simulator's results pinned to a recorded run: a speed change must leave every decision and
every figure alone. A small census-style fleet (22 workers in 8 regions, one shard per region, so
edges read index views at many lags and the shared views' compaction runs) under Mixed at 8x its
worker count in req/s, for KVCompass, Dynamo and the central directory: per scheme the P50, P99
and mean TTFT, the reuse, and a SHA-256 over every per-request record column (tools/sim_digest.py),
compared exactly with ``tests/data/sim_determinism.json``.

The file was written by the code before the simulator's CPU work of issue 31. A change that is
meant to change results re-records it (and says why in its commit):

    PYTHONPATH=. python tests/test_sim_determinism.py --record
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest

from kvcompassd.core.config import parse_config
from kvcompassd.sim.engine import SimSettings, request_window, simulate
from kvcompassd.sim.geo import DEPLOYMENTS, render_toml, scale_deployment
from kvcompassd.sim.metrics import summarize
from kvcompassd.sim.policy import Topology
from kvcompassd.sim.schemes import make_policy, make_workload, region_weights
from tool_loader import load_tool

RECORDED = Path(__file__).resolve().parent / "data" / "sim_determinism.json"
SCHEMES = ("kvcompass", "dynamo", "central-directory")
SEED, DURATION_S, WARMUP_S = 3, 3.0, 0.5
FIGURES = ("requests", "ttft_p50_ms", "ttft_p99_ms", "ttft_mean_ms", "hit_rate", "reused_tokens")


def _digest(result) -> str:
    return load_tool("sim_digest").digest(result)


def run_all() -> dict[str, dict]:
    spec = scale_deployment(DEPLOYMENTS["northamerica-11"], factor=2, split=2)
    topo = Topology.from_config(parse_config(tomllib.loads(render_toml(spec)), spec.name))
    requests = request_window(make_workload("mixed", 8.0 * topo.n_workers, region_weights(topo), seed=SEED),
                              duration_s=DURATION_S)
    out = {}
    for scheme in SCHEMES:
        result = simulate(topo, make_policy(scheme, topo, seed=SEED), requests,
                          settings=SimSettings(eviction="lfu", seed=SEED), duration_s=DURATION_S)
        summary = summarize(result, warmup_s=WARMUP_S).as_dict()
        out[scheme] = {**{k: summary[k] for k in FIGURES}, "digest": _digest(result)}
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    return run_all()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_results_are_the_recorded_ones(runs, scheme):
    recorded = json.loads(RECORDED.read_text())[scheme]  # missing data fails, never skips
    assert runs[scheme]["requests"] > 300
    assert {k: runs[scheme][k] for k in FIGURES} == {k: recorded[k] for k in FIGURES}
    assert runs[scheme]["digest"] == recorded["digest"]


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        raise SystemExit(__doc__)
    RECORDED.write_text(json.dumps(run_all(), indent=1) + "\n")
    print(f"wrote {RECORDED}")
