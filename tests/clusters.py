"""Small cluster configs built in code for tests (the same parser the daemons use)."""

from __future__ import annotations

import itertools

from kvcompassd.core.config import ClusterConfig, parse_config


def make_cluster(
    regions: dict[str, int],
    *,
    shards: int = 2,
    value_bits: int = 32,
    fingerprint_bits: int = 0,
    one_way_ms: float = 40.0,
    block_size: int = 16,
    levels: int = 4,
    same_region_min_tokens: int = 32,
    prefill_ms_per_token: float = 0.1,
    initial_capacity: int = 64,
    long_growth: float = 1.25,  # the tests' hand-worked lengths past 1,008 tokens use 1.25 steps
    **score: float,
) -> ClusterConfig:
    names = list(regions)
    data = {
        "cluster": {"name": "test", "model": "test-model", "tenant": "", "shards": shards},
        "index": {
            "block_size": block_size,
            "levels": levels,
            "same_region_min_tokens": same_region_min_tokens,
            "value_bits": value_bits,
            "fingerprint_bits": fingerprint_bits,
            "initial_capacity": initial_capacity,
            "long_growth": long_growth,
        },
        "score": dict(score),
        "regions": [{"name": r} for r in names],
        "links": [
            {"between": [a, b], "one_way_ms": one_way_ms * (1 + i)}
            for i, (a, b) in enumerate(itertools.combinations(names, 2))
        ],
        "workers": [
            {
                "id": f"{r}-{i}",
                "region": r,
                "prefill_ms_per_token": prefill_ms_per_token,
                "decode_ms_per_token": 10.0,
                "vram_kv_tokens": 100000,
                "dram_kv_tokens": 400000,
                "max_running": 8,
            }
            for r in names
            for i in range(regions[r])
        ],
    }
    return parse_config(data, "<test>")
