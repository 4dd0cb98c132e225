"""Sans-IO codec for the KV-cache event stream of SGLang and vLLM (identical wire format).

Checked against the engines' own ``ZmqEventPublisher`` (SGLang 0.5.23
``sglang.srt.disaggregation.kv_events``, vLLM 0.34.0 ``vllm.distributed.kv_events``); their
bytes are committed under ``tests/data/engine_events/``.

Live, on a SUB socket: ``[topic, seq, payload]``. ``topic`` is the engine's ``topic`` setting
(default empty); ``seq`` is 8 bytes big-endian, written unsigned by the engines, counting batches
from 0 per publisher start: a value that reads negative as int64 is not a seq an engine sends
and is rejected. ``payload`` is msgpack: ``[ts, events, dp_rank]`` (both engines; older ones
send ``[ts, events]``) or a map ``{"ts", "events", "data_parallel_rank"}``. Events are maps
tagged with ``"type"`` (optional fields left at None are omitted by SGLang, sent as null by
vLLM) or, from old SGLang builds, positional ``["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, ...]``. Fields this index does not
use (``cache_salt``, ``session_id``, ``extra_keys``, ``kv_cache_spec_*``, ``locality``...) are
ignored; ``lora_name`` and vLLM's ``group_idx`` are kept (see :mod:`.blocktree` for what is
indexed).

Block hashes are canonicalised: integers to signed int64 (SGLang's convention; a uint64 such as
vLLM's 17000000000000000001 becomes the int64 with the same 64 bits), bytes stay bytes (vLLM
with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).

A batch is decoded completely or rejected with :class:`KvEventError`: one malformed event
rejects the whole batch, so a consumer never applies half a batch (the block tree would
otherwise hold a state the engine never had). The sequence number is kept so the caller can
still account for the batch in its gap tracking.

Replay (``ZmqEventPublisher._service_replay``, the same in both engines): a client sends
``[b"", start_seq]`` from a DEALER; the ROUTER sees ``[identity, b"", start_seq]`` (any other
frame count is ignored by the engine) and answers every buffered batch with ``seq >= start_seq``
as ``[identity, b"", topic, seq, payload]`` -- a DEALER receives four frames -- and then the end
marker ``[identity, b"", b"", seq=-1, b""]`` (its topic frame is empty whatever the topic).
"""

from __future__ import annotations

import enum
import threading
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import numpy as np

from kvcompassd.core._ludo_cffi import ffi, lib
from kvcompassd.core.events import Tier

BlockHash = int | bytes

INT64_MIN = -(1 << 63)
UINT64_LIMIT = 1 << 64
MAX_HASH_BYTES = 64
MAX_TOKEN_ID = (1 << 32) - 1
MAX_PAYLOAD_BYTES = 64 << 20
SEQ_BYTES = 8
END_SEQ = -1


class KvEventError(ValueError):
    """A KV-event message (or replay frame) from the engine is malformed."""


class NegativeReplaySeq(KvEventError):
    """A replay reply whose seq reads negative (and is not the end marker): one buffered batch
    no engine counter produces. The rest of the replay is still good."""

    def __init__(self, seq: int) -> None:
        super().__init__(f"replay reply has negative seq {seq}")
        self.seq = seq


class StorageTier(enum.IntEnum):
    """Where a block lives, ordered so that ``max`` is the worst tier of a path."""

    VRAM = 1
    DRAM = 2
    UNINDEXED = 3  # SSD, remote storage, LoRA blocks: kept in the mirror, never registered

    def index_tier(self) -> Tier | None:
        """The index tier to register, or None when this tier is not indexed."""
        if self is StorageTier.VRAM:
            return Tier.VRAM
        if self is StorageTier.DRAM:
            return Tier.DRAM
        return None


GPU_MEDIUM = "GPU"
_DRAM_MEDIA = frozenset({"CPU", "CPU_PINNED", "CPU_TIER1"})


def canonical_medium(medium: str | None) -> str:
    """Engines send None for GPU (older SGLang has no field at all); upper-case the rest."""
    return GPU_MEDIUM if medium is None else medium.upper()


def tier_of_medium(medium: str | None) -> StorageTier:
    """``GPU``/None -> VRAM; host memory -> DRAM; disk, FS, object store, anything else -> not
    indexed (the paper excludes SSD: fetching it costs more than recomputing)."""
    name = canonical_medium(medium)
    if name == GPU_MEDIUM:
        return StorageTier.VRAM
    if name in _DRAM_MEDIA:
        return StorageTier.DRAM
    return StorageTier.UNINDEXED


def canonical_hash(value: object, what: str = "block hash") -> BlockHash:
    """int64/uint64 -> signed int64; bytes -> bytes (bounded). Anything else is an error."""
    if isinstance(value, bool):
        raise KvEventError(f"{what} must be an int or bytes, got bool")
    if isinstance(value, int):
        if not INT64_MIN <= value < UINT64_LIMIT:
            raise KvEventError(f"{what} {value} is outside the int64/uint64 range")
        return value - UINT64_LIMIT if value >= (1 << 63) else value
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        if not 0 < len(data) <= MAX_HASH_BYTES:
            raise KvEventError(f"{what} has {len(data)} bytes (1..{MAX_HASH_BYTES} allowed)")
        return data
    raise KvEventError(f"{what} must be an int or bytes, got {type(value).__name__}")


def _hash_tuple(values: object, what: str) -> tuple[BlockHash, ...]:
    if not isinstance(values, (list, tuple)):
        raise KvEventError(f"{what} must be an array, got {type(values).__name__}")
    return tuple(canonical_hash(v, what) for v in values)


def _token(value: object) -> int:
    # EAGLE bigram pages carry (token, next_token) pairs: the first is the token at that slot.
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKEN_ID:
        raise KvEventError(f"token id must be an int in [0, 2^32), got {value!r}")
    return value


def _optional_str(value: object, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise KvEventError(f"{what} must be a string or null, got {type(value).__name__}")


def _optional_int(value: object, what: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise KvEventError(f"{what} must be an int or null, got {type(value).__name__}")


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks ``block_hashes`` (a chain: each one's parent is the previous) now hold
    ``token_ids`` (``block_size`` per block, the last block may be shorter) in ``medium``."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None  # vLLM (and SGLang's dynamo format): the adapter's public name
    group_idx: int | None = None  # vLLM: the KV-cache group (hybrid models have several)

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_hashes", tuple(map(canonical_hash, self.block_hashes)))
        if self.parent_block_hash is not None:
            object.__setattr__(
                self, "parent_block_hash", canonical_hash(self.parent_block_hash, "parent_block_hash")
            )
        tokens = tuple(self.token_ids)
        # fast path (C-level loops) for the usual plain ints; per token only for odd input
        if not (tokens and set(map(type, tokens)) == {int} and min(tokens) >= 0 and max(tokens) <= MAX_TOKEN_ID):
            tokens = tuple(_token(t) for t in tokens)
        object.__setattr__(self, "token_ids", tokens)
        if not self.block_hashes:
            raise KvEventError("BlockStored has no block hashes")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size <= 0:
            raise KvEventError(f"block_size must be a positive int, got {self.block_size!r}")
        n = len(self.block_hashes)
        if not (n - 1) * self.block_size < len(self.token_ids) <= n * self.block_size:
            raise KvEventError(
                f"BlockStored has {len(self.token_ids)} token ids for {n} blocks of "
                f"{self.block_size}: expected ({(n - 1) * self.block_size}, {n * self.block_size}]"
            )
        _optional_int(self.lora_id, "lora_id")
        _optional_str(self.medium, "medium")
        if self.lora_name is not None:  # both None on most events: skip the calls
            _optional_str(self.lora_name, "lora_name")
        if self.group_idx is not None:
            _check_group(self.group_idx)

    @classmethod
    def trusted(
        cls,
        block_hashes: tuple[int, ...],
        parent_block_hash: int | None,
        token_ids: tuple[int, ...],
        block_size: int,
        lora_id: int | None = None,
        medium: str | None = None,
    ) -> BlockStored:
        """Build without re-validating, for producers whose fields are canonical by
        construction (the prefix cache: signed int64 hashes, a tuple of plain ints in
        [0, 2^32), a token count that fits the blocks). Validation costs ~10x the object itself
        and the simulator builds one event per cached page; anything built here must compare
        equal to what the validating constructor builds (tests/test_kvevents_trusted.py checks it)."""
        event = _new_block_stored(cls)
        _set_hashes(event, block_hashes)
        _set_parent(event, parent_block_hash)
        _set_tokens(event, token_ids)
        _set_block_size(event, block_size)
        _set_lora(event, lora_id)
        _set_medium(event, medium)
        _set_lora_name(event, None)
        _set_group(event, None)
        return event

    @property
    def tier(self) -> StorageTier:
        return tier_of_medium(self.medium)

    @property
    def is_lora(self) -> bool:
        return self.lora_id is not None or self.lora_name is not None

    def slices(self, max_blocks: int) -> Iterable[BlockStored]:
        """The same stores as events of at most ``max_blocks`` blocks each (parents chained),
        so a huge event can be applied a slice at a time."""
        if len(self.block_hashes) <= max_blocks:
            yield self
            return
        parent = self.parent_block_hash
        step = max_blocks * self.block_size
        for i in range(0, len(self.block_hashes), max_blocks):
            hashes = self.block_hashes[i : i + max_blocks]
            part = BlockStored.trusted(hashes, parent, self.token_ids[(i // max_blocks) * step : (i // max_blocks + 1) * step],
                                       self.block_size, self.lora_id, self.medium)
            _set_lora_name(part, self.lora_name)
            _set_group(part, self.group_idx)
            yield part
            parent = hashes[-1]

    def blocks(self) -> Iterable[tuple[BlockHash, BlockHash | None, tuple[int, ...]]]:
        """Each block as (hash, parent hash, its tokens), parents chained through the event."""
        parent = self.parent_block_hash
        for i, block_hash in enumerate(self.block_hashes):
            yield block_hash, parent, self.token_ids[i * self.block_size : (i + 1) * self.block_size]
            parent = block_hash


# Slot setters for BlockStored.trusted (a frozen dataclass refuses plain assignment).
_new_block_stored = object.__new__
_set_hashes = BlockStored.block_hashes.__set__  # type: ignore[attr-defined]
_set_parent = BlockStored.parent_block_hash.__set__  # type: ignore[attr-defined]
_set_tokens = BlockStored.token_ids.__set__  # type: ignore[attr-defined]
_set_block_size = BlockStored.block_size.__set__  # type: ignore[attr-defined]
_set_lora = BlockStored.lora_id.__set__  # type: ignore[attr-defined]
_set_medium = BlockStored.medium.__set__  # type: ignore[attr-defined]
_set_lora_name = BlockStored.lora_name.__set__  # type: ignore[attr-defined]
_set_group = BlockStored.group_idx.__set__  # type: ignore[attr-defined]


def _check_group(value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < (1 << 32)):
        raise KvEventError(f"group_idx must be an int in [0, 2^32) or null, got {value!r}")


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks ``block_hashes`` left ``medium`` (None means GPU)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None  # vLLM: the KV-cache group

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_hashes", tuple(canonical_hash(h) for h in self.block_hashes))
        _optional_str(self.medium, "medium")
        _check_group(self.group_idx)

    @classmethod
    def trusted(cls, block_hashes: tuple[int, ...], medium: str | None = None) -> BlockRemoved:
        """Build without re-validating, as ``BlockStored.trusted``: for producers whose hashes
        are signed int64 and medium a str or None by construction (the prefix cache)."""
        event = _new_block_stored(cls)
        _set_removed_hashes(event, block_hashes)
        _set_removed_medium(event, medium)
        _set_removed_group(event, None)
        return event

    @property
    def tier(self) -> StorageTier:
        return tier_of_medium(self.medium)


_set_removed_hashes = BlockRemoved.block_hashes.__set__  # type: ignore[attr-defined]
_set_removed_medium = BlockRemoved.medium.__set__  # type: ignore[attr-defined]
_set_removed_group = BlockRemoved.group_idx.__set__  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole cache (flush, reset)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message: batch number ``seq``, engine timestamp ``ts`` (s), events."""

    seq: int
    ts: float
    events: tuple[KvEvent, ...] | ScannedEvents  # a tuple, or a scanned payload's columns (PayloadDecoder)
    dp_rank: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.seq, bool) or not isinstance(self.seq, int) or not 0 <= self.seq < (1 << 63):
            raise KvEventError(f"batch seq must be an int in [0, 2^63), got {self.seq!r}")
        if isinstance(self.ts, bool) or not isinstance(self.ts, (int, float)) or self.ts != self.ts:
            raise KvEventError(f"batch ts must be a number, got {self.ts!r}")
        object.__setattr__(self, "ts", float(self.ts))
        if type(self.events) is ScannedEvents:
            pass  # immutable, and every run a KV event by construction (the C scan's columns)
        else:
            object.__setattr__(self, "events", tuple(self.events))
            for event in self.events:
                if not isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)):
                    raise KvEventError(f"not a KV event: {type(event).__name__}")
        _optional_int(self.dp_rank, "dp_rank")


# ---------------------------------------------------------------------------------------------
# decoding


def decode_seq(frame: bytes) -> int:
    """The 8-byte big-endian sequence frame (signed: the replay end marker is -1)."""
    if not isinstance(frame, (bytes, bytearray, memoryview)) or len(frame) != SEQ_BYTES:
        size = len(frame) if isinstance(frame, (bytes, bytearray, memoryview)) else "?"
        raise KvEventError(f"sequence frame must be {SEQ_BYTES} bytes, got {size}")
    return int.from_bytes(bytes(frame), "big", signed=True)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def _unpack(payload: bytes) -> Any:
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise KvEventError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        return msgpack.unpackb(bytes(payload), raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises many types (ExtraData, FormatError, Unicode...)
        raise KvEventError(f"payload is not valid msgpack: {exc.__class__.__name__}: {exc}") from None


def _decode_event(raw: object, index: int) -> KvEvent:
    try:
        if isinstance(raw, (list, tuple)):
            return _decode_positional(raw)
        if isinstance(raw, Mapping):
            return _decode_map(raw)
        raise KvEventError(f"event must be an array or a map, got {type(raw).__name__}")
    except KvEventError as exc:
        raise KvEventError(f"event #{index}: {exc}") from None


def _decode_positional(raw: Sequence[Any]) -> KvEvent:
    if not raw or not isinstance(raw[0], str):
        raise KvEventError("positional event must start with its type name")
    kind = raw[0]
    if kind == "BlockStored":
        if len(raw) < 5:
            raise KvEventError(f"positional BlockStored needs >= 5 fields, got {len(raw)}")
        return _stored(
            raw[1], raw[2], raw[3], raw[4],
            raw[5] if len(raw) > 5 else None,
            raw[6] if len(raw) > 6 else None,
        )
    if kind == "BlockRemoved":
        if len(raw) < 2:
            raise KvEventError("positional BlockRemoved needs block_hashes")
        return _removed(raw[1], raw[2] if len(raw) > 2 else None)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KvEventError(f"unknown event type {kind!r}")


def _decode_map(raw: Mapping[Any, Any]) -> KvEvent:
    kind = raw.get("type")
    if kind == "BlockStored":
        if not ("block_hashes" in raw and "token_ids" in raw and "block_size" in raw):
            missing = [k for k in ("block_hashes", "token_ids", "block_size") if k not in raw]
            raise KvEventError(f"BlockStored map lacks {', '.join(missing)}")
        return _stored(
            raw["block_hashes"], raw.get("parent_block_hash"), raw["token_ids"], raw["block_size"],
            raw.get("lora_id"), raw.get("medium"), raw.get("lora_name"), raw.get("group_idx"),
        )
    if kind == "BlockRemoved":
        if "block_hashes" not in raw:
            raise KvEventError("BlockRemoved map lacks block_hashes")
        return _removed(raw["block_hashes"], raw.get("medium"), raw.get("group_idx"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KvEventError(f"unknown event type {kind!r}")


_INT64_END = 1 << 63


def _signed_int64s(values: Any) -> bool:
    """Whether ``values`` is a non-empty array of plain ints that are already canonical
    (signed int64): what the engines send, which the fast paths below take as is."""
    if type(values) is not list or not values:
        return False
    if len(values) == 1:  # one block per event is what SGLang and vLLM send
        value = values[0]
        return type(value) is int and INT64_MIN <= value < _INT64_END
    return set(map(type, values)) == {int} and INT64_MIN <= min(values) and max(values) < _INT64_END


def _plain_optional(value: Any, kind: type) -> bool:
    return value is None or type(value) is kind


def _stored(hashes: Any, parent: Any, tokens: Any, block_size: Any, lora_id: Any, medium: Any,
            lora_name: Any = None, group_idx: Any = None) -> BlockStored:
    if not isinstance(tokens, (list, tuple)):
        raise KvEventError(f"token_ids must be an array, got {type(tokens).__name__}")
    # The shapes the engines send are checked here once and the event built without the
    # constructor's second pass over the same fields (decoding was a third of an agent's CPU,
    # issue 30 item 4). Anything else takes the validating constructor, which rejects it with
    # its usual error; both build equal events (tests/test_kvevents.py checks it).
    if (type(block_size) is int and block_size > 0 and _signed_int64s(hashes)
            and (parent is None or (type(parent) is int and INT64_MIN <= parent < _INT64_END))
            and _plain_optional(lora_id, int) and _plain_optional(medium, str) and _plain_optional(lora_name, str)
            and (group_idx is None or (type(group_idx) is int and 0 <= group_idx < (1 << 32)))
            and (len(hashes) - 1) * block_size < len(tokens) <= len(hashes) * block_size
            and set(map(type, tokens)) == {int} and min(tokens) >= 0 and max(tokens) <= MAX_TOKEN_ID):
        return _checked_stored(hashes, parent, tokens, block_size, lora_id, medium, lora_name, group_idx)
    return BlockStored(
        block_hashes=_hash_tuple(hashes, "block_hashes"),
        parent_block_hash=None if parent is None else canonical_hash(parent, "parent_block_hash"),
        token_ids=tuple(tokens),
        block_size=block_size,
        lora_id=_optional_int(lora_id, "lora_id"),
        medium=_optional_str(medium, "medium"),
        lora_name=lora_name,  # checked by BlockStored
        group_idx=group_idx,
    )


def _checked_stored(hashes, parent, tokens, block_size, lora_id, medium, lora_name, group_idx) -> BlockStored:
    """A BlockStored from fields already checked as its constructor checks them (the fast path's
    one place that writes the slots directly)."""
    event = _new_block_stored(BlockStored)
    _set_hashes(event, tuple(hashes))
    _set_parent(event, parent)
    _set_tokens(event, tuple(tokens))
    _set_block_size(event, block_size)
    _set_lora(event, lora_id)
    _set_medium(event, medium)
    _set_lora_name(event, lora_name)
    _set_group(event, group_idx)
    return event


def _plain_group(group_idx: Any) -> bool:
    return group_idx is None or (type(group_idx) is int and 0 <= group_idx < (1 << 32))


def _decode_coalesced(raws: list[Any], first_index: int) -> list[KvEvent]:
    """Decode ``raws`` (events ``first_index``...) with each run of map-form events that
    continue one another built as one event: BlockStored events of one block size, medium,
    LoRA and group, each one's parent the last block of the one before (whose blocks were all
    full), as one store of all their blocks; BlockRemoved events of one medium and group as
    one removal of all their hashes. A block tree applies a store's blocks, and a removal's
    hashes, one after the other in order, so it ends as the original events leave it; the
    engines publish one event per block, and this builds one object per run of them instead
    (issue 30 item 4). Each event is checked as :func:`_stored` / :func:`_removed` check it;
    any other event, or one that fails the checks, goes through :func:`_decode_event` as
    usual (and an invalid one rejects the batch with its usual error)."""
    out: list[KvEvent] = []
    kind = None  # of the open run: "stored" or "removed"
    run_key: tuple = ()
    hashes: list[BlockHash] = []
    tokens: list[int] = []
    parent: Any = None

    def close() -> None:
        if kind == "stored":
            size, lora_id, medium, lora_name, group_idx = run_key
            out.append(_checked_stored(hashes, parent, tokens, size, lora_id, medium, lora_name, group_idx))
        elif kind == "removed":
            event = _new_block_stored(BlockRemoved)
            _set_removed_hashes(event, tuple(hashes))
            _set_removed_medium(event, run_key[0])
            _set_removed_group(event, run_key[1])
            out.append(event)

    for offset, raw in enumerate(raws):
        kind_here = raw.get("type") if type(raw) is dict else None
        if kind_here == "BlockStored":
            event_hashes, event_tokens, size = raw.get("block_hashes"), raw.get("token_ids"), raw.get("block_size")
            event_parent, lora_id, medium = raw.get("parent_block_hash"), raw.get("lora_id"), raw.get("medium")
            lora_name, group_idx = raw.get("lora_name"), raw.get("group_idx")
            if (type(size) is int and size > 0 and _signed_int64s(event_hashes) and type(event_tokens) is list
                    and (event_parent is None or (type(event_parent) is int and INT64_MIN <= event_parent < _INT64_END))
                    and _plain_optional(lora_id, int) and _plain_optional(medium, str)
                    and _plain_optional(lora_name, str) and _plain_group(group_idx)
                    and (len(event_hashes) - 1) * size < len(event_tokens) <= len(event_hashes) * size
                    and set(map(type, event_tokens)) == {int} and min(event_tokens) >= 0
                    and max(event_tokens) <= MAX_TOKEN_ID):
                key = (size, lora_id, medium, lora_name, group_idx)
                if (kind == "stored" and key == run_key and event_parent == hashes[-1]
                        and len(tokens) == len(hashes) * size):
                    hashes.extend(event_hashes)
                    tokens.extend(event_tokens)
                    continue
                close()
                kind, run_key, parent = "stored", key, event_parent
                hashes, tokens = list(event_hashes), list(event_tokens)
                continue
        elif kind_here == "BlockRemoved":
            event_hashes, medium, group_idx = raw.get("block_hashes"), raw.get("medium"), raw.get("group_idx")
            if _signed_int64s(event_hashes) and _plain_optional(medium, str) and _plain_group(group_idx):
                key = (medium, group_idx)
                if kind == "removed" and key == run_key:
                    hashes.extend(event_hashes)
                    continue
                close()
                kind, run_key, hashes = "removed", key, list(event_hashes)
                continue
        close()
        kind = None
        out.append(_decode_event(raw, first_index + offset))
    close()
    return out


class _ScanBuffers(threading.local):
    """kvc_kvevents_scan's output arrays, reused from one payload to the next and grown to the
    largest payload seen (the scan's results are copied out at once). One set per thread: cffi
    releases the GIL during the call."""

    def __init__(self) -> None:
        self.capacity = 0  # payload bytes the arrays hold room for
        self.runs = self.hashes = self.tokens = None
        self.ts = ffi.new("double *")
        self.dp_rank = ffi.new("int64_t *")
        self.has_dp_rank = ffi.new("int *")

    def room_for(self, size: int) -> None:
        if size > self.capacity:
            size = max(size, 1 << 14)
            # an event takes >= 23 bytes (the smallest: a one-field AllBlocksCleared map), a hash
            # or a token >= 1
            self.runs = ffi.new("kvc_event_run[]", size // 16 + 1)
            self.hashes = ffi.new("int64_t[]", size)
            self.tokens = ffi.new("uint32_t[]", size)
            self.capacity = size


_scan_buffers = _ScanBuffers()


# Fields of a scanned run (ScannedEvents.runs): kvc_event_run's, in its order.
(RUN_KIND, RUN_HAS_PARENT, RUN_HAS_LORA_ID, RUN_HAS_GROUP, RUN_BLOCK_SIZE, RUN_GROUP_IDX, RUN_PARENT, RUN_LORA_ID,
 RUN_HASH_START, RUN_HASH_END, RUN_TOKEN_START, RUN_TOKEN_END, RUN_MEDIUM_OFF, RUN_MEDIUM_LEN, RUN_LORA_NAME_OFF,
 RUN_LORA_NAME_LEN) = range(16)
RUN_STORED, RUN_REMOVED, RUN_CLEARED = lib.KVC_RUN_STORED, lib.KVC_RUN_REMOVED, lib.KVC_RUN_CLEARED


class ScannedEvents(Sequence):
    """A scanned payload's events (the C scan's coalesced runs), kept as its columns: ``runs``
    (one tuple of kvc_event_run's fields per event, ``RUN_*`` indices), ``hashes`` and ``tokens``
    (flat lists the runs slice). A block mirror reads the columns directly
    (``BlockTree.apply_events``) and builds no object per event; anything else reads it as the
    sequence of the events ``_decode_coalesced`` builds (made on first use, equal to them).
    Immutable: nothing changes the columns once scanned."""

    __slots__ = ("_columns", "_data", "_events", "_hashes", "_runs", "_tokens")

    def __init__(self, data: bytes, runs: list[tuple] | None, hashes: list[int] | None, tokens: list[int] | None,
                 columns: tuple[bytes, bytes, bytes] | None = None) -> None:
        """``columns``: the same runs, hashes and tokens as the scan wrote them (kvc_event_run
        records, int64s, uint32s, native order), for a C block tree to read as they are; the
        lists may then be None (made from the columns on first use)."""
        if columns is None and (runs is None or hashes is None or tokens is None):
            raise ValueError("ScannedEvents needs its lists or its columns")
        self._data = data
        self._runs = runs
        self._hashes = hashes
        self._tokens = tokens
        self._columns = columns
        self._events: tuple[KvEvent, ...] | None = None

    @property
    def runs(self) -> list[tuple]:
        if self._runs is None:
            self._runs = np.frombuffer(self._columns[0], dtype=_RUN_DTYPE).tolist()  # type: ignore[index]
        return self._runs

    @property
    def hashes(self) -> list[int]:
        if self._hashes is None:
            self._hashes = array("q", self._columns[1]).tolist()  # type: ignore[index]
        return self._hashes

    @property
    def tokens(self) -> list[int]:
        if self._tokens is None:
            self._tokens = array("I", self._columns[2]).tolist()  # type: ignore[index]
        return self._tokens

    @property
    def data(self) -> bytes:
        """The payload the runs' media and LoRA names point into."""
        return self._data

    def columns(self) -> tuple[bytes, bytes, bytes]:
        """The runs as kvc_event_run records, the hashes as int64s, the tokens as uint32s
        (native order): what the scan wrote, or laid out from the lists. Raises OverflowError or
        TypeError for hashes that are not int64s (lists made by hand)."""
        if self._columns is None:
            runs = np.array(self.runs, dtype=_RUN_DTYPE).tobytes() if self.runs else b""
            self._columns = (runs, array("q", self.hashes).tobytes(), array("I", self.tokens).tobytes())
        return self._columns

    def medium(self, run: tuple) -> str | None:
        """The run's medium as the engine named it (None: null or absent)."""
        return _string_at(self._data, run[RUN_MEDIUM_OFF], run[RUN_MEDIUM_LEN])

    def lora_name(self, run: tuple) -> str | None:
        return _string_at(self._data, run[RUN_LORA_NAME_OFF], run[RUN_LORA_NAME_LEN])

    def canonical_media(self) -> list[str | None]:
        """Each run's medium as ``canonical_medium`` names it (None for a cleared run)."""
        data, seen = self._data, {}
        out: list[str | None] = []
        for run in self.runs:
            if run[RUN_KIND] == RUN_CLEARED:
                out.append(None)
                continue
            off = run[RUN_MEDIUM_OFF]
            raw = data[off:off + run[RUN_MEDIUM_LEN]] if off >= 0 else None
            medium = seen.get(raw)
            if medium is None:
                medium = seen[raw] = canonical_medium(_string_at(data, off, run[RUN_MEDIUM_LEN]))
            out.append(medium)
        return out

    def block_count(self) -> int:
        """Block hashes over all the runs (what an event's ``block_hashes`` would count)."""
        if self._runs is None:  # (from the columns, without making the runs' tuples; builtin sums:
            # numpy's reductions over a batch's few runs were 3 % of an agent's CPU, c = 16)
            runs = np.frombuffer(self._columns[0], dtype=_RUN_DTYPE)  # type: ignore[index]
            return sum(runs["hash_end"].tolist()) - sum(runs["hash_start"].tolist())
        return sum(run[RUN_HASH_END] - run[RUN_HASH_START] for run in self.runs)

    def event(self, index: int) -> KvEvent:
        """Run ``index`` built as its event object."""
        return self._built()[index]

    def _built(self) -> tuple[KvEvent, ...]:
        if self._events is None:
            self._events = tuple(self._build(run) for run in self.runs)
        return self._events

    def _build(self, run: tuple) -> KvEvent:
        kind = run[RUN_KIND]
        if kind == RUN_CLEARED:
            return AllBlocksCleared()
        group_idx = run[RUN_GROUP_IDX] if run[RUN_HAS_GROUP] else None
        block_hashes = tuple(self.hashes[run[RUN_HASH_START]:run[RUN_HASH_END]])
        if kind == RUN_REMOVED:
            event = _new_block_stored(BlockRemoved)
            _set_removed_hashes(event, block_hashes)
            _set_removed_medium(event, self.medium(run))
            _set_removed_group(event, group_idx)
            return event
        return _checked_stored(block_hashes, run[RUN_PARENT] if run[RUN_HAS_PARENT] else None,
                               tuple(self.tokens[run[RUN_TOKEN_START]:run[RUN_TOKEN_END]]), run[RUN_BLOCK_SIZE],
                               run[RUN_LORA_ID] if run[RUN_HAS_LORA_ID] else None, self.medium(run),
                               self.lora_name(run), group_idx)

    def __len__(self) -> int:
        if self._runs is None:
            return len(self._columns[0]) // _RUN_BYTES  # type: ignore[index]
        return len(self._runs)

    def __getitem__(self, index):  # type: ignore[override]
        return self._built()[index]

    def __iter__(self):
        return iter(self._built())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (ScannedEvents, tuple)):
            return self._built() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._built())

    def __repr__(self) -> str:
        return f"ScannedEvents({self._built()!r})"


def _run_dtype() -> np.dtype:
    """kvc_event_run's layout as a numpy record (offsets from cffi), so a scan's runs are read
    as one array and turned into tuples in one call, not field by field through cffi."""
    fields = [("kind", "u1"), ("has_parent", "u1"), ("has_lora_id", "u1"), ("has_group", "u1"),
              ("block_size", "u4"), ("group_idx", "u4"), ("parent", "i8"), ("lora_id", "i8"),
              ("hash_start", "u4"), ("hash_end", "u4"), ("token_start", "u4"), ("token_end", "u4"),
              ("medium_off", "i8"), ("medium_len", "u4"), ("lora_name_off", "i8"), ("lora_name_len", "u4")]
    return np.dtype({"names": [name for name, _ in fields], "formats": [fmt for _, fmt in fields],
                     "offsets": [ffi.offsetof("kvc_event_run", name) for name, _ in fields],
                     "itemsize": ffi.sizeof("kvc_event_run")})


_RUN_DTYPE = _run_dtype()
_RUN_BYTES = ffi.sizeof("kvc_event_run")
_STRINGS: dict[bytes, str] = {}  # media and LoRA names' UTF-8 -> str (the engines use a handful; kept <= 64)


def _string_at(data: bytes, off: int, length: int) -> str | None:
    if off < 0:
        return None
    raw = data[off:off + length]
    text = _STRINGS.get(raw)
    if text is None:
        text = raw.decode()  # (the scan checked it is UTF-8)
        if len(_STRINGS) < 64:
            _STRINGS[raw] = text
    return text


def _scan_coalesced(data: bytes) -> tuple[float, int | None, ScannedEvents] | None:
    """``data`` decoded in one C pass into the events ``_decode_coalesced`` builds (equal
    events: tests/test_kvevents.py checks it on the engines' fixtures and on fuzzed payloads),
    or None when the payload is outside the C scan's shapes (the Python decoder takes it).
    The events stay columns (:class:`ScannedEvents`): the runs read as one numpy record array,
    the hashes and tokens as two flat lists; the engines send one event per page, and an object
    per event was most of the decoding's time (issue 30 item 4)."""
    buffers = _scan_buffers
    size = len(data)
    buffers.room_for(size)
    n_runs = lib.kvc_kvevents_scan(ffi.from_buffer("uint8_t[]", data), size, buffers.runs, size // 16 + 1,
                                   buffers.hashes, size, buffers.tokens, size,
                                   buffers.ts, buffers.dp_rank, buffers.has_dp_rank)
    if n_runs < 0:
        return None
    if n_runs:
        runs = np.frombuffer(ffi.buffer(buffers.runs, n_runs * _RUN_BYTES), dtype=_RUN_DTYPE)
        # (builtin max over the few runs' ends: numpy's reductions on a record array's fields
        # were ~2 % of an agent's CPU in py-spy under the zero-delay gateway load, c = 16)
        n_hashes, n_tokens = max(runs["hash_end"].tolist()), max(runs["token_end"].tolist())
        # copies (the buffers are reused); the lists are made only if something reads them
        columns = (runs.tobytes(), ffi.buffer(buffers.hashes, 8 * n_hashes)[:], ffi.buffer(buffers.tokens, 4 * n_tokens)[:])
        return (buffers.ts[0], (buffers.dp_rank[0] if buffers.has_dp_rank[0] else None),
                ScannedEvents(data, None, None, None, columns))
    return (buffers.ts[0], (buffers.dp_rank[0] if buffers.has_dp_rank[0] else None),
            ScannedEvents(data, [], [], [], (b"", b"", b"")))


def _removed(hashes: Any, medium: Any, group_idx: Any = None) -> BlockRemoved:
    if (_signed_int64s(hashes) and _plain_optional(medium, str)
            and (group_idx is None or (type(group_idx) is int and 0 <= group_idx < (1 << 32)))):
        event = _new_block_stored(BlockRemoved)  # as _stored: checked once, built directly
        _set_removed_hashes(event, tuple(hashes))
        _set_removed_medium(event, medium)
        _set_removed_group(event, group_idx)
        return event
    return BlockRemoved(block_hashes=_hash_tuple(hashes, "block_hashes"), medium=_optional_str(medium, "medium"),
                        group_idx=group_idx)


def decode_payload(payload: bytes, seq: int) -> EventBatch:
    """Decode one msgpack batch published under ``seq``; all or nothing."""
    decoder = PayloadDecoder(payload, seq)
    decoder.step(len(payload) + 1)  # every event takes at least one byte
    assert decoder.result is not None
    return decoder.result


STREAM_ABOVE_BYTES = 1 << 20


class PayloadDecoder:
    """One payload decoded a slice of events at a time, so that an asyncio shell can yield to
    its loop between slices: an engine batch of 150 k blocks takes seconds to decode, and a loop
    stalled that long lets QUIC connections idle out. All or nothing, as :func:`decode_payload`
    (which is this decoder in one step): ``result`` is set only once every event decoded, and
    any error raises :class:`KvEventError`.

    A large array-form payload ``[ts, events, dp_rank]`` is read as a stream (events unpacked
    one by one); smaller ones and the map form are unpacked whole, then their events are decoded
    in slices. With ``coalesce``, a payload of the engines' usual shapes is first read in one C
    pass (``kvc_kvevents_scan``: no msgpack object per event, one event object per run); anything
    else falls back to the Python path, which names every error."""

    __slots__ = ("_coalesce", "_consumed", "_decoded", "_dp_rank", "_raw_events", "_remaining", "_trailing", "_ts",
                 "_unpacker", "result",
                 "seq")

    def __init__(self, payload: bytes, seq: int, *, stream: bool | None = None, coalesce: bool = False) -> None:
        """``stream``: read the array form event by event (default: for payloads above
        ``STREAM_ABOVE_BYTES``; one ``unpackb`` is faster for the usual small batches).
        ``coalesce``: build each run of events that continue one another as one event
        (:func:`_decode_coalesced`; a block mirror's view of the batch, not the engine's
        events one for one)."""
        self._coalesce = coalesce
        self._consumed = 0
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise KvEventError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
        self.seq = seq
        self.result: EventBatch | None = None
        self._decoded: list[KvEvent] | ScannedEvents = []
        self._dp_rank: Any = None
        self._raw_events: list[Any] | None = None
        self._unpacker: msgpack.Unpacker | None = None
        self._trailing = 0
        data = bytes(payload)
        if not (len(data) > STREAM_ABOVE_BYTES if stream is None else stream):
            scanned = _scan_coalesced(data) if coalesce else None
            if scanned is not None:  # one C pass (kvc_kvevents_scan); step() only builds the batch
                self._ts, self._dp_rank, self._decoded = scanned
                self._remaining = 0
                return
            self._start_whole(data)
            return
        try:
            unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, use_list=True,
                                        max_buffer_size=max(len(data), 1))
            unpacker.feed(data)
            try:
                fields = unpacker.read_array_header()
            except ValueError:  # not an array: the map form, or not a batch at all
                self._start_whole(data)
                return
            if fields < 2:
                raise KvEventError(f"batch array needs [ts, events, (dp_rank)], got {fields} fields")
            self._ts = _check_ts(unpacker.unpack())
            try:
                self._remaining = unpacker.read_array_header()
            except ValueError:
                raise KvEventError("batch events must be an array") from None
            self._trailing = fields - 2
            self._unpacker = unpacker
        except KvEventError:
            raise
        except Exception as exc:  # msgpack raises many types (OutOfData, FormatError, Unicode...)
            raise KvEventError(f"payload is not valid msgpack: {exc.__class__.__name__}: {exc}") from None

    def _start_whole(self, data: bytes) -> None:
        raw = _unpack(data)
        if isinstance(raw, list):
            if len(raw) < 2:
                raise KvEventError(f"batch array needs [ts, events, (dp_rank)], got {len(raw)} fields")
            ts, events = raw[0], raw[1]
            self._dp_rank = raw[2] if len(raw) > 2 else None
        elif isinstance(raw, Mapping):
            if "ts" not in raw or "events" not in raw:
                raise KvEventError("batch map lacks ts or events")
            ts, events = raw["ts"], raw["events"]
            self._dp_rank = raw.get("data_parallel_rank", raw.get("dp_rank"))
        else:
            raise KvEventError(f"batch must be an array or a map, got {type(raw).__name__}")
        self._ts = _check_ts(ts)
        if not isinstance(events, (list, tuple)):
            raise KvEventError(f"batch events must be an array, got {type(events).__name__}")
        self._raw_events = list(events)
        self._remaining = len(events)

    def step(self, max_events: int) -> bool:
        """Decode up to ``max_events`` more events; True once the batch is complete."""
        if self.result is not None:
            return True
        try:
            decoded = self._decoded
            n = min(max_events, self._remaining)
            start = self._consumed
            if not n:
                pass  # all decoded already (by the C scan, or an empty batch)
            elif self._coalesce:
                if self._raw_events is not None:
                    raws = self._raw_events[start:start + n]
                else:
                    unpack = self._unpacker.unpack  # type: ignore[union-attr]
                    raws = [unpack() for _ in range(n)]
                decoded.extend(_decode_coalesced(raws, start))
            elif self._raw_events is not None:
                decoded.extend(_decode_event(raw, start + i) for i, raw in enumerate(self._raw_events[start:start + n]))
            else:
                unpack = self._unpacker.unpack  # type: ignore[union-attr]
                for i in range(n):
                    decoded.append(_decode_event(unpack(), start + i))
            self._consumed = start + n
            self._remaining -= n
            if self._remaining:
                return False
            if self._unpacker is not None:
                if self._trailing:
                    self._dp_rank = self._unpacker.unpack()
                    for _ in range(self._trailing - 1):  # fields a newer engine may append
                        self._unpacker.skip()
                try:
                    self._unpacker.unpack()
                except msgpack.OutOfData:
                    pass
                else:
                    raise KvEventError("payload has extra data after the batch")
        except KvEventError:
            raise
        except Exception as exc:  # msgpack raises many types (OutOfData, FormatError, Unicode...)
            raise KvEventError(f"payload is not valid msgpack: {exc.__class__.__name__}: {exc}") from None
        self.result = EventBatch(seq=self.seq, ts=self._ts,
                                 events=decoded if type(decoded) is ScannedEvents else tuple(decoded),
                                 dp_rank=_optional_int(self._dp_rank, "dp_rank"))
        self._raw_events = self._unpacker = None
        return True


def _check_ts(ts: Any) -> float:
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise KvEventError(f"batch ts must be a number, got {type(ts).__name__}")
    return ts


def decode_message(frames: Sequence[bytes], *, topic: bytes | None = None) -> EventBatch:
    """Decode ``[topic, seq, payload]`` as received on a SUB socket."""
    if len(frames) != 3:
        raise KvEventError(f"KV-event message must have 3 frames, got {len(frames)}")
    if topic is not None and bytes(frames[0]) != topic:
        raise KvEventError(f"unexpected topic {bytes(frames[0])!r} (want {topic!r})")
    seq = decode_seq(frames[1])
    if seq < 0:
        raise KvEventError(f"published batch has negative seq {seq}")
    return decode_payload(frames[2], seq)


# ---------------------------------------------------------------------------------------------
# encoding (the emulated worker publishes exactly what the engines publish)


# BlockStored's fields without a default in SGLang's struct: always sent, null or not
_REQUIRED_FIELDS = frozenset({"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"})


def _event_to_wire(event: KvEvent, style: Literal["map", "positional"]) -> Any:
    if isinstance(event, BlockStored):
        fields = [
            ("block_hashes", list(event.block_hashes)),
            ("parent_block_hash", event.parent_block_hash),
            ("token_ids", list(event.token_ids)),
            ("block_size", event.block_size),
            ("lora_id", event.lora_id),
            ("medium", event.medium),
        ]
        kind = "BlockStored"
    elif isinstance(event, BlockRemoved):
        fields = [("block_hashes", list(event.block_hashes)), ("medium", event.medium)]
        kind = "BlockRemoved"
    elif isinstance(event, AllBlocksCleared):
        fields = []
        kind = "AllBlocksCleared"
    else:
        raise TypeError(f"not a KV event: {event!r}")
    if style == "map":
        # as SGLang's msgspec structs (omit_defaults): optional fields left at None are omitted
        if isinstance(event, BlockStored):
            fields += [("lora_name", event.lora_name), ("group_idx", event.group_idx)]
        elif isinstance(event, BlockRemoved):
            fields.append(("group_idx", event.group_idx))
        return {"type": kind, **{k: v for k, v in fields if v is not None or k in _REQUIRED_FIELDS}}
    if style == "positional":
        return [kind, *(value for _, value in fields)]
    raise ValueError(f"style must be 'map' or 'positional', got {style!r}")


def encode_payload(
    ts: float, events: Iterable[KvEvent], *, dp_rank: int | None = 0, style: Literal["map", "positional"] = "map"
) -> bytes:
    """The msgpack payload as SGLang 0.5.23 sends it: ``[ts, events, dp_rank]``."""
    wire_events = [_event_to_wire(e, style) for e in events]
    return msgpack.packb([float(ts), wire_events, dp_rank], use_bin_type=True)


def encode_batch(
    seq: int,
    ts: float,
    events: Iterable[KvEvent],
    *,
    style: Literal["map", "positional"] = "map",
    topic: bytes = b"",
    dp_rank: int | None = 0,
) -> list[bytes]:
    """The three frames of one published message."""
    if seq < 0:
        raise ValueError(f"seq must be >= 0, got {seq}")
    return [topic, encode_seq(seq), encode_payload(ts, events, dp_rank=dp_rank, style=style)]


# ---------------------------------------------------------------------------------------------
# replay framing


@dataclass(frozen=True, slots=True)
class ReplayedBatch:
    """One buffered batch answered by the replay socket."""

    seq: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class ReplayEnded:
    """The replay socket's end marker (seq -1, empty payload)."""


def replay_request_frames(start_seq: int) -> list[bytes]:
    """What a DEALER sends: the empty delimiter a REQ socket would add, then the start seq."""
    if start_seq < 0:
        raise ValueError(f"start_seq must be >= 0, got {start_seq}")
    return [b"", encode_seq(start_seq)]


def decode_replay_reply(frames: Sequence[bytes], *, topic: bytes | None = None) -> ReplayedBatch | ReplayEnded:
    """A reply as a DEALER receives it from the engines: ``[b"", topic, seq, payload]``, or the
    end marker ``[b"", b"", -1, b""]``. ``topic``, when given, must match a batch's topic."""
    if len(frames) != 4 or len(frames[0]) != 0:
        raise KvEventError(f"replay reply must be ['', topic, seq, payload], got {len(frames)} frames")
    seq = decode_seq(frames[2])
    if seq == END_SEQ:
        return ReplayEnded()
    if seq < 0:
        raise NegativeReplaySeq(seq)
    if topic is not None and bytes(frames[1]) != topic:
        raise KvEventError(f"replay reply on topic {bytes(frames[1])!r} (want {topic!r})")
    return ReplayedBatch(seq=seq, payload=bytes(frames[3]))


def parse_replay_request(frames: Sequence[bytes]) -> tuple[bytes, int]:
    """What a ROUTER receives: ``[identity, b"", start_seq]`` -> (identity, start_seq)."""
    if len(frames) != 3:
        raise KvEventError(f"replay request must be [identity, '', start_seq], got {len(frames)} frames")
    decode_seq(frames[2])  # checks the length
    return bytes(frames[0]), int.from_bytes(bytes(frames[2]), "big")  # unsigned, as the engines read it


def replay_reply_frames(identity: bytes, topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """One buffered batch as the engines answer it: the same topic, seq and payload as live."""
    return [identity, b"", topic, encode_seq(seq), payload]


def replay_end_frames(identity: bytes) -> list[bytes]:
    return [identity, b"", b"", encode_seq(END_SEQ), b""]


# ---------------------------------------------------------------------------------------------
# sequence tracking


class SeqVerdict(enum.Enum):
    NEXT = "next"            # apply it
    DUPLICATE = "duplicate"  # at or below the last applied seq: a replay overlap, or an odd seq
    GAP = "gap"              # batches [missing_from, missing_to] were not seen: replay them first


@dataclass(frozen=True, slots=True)
class SeqCheck:
    verdict: SeqVerdict
    missing_from: int = -1
    missing_to: int = -1


class SequenceTracker:
    """Orders batches from a live SUB stream and a replay stream.

    A seq at or below the last applied one is never taken as an engine restart here: one odd
    seq proves nothing. The subscriber asks the replay socket for evidence (see
    :mod:`kvcompassd.engine.subscriber`). The caller applies a batch and then calls
    :meth:`applied`; a GAP leaves the state unchanged until the missing range is applied or
    declared lost with :meth:`skip_to`.
    """

    __slots__ = ("last_applied", "last_live")

    def __init__(self) -> None:
        self.last_applied: int | None = None
        self.last_live: int | None = None

    def check_live(self, seq: int) -> SeqCheck:
        self.last_live = seq
        return self._against_applied(seq)

    def check_replayed(self, seq: int) -> SeqCheck:
        return self._against_applied(seq)

    @property
    def expected(self) -> int:
        return 0 if self.last_applied is None else self.last_applied + 1

    def _against_applied(self, seq: int) -> SeqCheck:
        expected = self.expected
        if seq < expected:
            return SeqCheck(SeqVerdict.DUPLICATE)
        if seq == expected:
            return SeqCheck(SeqVerdict.NEXT)
        return SeqCheck(SeqVerdict.GAP, expected, seq - 1)

    def applied(self, seq: int) -> None:
        if self.last_applied is None or seq > self.last_applied:
            self.last_applied = seq

    def skip_to(self, seq: int) -> None:
        """Give up on everything before ``seq`` (replay could not supply it)."""
        self.last_applied = seq - 1 if seq > 0 else None

    def reset(self) -> None:
        self.last_applied = None
        self.last_live = None
