"""Requests and workload sources: the Mooncake trace loader, Azure 2023 arrival/length traces,
rate scaling, and the shared token machinery of the synthetic generators (``synthetic.py``).

Tokens are deterministic pseudo-tokens: a *segment* (a system prompt, a tool manual, a trace's
512-token block) is identified by an integer key, and its tokens are drawn from a PRNG seeded by
that key. Equal segment sequences therefore give equal token prefixes, which is all the prefix
caches and the discovery index need; no tokenizer is involved.
"""

from __future__ import annotations

import bisect
import csv
import hashlib
import heapq
import itertools
import json
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

VOCAB_SIZE = 128_256  # Llama 3 vocabulary
MOONCAKE_BLOCK_TOKENS = 512


class WorkloadError(ValueError):
    """A trace file or workload parameter is malformed; the message names the file/line/field."""


@dataclass(frozen=True, slots=True, eq=False)
class Request:
    """One user request as it enters the edge of ``region`` at ``arrival_s`` (virtual seconds)."""

    id: int
    arrival_s: float
    region: str
    session: int
    tokens: np.ndarray  # uint32 prompt token ids
    output_tokens: int
    tenant: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.id, int) or self.id < 0:
            raise WorkloadError(f"request id must be a non-negative int, got {self.id!r}")
        if not (isinstance(self.arrival_s, (int, float)) and math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise WorkloadError(f"request {self.id}: arrival_s must be finite and >= 0, got {self.arrival_s!r}")
        if not isinstance(self.region, str) or not self.region:
            raise WorkloadError(f"request {self.id}: region must be a non-empty string")
        if not isinstance(self.tokens, np.ndarray) or self.tokens.dtype != np.uint32 or self.tokens.ndim != 1:
            raise WorkloadError(f"request {self.id}: tokens must be a 1-D uint32 numpy array")
        if len(self.tokens) == 0:
            raise WorkloadError(f"request {self.id}: empty prompt")
        if not isinstance(self.output_tokens, int) or self.output_tokens < 1:
            raise WorkloadError(f"request {self.id}: output_tokens must be an int >= 1, got {self.output_tokens!r}")

    @property
    def prompt_tokens(self) -> int:
        return len(self.tokens)


# --------------------------------------------------------------------------- token segments


def segment_key(*parts: object) -> int:
    """A stable 64-bit key for a segment named by ``parts`` (independent of PYTHONHASHSEED)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class SegmentTokens:
    """Deterministic tokens per segment key, with an LRU cache for the reused (shared) segments."""

    def __init__(self, cache_segments: int = 50_000) -> None:
        self._cache: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._limit = cache_segments

    @staticmethod
    def generate(key: int, length: int) -> np.ndarray:
        return np.random.default_rng(key).integers(0, VOCAB_SIZE, size=length, dtype=np.uint32)

    def get(self, key: int, length: int, *, shared: bool = True) -> np.ndarray:
        if not shared:
            return self.generate(key, length)
        k = (key, length)
        arr = self._cache.get(k)
        if arr is None:
            arr = self.generate(key, length)
            arr.setflags(write=False)
            self._cache[k] = arr
            if len(self._cache) > self._limit:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(k)
        return arr


_CDFS: dict[tuple[tuple[str, float], ...], tuple[list[str], list[float]]] = {}


def weighted_choice(rng: np.random.Generator, weights: Mapping[str, float]) -> str:
    """``names[rng.choice(len(names), p=normalised weights)]``, drawing the same one uniform
    and returning the same name as that call, without its per-call checks (one call per
    session: it was ~a fifth of generating a stream, 4.2 of 19.6 s under cProfile)."""
    key = tuple(weights.items())
    known = _CDFS.get(key)
    if known is None:
        names = [name for name, _ in key]
        p = np.array([weight for _, weight in key], dtype=float)
        if len(p) == 0 or (p < 0).any() or p.sum() <= 0 or not np.isfinite(p).all():
            raise WorkloadError(f"region weights must be non-negative with a positive sum, got {dict(weights)}")
        cdf = (p / p.sum()).cumsum()  # as Generator.choice computes it
        cdf /= cdf[-1]
        known = (names, cdf.tolist())
        if len(_CDFS) < 256:
            _CDFS[key] = known
    names, cdf = known
    return names[bisect.bisect_right(cdf, rng.random())]


# --------------------------------------------------------------------------- Mooncake trace


@dataclass(frozen=True, slots=True)
class MooncakeRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


MAX_TRACE_LINE_BYTES = 16 << 20  # one record; a 1 M-token prompt is ~2,000 block ids at 512 tokens


def _json_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_mooncake(path: str | Path, *, limit: int | None = None,
                  block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[MooncakeRecord]:
    """Parse a Mooncake-format trace (FAST'25; JSON lines of ``timestamp`` in ms,
    ``input_length``, ``output_length`` and ``hash_ids``, one id per ``block_tokens``-token block
    of the prompt). Every fault is a ``WorkloadError`` naming the file and, for a record, its
    line: a missing or unreadable file, a line that is not a JSON object, a missing or mistyped
    field, a block count that does not fit the input length, timestamps that go backwards (the
    simulator replays in arrival order), no records at all."""
    if not (_json_int(block_tokens) and block_tokens > 0):
        raise WorkloadError(f"block size must be a positive number of tokens, got {block_tokens!r}")
    path = Path(path)
    if not path.exists():
        raise WorkloadError(f"trace file {str(path)!r} does not exist")
    if not path.is_file():
        raise WorkloadError(f"trace {str(path)!r} is not a file")
    records: list[MooncakeRecord] = []
    last_ts = 0.0
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise WorkloadError(f"trace file {str(path)!r} cannot be read ({exc.strerror})") from None
    with fh:
        for lineno in itertools.count(1):
            if limit is not None and len(records) >= limit:
                break
            raw = fh.readline(MAX_TRACE_LINE_BYTES + 1)
            if not raw:
                break
            where = f"{path}:{lineno}"
            if len(raw) > MAX_TRACE_LINE_BYTES:
                raise WorkloadError(f"{where}: line longer than {MAX_TRACE_LINE_BYTES} bytes")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise WorkloadError(f"{where}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{where}: not JSON ({exc.msg})") from None
            except RecursionError:
                raise WorkloadError(f"{where}: not JSON (nested too deeply)") from None
            if not isinstance(obj, dict):
                raise WorkloadError(f"{where}: expected a JSON object")
            for fld in ("timestamp", "input_length", "output_length", "hash_ids"):
                if fld not in obj:
                    raise WorkloadError(f"{where}: missing field {fld!r}")
            ts, n_in, n_out, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
                raise WorkloadError(f"{where}: field 'timestamp' must be a non-negative number (ms)")
            if ts < last_ts:
                raise WorkloadError(f"{where}: timestamp {ts} is earlier than the previous record's {last_ts} "
                                    f"(records must be in arrival order)")
            if not _json_int(n_in) or n_in < 1:
                raise WorkloadError(f"{where}: field 'input_length' must be a positive int")
            if not _json_int(n_out) or n_out < 0:
                raise WorkloadError(f"{where}: field 'output_length' must be a non-negative int")
            if not isinstance(ids, list) or not all(_json_int(h) and h >= 0 for h in ids):
                raise WorkloadError(f"{where}: field 'hash_ids' must be a list of non-negative ints")
            if len(ids) != -(-n_in // block_tokens):  # integer ceil: a huge input_length must not overflow
                raise WorkloadError(
                    f"{where}: field 'hash_ids' has {len(ids)} blocks for input_length {n_in} "
                    f"(expected ceil({n_in}/{block_tokens}); is the block size {block_tokens} right?)"
                )
            last_ts = float(ts)
            records.append(MooncakeRecord(float(ts), n_in, n_out, tuple(ids)))
    if not records:
        raise WorkloadError(f"trace file {str(path)!r} holds no records")
    return records


def mooncake_sessions(records: Sequence[MooncakeRecord], *,
                      block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[int]:
    """Session id per record. The synthetic trace has no session field; a record continues the
    earlier conversation whose *whole* prompt (all but its possibly partial last block) is a
    prefix of this prompt, if it is long enough to extend it: a follow-up turn carries the
    previous prompt and its answer, so at least ``input_length + output_length`` tokens.
    Anything else starts a new root session: a shared system prompt or document followed by new
    text, and another question on the same document ending in the same partial block (in the
    synthetic trace 79 % of the records the prefix test alone took for follow-ups, 67 of them
    exact repeats, most a few tokens longer or shorter than their "parent")."""
    owner_of_chain: dict[tuple[int, ...], int] = {}
    sessions: list[int] = []
    next_session = 0
    for i, rec in enumerate(records):
        session = None
        ids = rec.hash_ids
        # Longest earlier full-prompt chain that prefixes this one.
        for cut in range(len(ids), 0, -1):
            j = owner_of_chain.get(ids[:cut])
            if j is not None:
                prev = records[j]
                if rec.input_length >= prev.input_length + prev.output_length:
                    session = sessions[j]
                break
        if session is None:
            session = next_session
            next_session += 1
        sessions.append(session)
        full_blocks = rec.input_length // block_tokens
        if full_blocks:
            owner_of_chain[ids[:full_blocks]] = i
    return sessions


def session_regions(sessions: Sequence[int], region_weights: Mapping[str, float], *, seed: int = 0) -> list[str]:
    """Region per request: each new session draws one in proportion to the weights; its later
    turns inherit it (appendix D)."""
    rng = np.random.default_rng(seed)
    region_of: dict[int, str] = {}
    out = []
    for session in sessions:
        region = region_of.get(session)
        if region is None:
            region = region_of[session] = weighted_choice(rng, region_weights)
        out.append(region)
    return out


def mooncake_requests(
    path: str | Path,
    region_weights: Mapping[str, float],
    *,
    seed: int = 0,
    limit: int | None = None,
    tenant: str = "",
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    records: Sequence[MooncakeRecord] | None = None,
) -> Iterator[Request]:
    """Replay a Mooncake-format trace: block ids become deterministic ``block_tokens``-token
    segments (equal id ⇒ equal tokens; ids are prefix-chained, so equal ids give equal
    prefixes); root sessions are assigned to regions in proportion to ``region_weights`` and
    follow-ups inherit the region. ``records``: the file already read (``read_mooncake``)."""
    if records is None:
        records = read_mooncake(path, limit=limit, block_tokens=block_tokens)
    sessions = mooncake_sessions(records, block_tokens=block_tokens)
    regions = session_regions(sessions, region_weights, seed=seed)
    segs = SegmentTokens()
    for i, (rec, session, region) in enumerate(zip(records, sessions, regions)):
        parts = [segs.get(segment_key("mooncake", h), block_tokens) for h in rec.hash_ids]
        tokens = np.concatenate(parts)[: rec.input_length]
        yield Request(i, rec.timestamp_ms / 1000.0, region, session, tokens, max(1, rec.output_length), tenant)


# --------------------------------------------------------------------------- Azure 2023 traces


@dataclass(frozen=True, slots=True)
class AzureTrace:
    """Arrival offsets (s, from the first request) and token counts of an Azure LLM 2023 trace."""

    offsets_s: np.ndarray
    context_tokens: np.ndarray
    generated_tokens: np.ndarray

    @property
    def mean_rate(self) -> float:
        span = float(self.offsets_s[-1] - self.offsets_s[0])
        return (len(self.offsets_s) - 1) / span if span > 0 else float("inf")


def read_azure(path: str | Path) -> AzureTrace:
    """Parse ``TIMESTAMP,ContextTokens,GeneratedTokens`` (timestamps with 100 ns resolution)."""
    stamps: list[float] = []
    ctx: list[int] = []
    gen: list[int] = []
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            raise WorkloadError(f"{path}: header must be TIMESTAMP,ContextTokens,GeneratedTokens, got {header}")
        for lineno, row in enumerate(reader, 2):
            if len(row) != 3:
                raise WorkloadError(f"{path}:{lineno}: expected 3 fields, got {len(row)}")
            try:
                ts = row[0]
                base, _, frac = ts.partition(".")
                t = datetime.strptime(base, "%Y-%m-%d %H:%M:%S").timestamp() + (float("0." + frac) if frac else 0.0)
                c, g = int(row[1]), int(row[2])
            except ValueError as exc:
                raise WorkloadError(f"{path}:{lineno}: bad field ({exc})") from None
            if c < 0 or g < 0:
                raise WorkloadError(f"{path}:{lineno}: negative token count")
            stamps.append(t)
            ctx.append(c)
            gen.append(g)
    if len(stamps) < 2:
        raise WorkloadError(f"{path}: needs at least two records")
    order = np.argsort(np.array(stamps), kind="stable")
    t = np.array(stamps)[order]
    return AzureTrace(t - t[0], np.array(ctx)[order], np.array(gen)[order])


class ArrivalProcess:
    """Arrival times at ``rate`` req/s: Poisson, or an Azure trace's inter-arrival gaps scaled so
    their mean rate is ``rate`` (burstiness kept) and cycled when the trace runs out."""

    def __init__(self, rate: float, *, seed: int = 0, azure: AzureTrace | None = None) -> None:
        if not (rate > 0 and math.isfinite(rate)):
            raise WorkloadError(f"arrival rate must be a positive number, got {rate!r}")
        self.rate = rate
        self._rng = np.random.default_rng(seed)
        self._gaps = None if azure is None else np.diff(azure.offsets_s) * (azure.mean_rate / rate)

    def times(self) -> Iterator[float]:
        t = 0.0
        if self._gaps is None:
            while True:
                yield t
                t += float(self._rng.exponential(1.0 / self.rate))
        start = int(self._rng.integers(len(self._gaps)))
        i = start
        while True:
            yield t
            t += float(self._gaps[i])
            i = (i + 1) % len(self._gaps)


def rescale(requests: Iterable[Request], target_rate: float, native_rate: float) -> Iterator[Request]:
    """Scale inter-arrivals by ``native_rate / target_rate`` so the stream runs at ``target_rate``."""
    if not (target_rate > 0 and native_rate > 0):
        raise WorkloadError("rates for rescaling must be positive")
    factor = native_rate / target_rate
    for r in requests:
        yield Request(r.id, r.arrival_s * factor, r.region, r.session, r.tokens, r.output_tokens, r.tenant)


def trace_rate(requests: Sequence[Request]) -> float:
    """Mean arrival rate of a finite request list."""
    if len(requests) < 2:
        raise WorkloadError("need at least two requests to measure a rate")
    span = requests[-1].arrival_s - requests[0].arrival_s
    return (len(requests) - 1) / span if span > 0 else float("inf")


def limit_stream(requests: Iterable[Request], *, max_requests: int | None = None, duration_s: float | None = None) -> Iterator[Request]:
    """Stop after ``max_requests`` or at ``duration_s`` of virtual time, whichever comes first."""
    for n, r in enumerate(requests):
        if max_requests is not None and n >= max_requests:
            return
        if duration_s is not None and r.arrival_s >= duration_s:
            return
        yield r


def merge_by_arrival(streams: Sequence[Iterable[Request]]) -> Iterator[Request]:
    """Merge arrival-ordered streams, renumbering ids in the merged order."""
    merged = heapq.merge(*streams, key=lambda r: r.arrival_s)
    for i, r in enumerate(merged):
        yield Request(i, r.arrival_s, r.region, r.session, r.tokens, r.output_tokens, r.tenant)
