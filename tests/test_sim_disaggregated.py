"""Prefill-decode disaggregated fleets in the simulator (paper App. C): the KV transfer event,
decode workers' region and index, the shared decode draw, and fig18 at tiny size."""

from __future__ import annotations

import itertools
import json
import tomllib
from pathlib import Path

import numpy as np
import pytest

from kvcompassd.core.config import load_config, parse_config
from kvcompassd.sim.baselines import BASELINES
from kvcompassd.sim.baselines.random_policy import RandomPolicy
from kvcompassd.sim.baselines.round_robin import RoundRobinPolicy
from kvcompassd.sim.disaggregated import DisaggregatedSimulation
from kvcompassd.sim.engine import SimSettings, SimulationError, request_window, simulate
from kvcompassd.sim.exp_fig18 import SCHEMES, run_fig18
from kvcompassd.sim.geo import DEPLOYMENTS, GeoError, render_toml
from kvcompassd.sim.kvcompass_policy import KVCompassPolicy
from kvcompassd.sim.policy import BasePolicy, PolicyError, RouteDecision, Topology
from kvcompassd.sim.schemes import make_policy, make_workload, region_weights
from kvcompassd.sim.synthetic import MixedWorkload
from kvcompassd.sim.workloads import Request

CONFIG = Path(__file__).resolve().parent.parent / "config"
BETA = 0.1          # ms per prompt token
DECODE_MS = 10.0    # ms per decode step at batch 1
ONE_WAY = 50.0      # ms between the regions
INTRA = 0.5         # ms inside a region
GBPS = 40.0
KV_BYTES = 128 * 1024  # Llama-3.1-8B BF16, per token


def pd_config(layout: dict[str, tuple[int, int]], *, gbps: float = GBPS):
    """Regions -> (prefill workers, decode workers), prefill first in config order."""
    workers = []
    for region, (n_prefill, n_decode) in layout.items():
        for role, n in (("prefill", n_prefill), ("decode", n_decode)):
            for i in range(n):
                workers.append({"id": f"{region}-{role}-{i}", "region": region, "role": role,
                                "prefill_ms_per_token": BETA, "decode_ms_per_token": DECODE_MS,
                                "vram_kv_tokens": 100_000, "dram_kv_tokens": 0, "max_running": 8,
                                "kv_transfer_gbps": gbps})
    names = list(layout)
    data = {
        "cluster": {"name": "pd", "model": "m", "shards": 2, "intra_region_one_way_ms": INTRA},
        "index": {"block_size": 16},
        "regions": [{"name": r} for r in names],
        "links": [{"between": [a, b], "one_way_ms": ONE_WAY} for a, b in itertools.combinations(names, 2)],
        "workers": workers,
    }
    return parse_config(data, "pd")


def request(i: int, tokens: np.ndarray, *, region: str, t: float, out: int) -> Request:
    return Request(i, t, region, i, tokens.astype(np.uint32), out)


class Pinned(BasePolicy):
    """Routes everything to one worker."""

    name = "pinned"

    def __init__(self, topo: Topology, worker: int) -> None:
        super().__init__(topo)
        self.worker = worker

    def route(self, req: Request, *, now: float) -> RouteDecision:
        return RouteDecision(self.worker, 0.0, 0)


def transfer_ms(tokens: int, gbps: float = GBPS) -> float:
    return tokens * KV_BYTES * 8 / (gbps * 1e9) * 1000.0


def test_a_lone_requests_ttft_is_prefill_plus_transfer_plus_first_decode_step():
    topo = Topology.from_config(pd_config({"a": (1, 1), "b": (1, 1)}))
    policy = Pinned(topo, 0)  # a-prefill-0, across the WAN from region b
    tokens = np.arange(1000)
    first = request(0, tokens, region="b", t=0.0, out=5)
    again = request(1, tokens, region="b", t=10.0, out=1)  # long after: the same prompt, now cached
    result = simulate(topo, policy, [first, again])
    r = result.records
    assert r["worker"].tolist() == [0, 0] and r["decode_worker"].tolist() == [1, 1]

    wan = 2 * ONE_WAY
    expected = wan + BETA * 1000 + transfer_ms(1000) + DECODE_MS
    assert r["ttft_ms"][0] == pytest.approx(expected, abs=1e-6)
    # The answer: 4 decode steps in all (5 tokens, the first sampled by the prefill), alone in the batch.
    assert r["e2e_ms"][0] == pytest.approx(wan + BETA * 1000 + transfer_ms(1000) + 4 * DECODE_MS, abs=1e-6)
    assert r["transfer_ms"][0] == pytest.approx(transfer_ms(1000), abs=1e-6)

    # Cached: 992 tokens (62 full pages) reused, 8 prefilled; the whole prompt's KV still moves.
    assert r["reused_tokens"][1] == 992
    assert r["ttft_ms"][1] == pytest.approx(wan + BETA * 8 + transfer_ms(1000) + DECODE_MS, abs=1e-6)
    assert r["e2e_ms"][1] == pytest.approx(r["ttft_ms"][1], abs=1e-6)  # one token: one step


def test_transfers_from_one_prefill_worker_queue_on_its_link():
    topo = Topology.from_config(pd_config({"a": (1, 1)}, gbps=1.0))
    rng = np.random.default_rng(0)
    # Two prompts at once: the second's prefill ends 100 ms later, its transfer waits for the first's.
    reqs = [request(i, rng.integers(0, 50_000, 1000), region="a", t=0.0, out=1) for i in range(2)]
    r = simulate(topo, RandomPolicy(topo), reqs).records
    one = transfer_ms(1000, 1.0)  # ~1049 ms at 1 Gbit/s, far longer than a 100 ms prefill
    assert r["transfer_ms"][0] == pytest.approx(one)
    assert r["transfer_ms"][1] == pytest.approx(2 * one - BETA * 1000)


def test_decode_runs_only_on_a_decode_worker_of_the_prefills_region():
    cfg = load_config(CONFIG / "testbed-3continent-pd.toml")
    topo = Topology.from_config(cfg)
    reqs = request_window(make_workload("mixed-hot", 24.0, region_weights(topo), seed=3), duration_s=3.0)
    for policy in (RandomPolicy(topo, seed=1), RoundRobinPolicy(topo), RandomPolicy(topo, seed=1, scope="region")):
        r = simulate(topo, policy, reqs).records
        assert len(r["id"]) == len(reqs)
        decode = r["decode_worker"]
        assert not topo.routable[decode].any() and topo.routable[r["worker"]].all()
        assert (topo.worker_region[decode] == r["worker_region"]).all()
        assert len(set(r["worker_region"].tolist())) == 3  # requests reached every region's pool


def test_every_scheme_gets_the_same_decode_draws():
    topo = Topology.from_config(pd_config({"a": (2, 3), "b": (2, 3)}))
    rng = np.random.default_rng(5)
    reqs = [request(i, rng.integers(0, 50_000, 200), region="ab"[i % 2], t=i * 0.05, out=3) for i in range(200)]
    runs = [simulate(topo, policy, reqs).records for policy in (RandomPolicy(topo, seed=9), RoundRobinPolicy(topo))]
    same_region = runs[0]["worker_region"] == runs[1]["worker_region"]
    assert 40 < same_region.sum() < 160  # the two schemes disagree on the region often enough to matter
    assert (runs[0]["decode_worker"][same_region] == runs[1]["decode_worker"][same_region]).all()
    # The draw is uniform over the region's decode workers: all three are used.
    assert len(set(runs[0]["decode_worker"].tolist())) == 6


def test_decode_workers_never_hold_index_entries():
    cfg = load_config(CONFIG / "testbed-3continent-pd.toml")
    topo = Topology.from_config(cfg)
    policy = KVCompassPolicy(topo)
    reqs = request_window(make_workload("mixed-hot", 24.0, region_weights(topo), seed=1), duration_s=2.0)
    r = simulate(topo, policy, reqs).records
    assert len(r["id"]) == len(reqs) and (r["reused_tokens"] > 0).any()
    policy.settle(now=1e6)
    decode_ids = {topo.worker_ids[d] for d in np.flatnonzero(~topo.routable)}
    seen: set[str] = set()
    for shard in policy.shards:
        for key in shard_keys(shard):
            seen.update(shard.holders(key))
    assert seen and seen <= {topo.worker_ids[p] for p in np.flatnonzero(topo.routable)}
    assert not seen & decode_ids
    assert all(len(policy.trees[d]) == 0 for d in np.flatnonzero(~topo.routable))
    assert all(len(policy.trees[p]) > 0 for p in np.flatnonzero(topo.routable))


def shard_keys(shard) -> list[int]:
    keys = []
    for group in shard.group_items().values():
        keys.extend(int(k) for k in group[0])
    return keys


def test_a_policy_routing_to_a_decode_worker_is_refused():
    topo = Topology.from_config(pd_config({"a": (1, 1)}))

    with pytest.raises(PolicyError, match="decode worker a-decode-0"):
        simulate(topo, Pinned(topo, 1), [request(0, np.arange(100), region="a", t=0.0, out=2)])


def test_mixed_workers_cannot_join_a_disaggregated_simulation():
    data = tomllib.loads(Path(CONFIG / "testbed-3continent-pd.toml").read_text())
    data["workers"][0]["role"] = "mixed"
    del data["workers"][0]["bootstrap_port"]
    topo = Topology.from_config(parse_config(data, "x"))
    with pytest.raises(SimulationError, match="prefill or decode"):
        DisaggregatedSimulation(topo, RandomPolicy(topo))


def test_the_census_variant_splits_every_region_and_matches_the_generator():
    text = render_toml(DEPLOYMENTS["census-64x8-pd"])
    assert (CONFIG / "census-64x8-pd.toml").read_text() == text
    cfg = load_config(CONFIG / "census-64x8-pd.toml")
    assert len(cfg.workers) == 64 and cfg.disaggregated
    for region in cfg.region_names():
        roles = [w.role for w in cfg.workers_in(region)]
        assert roles.count("decode") >= 1 and roles.count("prefill") >= 1
    assert sum(w.role == "decode" for w in cfg.workers) == 20
    colocated = load_config(CONFIG / "census-64x8.toml")
    assert [w.id for w in cfg.workers] == [w.id for w in colocated.workers]


def test_a_one_worker_region_cannot_be_split():
    from dataclasses import replace

    spec = replace(DEPLOYMENTS["northamerica-11"], decode_share=0.3)  # New York has one worker
    with pytest.raises(GeoError, match="cannot hold both"):
        render_toml(spec)


def test_the_testbed_variant_is_the_papers_7_prefill_3_decode():
    cfg = load_config(CONFIG / "testbed-3continent-pd.toml")
    roles = [w.role for w in cfg.workers]
    assert roles.count("prefill") == 7 and roles.count("decode") == 3
    base = load_config(CONFIG / "testbed-3continent.toml")
    assert cfg.links == base.links and cfg.score == base.score and cfg.index == base.index


def test_fig18_at_tiny_size_runs_every_scheme(tmp_path):
    rows = run_fig18(tmp_path, duration_s=2.0, warmup_s=0.5, seed=2)
    assert [r["scheme"] for r in rows] == list(SCHEMES)
    assert {"random", "sglang-cache-aware", "round-robin", "consistent-hash",
            "sglang-cache-aware-regional"} < set(SCHEMES)
    for r in rows:
        assert r["requests"] > 20 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0
        assert r["warmup_s"] == 0.5 and r["measured_s"] == 1.5 and r["seed"] == 2
    kvc = next(r for r in rows if r["scheme"] == "kvcompass")
    assert kvc["median_ratio_to_kvcompass"] == kvc["p99_ratio_to_kvcompass"] == 1.0
    assert json.loads((tmp_path / "summary.json").read_text())[0]["scheme"] == SCHEMES[0]
    text = (tmp_path / "summary.md").read_text()
    assert "paper: 1.25-1.69x" in text and "0.5 s warm-up, then 1.5 s" in text
    assert "fleet-wide baselines over KVCompass" in text and "regional baselines over KVCompass" in text
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 0


def test_the_experiments_command_registers_fig18():
    from kvcompassd.sim.experiments import EXPERIMENTS

    assert "fig18" in EXPERIMENTS


def test_make_policy_builds_the_fig18_baselines():
    topo = Topology.from_config(pd_config({"a": (2, 1), "b": (1, 1)}))
    for name in SCHEMES:
        policy = make_policy(name, topo, seed=0)
        d = policy.route(request(0, np.arange(300), region="a", t=0.0, out=2), now=0.0)
        assert topo.routable[d.worker_index]


def test_settings_seed_changes_the_draws():
    topo = Topology.from_config(pd_config({"a": (1, 4)}))
    reqs = [request(i, np.arange(50) + i * 100, region="a", t=i * 0.01, out=2) for i in range(60)]
    draws = [simulate(topo, RandomPolicy(topo), reqs, settings=SimSettings(seed=s)).records["decode_worker"]
             for s in (0, 0, 1)]
    assert (draws[0] == draws[1]).all() and not (draws[0] == draws[2]).all()


@pytest.mark.parametrize("name", sorted(BASELINES) + ["kvcompass"])
def test_every_scheme_routes_only_to_prefill_workers(name):
    topo = Topology.from_config(pd_config({"a": (2, 1), "b": (2, 2)}))
    reqs = request_window(MixedWorkload(60.0, {"a": 1, "b": 1}, seed=4), duration_s=None, max_requests=80)
    r = simulate(topo, make_policy(name, topo, seed=0), reqs).records
    assert len(r["id"]) == 80
    assert topo.routable[r["worker"]].all() and not topo.routable[r["decode_worker"]].any()


def test_an_answer_enters_the_prefill_cache_only_when_the_next_turn_is_prefilled():
    topo = Topology.from_config(pd_config({"a": (1, 1)}))
    rng = np.random.default_rng(8)
    turn1 = rng.integers(0, 50_000, 500)
    answer = rng.integers(0, 50_000, 200)  # what turn 1's decode produced, on the decode worker
    turn2 = np.concatenate([turn1, answer, rng.integers(0, 50_000, 60)])
    turn3 = np.concatenate([turn2, rng.integers(0, 50_000, 60)])
    reqs = [request(0, turn1, region="a", t=0.0, out=200), request(1, turn2, region="a", t=10.0, out=5),
            request(2, turn3, region="a", t=20.0, out=5)]
    r = simulate(topo, Pinned(topo, 0), reqs).records
    # Turn 2 finds only turn 1's prompt (its full pages), not the answer the decode worker wrote;
    # turn 3 finds turn 2's whole prompt, the answer included, because turn 2 prefilled it.
    assert r["reused_tokens"].tolist() == [0, 496, 752]
