"""Scheme names -> routing policies, and workload names -> request streams, for the CLI and
the experiments.

KVCompass comes from ``kvcompassd.sim.kvcompass_policy`` (the adapter that drives the real core),
constructed as ``KVCompassPolicy(topo, ablation=Ablation, seed=int)``. Ablations (Fig. 15) are
the scheme names ``kvcompass-no-load``, ``kvcompass-no-xregion``, ``kvcompass-tier-blind`` and
``kvcompass-no-migration``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from kvcompassd.core.ablation import Ablation

from .baselines import BASELINES, make_baseline
from .policy import PolicyError, Topology
from .synthetic import (MIXED_HOT_SKEW, MIXED_HOT_SKEW_COMMON, AzureWorkload, ChatWorkload, LongContextParams,
                        LongContextWorkload, MixedWorkload, SessionWorkload)
from .workloads import (MOONCAKE_BLOCK_TOKENS, Request, WorkloadError, mooncake_requests, read_azure, read_mooncake,
                        rescale)

KVCOMPASS_VARIANTS: dict[str, Ablation] = {
    "kvcompass": Ablation(),
    "kvcompass-no-load": Ablation.without("load_aware"),
    "kvcompass-no-xregion": Ablation.without("cross_region"),
    "kvcompass-tier-blind": Ablation.without("tier_aware"),
    "kvcompass-no-migration": Ablation.without("migration"),
}
PAPER_SCHEMES = ("central-directory", "planetserve", "consistent-hash", "chord", "skywalker", "dynamo", "kvcompass")
ALL_SCHEMES = tuple(KVCOMPASS_VARIANTS) + tuple(BASELINES)

# §5.1: LFU for Mixed, LRU for WildChat and LMSYS (the best policy for each workload).
DEFAULT_EVICTION = {"mixed": "lfu", "mixed-hot": "lfu", "wildchat": "lru", "lmsys": "lru", "mooncake": "lru",
                    "azure-conv": "lru", "azure-code": "lru", "long": "lru"}
WORKLOADS = tuple(DEFAULT_EVICTION)
# The public traces ship inside the package (kvcompassd/data/traces, with their licences).
TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"


def make_policy(name: str, topo: Topology, *, seed: int = 0, **options: Any):
    if name in KVCOMPASS_VARIANTS:
        try:
            from .kvcompass_policy import KVCompassPolicy  # the lead's adapter over the real core
        except ImportError as exc:
            raise PolicyError(f"scheme {name!r} needs kvcompassd.sim.kvcompass_policy ({exc})") from None
        return KVCompassPolicy(topo, ablation=KVCOMPASS_VARIANTS[name], seed=seed, **options)
    if name in ("chord", "random", "random-regional"):
        options.setdefault("seed", seed)
    return make_baseline(name, topo, **options)


def region_weights(topo: Topology, how: str = "workers") -> dict[str, float]:
    """Users per region: proportional to worker count (the census measures deployed capacity,
    which follows demand) or, with ``how="population"``, to the regions' populations."""
    if how == "workers":
        return {r: float(len(topo.workers_in(i))) for i, r in enumerate(topo.regions)}
    if how == "population":
        from .geo import SITES

        return {r: SITES[r].population_m if r in SITES else 1.0 for r in topo.regions}
    raise WorkloadError(f"region weighting must be 'workers' or 'population', got {how!r}")


def traces_dir(override: str | Path | None = None) -> Path:
    """The directory holding ``mooncake/`` and ``azure_llm_2023/``: ``override`` when given (it
    must exist: a mistyped ``--traces`` is an error, not a silent fall-back), else the package's."""
    path = Path(override) if override is not None else TRACES
    if path.exists() and not path.is_dir():
        raise WorkloadError(f"traces directory {str(path)!r} is a file, not a directory "
                            f"(to replay one Mooncake-format file, give it as --trace)")
    if not path.is_dir():
        raise WorkloadError(f"traces directory {str(path)!r} does not exist"
                            + ("" if override is not None else " (the package was installed without its data)"))
    return path


def mooncake_stream(path: str | Path, rate: float, weights: Mapping[str, float], *, seed: int = 0,
                    block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Iterator[Request]:
    """A Mooncake-format trace replayed at ``rate`` req/s: its inter-arrival gaps scaled by
    (native rate / ``rate``), so the trace's burstiness is kept. The file is read and checked
    completely before the first request is returned."""
    recs = read_mooncake(path, block_tokens=block_tokens)
    span_s = (recs[-1].timestamp_ms - recs[0].timestamp_ms) / 1000.0
    if len(recs) < 2 or span_s <= 0:
        raise WorkloadError(f"trace file {str(path)!r}: replaying at a rate needs at least two records "
                            f"with different timestamps")
    native = (len(recs) - 1) / span_s
    return rescale(mooncake_requests(path, weights, seed=seed, block_tokens=block_tokens, records=recs),
                   rate, native)


def make_workload(name: str, rate: float, weights: Mapping[str, float], *, seed: int = 0,
                  traces: str | Path | None = None, trace: str | Path | None = None,
                  trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                  max_prompt_tokens: int | None = None) -> Iterator[Request]:
    """``trace``: a Mooncake-format JSONL file a user brings, replayed as workload ``mooncake``
    instead of the bundled synthetic trace (``trace_block_tokens`` tokens per hash id).
    ``max_prompt_tokens``: the longest prompt workload ``long`` may send (the fleet's, see
    ``synthetic.servable_prompt_tokens``; default the model's 128 K context); other workloads
    keep their own lengths."""
    if trace is not None:
        if name != "mooncake":
            raise WorkloadError(f"a trace file replays as workload 'mooncake', not {name!r}")
        return mooncake_stream(trace, rate, weights, seed=seed, block_tokens=trace_block_tokens)
    session = _session_workload(name, rate, weights, seed=seed, traces=traces, max_prompt_tokens=max_prompt_tokens)
    if session is not None:
        return iter(session)
    if name == "mooncake":
        return mooncake_stream(traces_dir(traces) / "mooncake" / "synthetic_trace.jsonl", rate, weights, seed=seed)
    raise WorkloadError(f"unknown workload {name!r}; known: {WORKLOADS}")


def prompt_lengths(name: str, rate: float, weights: Mapping[str, float], *, seed: int = 0,
                   traces: str | Path | None = None) -> Iterator[int]:
    """The prompt length of each request ``make_workload`` yields, in order; the synthetic
    workloads draw them without making the prompts' tokens."""
    session = _session_workload(name, rate, weights, seed=seed, traces=traces)
    if session is not None:
        return session.prompt_lengths()
    return (r.prompt_tokens for r in make_workload(name, rate, weights, seed=seed, traces=traces))


def _session_workload(name: str, rate: float, weights: Mapping[str, float], *, seed: int,
                      traces: str | Path | None = None,
                      max_prompt_tokens: int | None = None) -> SessionWorkload | None:
    """The synthetic workload ``name`` names, or None when it is a trace replay."""
    if name == "mixed":
        return MixedWorkload(rate, weights, seed=seed)
    if name == "long":
        params = LongContextParams() if max_prompt_tokens is None else LongContextParams(max_prompt_tokens=max_prompt_tokens)
        return LongContextWorkload(rate, weights, seed=seed, params=params)
    if name == "mixed-hot":  # hot-skew Mixed, full-size prompts (App. C; synthetic.MIXED_HOT_SKEW)
        return MixedWorkload(rate, weights, seed=seed, params=MIXED_HOT_SKEW, common=MIXED_HOT_SKEW_COMMON)
    if name in ("wildchat", "lmsys"):
        return ChatWorkload(rate, weights, flavour=name, seed=seed)
    if name in ("azure-conv", "azure-code"):
        kind = name.split("-")[1]
        trace = read_azure(traces_dir(traces) / "azure_llm_2023" / f"AzureLLMInferenceTrace_{kind}.csv")
        return AzureWorkload(rate, weights, trace, seed=seed)
    return None
