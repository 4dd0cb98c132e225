"""Geography of the simulated deployments: regions, great-circle latencies, config generator.

The paper gives worker counts per region for every deployment but latencies only for the
testbeds (and ranges for the simulated ones). Missing one-way latencies are derived as

    one_way_ms = great_circle_km / 200 * 1.5 + 2

i.e. light in fibre at ~2/3 c (200 km per ms), a 1.5x route-inflation factor over the great
circle, and 2 ms of fixed switching/queueing. Where the paper gives a measured range for a
group of links (appendix B), the derived latencies of that group are mapped linearly onto the
paper's range, anchored at its shortest and longest link.

Run ``python -m kvcompassd.sim.geo --out config`` to regenerate the deployment files.

Bigger fleets in the census style (``scale_deployment``): every region's worker count times a
factor, every site split into nearby sub-sites (``SUBSITE_RADIUS_KM`` from it, evenly around it,
the site's population and workers shared out), one shard per region. The 1,024-worker, 64-region
fleet shipped in config/ is census-128x16 x 8 split 4 ways; any other size is

    python -m kvcompassd.sim.geo --out config --from census-128x16 --factor 8 --split 4
    python -m kvcompassd.sim.geo --out config --from census-128x16 --workers 10000 --regions 100
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from kvcompassd.core.config import IndexParams
from kvcompassd.core.fingerprints import MAX_FINGERPRINT_BITS, fingerprint_bits_for
from kvcompassd.core.layout import IndexLayout

EARTH_RADIUS_KM = 6371.0088
FIBRE_KM_PER_MS = 200.0
ROUTE_INFLATION = 1.5
FIXED_MS = 2.0

# Worker calibration: A100-80GB SXM serving Llama-3.1-8B-Instruct in BF16.
# Prefill: ~11.8k prompt tokens/s for Llama-3-8B on one A100 (16 GFLOP/token at ~60 % of 312 TFLOP/s;
# SGLang/vLLM publish 10-14k tokens/s), so beta = 0.085 ms/token, as in kvcompassd/worker/workermodel.py.
# Decode: a decode step streams 16 GB of weights at ~1.6-2.0 TB/s (HBM2e) plus KV reads, so
# ~10-12 ms per step at moderate batch; one output token per running request per step.
A100_PREFILL_MS_PER_TOKEN = 0.085
A100_DECODE_MS_PER_TOKEN = 12.0
# KV per token: 32 layers x 8 KV heads x 128 dims x 2 (K,V) x 2 bytes = 128 KiB.
# False claims per request the generated configs' fingerprint bits are sized for.
FALSE_LOOKUP_BUDGET = IndexParams().false_lookup_budget
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2
A100_VRAM_KV_TOKENS = (32 << 30) // KV_BYTES_PER_TOKEN  # 32 GiB of VRAM for KV cache
A100_DRAM_KV_TOKENS = (128 << 30) // KV_BYTES_PER_TOKEN  # 128 GiB of host DRAM
A100_MAX_RUNNING = 64
# The testbeds' workers (paper 5.2 and appendix B) are RTX 5090s: 32 GiB for weights and KV together.
# The BF16 weights take 15 GiB (8.03 B parameters x 2 bytes) and SGLang's static pool is about 0.85 of
# the card (activations, CUDA graphs and the context take the rest), which leaves ~12 GiB of KV in VRAM.
# Host DRAM: HiCache's pool at its usual --hicache-ratio 2, twice the device pool.
RTX5090_VRAM_KV_TOKENS = (12 << 30) // KV_BYTES_PER_TOKEN  # 98,304 tokens
RTX5090_DRAM_KV_TOKENS = 2 * RTX5090_VRAM_KV_TOKENS  # 196,608 tokens (24 GiB)


class GeoError(ValueError):
    """A deployment specification is inconsistent (unknown region, bad count, bad range)."""


@dataclass(frozen=True, slots=True)
class Site:
    """A region's location; ``population_m`` (millions, metro or country served) weights users."""

    name: str
    latitude: float
    longitude: float
    population_m: float
    label: str = ""


# AWS-like region sites (CloudPing.co measures between these). Populations are of the
# country (or, for the two US regions, the half of the US population each serves), in millions
# (UN World Population Prospects 2024, rounded).
SITES: dict[str, Site] = {
    s.name: s
    for s in (
        Site("us", 38.95, -77.45, 340.0, "US (N. Virginia)"),
        Site("us-east", 38.95, -77.45, 200.0, "US East (N. Virginia)"),
        Site("us-west", 45.84, -119.70, 140.0, "US West (Oregon)"),
        Site("cn", 39.90, 116.40, 1410.0, "China (Beijing)"),
        Site("de", 50.11, 8.68, 84.0, "Germany (Frankfurt)"),
        Site("ie", 53.35, -6.26, 5.3, "Ireland (Dublin)"),
        Site("jp", 35.68, 139.69, 124.0, "Japan (Tokyo)"),
        Site("sg", 1.35, 103.82, 5.9, "Singapore"),
        Site("gb", 51.51, -0.13, 68.0, "United Kingdom (London)"),
        Site("kr", 37.57, 126.98, 51.7, "South Korea (Seoul)"),
        Site("au", -33.87, 151.21, 26.6, "Australia (Sydney)"),
        Site("in", 19.08, 72.88, 1440.0, "India (Mumbai)"),
        Site("br", -23.55, -46.63, 212.0, "Brazil (Sao Paulo)"),
        Site("ca", 45.50, -73.57, 39.7, "Canada (Montreal)"),
        Site("it", 45.46, 9.19, 59.0, "Italy (Milan)"),
        Site("bh", 26.07, 50.56, 1.6, "Bahrain"),
        Site("za", -33.92, 18.42, 63.0, "South Africa (Cape Town)"),
        # Appendix B testbed: four North-American sites.
        Site("pa", 39.95, -75.17, 13.0, "Pennsylvania (Philadelphia)"),
        Site("oh", 39.96, -82.99, 11.8, "Ohio (Columbus)"),
        Site("ny", 40.71, -74.01, 19.6, "New York (New York City)"),
        Site("calgary", 51.05, -114.07, 1.6, "Calgary"),
    )
}

# Appendix D: 16 North-American regions for the cross-region reuse analysis, weighted by
# metropolitan-area population (US Census 2023 / Statistics Canada 2021, millions).
NORTH_AMERICA_16: tuple[Site, ...] = (
    Site("na-newyork", 40.71, -74.01, 19.5),
    Site("na-losangeles", 34.05, -118.24, 12.8),
    Site("na-chicago", 41.88, -87.63, 9.3),
    Site("na-dallas", 32.78, -96.80, 8.1),
    Site("na-houston", 29.76, -95.37, 7.5),
    Site("na-toronto", 43.65, -79.38, 6.7),
    Site("na-washington", 38.91, -77.04, 6.3),
    Site("na-philadelphia", 39.95, -75.17, 6.2),
    Site("na-atlanta", 33.75, -84.39, 6.3),
    Site("na-miami", 25.76, -80.19, 6.2),
    Site("na-phoenix", 33.45, -112.07, 5.1),
    Site("na-boston", 42.36, -71.06, 4.9),
    Site("na-sanfrancisco", 37.77, -122.42, 4.6),
    Site("na-seattle", 47.61, -122.33, 4.0),
    Site("na-montreal", 45.50, -73.57, 4.3),
    Site("na-denver", 39.74, -104.99, 3.0),
)


def great_circle_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Haversine distance on a spherical Earth."""
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp, dl = p2 - p1, math.radians(lon2 - lon1)
    h = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


def derived_one_way_ms(a: Site, b: Site) -> float:
    """The documented formula: fibre at 2/3 c, 1.5x route inflation, 2 ms fixed."""
    km = great_circle_km(a.latitude, a.longitude, b.latitude, b.longitude)
    return km / FIBRE_KM_PER_MS * ROUTE_INFLATION + FIXED_MS


def population_weights(sites: Sequence[Site]) -> dict[str, float]:
    """Share of users per site, proportional to population (appendix D)."""
    total = sum(s.population_m for s in sites)
    if total <= 0:
        raise GeoError("population weights need a positive total population")
    return {s.name: s.population_m / total for s in sites}


@dataclass(frozen=True, slots=True)
class LinkRange:
    """Map the derived latencies of ``pairs`` linearly onto [lo_ms, hi_ms] (measured range)."""

    pairs: tuple[tuple[str, str], ...]
    lo_ms: float
    hi_ms: float


@dataclass(frozen=True, slots=True)
class DeploymentSpec:
    """Everything needed to write one deployment's cluster config."""

    name: str
    description: str
    workers: tuple[tuple[str, int], ...]  # (site name, worker count), in config order
    fixed_links: Mapping[tuple[str, str], float] = field(default_factory=dict)
    link_ranges: tuple[LinkRange, ...] = ()
    value_bits: int = 32
    shards: int = 8
    prefill_ms_per_token: float = A100_PREFILL_MS_PER_TOKEN
    decode_ms_per_token: float = A100_DECODE_MS_PER_TOKEN
    vram_kv_tokens: int = A100_VRAM_KV_TOKENS
    dram_kv_tokens: int = A100_DRAM_KV_TOKENS
    max_running: int = A100_MAX_RUNNING
    source: str = ""
    # Prefill-decode split (paper App. C): this share of each region's workers, rounded and at
    # least one, are decode workers, the rest prefill workers (0: every worker is mixed).
    decode_share: float = 0.0

    def roles(self, count: int) -> list[str]:
        """Roles of one region's ``count`` workers, prefill first (see ``decode_share``)."""
        if not self.decode_share:
            return ["mixed"] * count
        if not 0 < self.decode_share < 1:
            raise GeoError(f"deployment {self.name}: decode_share must be in (0, 1), got {self.decode_share}")
        if count < 2:
            raise GeoError(f"deployment {self.name}: a region of {count} worker cannot hold both a prefill and a "
                           f"decode worker")
        decode = min(count - 1, max(1, round(count * self.decode_share)))
        return ["prefill"] * (count - decode) + ["decode"] * decode

    # Sites beyond SITES (scale_deployment's sub-sites), looked up first.
    extra_sites: tuple[Site, ...] = ()
    # The command that writes this deployment's file (its header names it).
    command: str = "python -m kvcompassd.sim.geo --out config"

    def site(self, name: str) -> Site:
        for s in self.extra_sites:
            if s.name == name:
                return s
        try:
            return SITES[name]
        except KeyError:
            raise GeoError(f"deployment {self.name}: unknown region {name!r}") from None

    def region_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.workers)

    def worker_count(self) -> int:
        return sum(n for _, n in self.workers)


def link_matrix(spec: DeploymentSpec) -> dict[tuple[str, str], float]:
    """One-way latency for every unordered region pair (keys sorted by config order)."""
    names = spec.region_names()
    sites = {name: spec.site(name) for name in names}
    if len(set(names)) != len(names):
        raise GeoError(f"deployment {spec.name}: a region is listed twice")
    order = {n: i for i, n in enumerate(names)}

    def key(a: str, b: str) -> tuple[str, str]:
        return (a, b) if order[a] < order[b] else (b, a)

    links = {
        key(a, b): derived_one_way_ms(sites[a], sites[b])
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }
    for rng in spec.link_ranges:
        pairs = [key(a, b) for a, b in rng.pairs]
        derived = np.array([links[p] for p in pairs])
        span = derived.max() - derived.min()
        for p, d in zip(pairs, derived):
            frac = 0.5 if span == 0 else (d - derived.min()) / span
            links[p] = rng.lo_ms + frac * (rng.hi_ms - rng.lo_ms)
    for (a, b), ms in spec.fixed_links.items():
        links[key(a, b)] = float(ms)
    return links


DEPLOYMENTS: dict[str, DeploymentSpec] = {
    "census-64x8": DeploymentSpec(
        name="census-64x8",
        description="64 A100 workers in 8 regions, per-region counts from the LLM-deployment census (paper 5.3)",
        workers=(("us", 30), ("cn", 13), ("de", 8), ("jp", 3), ("sg", 3), ("gb", 3), ("kr", 2), ("au", 2)),
        value_bits=64,  # the 30-worker US region needs 64-bit values (32 workers per group)
        shards=8,
        source="paper 5.3: US 30, CN 13, DE 8, 2-3 each in JP, SG, GB, KR, AU; 12-150 ms RTT",
    ),
    "census-64x8-pd": DeploymentSpec(
        name="census-64x8-pd",
        description="The 64x8 census split into prefill and decode pools, 3 decode per 10 workers as the paper's "
        "App. C testbed (7 + 3), at least one decode worker per region",
        workers=(("us", 30), ("cn", 13), ("de", 8), ("jp", 3), ("sg", 3), ("gb", 3), ("kr", 2), ("au", 2)),
        value_bits=64,
        shards=8,
        decode_share=0.3,
        source="paper 5.3 census counts; App. C prefill-decode split 7:3",
    ),
    "census-128x16": DeploymentSpec(
        name="census-128x16",
        description="128 A100 workers in 16 regions (paper appendix A)",
        workers=(
            ("us-east", 26), ("us-west", 14), ("cn", 12), ("de", 10), ("ie", 10), ("jp", 8), ("gb", 8),
            ("sg", 7), ("in", 6), ("kr", 5), ("ca", 5), ("au", 4), ("br", 4), ("it", 4), ("za", 3), ("bh", 2),
        ),
        value_bits=64,  # the 26-worker US-East region needs 64-bit values
        shards=16,
        source="appendix A: US 26 + 14, CN 12, DE 10, IE 10, JP 8, GB 8, 2-7 each in SG, KR, IN, AU, BR, CA, "
        "IT, BH, ZA (split of the remaining 40 is ours); one-way 9-144 ms",
    ),
    "northamerica-11": DeploymentSpec(
        name="northamerica-11",
        description="11 RTX 5090 workers in four North-American regions (paper appendix B)",
        workers=(("pa", 2), ("oh", 4), ("ny", 1), ("calgary", 4)),
        link_ranges=(
            LinkRange((("pa", "oh"), ("pa", "ny"), ("oh", "ny")), 5.8, 16.6),
            LinkRange((("calgary", "pa"), ("calgary", "oh"), ("calgary", "ny")), 24.9, 37.4),
        ),
        value_bits=32,
        shards=4,
        prefill_ms_per_token=0.085,  # the testbeds' calibrated RTX 5090 prefill speed (paper 5.2)
        vram_kv_tokens=RTX5090_VRAM_KV_TOKENS,
        dram_kv_tokens=RTX5090_DRAM_KV_TOKENS,
        source="appendix B: PA 2, OH 4, NY 1, Calgary 4; one-way 5.8-16.6 ms east, 24.9-37.4 ms to Calgary",
    ),
}


# Sub-sites of a split site sit this far from it, evenly spaced around it: close enough to be one
# metro area's data centres (2-4 ms apart one way by the formula above), far enough to be distinct.
SUBSITE_RADIUS_KM = 150.0
SUBSITE_SUFFIXES = "abcdefghijklmnopqrstuvwxyz"


def _offset(site: Site, km: float, bearing_deg: float) -> tuple[float, float]:
    """The point ``km`` from ``site`` along ``bearing_deg`` on the sphere (lat, lon, 4 decimals)."""
    d = km / EARTH_RADIUS_KM
    lat1, lon1, b = math.radians(site.latitude), math.radians(site.longitude), math.radians(bearing_deg)
    lat2 = math.asin(math.sin(lat1) * math.cos(d) + math.cos(lat1) * math.sin(d) * math.cos(b))
    lon2 = lon1 + math.atan2(math.sin(b) * math.sin(d) * math.cos(lat1), math.cos(d) - math.sin(lat1) * math.sin(lat2))
    lon = (math.degrees(lon2) + 540.0) % 360.0 - 180.0
    return round(math.degrees(lat2), 4), round(lon, 4)


def split_counts(total: int, parts: int) -> list[int]:
    """``total`` shared over ``parts`` as evenly as possible, the larger shares first."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def largest_remainder(total: int, weights: Sequence[float], *, floor: int = 0) -> list[int]:
    """``total`` shared in proportion to ``weights`` (each share at least ``floor``), rounded by
    largest remainder so the shares add up exactly; ties go to the earlier entry."""
    n = len(weights)
    if total < floor * n:
        raise GeoError(f"cannot give {n} shares of at least {floor} out of {total}")
    spare = total - floor * n
    weight_sum = float(sum(weights))
    exact = [spare * w / weight_sum for w in weights]
    shares = [int(math.floor(x)) for x in exact]
    order = sorted(range(n), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[: spare - sum(shares)]:
        shares[i] += 1
    return [floor + x for x in shares]


def _scaled(base: DeploymentSpec, site_workers: Sequence[int], site_splits: Sequence[int], *, name: str | None,
            shards: int | None, how: str, command: str) -> DeploymentSpec:
    workers: list[tuple[str, int]] = []
    extra: list[Site] = []
    for (region, _), count, split in zip(base.workers, site_workers, site_splits):
        site = base.site(region)
        for i, n in enumerate(split_counts(count, split)):
            if n == 0:
                continue
            if split == 1:
                sub = site
            else:
                lat, lon = _offset(site, SUBSITE_RADIUS_KM, 45.0 + 360.0 * i / split)
                sub = Site(f"{region}-{SUBSITE_SUFFIXES[i]}", lat, lon, site.population_m / split,
                           f"{site.label or region}, site {SUBSITE_SUFFIXES[i]}")
                extra.append(sub)
            workers.append((sub.name, n))
    total = sum(n for _, n in workers)
    default_name = f"census-{total}x{len(workers)}"
    name = name or default_name
    if shards is not None:
        command += f" --shards {shards}"
    if name != default_name:
        command += f" --name {name}"
    return DeploymentSpec(
        name=name,
        description=f"{total} workers in {len(workers)} regions: {base.name} {how}",
        workers=tuple(workers),
        value_bits=32 if max(n for _, n in workers) <= 16 else 64,
        shards=len(workers) if shards is None else shards,
        prefill_ms_per_token=base.prefill_ms_per_token,
        decode_ms_per_token=base.decode_ms_per_token,
        vram_kv_tokens=base.vram_kv_tokens,
        dram_kv_tokens=base.dram_kv_tokens,
        max_running=base.max_running,
        source=f"{base.name} ({base.source}) scaled by kvcompassd.sim.geo",
        extra_sites=tuple(extra),
        command=command,
    )


def scale_deployment(base: DeploymentSpec, *, factor: int, split: int, name: str | None = None,
                     shards: int | None = None) -> DeploymentSpec:
    """A census-style fleet ``factor`` times ``base``'s workers, each site split into ``split``
    sub-sites ``SUBSITE_RADIUS_KM`` around it (named ``<site>-a``, ``-b``, ...; ``split=1`` keeps
    the sites), with one shard per region unless ``shards`` says otherwise. Per-region worker
    counts are ``base``'s times ``factor``, shared out evenly over the sub-sites; a sub-site that
    would get no worker is left out. Measured link ranges of ``base`` are not carried over (the
    sub-sites' links are derived). Value bits are 64 (groups of 32 workers) unless every region
    fits 16 workers."""
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise GeoError(f"factor must be an integer >= 1, got {factor!r}")
    if isinstance(split, bool) or not isinstance(split, int) or not 1 <= split <= len(SUBSITE_SUFFIXES):
        raise GeoError(f"split must be an integer in [1, {len(SUBSITE_SUFFIXES)}], got {split!r}")
    return _scaled(base, [n * factor for _, n in base.workers], [split] * len(base.workers), name=name,
                   shards=shards, how=f"x {factor}, each site split into {split} sites {SUBSITE_RADIUS_KM:g} km around it",
                   command=f"python -m kvcompassd.sim.geo --out config --from {base.name} --factor {factor} "
                           f"--split {split}")


def census_fleet(base: DeploymentSpec, *, workers: int, regions: int, name: str | None = None,
                 shards: int | None = None) -> DeploymentSpec:
    """Exactly ``workers`` workers in ``regions`` regions shaped like ``base``: each site gets
    workers and sub-sites in proportion to its worker count (largest remainder, at least one
    sub-site each), its workers shared evenly over its sub-sites."""
    sites = len(base.workers)
    if isinstance(regions, bool) or not isinstance(regions, int) or not sites <= regions <= sites * len(SUBSITE_SUFFIXES):
        raise GeoError(f"regions must be an integer in [{sites}, {sites * len(SUBSITE_SUFFIXES)}] for {base.name}, "
                       f"got {regions!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < regions:
        raise GeoError(f"workers must be an integer >= regions ({regions}), got {workers!r}")
    counts = [n for _, n in base.workers]
    splits = largest_remainder(regions, counts, floor=1)
    if max(splits) > len(SUBSITE_SUFFIXES):
        raise GeoError(f"{regions} regions would split one site of {base.name} more than {len(SUBSITE_SUFFIXES)} ways")
    site_workers = largest_remainder(workers, counts, floor=0)
    # every sub-site needs a worker: move workers from the best-supplied sites if need be
    for i in range(sites):
        while site_workers[i] < splits[i]:
            donor = max(range(sites), key=lambda j: site_workers[j] - splits[j])
            site_workers[donor] -= 1
            site_workers[i] += 1
    return _scaled(base, site_workers, splits, name=name, shards=shards,
                   how=f"reshaped to {workers} workers in {regions} regions",
                   command=f"python -m kvcompassd.sim.geo --out config --from {base.name} --workers {workers} "
                           f"--regions {regions}")


# The 1,024-worker, 64-region fleet (issue 31): census-128x16's counts x 8, each site split in 4.
DEPLOYMENTS["census-1024x64"] = scale_deployment(DEPLOYMENTS["census-128x16"], factor=8, split=4)


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _gib(kv_tokens: int) -> str:
    return f"{kv_tokens * KV_BYTES_PER_TOKEN / 2**30:g}"


# Region groups up to which a generated config steps its long lengths by 1.1 rather than 1.25.
# Every length is a table read in each region group at every decision: at 10,000 x 100 (372
# groups) 1.1 took a decision from 76 to 89 us (tools/bench_forward.py), where on the fleets the
# long-context tables measure (8 groups) it bought reuse (core/levels.py).
FINE_LONG_GROWTH_MAX_GROUPS = 16


def _region_groups(spec: DeploymentSpec) -> int:
    """How many region groups the index of ``spec``'s fleet has (its value-bit slots per region)."""
    layout = IndexLayout(spec.region_names(), tuple((f"{name}-{i}", name) for name, n in spec.workers
                                                    for i in range(n)), spec.value_bits)
    return len(layout.groups)


def _long_growth_line(groups: int) -> str:
    growth = "1.1 " if groups <= FINE_LONG_GROWTH_MAX_GROUPS else "1.25"
    return f"long_growth = {growth}        # past the paper's lengths, shared steps of at most this factor"


def _fingerprint_lines(spec: DeploymentSpec, groups: int, *, over_budget: bool = False) -> list[str]:
    """``fingerprint_bits`` sized for the default false-lookup budget, with its budget and cost.

    Uses the same function as the edge's start-up check (core/fingerprints.py), with the levels,
    max_load and budget this generator writes, so a generated config never draws the warning.
    """
    choice = fingerprint_bits_for(groups=groups, levels=6, load=0.95, budget=FALSE_LOOKUP_BUDGET)
    if not choice.achievable and over_budget:
        # What a projection of a fleet this big needs: the most bits, and the budget it misses.
        return [f"# {groups} region groups need {choice.needed_bits} fingerprint bits for a false-lookup "
                f"budget of {FALSE_LOOKUP_BUDGET:g}; the index stores at most {MAX_FINGERPRINT_BITS}.",
                f"fingerprint_bits = {MAX_FINGERPRINT_BITS}",
                f"false_lookup_budget = {FALSE_LOOKUP_BUDGET!r}"]
    if not choice.achievable:
        raise GeoError(f"deployment {spec.name}: {groups} region groups need {choice.needed_bits} "
                       f"fingerprint bits for a false-lookup budget of {FALSE_LOOKUP_BUDGET}; the index stores "
                       f"at most {MAX_FINGERPRINT_BITS}")
    return [
        f"# {groups} region groups read per lookup at load <= 0.95: "
        f"<= {choice.expected_with_needed:.2g} false claims per request (budget {FALSE_LOOKUP_BUDGET:g})",
        f"# for +{choice.bits_per_entry:.1f} bits per entry (core/fingerprints.py).",
        f"fingerprint_bits = {choice.needed_bits}",
        f"false_lookup_budget = {FALSE_LOOKUP_BUDGET!r}",
    ]


def render_toml(spec: DeploymentSpec, *, over_budget: bool = False) -> str:
    """The cluster config for ``spec`` (format: the shared config contract). A fleet whose region
    groups no fingerprint width keeps within the false-lookup budget is an error, unless
    ``over_budget`` (then the widest, with the shortfall in a comment)."""
    links = link_matrix(spec)
    lo, hi = min(links.values()), max(links.values())
    groups = _region_groups(spec)
    lines = [
        f"# {spec.description}.",
        f"# Generated by `{spec.command}` (kvcompassd/sim/geo.py).",
        f"# Paper: {spec.source}.",
        "# Latencies the paper does not give are derived from great-circle distance:",
        "#   one_way_ms = great_circle_km / 200 * 1.5 + 2   (fibre at 2/3 c, 1.5x route inflation, 2 ms fixed)",
    ]
    if spec.link_ranges:
        lines.append("# then each measured group of links is mapped linearly onto the paper's measured range.")
    lines += [
        f"# One-way WAN latencies here span {lo:.1f}-{hi:.1f} ms (RTT {2 * lo:.1f}-{2 * hi:.1f} ms).",
        f"# Workers: A100-80GB / Llama-3.1-8B BF16 unless noted; {_gib(spec.vram_kv_tokens)} GiB VRAM and "
        f"{_gib(spec.dram_kv_tokens)} GiB DRAM of KV at",
        "# 128 KiB per token; prefill and decode calibration and sources are in kvcompassd/sim/geo.py.",
        "",
        "[cluster]",
        f"name = {_toml_str(spec.name)}",
        'model = "meta-llama/Llama-3.1-8B-Instruct"',
        'tenant = ""',
        f"shards = {spec.shards}",
        "intra_region_one_way_ms = 0.25",
        "",
        "[index]",
        "block_size = 16",
        "levels = 6",
        "same_region_min_tokens = 64",
        "same_region_growth = 1.25",
        "same_region_max_step = 2.0",
        f"value_bits = {spec.value_bits}",
        *_fingerprint_lines(spec, groups, over_budget=over_budget),
        "max_load = 0.95",
        "# 0: each table starts at 1/64 of what its region group can register in its shard and grows",
        "# (core/index.py table_capacities).",
        "initial_capacity = 0",
        "context_tokens = 131072   # the model's context length: indexed lengths reach it (core/levels.py)",
        _long_growth_line(groups),
        "",
        "[score]",
        "lambda_max = 64.0",
        "tau_ms = 100.0",
        "gamma_ms_per_token = 0.00524   # 128 KiB per token / 25 GB/s PCIe 4.0",
        'wan = "rtt"',
        "belief_weight = 0.2",
        "queue_ewma_weight = 0.5",
        "broadcast_period_ms = 100.0",
        "hot_prefix_misses = 3",
        "hot_prefix_window_ms = 1000.0",
        "idle_period_ms = 1000.0",
        "occupancy_ms_per_running = 0.25",
        "pending_hold_ms = 1000.0",
    ]
    for name in spec.region_names():
        site = spec.site(name)
        lines += [
            "",
            "[[regions]]",
            f"name = {_toml_str(name)}   # {site.label}" if site.label else f"name = {_toml_str(name)}",
            f"latitude = {site.latitude}",
            f"longitude = {site.longitude}",
        ]
    for (a, b), ms in links.items():
        lines += ["", "[[links]]", f"between = [{_toml_str(a)}, {_toml_str(b)}]", f"one_way_ms = {ms:.2f}"]
    for name, count in spec.workers:
        if count <= 0:
            raise GeoError(f"deployment {spec.name}: region {name!r} has {count} workers")
        for i, role in enumerate(spec.roles(count)):
            lines += [
                "",
                "[[workers]]",
                f'id = "{name}-{i}"',
                f"region = {_toml_str(name)}",
                *([] if role == "mixed" else [f'role = "{role}"']),
                f"prefill_ms_per_token = {spec.prefill_ms_per_token}",
                f"decode_ms_per_token = {spec.decode_ms_per_token}",
                f"vram_kv_tokens = {spec.vram_kv_tokens}",
                f"dram_kv_tokens = {spec.dram_kv_tokens}",
                f"max_running = {spec.max_running}",
            ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcompassd.sim.geo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("config"), help="directory for the TOML files")
    parser.add_argument("names", nargs="*", help=f"deployments to write (default: all of {sorted(DEPLOYMENTS)})")
    parser.add_argument("--decode-share", type=float, default=None,
                        help="write prefill-decode variants <name>-pd-<share> of the named deployments instead: "
                             "this share of each region's workers decode (at least one), the rest prefill")
    parser.add_argument("--from", dest="base", metavar="DEPLOYMENT", default=None,
                        help="write a census-style fleet scaled from this deployment instead (scale_deployment)")
    parser.add_argument("--factor", type=int, default=8, help="--from: workers per region times this")
    parser.add_argument("--split", type=int, default=4, help="--from: each site split into this many sub-sites")
    parser.add_argument("--workers", type=int, default=None,
                        help="--from: exactly this many workers (with --regions; instead of --factor/--split)")
    parser.add_argument("--regions", type=int, default=None, help="--from: exactly this many regions (with --workers)")
    parser.add_argument("--shards", type=int, default=None, help="--from: index shards (default: one per region)")
    parser.add_argument("--name", default=None, help="--from: deployment name (default census-<workers>x<regions>)")
    args = parser.parse_args(argv)
    if args.base is not None:
        if args.names:
            parser.error("--from writes one scaled deployment; name no others")
        if args.base not in DEPLOYMENTS:
            parser.error(f"unknown deployment {args.base!r}; known: {sorted(DEPLOYMENTS)}")
        try:
            if (args.workers is None) != (args.regions is None):
                parser.error("--workers and --regions go together")
            if args.workers is not None:
                specs = [census_fleet(DEPLOYMENTS[args.base], workers=args.workers, regions=args.regions,
                                      name=args.name, shards=args.shards)]
            else:
                specs = [scale_deployment(DEPLOYMENTS[args.base], factor=args.factor, split=args.split,
                                          name=args.name, shards=args.shards)]
        except GeoError as exc:
            parser.error(str(exc))
    else:
        names = args.names or list(DEPLOYMENTS)
        unknown = [n for n in names if n not in DEPLOYMENTS]
        if unknown:
            parser.error(f"unknown deployment(s) {unknown}; known: {sorted(DEPLOYMENTS)}")
        specs = [DEPLOYMENTS[n] for n in names]
    args.out.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        if args.decode_share is not None:
            spec = replace(spec, name=f"{spec.name}-pd-{args.decode_share:g}", decode_share=args.decode_share,
                           description=f"{spec.description}, split into prefill and decode pools "
                           f"({args.decode_share:g} of each region decodes)")
        path = args.out / f"{spec.name}.toml"
        try:
            text = render_toml(spec)
        except GeoError as exc:
            parser.error(str(exc))
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
