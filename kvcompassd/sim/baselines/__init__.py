"""The paper's baselines (§5.1) and the load-balance oracle (a bound, not a router), each a ``RoutingPolicy`` (see each module's
docstring for what its design lets it see)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..policy import PolicyError, Topology
from .directory import CentralDirectoryPolicy
from .dynamo import DynamoPolicy
from .hashing import ChordPolicy, ConsistentHashPolicy
from .oracle import LoadBalanceOraclePolicy
from .planetserve import PlanetServePolicy
from .random_policy import RandomPolicy
from .round_robin import RoundRobinPolicy
from .sglang_cache_aware import SGLangCacheAwarePolicy
from .skywalker import SkyWalkerPolicy

BASELINES: dict[str, Callable[..., Any]] = {
    "consistent-hash": ConsistentHashPolicy,
    "chord": ChordPolicy,
    "planetserve": PlanetServePolicy,
    "central-directory": CentralDirectoryPolicy,
    "skywalker": SkyWalkerPolicy,
    "dynamo": DynamoPolicy,
    "load-balance-oracle": LoadBalanceOraclePolicy,
    "random": RandomPolicy,
    "round-robin": RoundRobinPolicy,
    "sglang-cache-aware": SGLangCacheAwarePolicy,
}
# Per-region variants (each edge dispatches among its own region's workers only, as a stock
# balancer per region would): "<name>-regional".
for _name in ("random", "round-robin", "consistent-hash", "sglang-cache-aware"):
    BASELINES[f"{_name}-regional"] = functools.partial(BASELINES[_name], scope="region")

# Short names as in the paper's figures.
SHORT = {"central-directory": "CD", "planetserve": "PS", "consistent-hash": "CH", "chord": "ChD",
         "skywalker": "SW", "dynamo": "Dyn", "kvcompass": "KVC", "load-balance-oracle": "LB-Oracle", "random": "Rand",
         "round-robin": "RR", "sglang-cache-aware": "CA"}


def make_baseline(name: str, topo: Topology, **options: Any):
    try:
        cls = BASELINES[name]
    except KeyError:
        raise PolicyError(f"unknown baseline {name!r}; known: {sorted(BASELINES)}") from None
    return cls(topo, **options)
