"""Tiny deployments for the simulator tests."""

from __future__ import annotations

from kvcompassd.core.config import parse_config
from kvcompassd.sim.policy import Topology

BETA = 0.1        # ms per prompt token
DECODE = 10.0     # ms per output token (batch 1)
ONE_WAY = 50.0    # ms between the two regions


def two_region_config(workers_a: int = 1, workers_b: int = 1, *, vram: int = 100_000, dram: int = 0,
                      context: int | None = None):
    workers = [
        {"id": f"a-{i}", "region": "a", "prefill_ms_per_token": BETA, "decode_ms_per_token": DECODE,
         "vram_kv_tokens": vram, "dram_kv_tokens": dram, "max_running": 8}
        for i in range(workers_a)
    ] + [
        {"id": f"b-{i}", "region": "b", "prefill_ms_per_token": BETA, "decode_ms_per_token": DECODE,
         "vram_kv_tokens": vram, "dram_kv_tokens": dram, "max_running": 8}
        for i in range(workers_b)
    ]
    data = {
        "cluster": {"name": "tiny", "model": "m", "shards": 2, "intra_region_one_way_ms": 0.5},
        "index": {"block_size": 16, **({} if context is None else {"context_tokens": context})},
        "regions": [{"name": "a"}, {"name": "b"}],
        "links": [{"between": ["a", "b"], "one_way_ms": ONE_WAY}],
        "workers": workers,
    }
    return parse_config(data, "tiny")


def two_region_topology(workers_a: int = 1, workers_b: int = 1, *, page_tokens: int | None = None, **kw) -> Topology:
    return Topology.from_config(two_region_config(workers_a, workers_b, **kw), page_tokens=page_tokens)
