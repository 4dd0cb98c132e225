"""Cluster configuration: a TOML file loaded into validated, frozen dataclasses.

Every error is a :class:`ConfigError` whose message names the file, the table and the field,
e.g. ``testbed.toml: [[workers]] #3 field 'region': unknown region 'xx'`` (entries of an
array of tables are numbered from 1, as an operator counts them in the file).

Each dataclass validates its own fields on construction, so a config built in code (by the
simulator or a tool) is checked exactly like one read from disk; cross-references (regions
named by workers, shard coverage, the latency matrix) are checked by :class:`ClusterConfig`.
:func:`dump_config` writes a config back as TOML text, so tools can generate configs.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Final

from .messages import MAX_SNAPSHOT_CHUNK_BYTES

__all__ = [
    "DECODE_POLICIES",
    "SGLANG_BOOTSTRAP_PORT",
    "WORKER_ROLES",
    "DisaggregationParams",
    "ClusterConfig",
    "ConfigError",
    "ConfigSocket",
    "EdgeConfig",
    "FrontDoorLimits",
    "IndexParams",
    "LinkConfig",
    "MaintenanceConfig",
    "RegionConfig",
    "ScoreParams",
    "SyncParams",
    "WorkerConfig",
    "bootstrap_port_of",
    "check_socket_collisions",
    "config_sockets",
    "derive_one_way_ms",
    "dump_config",
    "great_circle_km",
    "load_config",
    "parse_config",
]

EARTH_RADIUS_KM = 6371.0
FIBRE_KM_PER_MS = 200.0  # light in fibre travels at about 2/3 c
ROUTE_INFLATION = 1.5  # real routes are longer than the great circle
PER_PATH_OVERHEAD_MS = 2.0  # switching, serialisation and last-mile hops

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_HOST_PORT_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")


class ConfigError(ValueError):
    """A configuration is invalid; the message names file, table and field."""

    def __init__(self, detail: str, *, source: str = "<config>", table: str = "", field: str = "") -> None:
        self.detail = detail
        self.source = source
        self.table = table
        self.field = field
        where = source
        if table:
            where += f": {table}"
        if field:
            where += f" field '{field}'"
        super().__init__(f"{where}: {detail}")

    def located(self, *, source: str | None = None, table: str | None = None) -> ConfigError:
        """The same error with the file and/or table filled in (keeps what is already set)."""
        return ConfigError(
            self.detail,
            source=source if source is not None and self.source == "<config>" else self.source,
            table=table if table is not None and not self.table else self.table,
            field=self.field,
        )


# ---------------------------------------------------------------- field checks


def _fail(name: str, detail: str) -> None:
    raise ConfigError(detail, field=name)


def _check_str(name: str, value: Any, *, pattern: re.Pattern[str] | None = _NAME_RE, allow_empty: bool = False) -> None:
    if not isinstance(value, str):
        _fail(name, f"expected a string, got {type(value).__name__} {value!r}")
    if not value and allow_empty:
        return
    if not value:
        _fail(name, "must not be empty")
    if pattern is not None and not pattern.match(value):
        _fail(name, f"invalid name {value!r} (letters, digits, '_', '-', '.'; no spaces)")


def _check_int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        _fail(name, f"expected an integer, got {type(value).__name__} {value!r}")
    if lo is not None and value < lo:
        _fail(name, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        _fail(name, f"must be <= {hi}, got {value}")


def _check_float(
    name: str, value: Any, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
    hi_open: bool = False,
) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        _fail(name, f"expected a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        _fail(name, f"must be finite, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        _fail(name, f"must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and (value >= hi if hi_open else value > hi):
        _fail(name, f"must be {'<' if hi_open else '<='} {hi}, got {value}")


def _check_optional_address(name: str, value: Any, schemes: tuple[str, ...] | None) -> None:
    """``None`` or an address: ``scheme://...`` when schemes are given, else ``host:port``."""
    if value is None:
        return
    _check_str(name, value, pattern=None)
    if schemes is not None:
        if not value.startswith(tuple(f"{s}://" for s in schemes)) or value.endswith("://"):
            _fail(name, f"expected a {'/'.join(schemes)}:// address, got {value!r}")
        return
    match = _HOST_PORT_RE.match(value)
    if match is None or not 0 < int(match.group(2)) < 65536:
        _fail(name, f"expected host:port, got {value!r}")


def _as_float(obj: Any, name: str) -> None:
    # TOML integers are accepted for float fields; store floats so equality and dumps are stable.
    object.__setattr__(obj, name, float(getattr(obj, name)))


# ---------------------------------------------------------------- tables


@dataclass(frozen=True, slots=True)
class RegionConfig:
    """A region; latitude/longitude (degrees) are optional and only used to derive latencies."""

    name: str
    latitude: float | None = None
    longitude: float | None = None

    def __post_init__(self) -> None:
        _check_str("name", self.name)
        if (self.latitude is None) != (self.longitude is None):
            _fail("latitude" if self.latitude is None else "longitude", "latitude and longitude go together")
        if self.latitude is not None:
            _check_float("latitude", self.latitude, lo=-90.0, hi=90.0)
            _check_float("longitude", self.longitude, lo=-180.0, hi=180.0)
            _as_float(self, "latitude")
            _as_float(self, "longitude")

    @property
    def has_position(self) -> bool:
        return self.latitude is not None


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """One-way WAN latency between two distinct regions (symmetric).

    ``derived`` marks a latency computed by :func:`derive_one_way_ms` rather than configured;
    it is informational and does not take part in equality.
    """

    between: tuple[str, str]
    one_way_ms: float
    derived: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        pair = self.between
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            _fail("between", f"expected two region names, got {pair!r}")
        for name in pair:
            _check_str("between", name)
        if pair[0] == pair[1]:
            _fail("between", f"a link joins two different regions, got {list(pair)!r}")
        object.__setattr__(self, "between", (pair[0], pair[1]))
        _check_float("one_way_ms", self.one_way_ms, lo=0.0)
        _as_float(self, "one_way_ms")


WORKER_ROLES: Final = ("mixed", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One inference worker (a model replica) and how to reach its engine and agent."""

    id: str
    region: str
    prefill_ms_per_token: float
    decode_ms_per_token: float
    vram_kv_tokens: int
    dram_kv_tokens: int
    max_running: int = 64
    http: str | None = None
    kv_events: str | None = None
    agent: str | None = None
    agent_metrics: str | None = None  # the agent's Prometheus endpoint (host:port)
    # KV events (22.1): the engine's --kv-events-config "topic" (the engines' default is empty)
    # and its "replay_endpoint" as the agent dials it (None: ask SGLang's /server_info).
    kv_events_topic: str = ""
    kv_events_replay: str | None = None
    # The operator's word that this worker is `kvcompassd emulate-worker`, not SGLang: only then may
    # edges run the byte tokenizer (and the edge checks the worker says so too).
    emulated: bool = False
    # Prefill-decode disaggregation (paper App. C): "mixed" serves whole requests; a "prefill"
    # worker computes and publishes a prompt's KV and hands it to a "decode" worker of its region,
    # which streams the tokens. Only mixed and prefill workers are routed to and indexed.
    role: str = "mixed"
    # A prefill worker's KV-transfer bootstrap port (SGLang's --disaggregation-bootstrap-port),
    # which the router names in every request it hands to a prefill-decode pair.
    bootstrap_port: int | None = None
    # A prefill worker's KV-transfer bandwidth to the decode workers of its region (Mooncake over
    # RDMA or TCP), Gbit/s: a handed-over prompt's KV (tokens x KV bytes per token) takes
    # bytes * 8 / (kv_transfer_gbps * 1e9) s on the sender's link, one transfer after another.
    kv_transfer_gbps: float = 100.0

    def __post_init__(self) -> None:
        _check_str("id", self.id)
        _check_str("region", self.region)
        if self.role not in WORKER_ROLES:
            _fail("role", f"expected one of {', '.join(WORKER_ROLES)}, got {self.role!r}")
        if self.bootstrap_port is not None:
            if self.role != "prefill":
                _fail("bootstrap_port", f"only a prefill worker has a bootstrap port (role is {self.role!r})")
            _check_int("bootstrap_port", self.bootstrap_port, lo=1, hi=65535)
        if self.role == "decode" and (self.kv_events is not None or self.kv_events_replay is not None):
            _fail("kv_events", "a decode worker publishes nothing to the index (only prefill and mixed "
                  "workers do): drop kv_events and kv_events_replay")
        _check_float("kv_transfer_gbps", self.kv_transfer_gbps, lo=0.0, lo_open=True)
        _as_float(self, "kv_transfer_gbps")
        if not isinstance(self.emulated, bool):
            _fail("emulated", f"expected true or false, got {self.emulated!r}")
        _check_float("prefill_ms_per_token", self.prefill_ms_per_token, lo=0.0, lo_open=True)
        _check_float("decode_ms_per_token", self.decode_ms_per_token, lo=0.0, lo_open=True)
        _as_float(self, "prefill_ms_per_token")
        _as_float(self, "decode_ms_per_token")
        _check_int("vram_kv_tokens", self.vram_kv_tokens, lo=0)
        _check_int("dram_kv_tokens", self.dram_kv_tokens, lo=0)
        _check_int("max_running", self.max_running, lo=1)
        _check_optional_address("http", self.http, ("http", "https"))
        _check_optional_address("kv_events", self.kv_events, ("tcp", "ipc", "inproc"))
        _check_str("kv_events_topic", self.kv_events_topic, pattern=None, allow_empty=True)
        if len(self.kv_events_topic.encode()) > 255:
            _fail("kv_events_topic", "must be at most 255 bytes")
        _check_optional_address("kv_events_replay", self.kv_events_replay, ("tcp", "ipc", "inproc"))
        _check_optional_address("agent", self.agent, None)
        _check_optional_address("agent_metrics", self.agent_metrics, None)


@dataclass(frozen=True, slots=True)
class EdgeConfig:
    """An edge node of a region: the HTTP front door and its QUIC endpoint."""

    id: str
    region: str
    http: str | None = None
    quic: str | None = None
    metrics: str | None = None  # Prometheus endpoint (host:port), besides /metrics on http

    def __post_init__(self) -> None:
        _check_str("id", self.id)
        _check_str("region", self.region)
        _check_optional_address("http", self.http, None)
        _check_optional_address("quic", self.quic, None)
        _check_optional_address("metrics", self.metrics, None)


@dataclass(frozen=True, slots=True)
class FrontDoorLimits:
    """What one client may cost an edge's HTTP front door (``[frontdoor]``): every input bounded
    in size, time and memory. Refusals are OpenAI-style JSON errors, counted by reason."""

    # Request line plus headers, all together; aiohttp's per-line limits are set from it too.
    max_header_bytes: int = 32768
    max_headers: int = 64
    # From a request's first byte to its last header, and from then to its last body byte.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # One request's body after any decompression (a prompt of 131072 token ids is ~1 MB of JSON).
    max_body_bytes: int = 8 << 20
    # Request bodies held at once by all requests; over it: 503 with Retry-After. Its last
    # eighth is kept for the first 64 KiB of each request, so stalled large uploads cannot
    # starve ordinary small requests.
    body_budget_bytes: int = 48 << 20
    max_connections: int = 4096
    keepalive_timeout_s: float = 15.0
    # Nesting of a JSON body (the deepest OpenAI shape, chat content parts, needs 5).
    max_json_depth: int = 32

    def __post_init__(self) -> None:
        _check_int("max_header_bytes", self.max_header_bytes, lo=1024, hi=1 << 20)
        _check_int("max_headers", self.max_headers, lo=8, hi=1024)
        _check_float("header_timeout_s", self.header_timeout_s, lo=0.0, lo_open=True)
        _check_float("body_timeout_s", self.body_timeout_s, lo=0.0, lo_open=True)
        _check_int("max_body_bytes", self.max_body_bytes, lo=1024, hi=1 << 30)
        _check_int("body_budget_bytes", self.body_budget_bytes, lo=1024)
        if self.body_budget_bytes < self.max_body_bytes:
            _fail("body_budget_bytes", f"must be >= max_body_bytes {self.max_body_bytes}, got {self.body_budget_bytes}")
        _check_int("max_connections", self.max_connections, lo=1)
        _check_float("keepalive_timeout_s", self.keepalive_timeout_s, lo=0.0, lo_open=True)
        _check_int("max_json_depth", self.max_json_depth, lo=4, hi=256)
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            _as_float(self, name)


@dataclass(frozen=True, slots=True)
class MaintenanceConfig:
    """A maintenance unit: the single writer of index shard ``shard``."""

    id: str
    shard: int
    quic: str | None = None
    metrics: str | None = None  # Prometheus endpoint (host:port)

    def __post_init__(self) -> None:
        _check_str("id", self.id)
        _check_int("shard", self.shard, lo=0)
        _check_optional_address("quic", self.quic, None)
        _check_optional_address("metrics", self.metrics, None)


@dataclass(frozen=True, slots=True)
class IndexParams:
    """Shape of the discovery index (paper §3.2)."""

    block_size: int = 16
    levels: int = 6
    same_region_min_tokens: int = 64
    # Own-region lookups also read the lengths workers register anyway (for remote edges), each
    # at least this factor above the last one read; 2 keeps only the doubling lengths (paper §3.2).
    same_region_growth: float = 1.25
    # Where neither the doublings nor those registered lengths leave own-region reads within
    # this factor, the gap is split into the fewest equal steps within it, and the new lengths
    # are registered: a local holder is credited at least 1/max_step of its match. 2 adds none.
    same_region_max_step: float = 2.0
    value_bits: int = 32
    fingerprint_bits: int = 0
    # False claims per request that keyless reads may cause (core/fingerprints.py): the edge warns
    # at start-up when fingerprint_bits cannot keep within it; the config generator sizes them by it.
    false_lookup_budget: float = 0.002
    max_load: float = 0.95
    # Entries per Ludo table before its first growth; 0 sizes each table from the entries its region
    # group can register in its shard (core/index.py table_capacities), small at first.
    initial_capacity: int = 0
    # The longest prompt the model serves (its context length, tokens). Past the paper's lengths
    # (core/levels.py), every pair's lookup goes on to it in equal geometric steps of at most
    # long_growth, shared by all pairs, so a 128 K-token prompt costs a few more keys, not ~200.
    # Each length costs a table read in every region group: 1.25 (a long match credited >= 80 % of
    # itself) is the default, and what kvcompassd.sim.geo writes past 16 region groups (at 10,000
    # x 100, 372 groups, 1.1 made a decision 76 -> 89 us); every shipped fleet of up to 16 groups
    # uses 1.1 (>= 91 %: at 1.25 the missing fifth of a 37 K-token match sent its follow-up turn
    # to a recompute).
    context_tokens: int = 131072
    long_growth: float = 1.25

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, lo=1, hi=1 << 20)
        _check_int("levels", self.levels, lo=1, hi=64)
        _check_int("same_region_min_tokens", self.same_region_min_tokens, lo=1)
        if self.same_region_min_tokens % self.block_size:
            _fail(
                "same_region_min_tokens",
                f"must be a multiple of block_size {self.block_size}, got {self.same_region_min_tokens}",
            )
        _check_float("same_region_growth", self.same_region_growth, lo=1.0, hi=2.0, lo_open=True)
        _as_float(self, "same_region_growth")
        # Below 1.1 a doubling would take 8 or more lengths: more keys than the credit is worth.
        _check_float("same_region_max_step", self.same_region_max_step, lo=1.1, hi=2.0)
        _as_float(self, "same_region_max_step")
        _check_int("value_bits", self.value_bits)
        if self.value_bits not in (32, 64):
            _fail("value_bits", f"must be 32 or 64, got {self.value_bits}")
        _check_int("fingerprint_bits", self.fingerprint_bits, lo=0, hi=16)
        _check_float("false_lookup_budget", self.false_lookup_budget, lo=0.0, hi=1.0, lo_open=True)
        _as_float(self, "false_lookup_budget")
        _check_float("max_load", self.max_load, lo=0.0, hi=1.0, lo_open=True)
        if self.max_load >= 1.0:
            _fail("max_load", f"must be < 1, got {self.max_load}")
        _as_float(self, "max_load")
        _check_int("initial_capacity", self.initial_capacity, lo=0, hi=(1 << 33) - 1)
        _check_int("context_tokens", self.context_tokens, lo=self.block_size, hi=1 << 24)
        if self.context_tokens % self.block_size:
            _fail("context_tokens", f"must be a multiple of block_size {self.block_size}, got {self.context_tokens}")
        # 1.1 from 64 tokens to the 16 M bound is 131 long lengths at most; below it the keys
        # (one registration each) would cost more than the credit they add.
        _check_float("long_growth", self.long_growth, lo=1.1, hi=4.0)
        _as_float(self, "long_growth")

    @property
    def workers_per_group(self) -> int:
        """Workers per region group: one 2-bit tier field each in a value."""
        return self.value_bits // 2


@dataclass(frozen=True, slots=True)
class ScoreParams:
    """Joint score, queue estimates, cache belief and hot-prefix parameters (paper §3.4)."""

    # lambda = min queue / tau counts the ~tau-sized requests a recomputation delays; a cap of 64
    # keeps that price tracking backlogs up to 6.4 s. (8 stopped at 0.8 s: in overload, at
    # 4.5 lambda0 on Mixed 64x8, reuse fell to 19 % against 26 % at 64, P99 TTFT 46 s against 43 s;
    # identical at 0.75-1.5 lambda0, where lambda stays below both caps.)
    lambda_max: float = 64.0
    tau_ms: float = 100.0
    gamma_ms_per_token: float = 0.00524
    wan: str = "rtt"
    belief_weight: float = 0.2
    queue_ewma_weight: float = 0.5
    broadcast_period_ms: float = 100.0
    hot_prefix_misses: int = 3
    hot_prefix_window_ms: float = 1000.0
    idle_period_ms: float = 1000.0
    # ms added to an own-region worker's queue estimate per request it is running. A worker's
    # queue is 0 while it has a free decode slot, however full its batch, so between holders and
    # an idle non-holder the prefill saved always won: a worker that had lost the popular shared
    # prefixes was passed over until the others' slots filled (testbed LMSYS 150 req/s: 27
    # running requests on it against 50-58 on its peers; P99 107.6 -> 98.2 ms at 0.25).
    occupancy_ms_per_running: float = 0.25
    # How long after its prefill an edge keeps crediting a worker with a prompt it sent there,
    # until its view shows the worker's registration (core/pending.py); 0 turns the ledger off.
    # The write path crosses the WAN twice when the shard is abroad (testbed: 250-320 ms); a
    # follow-up sooner than that found nothing (testbed LMSYS 25 req/s, seeds 0-4: P99 above
    # Dynamo's by up to 3.3 %, equal at all five with the ledger).
    pending_hold_ms: float = 1000.0
    # What the pending ledger believes of the responses it sees (core/pending.py). refute: a
    # response that reused less than its worker was credited with ends that credit (a prefix
    # the worker evicted or could not cache sent the group's requests on to the same miss for
    # the whole hold; issue 30.8). from_first_token: a dispatch is credited from its first token,
    # not from the estimate of its queue and prefill; right for a worker that matches a prompt
    # when it arrives (the emulator, the simulator), wrong for SGLang and vLLM, which match when
    # they schedule it (after the prefill ahead of it), so off by default.
    pending_refute: bool = True
    pending_from_first_token: bool = False
    # The edge learns each worker's prefill and decode rates from the first tokens and ends it
    # sees (core/rates.py) and scores with them; a learned rate stays within this factor of the
    # configured one either way (1 turns learning off). A configured beta 5x off routed against
    # the cache (issue 30: affinity 0.27 on fast workers). 16 covered that, but not a beta
    # configured for a far larger model or slower GPU: zero-delay emulated workers spend ~50x
    # less than the A100 model, and at 16 their groups were spread (affinity 0.52-0.68 against
    # 0.89-0.93 at 64 at c = 16; README, "A cost model that corrects itself").
    learned_rate_bound: float = 64.0
    # A dispatch that adds at least this many ms of work to an own-region worker sends the
    # region's queue vector to every other region at once, not at the next Delta (0 = off): a
    # long prompt's prefill is seconds of queue the other regions' edges cannot see for up to
    # Delta + one way, and one of them sending a long prompt there meanwhile waits all of it
    # (issue 28: long-context at 1x the testbed's capacity, seed 1, two asia requests sent to us
    # workers a 7-9 s prefill had just taken: TTFT 17.3 and 16.6 s, P99 16.7 s against 12.3).
    urgent_broadcast_ms: float = 1000.0
    # A request sent to a worker holding less of its prompt than another does copies the
    # difference into that worker's cache, and a full cache makes room by evicting as much of
    # what it held, which that worker's own groups may then recompute. The score charges such a
    # worker the copy once more at the prefill's price, times this weight and the share of its
    # VRAM its requests pin (room steps, else its engine's load report: SGLang's num_used_tokens
    # over max_total_num_tokens): weight x pinned x (1 + lambda) x beta x (best holder's
    # effective match - its own). 0 = off, the paper's score. Under cache pressure 2 kept each prefix group on its holder (4 emulated
    # workers, 8,192 tokens of VRAM each, c = 64: 71.9 / 70.2 req/s and reuse 0.99 / 0.97
    # against 64.5 / 65.2 and 0.94; README "A copy's price under cache pressure"); off by
    # default until the simulator's evaluation is rerun with it.
    copy_weight: float = 0.0
    # The copy is charged only where the worker's requests pin more than this share of its VRAM,
    # in full with all of it pinned (linearly between): with room to spare a copy evicts a cold
    # prefix. 0 = in proportion to the pinned share. At 16,384 tokens and c = 16 the emulated
    # workers' shares stayed at 0-0.7 and at 0.5 no charge moved a decision, where in proportion
    # they cost 2 % of throughput; at 8,192 and c = 64 they were mostly 1 (README, same section).
    copy_pinned_floor: float = 0.5
    # A worker runs a prefill before its next decode step (SGLang without mixed chunks, the
    # emulated worker, the simulator's model), so a prompt sent to a worker decoding r requests
    # delays each of them by its prefill. The score prices the prefill at
    # 1 + min(1, weight x r) times its own time: each paused request counted at this weight, and
    # all of them together at most as much as the request's own prefill (uncapped, the term
    # spread prefix groups over VRAM-bound workers). r is an own-region worker's latest reading;
    # a remote worker counts as the own region's least busy one. 0 = off, the paper's score
    # (README, "The decodes a prefill pauses").
    decode_stall_weight: float = 0.0

    def __post_init__(self) -> None:
        _check_float("lambda_max", self.lambda_max, lo=0.0)
        _check_float("tau_ms", self.tau_ms, lo=0.0, lo_open=True)
        _check_float("gamma_ms_per_token", self.gamma_ms_per_token, lo=0.0)
        if self.wan not in ("rtt", "one_way"):
            _fail("wan", f"must be 'rtt' or 'one_way', got {self.wan!r}")
        _check_float("belief_weight", self.belief_weight, lo=0.0, hi=1.0, lo_open=True)
        _check_float("queue_ewma_weight", self.queue_ewma_weight, lo=0.0, hi=1.0, lo_open=True)
        _check_float("broadcast_period_ms", self.broadcast_period_ms, lo=0.0, lo_open=True)
        _check_int("hot_prefix_misses", self.hot_prefix_misses, lo=1)
        _check_float("hot_prefix_window_ms", self.hot_prefix_window_ms, lo=0.0, lo_open=True)
        _check_float("idle_period_ms", self.idle_period_ms, lo=0.0)
        _check_float("occupancy_ms_per_running", self.occupancy_ms_per_running, lo=0.0)
        _check_float("pending_hold_ms", self.pending_hold_ms, lo=0.0)
        for name in ("pending_refute", "pending_from_first_token"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, f"expected true or false, got {getattr(self, name)!r}")
        _check_float("learned_rate_bound", self.learned_rate_bound, lo=1.0, hi=1e6)
        _check_float("urgent_broadcast_ms", self.urgent_broadcast_ms, lo=0.0)
        _check_float("copy_weight", self.copy_weight, lo=0.0, hi=1e3)
        _check_float("copy_pinned_floor", self.copy_pinned_floor, lo=0.0, hi=1.0, hi_open=True)
        _check_float("decode_stall_weight", self.decode_stall_weight, lo=0.0, hi=1e3)
        for name in ("lambda_max", "tau_ms", "gamma_ms_per_token", "belief_weight", "queue_ewma_weight",
                     "broadcast_period_ms", "hot_prefix_window_ms", "idle_period_ms", "occupancy_ms_per_running",
                     "pending_hold_ms", "learned_rate_bound", "urgent_broadcast_ms", "copy_weight",
                     "copy_pinned_floor", "decode_stall_weight"):
            _as_float(self, name)


@dataclass(frozen=True, slots=True)
class DeadlineParams:
    """How long the edge waits on a worker (``[deadlines]``).

    Before the first token a late worker costs the request only a failover to the next best:
    the deadline is ``first_token_factor`` times what the score expected, never under
    ``first_token_floor_s``. After it the request cannot move, so a gap of ``inter_token_s``
    between two pieces of output ends it with an error instead of a hang; it must outlast the
    longest pause a healthy engine puts between a running request's tokens, which is a prefill
    chunk of the batch's other requests (SGLang's default chunk, 8,192 tokens, is ~0.7 s on an
    A100 and several seconds on slower cards or under CPU contention). A worker that failed
    is left out of decisions for ``suspect_initial_s``, doubling per further failure up to
    ``suspect_max_s``, or until its agent or load reports say it is back.
    ``view_copy_timeout_s`` bounds a bootstrap from a peer edge's views.

    The edge asks workers for a stream whatever the client asked (the first token times the
    prefill and retires its charge; the deadlines watch what follows). For a client that asked
    for its answer whole, the stream comes in pieces of ``worker_stream_interval`` tokens (SGLang's
    per-request ``stream_interval``: the first token at once, then every that many, then the end),
    not one event per token: each event costs the edge a parse and a pass through its generators,
    and SGLang's stream without ``--incremental-streaming-output`` repeats every id so far in each,
    so a long answer cost the edge CPU quadratic in its length. A client's own ``stream_interval``
    is kept. Between two pieces of N tokens (N at most the answer's ``max_new_tokens``) the edge
    allows ``inter_token_s`` plus N - 1 tokens' decode at the worker's rate (learned, else
    configured).

    The first-token deadline judges a worker, not a request: when it passes while the worker
    brought this edge output for other requests within the last deadline's length, the worker
    is alive and busy (its queue was longer than the score expected), and moving the request
    would only start it again at the back of another queue and mark a working worker suspect.
    So the wait goes on, judged again each deadline's length, up to ``first_token_max_s`` in
    all (never less than the first deadline); a worker that brought nothing in a whole deadline (frozen, or a dead path) still loses
    the request at the first deadline."""

    first_token_floor_s: float = 2.0
    first_token_factor: float = 4.0
    first_token_max_s: float = 120.0
    inter_token_s: float = 10.0
    suspect_initial_s: float = 5.0
    suspect_max_s: float = 60.0
    view_copy_timeout_s: float = 10.0
    worker_stream_interval: int = 16

    def __post_init__(self) -> None:
        for name in ("first_token_floor_s", "first_token_max_s", "inter_token_s", "suspect_initial_s",
                     "suspect_max_s", "view_copy_timeout_s"):
            _check_float(name, getattr(self, name), lo=0.0, lo_open=True)
        _check_int("worker_stream_interval", self.worker_stream_interval, lo=1, hi=4096)
        _check_float("first_token_factor", self.first_token_factor, lo=0.0)
        if self.suspect_max_s < self.suspect_initial_s:
            _fail("suspect_max_s", f"must be at least suspect_initial_s ({self.suspect_initial_s}), "
                                   f"got {self.suspect_max_s}")
        for name in _field_names(DeadlineParams):
            if name != "worker_stream_interval":
                _as_float(self, name)


# The longest coalescing window ``[sync] report_delay_ms`` / ``batch_delay_ms`` may set: beyond,
# the added staleness would approach the time a prompt takes to reach its worker.
MAX_COALESCE_MS = 100.0


@dataclass(frozen=True, slots=True)
class SyncParams:
    """How shard snapshots reach edges (``[sync]``; ``kvcompassd.core.snapshots``).

    A maintenance unit (or a peer edge) sends a snapshot in chunks of ``snapshot_chunk_bytes``
    (at most 1 MiB, the wire's bound), keeping at most ``snapshot_window_bytes`` of the
    connection unacknowledged while it does, so update batches to that edge never queue behind
    more. An edge refuses a transfer whose header declares more than ``max_snapshot_entries``
    entries or ``max_snapshot_bytes`` bytes, before it buffers any, and holds at most
    ``max_buffered_bytes`` of update batches per shard while a transfer is in progress (beyond
    that it has them replayed afterwards)."""

    snapshot_chunk_bytes: int = 512 * 1024
    snapshot_window_bytes: int = 4 * 1024 * 1024
    max_snapshot_entries: int = 1 << 28
    max_snapshot_bytes: int = 4 << 30
    max_buffered_bytes: int = 64 << 20
    # Which update stream a maintenance unit sends each edge (kvcompassd.core.streams): "region"
    # sends an edge only the lengths its region looks up (at 1,024 x 64 several times fewer
    # updates, the same decisions); "full" sends every edge the whole shard. The full stream
    # stays available because a region stream costs the unit one more set of (thinner) tables
    # per edge region, and because an edge whose config reads other lengths than the unit's
    # (a fleet changing its levels) decides right only on the full stream. ``full_stream_edges``
    # names edges that get the full stream whatever ``edge_streams`` says (a reference edge).
    edge_streams: str = "region"
    full_stream_edges: tuple[str, ...] = ()
    # A unit sends each stream's live batches to one edge per region (the first of the region's
    # subscribed edges following it, in config order), which forwards them to the region's other
    # edges of that stream: the unit's egress does not grow with the edges per region.
    relay: bool = True
    # A unit announces a stream's position (epoch, seq) to every edge following it after this
    # long without a batch on it, and again every such period while it stays idle, so an edge
    # whose last batch was lost repairs it within one heartbeat and one request rather than at
    # the stream's next batch (kvcompassd.core.sync). 0 turns it off (edges older than the
    # announcement refuse it: off until they are upgraded, or upgrade edges first).
    position_heartbeat_ms: float = 1000.0
    # Coalescing windows (kvcompassd.pacing.FlushPacer), the staleness they add to the edges'
    # views: an agent gathers its engine's index events per shard for ``report_delay_ms`` after
    # the first one and sends them as one report; a maintenance unit gathers what it applied for
    # ``batch_delay_ms`` after the first edit and publishes one update batch per stream. Every
    # send costs a QUIC packet and its acknowledgement at both ends whatever it carries, so at
    # ``r`` engine batches a second an agent sends about ``r / (1 + r * window)`` reports
    # (issue 30 item 4). At the defaults a worker's new cache reaches the edges' views at most
    # 30 ms later than it would unbatched (below the 100 ms queue broadcast period; an edge's
    # own dispatches are credited meanwhile by its pending ledger). 0 sends with the next
    # event-loop turn. At most MAX_COALESCE_MS each.
    report_delay_ms: float = 20.0
    batch_delay_ms: float = 10.0

    def __post_init__(self) -> None:
        for name in ("report_delay_ms", "batch_delay_ms"):
            _check_float(name, getattr(self, name), lo=0.0, hi=MAX_COALESCE_MS)
            _as_float(self, name)
        if isinstance(self.position_heartbeat_ms, bool) or self.position_heartbeat_ms != 0:  # 0: off
            _check_float("position_heartbeat_ms", self.position_heartbeat_ms, lo=10.0, hi=60_000.0)
        _as_float(self, "position_heartbeat_ms")
        _check_int("snapshot_chunk_bytes", self.snapshot_chunk_bytes, lo=4096, hi=MAX_SNAPSHOT_CHUNK_BYTES)
        _check_int("snapshot_window_bytes", self.snapshot_window_bytes, lo=self.snapshot_chunk_bytes, hi=1 << 30)
        _check_int("max_snapshot_entries", self.max_snapshot_entries, lo=1)
        _check_int("max_snapshot_bytes", self.max_snapshot_bytes, lo=1)
        _check_int("max_buffered_bytes", self.max_buffered_bytes, lo=0)
        if not isinstance(self.relay, bool):
            _fail("relay", f"expected true or false, got {self.relay!r}")
        if self.edge_streams not in EDGE_STREAMS:
            _fail("edge_streams", f"expected one of {', '.join(EDGE_STREAMS)}, got {self.edge_streams!r}")
        if not isinstance(self.full_stream_edges, (tuple, list)):
            _fail("full_stream_edges", f"expected an array of edge ids, got {self.full_stream_edges!r}")
        object.__setattr__(self, "full_stream_edges", tuple(self.full_stream_edges))
        for edge in self.full_stream_edges:
            _check_str("full_stream_edges", edge)

    def full_stream_for(self, edge: str) -> bool:
        """Whether edge ``edge`` follows the full stream rather than its region's."""
        return self.edge_streams == "full" or edge in self.full_stream_edges


EDGE_STREAMS = ("region", "full")


@dataclass(frozen=True, slots=True)
class IdleParams:
    """What the plane sends while nothing changes (``[idle]``; issue 30 item 4).

    A value that moves is sent at once (load readings) or within a broadcast period (queue
    vectors); one that does not is sent again only every ``heartbeat_ms``: an agent's
    unchanged load report to its edges (which also read the engine only that often while it
    sits idle) and an edge's unchanged queue vector to the other regions' edges and to its
    own agents. An edge takes an agent's load reports as resumed after a silence of three
    heartbeats (its engine was down or frozen). Liveness of the connections themselves is
    the transport's keepalives, not this. Set it to ``score.broadcast_period_ms`` for the
    behaviour before it existed (every report every period).

    ``engine_probe_max_ms``: after a second without KV events an agent asks its engine's
    replay socket for batches it missed (a lost last batch, a restart); while such probes find
    nothing the silence before the next doubles up to this. Any event, or a probe that finds
    something, brings the second back."""

    heartbeat_ms: float = 1000.0
    engine_probe_max_ms: float = 8000.0
    # A busy engine's reading goes to the edges only once it moved more than
    # max(load_tolerance_ms, load_tolerance_share x the value) from what they hold: the last
    # reading sent, aged at one ms per ms as they age it (kvcompassd.pacing.LoadTolerance);
    # otherwise once per heartbeat. Both 0 (the default): every changed reading goes. With two
    # edges in a region, 2 ms / 2 % served 1-3 % less in service-time gateway runs (the P99
    # cost of one ABBA round did not repeat) for a fifth less of the plane's CPU; with one,
    # routing held (README, "A busy engine's readings").
    load_tolerance_ms: float = 0.0
    load_tolerance_share: float = 0.0
    # An agent whose worker only one edge sends work to (one of the region's edges connected,
    # no requests from other regions, its KV pool under three quarters held) reads its busy
    # engine this often instead of every --load-poll-ms: that edge's own charges, retired at
    # each request's first token and end, carry its queue (kvcompassd.pacing.ReadingCadence).
    # 0: every busy engine at --load-poll-ms, as before.
    sole_edge_poll_ms: float = 100.0

    def __post_init__(self) -> None:
        _check_float("heartbeat_ms", self.heartbeat_ms, lo=0.0, hi=10_000.0, lo_open=True)
        _check_float("engine_probe_max_ms", self.engine_probe_max_ms, lo=1000.0, hi=60_000.0)
        # Past these an edge's view of its own workers would lag the reading it is sent to
        # replace by more than a queue broadcast period's worth of a remote region's error.
        _check_float("load_tolerance_ms", self.load_tolerance_ms, lo=0.0, hi=100.0)
        _check_float("load_tolerance_share", self.load_tolerance_share, lo=0.0, hi=0.5)
        # (an agent reads no less often than once per heartbeat, whatever this says)
        _check_float("sole_edge_poll_ms", self.sole_edge_poll_ms, lo=0.0, hi=1000.0)
        for name in ("heartbeat_ms", "engine_probe_max_ms", "load_tolerance_ms", "load_tolerance_share",
                     "sole_edge_poll_ms"):
            _as_float(self, name)


DECODE_POLICIES: Final = ("least_loaded", "random")
SGLANG_BOOTSTRAP_PORT: Final = 8998  # SGLang's --disaggregation-bootstrap-port default


def bootstrap_port_of(worker: WorkerConfig) -> int:
    """A prefill worker's KV-transfer bootstrap port: the configured one, else SGLang's default."""
    return worker.bootstrap_port if worker.bootstrap_port is not None else SGLANG_BOOTSTRAP_PORT


@dataclass(frozen=True, slots=True)
class DisaggregationParams:
    """Prefill-decode disaggregation (``[disaggregation]``; used only when workers have roles).

    The edge picks the prefill worker with the score and a decode worker of the prefill's region
    by ``decode_policy``: ``least_loaded`` (fewest requests in flight, as this edge counts them
    plus what the region's agents report) or ``random`` (the paper's control, App. C). The KV of
    the whole prompt moves from prefill to decode in ``kv_bytes_per_token * tokens * 8 /
    (kv_transfer_gbps * 1e9)`` s over the prefill worker's link (its ``kv_transfer_gbps``);
    128 KiB/token is Llama-3.1-8B in BF16 (32 layers x 8 KV heads x 128 dims x K,V x 2 bytes).
    A decode instance waits at most
    ``transfer_timeout_s`` for its KV before it fails the request. The transfer's time is
    ``kvcompassd.worker.kvtransfer``'s, which the simulator and the emulated worker share."""

    decode_policy: str = "least_loaded"
    kv_bytes_per_token: int = 131_072
    transfer_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.decode_policy not in DECODE_POLICIES:
            _fail("decode_policy", f"expected one of {', '.join(DECODE_POLICIES)}, got {self.decode_policy!r}")
        _check_int("kv_bytes_per_token", self.kv_bytes_per_token, lo=1, hi=1 << 30)
        _check_float("transfer_timeout_s", self.transfer_timeout_s, lo=0.0, lo_open=True)
        _as_float(self, "transfer_timeout_s")


# ---------------------------------------------------------------- latency derivation


def great_circle_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Haversine distance in km on a sphere of radius 6371 km."""
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp, dl = p2 - p1, math.radians(lon2 - lon1)
    h = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


def derive_one_way_ms(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """One-way WAN latency estimated from geography, for region pairs without a configured link.

    ``one_way_ms = great_circle_km / 200 km-per-ms * 1.5 + 2 ms``: light in fibre covers about
    200 km per ms (2/3 c); real routes are about 1.5x the great circle; 2 ms covers switching and
    the hops at each end. Checked against the paper's testbed: Virginia-Frankfurt (6,500 km)
    gives 51 ms, the public Internet measured 160 ms there, so measured links should be
    configured whenever they are known; the derivation is a floor for planning.
    """
    return great_circle_km(lat1, lon1, lat2, lon2) / FIBRE_KM_PER_MS * ROUTE_INFLATION + PER_PATH_OVERHEAD_MS


# ---------------------------------------------------------------- socket collisions
# Every address in the config is a socket some process binds; two that bind the same port on one
# host make the second process die with "Address already in use" at start-up, possibly hours
# after the config was written. The loader refuses them, naming both.

_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "*", ""})


@dataclass(frozen=True, slots=True)
class ConfigSocket:
    """One socket a config implies: who binds it, TCP or UDP, where."""

    owner: str  # e.g. "[[workers]] #2 (us-1) kv_events replay (port + 1)"
    transport: str  # "tcp" or "udp": a TCP and a UDP socket may share a port
    host: str
    port: int


def _split_host_port(address: str) -> tuple[str, int] | None:
    """``host:port`` / ``scheme://host:port[/path]`` -> (normalised host, port); None for
    addresses without a port (``ipc://``, ``inproc://``)."""
    rest = address.split("://", 1)[-1].split("/", 1)[0]
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    host = host.strip("[]").lower()
    return ("127.0.0.1" if host == "localhost" else host), int(port)


def config_sockets(cfg: ClusterConfig, overrides: Mapping[str, Mapping[str, str]] | None = None) -> list[ConfigSocket]:
    """Every socket the config's nodes bind. A worker entry is one host: its engine's HTTP and
    KV-event sockets (the engine's replay socket is the KV-event port + 1, as SGLang's default
    and the emulated worker use) and its agent's QUIC and metrics sockets. ``overrides`` maps a
    node id to fields given on its command line instead (``{"edge-us": {"metrics": ...}}``)."""
    overrides = overrides or {}
    out: list[ConfigSocket] = []
    for table, entries, fields_ in (
        ("[[workers]]", cfg.workers, (("http", "tcp"), ("kv_events", "tcp"), ("agent", "udp"),
                                      ("agent_metrics", "tcp"))),
        ("[[edges]]", cfg.edges, (("http", "tcp"), ("quic", "udp"), ("metrics", "tcp"))),
        ("[[maintenance]]", cfg.maintenance, (("quic", "udp"), ("metrics", "tcp"))),
    ):
        for i, entry in enumerate(entries, 1):
            found: list[tuple[str, str, str, int]] = []
            for name, transport in fields_:
                value = overrides.get(entry.id, {}).get(name, getattr(entry, name))
                parsed = None if value is None else _split_host_port(value)
                if parsed is None or (name == "kv_events" and not value.startswith("tcp://")):
                    continue
                label = name if value == getattr(entry, name) else f"{name} (command line)"
                found.append((label, transport, *parsed))
                if name == "kv_events":
                    replay = getattr(entry, "kv_events_replay", None)
                    if replay is None:  # the engines' and the emulator's default: the KV-event port + 1
                        found.append(("kv_events replay (port + 1)", transport, parsed[0], parsed[1] + 1))
                    elif replay.startswith("tcp://") and (at := _split_host_port(replay)) is not None:
                        found.append(("kv_events_replay", transport, *at))
            if table == "[[workers]]" and entry.role == "prefill" and found:
                # the engine's KV-transfer bootstrap server, on the engine's host
                host = next((h for label, _, h, _ in found if label.startswith("http")), found[0][2])
                found.append(("bootstrap_port", "tcp", host, bootstrap_port_of(entry)))
            # A wildcard bind address (edges' "0.0.0.0:8080") is on the host the entry's other
            # addresses name; with none, it is on a host of its own.
            home = next((h for _, _, h, _ in found if h not in _WILDCARD_HOSTS), f"<host of {table} #{i}>")
            out.extend(ConfigSocket(f"{table} #{i} ({entry.id}) {name}", transport,
                                    home if host in _WILDCARD_HOSTS else host, port)
                       for name, transport, host, port in found)
    return out


def check_socket_collisions(cfg: ClusterConfig, overrides: Mapping[str, Mapping[str, str]] | None = None) -> None:
    """Raise :class:`ConfigError` naming both sockets if two of them bind one port on one host
    (``overrides`` as for :func:`config_sockets`: a ``--metrics`` given on the command line)."""
    seen: dict[tuple[str, str, int], ConfigSocket] = {}
    for sock in config_sockets(cfg, overrides):
        key = (sock.transport, sock.host, sock.port)
        first = seen.setdefault(key, sock)
        if first is not sock:
            raise ConfigError(f"{sock.owner} binds {sock.transport} {sock.host}:{sock.port}, as {first.owner} "
                              "does: two sockets on one host cannot share a port")
        if not 0 < sock.port < 65536:
            raise ConfigError(f"{sock.owner} would bind port {sock.port}, outside 1-65535")
# ---------------------------------------------------------------- [tokenizer]


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    """The served model's tokenizer, which every edge must tokenise with exactly as the engines do.

    ``path``: a Hugging Face tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``,
    which holds the chat template and the BOS/EOS tokens); relative paths are relative to the
    config file. Absent: the byte tokenizer, which edges accept only when every worker is emulated.
    ``chat_template``: a Jinja file that replaces the directory's template (as SGLang's
    ``--chat-template`` does: give both the same file).
    """

    path: str | None = None
    chat_template: str | None = None

    def __post_init__(self) -> None:
        for name in ("path", "chat_template"):
            value = getattr(self, name)
            if value is not None:
                _check_str(name, value, pattern=None)
        if self.chat_template is not None and self.path is None:
            _fail("chat_template", "needs a tokenizer path (the byte tokenizer has a fixed template)")

    def resolved(self, base: Path) -> TokenizerConfig:
        """Relative paths made relative to ``base`` (the config file's directory)."""
        return TokenizerConfig(*(None if v is None else str(base / v) for v in (self.path, self.chat_template)))


# ---------------------------------------------------------------- the cluster


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """A whole deployment. ``links`` is complete after construction: configured links plus
    those derived from region coordinates, one per unordered pair, in region order."""

    name: str
    model: str
    tenant: str = ""
    shards: int = 1
    intra_region_one_way_ms: float = 0.25
    # Largest UDP payload the daemons send; 0 = by path (16 KiB to loopback peers, 1200 bytes
    # elsewhere). Set it where the path is known: 9000-byte jumbo frames on a LAN, or 1200 where
    # "loopback" addresses are really relays standing in for a WAN (the demo's emulated regions).
    max_datagram_size: int = 0
    regions: tuple[RegionConfig, ...] = ()
    workers: tuple[WorkerConfig, ...] = ()
    edges: tuple[EdgeConfig, ...] = ()
    maintenance: tuple[MaintenanceConfig, ...] = ()
    index: IndexParams = field(default_factory=IndexParams)
    score: ScoreParams = field(default_factory=ScoreParams)
    links: tuple[LinkConfig, ...] = ()
    deadlines: DeadlineParams = field(default_factory=DeadlineParams)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    frontdoor: FrontDoorLimits = field(default_factory=FrontDoorLimits)
    sync: SyncParams = field(default_factory=SyncParams)
    disaggregation: DisaggregationParams = field(default_factory=DisaggregationParams)
    idle: IdleParams = field(default_factory=IdleParams)
    _one_way: dict[tuple[str, str], float] = field(init=False, repr=False, compare=False)
    _workers_by_id: dict[str, WorkerConfig] = field(init=False, repr=False, compare=False)
    _workers_by_region: dict[str, tuple[WorkerConfig, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def located(table: str, check: Any) -> None:
            try:
                check()
            except ConfigError as exc:
                raise exc.located(table=table) from None

        for name in ("regions", "workers", "edges", "maintenance", "links"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        located("[cluster]", lambda: _check_str("name", self.name, pattern=None))
        located("[cluster]", lambda: _check_str("model", self.model, pattern=None))
        located("[cluster]", lambda: _check_str("tenant", self.tenant, pattern=None, allow_empty=True))
        located("[cluster]", lambda: _check_int("shards", self.shards, lo=1, hi=1 << 16))
        located("[cluster]", lambda: _check_float("intra_region_one_way_ms", self.intra_region_one_way_ms, lo=0.0))
        object.__setattr__(self, "intra_region_one_way_ms", float(self.intra_region_one_way_ms))
        located("[cluster]", lambda: _check_int("max_datagram_size", self.max_datagram_size, lo=0, hi=65527))
        if 0 < self.max_datagram_size < 1200:
            raise ConfigError(f"must be 0 (by path) or at least QUIC's 1200 bytes, got {self.max_datagram_size}",
                              table="[cluster]", field="max_datagram_size")
        if not isinstance(self.index, IndexParams):
            raise ConfigError(f"expected IndexParams, got {type(self.index).__name__}", table="[index]")
        if not isinstance(self.score, ScoreParams):
            raise ConfigError(f"expected ScoreParams, got {type(self.score).__name__}", table="[score]")
        if not isinstance(self.deadlines, DeadlineParams):
            raise ConfigError(f"expected DeadlineParams, got {type(self.deadlines).__name__}", table="[deadlines]")
        if not isinstance(self.tokenizer, TokenizerConfig):
            raise ConfigError(f"expected TokenizerConfig, got {type(self.tokenizer).__name__}", table="[tokenizer]")
        if not isinstance(self.frontdoor, FrontDoorLimits):
            raise ConfigError(f"expected FrontDoorLimits, got {type(self.frontdoor).__name__}", table="[frontdoor]")
        if not isinstance(self.sync, SyncParams):
            raise ConfigError(f"expected SyncParams, got {type(self.sync).__name__}", table="[sync]")
        if not isinstance(self.disaggregation, DisaggregationParams):
            raise ConfigError(f"expected DisaggregationParams, got {type(self.disaggregation).__name__}",
                              table="[disaggregation]")
        if not isinstance(self.idle, IdleParams):
            raise ConfigError(f"expected IdleParams, got {type(self.idle).__name__}", table="[idle]")
        if self.idle.heartbeat_ms < self.score.broadcast_period_ms:
            raise ConfigError(f"must be >= [score] broadcast_period_ms ({self.score.broadcast_period_ms}), "
                              f"got {self.idle.heartbeat_ms}", table="[idle]", field="heartbeat_ms")

        self._check_entries("[[regions]]", self.regions, RegionConfig)
        self._check_entries("[[workers]]", self.workers, WorkerConfig)
        self._check_entries("[[edges]]", self.edges, EdgeConfig)
        self._check_entries("[[maintenance]]", self.maintenance, MaintenanceConfig)
        self._check_entries("[[links]]", self.links, LinkConfig)
        if not self.regions:
            raise ConfigError("at least one region is required", table="[[regions]]")
        if not self.workers:
            raise ConfigError("at least one worker is required", table="[[workers]]")

        region_names: dict[str, int] = {}
        for i, region in enumerate(self.regions, 1):
            if region.name in region_names:
                raise ConfigError(f"duplicate region {region.name!r}", table=f"[[regions]] #{i}", field="name")
            region_names[region.name] = i

        # Node ids name certificates and log lines, so they are unique across all roles.
        seen_ids: dict[str, str] = {}
        for table, entries in (("[[workers]]", self.workers), ("[[edges]]", self.edges),
                               ("[[maintenance]]", self.maintenance)):
            for i, entry in enumerate(entries, 1):
                here = f"{table} #{i}"
                if entry.id in seen_ids:
                    raise ConfigError(f"duplicate id {entry.id!r} (also {seen_ids[entry.id]})", table=here, field="id")
                seen_ids[entry.id] = here
                region = getattr(entry, "region", None)
                if region is not None and region not in region_names:
                    raise ConfigError(f"unknown region {region!r}", table=here, field="region")

        edge_ids = {e.id for e in self.edges}
        for edge in self.sync.full_stream_edges:
            if edge not in edge_ids:
                raise ConfigError(f"unknown edge {edge!r}", table="[sync]", field="full_stream_edges")

        if self.maintenance:
            by_shard: dict[int, int] = {}
            for i, unit in enumerate(self.maintenance, 1):
                here = f"[[maintenance]] #{i}"
                if unit.shard >= self.shards:
                    raise ConfigError(f"shard {unit.shard} out of range 0..{self.shards - 1}", table=here, field="shard")
                if unit.shard in by_shard:
                    raise ConfigError(f"shard {unit.shard} already owned by [[maintenance]] #{by_shard[unit.shard]}",
                                      table=here, field="shard")
                by_shard[unit.shard] = i
            missing = sorted(set(range(self.shards)) - set(by_shard))
            if missing:
                raise ConfigError(f"shards {missing} have no maintenance unit (cluster.shards = {self.shards})",
                                  table="[[maintenance]]", field="shard")

        self._check_disaggregated_regions()
        check_socket_collisions(self)
        object.__setattr__(self, "links", self._complete_links(region_names))
        one_way: dict[tuple[str, str], float] = {}
        for link in self.links:
            a, b = link.between
            one_way[(a, b)] = one_way[(b, a)] = link.one_way_ms
        for region in self.regions:
            one_way[(region.name, region.name)] = self.intra_region_one_way_ms
        object.__setattr__(self, "_one_way", one_way)
        object.__setattr__(self, "_workers_by_id", {w.id: w for w in self.workers})
        object.__setattr__(
            self,
            "_workers_by_region",
            {r.name: tuple(w for w in self.workers if w.region == r.name) for r in self.regions},
        )

    def _check_disaggregated_regions(self) -> None:
        """A region that prefills hands its KV to a decode worker of the same region."""
        roles: dict[str, set[str]] = {}
        for w in self.workers:
            roles.setdefault(w.region, set()).add(w.role)
        for region, present in roles.items():
            if "prefill" in present and "decode" not in present:
                raise ConfigError(f"region {region!r} has prefill workers but no decode worker to hand their KV to",
                                  table="[[workers]]", field="role")
        if all(w.role == "decode" for w in self.workers):
            raise ConfigError("no worker can be routed to (every worker is a decode worker)",
                              table="[[workers]]", field="role")

    @property
    def disaggregated(self) -> bool:
        """True when any worker is a prefill or decode worker."""
        return any(w.role != "mixed" for w in self.workers)

    def routable(self, worker: WorkerConfig) -> bool:
        """Whether requests are routed to ``worker`` (decode workers only receive handed-over KV)."""
        return worker.role != "decode"

    @staticmethod
    def _check_entries(table: str, entries: tuple[Any, ...], cls: type) -> None:
        for i, entry in enumerate(entries, 1):
            if not isinstance(entry, cls):
                raise ConfigError(f"expected {cls.__name__}, got {type(entry).__name__}", table=f"{table} #{i}")

    def _complete_links(self, region_names: dict[str, int]) -> tuple[LinkConfig, ...]:
        order = {name: i for i, name in enumerate(region_names)}
        configured: dict[tuple[str, str], LinkConfig] = {}
        for i, link in enumerate(self.links, 1):
            here = f"[[links]] #{i}"
            for name in link.between:
                if name not in order:
                    raise ConfigError(f"unknown region {name!r}", table=here, field="between")
            a, b = sorted(link.between, key=order.__getitem__)
            if (a, b) in configured:
                raise ConfigError(f"duplicate link between {a!r} and {b!r} (links are symmetric: one entry per pair)",
                                  table=here, field="between")
            configured[(a, b)] = LinkConfig((a, b), link.one_way_ms, link.derived)
        complete: list[LinkConfig] = []
        for i, ra in enumerate(self.regions):
            for rb in self.regions[i + 1:]:
                pair = (ra.name, rb.name)
                if pair in configured:
                    complete.append(configured[pair])
                elif ra.has_position and rb.has_position:
                    ms = derive_one_way_ms(ra.latitude, ra.longitude, rb.latitude, rb.longitude)  # type: ignore[arg-type]
                    complete.append(LinkConfig(pair, round(ms, 3), derived=True))
                else:
                    raise ConfigError(
                        f"no link between {ra.name!r} and {rb.name!r}, and latitude/longitude of both are needed "
                        "to derive one",
                        table="[[links]]",
                        field="between",
                    )
        return tuple(complete)

    # ------------------------------------------------------------ queries

    def one_way_ms(self, a: str, b: str) -> float:
        """One-way latency between regions ``a`` and ``b`` (intra-region latency when equal)."""
        try:
            return self._one_way[(a, b)]
        except KeyError:
            unknown = a if a not in self._workers_by_region else b
            raise KeyError(f"unknown region {unknown!r}") from None

    def rtt_ms(self, a: str, b: str) -> float:
        return 2.0 * self.one_way_ms(a, b)

    def region_names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.regions)

    def region(self, name: str) -> RegionConfig:
        for region in self.regions:
            if region.name == name:
                return region
        raise KeyError(f"unknown region {name!r}")

    def workers_in(self, region: str) -> tuple[WorkerConfig, ...]:
        try:
            return self._workers_by_region[region]
        except KeyError:
            raise KeyError(f"unknown region {region!r}") from None

    def decode_workers_in(self, region: str) -> tuple[WorkerConfig, ...]:
        """The decode workers a prefill worker of ``region`` hands its KV to."""
        return tuple(w for w in self.workers_in(region) if w.role == "decode")

    # -- authority: who may speak for a shard or a region ------------------------------------

    def shard_owner(self, shard: int) -> str | None:
        """The id of the maintenance unit owning ``shard`` (its ``[[maintenance]]`` entry names
        it; construction checks every shard has exactly one), or None in a config without
        maintenance units."""
        for unit in self.maintenance:
            if unit.shard == shard:
                return unit.id
        return None

    def edge_region(self, edge_id: str) -> str | None:
        """The region of edge ``edge_id``, or None if the config has no such edge."""
        return next((e.region for e in self.edges if e.id == edge_id), None)

    def worker(self, worker_id: str) -> WorkerConfig:
        try:
            return self._workers_by_id[worker_id]
        except KeyError:
            raise KeyError(f"unknown worker {worker_id!r}") from None

    def worker_ids(self) -> tuple[str, ...]:
        return tuple(w.id for w in self.workers)

    def edges_in(self, region: str) -> tuple[EdgeConfig, ...]:
        return tuple(e for e in self.edges if e.region == region)


# ---------------------------------------------------------------- parsing

_TOP_LEVEL = ("cluster", "index", "score", "frontdoor", "tokenizer", "regions", "links", "workers", "edges",
              "maintenance", "deadlines", "sync", "disaggregation", "idle")
_CLUSTER_KEYS = ("name", "model", "tenant", "shards", "intra_region_one_way_ms", "max_datagram_size")


def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls) if f.init and not f.name.startswith("_"))


def _table(data: Mapping[str, Any], key: str, label: str) -> Mapping[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"expected a table, got {type(value).__name__}", table=label)
    return value


def _array(data: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise ConfigError("expected an array of tables", table=f"[[{key}]]")
    return value


def _build(cls: type, raw: Mapping[str, Any], table: str, *, allowed: tuple[str, ...] | None = None) -> Any:
    names = allowed if allowed is not None else _field_names(cls)
    for key in raw:
        if key not in names:
            raise ConfigError(f"unknown field (expected one of: {', '.join(names)})", table=table, field=key)
    try:
        return cls(**{k: raw[k] for k in raw})
    except ConfigError as exc:
        raise exc.located(table=table) from None
    except TypeError as exc:  # a required field is missing
        missing = [f.name for f in fields(cls) if f.init and f.name not in raw
                   and f.default is MISSING and f.default_factory is MISSING]
        raise ConfigError("missing required field", table=table, field=missing[0] if missing else "") from exc


def parse_config(data: Mapping[str, Any], source: str = "<config>") -> ClusterConfig:
    """Validate a parsed TOML document (a dict) into a :class:`ClusterConfig`."""
    try:
        return _parse(data)
    except ConfigError as exc:
        raise exc.located(source=source) from None


def _parse(data: Mapping[str, Any]) -> ClusterConfig:
    if not isinstance(data, Mapping):
        raise ConfigError(f"expected a TOML document (table), got {type(data).__name__}")
    for key in data:
        if key not in _TOP_LEVEL:
            raise ConfigError(f"unknown top-level table {key!r} (expected one of: {', '.join(_TOP_LEVEL)})")
    if "cluster" not in data:
        raise ConfigError("missing table", table="[cluster]")
    cluster = _table(data, "cluster", "[cluster]")
    for key in cluster:
        if key not in _CLUSTER_KEYS:
            raise ConfigError(f"unknown field (expected one of: {', '.join(_CLUSTER_KEYS)})",
                              table="[cluster]", field=key)
    for key in ("name", "model"):
        if key not in cluster:
            raise ConfigError("missing required field", table="[cluster]", field=key)

    index = _build(IndexParams, _table(data, "index", "[index]"), "[index]")
    score = _build(ScoreParams, _table(data, "score", "[score]"), "[score]")
    frontdoor = _build(FrontDoorLimits, _table(data, "frontdoor", "[frontdoor]"), "[frontdoor]")
    deadlines = _build(DeadlineParams, _table(data, "deadlines", "[deadlines]"), "[deadlines]")
    tokenizer = _build(TokenizerConfig, _table(data, "tokenizer", "[tokenizer]"), "[tokenizer]")
    sync = _build(SyncParams, _table(data, "sync", "[sync]"), "[sync]")
    disaggregation = _build(DisaggregationParams, _table(data, "disaggregation", "[disaggregation]"),
                            "[disaggregation]")
    idle = _build(IdleParams, _table(data, "idle", "[idle]"), "[idle]")
    regions = [_build(RegionConfig, raw, f"[[regions]] #{i}") for i, raw in enumerate(_array(data, "regions"), 1)]
    links = [_build(LinkConfig, raw, f"[[links]] #{i}", allowed=("between", "one_way_ms"))
             for i, raw in enumerate(_array(data, "links"), 1)]
    workers = [_build(WorkerConfig, raw, f"[[workers]] #{i}") for i, raw in enumerate(_array(data, "workers"), 1)]
    edges = [_build(EdgeConfig, raw, f"[[edges]] #{i}") for i, raw in enumerate(_array(data, "edges"), 1)]
    maintenance = [_build(MaintenanceConfig, raw, f"[[maintenance]] #{i}")
                   for i, raw in enumerate(_array(data, "maintenance"), 1)]
    return ClusterConfig(
        name=cluster["name"],
        model=cluster["model"],
        tenant=cluster.get("tenant", ""),
        shards=cluster.get("shards", 1),
        intra_region_one_way_ms=cluster.get("intra_region_one_way_ms", 0.25),
        max_datagram_size=cluster.get("max_datagram_size", 0),
        regions=tuple(regions),
        workers=tuple(workers),
        edges=tuple(edges),
        maintenance=tuple(maintenance),
        index=index,
        score=score,
        links=tuple(links),
        deadlines=deadlines,
        tokenizer=tokenizer,
        frontdoor=frontdoor,
        sync=sync,
        disaggregation=disaggregation,
        idle=idle,
    )


def load_config(path: str | Path) -> ClusterConfig:
    """Read and validate a TOML cluster config; errors name ``path``."""
    source = str(path)
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror or exc}", source=source) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML: {exc}", source=source) from None
    cfg = parse_config(data, source)
    return replace(cfg, tokenizer=cfg.tokenizer.resolved(Path(path).resolve().parent))


# ---------------------------------------------------------------- dumping


def _toml_string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and every control character escaped."""
    out = ['"']
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _emit(lines: list[str], obj: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None:
            lines.append(f"{name} = {_toml_value(value)}")


def dump_config(cfg: ClusterConfig) -> str:
    """TOML text that :func:`parse_config` reads back into an equal config.

    Derived links are written out explicitly (with a comment), so the dump pins the latencies.
    """
    lines = ["[cluster]"]
    _emit(lines, cfg, _CLUSTER_KEYS)
    for title, obj in (("index", cfg.index), ("score", cfg.score), ("frontdoor", cfg.frontdoor),
                       ("tokenizer", cfg.tokenizer), ("deadlines", cfg.deadlines), ("sync", cfg.sync),
                       ("disaggregation", cfg.disaggregation), ("idle", cfg.idle)):
        lines += ["", f"[{title}]"]
        _emit(lines, obj, _field_names(type(obj)))
    for region in cfg.regions:
        lines += ["", "[[regions]]"]
        _emit(lines, region, _field_names(RegionConfig))
    for link in cfg.links:
        lines += ["", "[[links]]" + ("  # derived from great-circle distance" if link.derived else "")]
        _emit(lines, link, ("between", "one_way_ms"))
    for table, entries in (("workers", cfg.workers), ("edges", cfg.edges), ("maintenance", cfg.maintenance)):
        for entry in entries:
            lines += ["", f"[[{table}]]"]
            _emit(lines, entry, _field_names(type(entry)))
    return "\n".join(lines) + "\n"
