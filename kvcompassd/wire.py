"""The kvcompass wire protocol: every message between daemons, and its one codec.

Each message is a frozen slotted dataclass with a past-tense name, validated on construction
(so a bad message is refused where it is made, whether by local code or by the decoder).

Encoding (msgpack): one array ``[PROTOCOL_VERSION, tag, field_1, ..., field_n]``, fields in
declaration order, optionally wrapped (when it is large and the path's datagrams small) as
``[PROTOCOL_VERSION, 0, zlib(encoding)]``. Token id sequences travel as packed little-endian uint32 bytes; a report's
index events as two packed columns, op codes and uint64 keys (see :class:`EventColumns`). :data:`MESSAGE_SPECS` is the
single dispatch table (tag -> class, field schema, size bound); :data:`SENDER_ROLES` says which
node role may send each message, enforced by :func:`check_sender`.

Errors: :class:`WireError` (a peer sent something malformed: wrong types, missing or extra
fields, unknown tag, bad version, oversize, trailing bytes) and :class:`WireForbidden` (a peer's
role may not send that message). Both subclass ``ValueError``.
"""

from __future__ import annotations

import array
import enum
import sys
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Final

import msgpack

from kvcompassd.core.messages import (  # the core's messages and field types: this module adds their codec
    COUNT,
    I64_MAX,
    I64_MIN,
    ID,
    MAX_FRAME_BYTES,
    MAX_ID_CHARS,
    MAX_SNAPSHOT_CHUNK_BYTES,
    QUEUE_VECTOR,
    REGION,
    REQUEST_ID,
    U32_MAX,
    U64_MAX,
    Blob as Blob,  # re-exported: tests walk every message's field types
    Bool,
    Choice,
    EventColumns as EventColumns,
    FieldType,
    Float as Float,
    Int,
    KiB,
    MessageError,
    MiB,
    Pairs as Pairs,
    PiggybackSent,
    PrefixEventsReported,
    QueueVectorBroadcast,
    QueueVectorInterestReported,
    ResyncRequested,
    RoomVectorBroadcast,
    ShardPositionAnnounced,
    ShardSnapshotSent,
    SnapshotChunkSent,
    SnapshotResumeRequested,
    SnapshotTransferStarted,
    Text,
    UpdateBatchPublished,
    UpdatesSubscribed,
    ViewCopyRequested,
    WireMessage,
    WorkerLoadReported,
    WorkerPinnedReported,
    WorkerRegistered,
    WorkerRoomReported,
    WorkerWithdrawn,
    _fail,
)

# 2: PrefixEventsReported carries its events as columns (was a [kind, key, tier] array each).
# 3: ResponseCompleted carries the engine's own time for the request (worker_latency_s).
PROTOCOL_VERSION: Final = 3
MAX_WORKER_LATENCY_S: Final = 7 * 86400.0  # ResponseCompleted's bound on an engine's time for one request
COMPRESSED_TAG: Final = 0  # [version, 0, zlib(encoded message)]: see encode(compress=True)


WireError = MessageError  # a message is malformed: the sender broke the protocol (or local code built a bad one)


class WireForbidden(WireError):
    """A message was sent by a node whose role may not send it."""


class Role(str, enum.Enum):
    """What a node is; carried in its certificate (see :mod:`kvcompassd.certs`)."""

    EDGE = "edge"
    MAINTENANCE = "maintenance"
    AGENT = "agent"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    """Who a peer is, as proven by its CA-signed certificate."""

    role: Role
    node_id: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))
        if not isinstance(self.node_id, str) or not 0 < len(self.node_id) <= MAX_ID_CHARS:
            raise ValueError(f"node id must be a 1-{MAX_ID_CHARS} character string, got {self.node_id!r}")

    def __str__(self) -> str:
        return f"{self.role.value}:{self.node_id}"


# --------------------------------------------------------------------------------------------
# Field types: each checks/normalises a Python value and converts it to and from its wire form.
# --------------------------------------------------------------------------------------------


class TokenIds(FieldType):
    """A sequence of token ids (uint32); packed little-endian on the wire, 4 bytes per token."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens

    def check(self, value: Any, where: str) -> tuple[int, ...]:
        if not isinstance(value, (tuple, list)):
            raise _fail(where, "a tuple of token ids", value)
        if len(value) > self.max_tokens:
            raise WireError(f"{where}: {len(value)} tokens exceeds {self.max_tokens}")
        # Type and range checks at C speed (prompts are thousands of tokens); the loop below
        # only runs to name the offending element.
        if not value or set(map(type, value)) == {int}:
            try:
                array.array("I", value)
            except OverflowError:
                pass
            else:
                return tuple(value)
        for i, token in enumerate(value):
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token <= U32_MAX:
                raise _fail(f"{where}[{i}]", "a token id in [0, 2^32)", token)
        return tuple(value)

    def to_wire(self, value: tuple[int, ...]) -> bytes:
        packed = array.array("I", value)
        if sys.byteorder == "big":
            packed.byteswap()
        return packed.tobytes()

    def from_wire(self, raw: Any, where: str) -> tuple[int, ...]:
        if not isinstance(raw, bytes):
            raise _fail(where, "packed uint32 token ids (bytes)", raw)
        if len(raw) % 4:
            raise WireError(f"{where}: packed token ids length {len(raw)} is not a multiple of 4")
        if len(raw) // 4 > self.max_tokens:
            raise WireError(f"{where}: {len(raw) // 4} tokens exceeds {self.max_tokens}")
        unpacked = array.array("I")
        unpacked.frombytes(raw)
        if sys.byteorder == "big":
            unpacked.byteswap()
        return tuple(unpacked)


class Params(FieldType):
    """A JSON-like mapping with string keys (sampling parameters, admin arguments and answers)."""

    def __init__(self, max_depth: int = 6, max_items: int = 4096) -> None:
        self.max_depth, self.max_items = max_depth, max_items

    def check(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise _fail(where, "a mapping with string keys", value)
        budget = [self.max_items]
        return self._mapping(value, where, 0, budget)

    def _mapping(self, value: Mapping[Any, Any], where: str, depth: int, budget: list[int]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise _fail(f"{where} key", "a string", key)
            out[key] = self._value(item, f"{where}[{key!r}]", depth + 1, budget)
        return out

    def _value(self, value: Any, where: str, depth: int, budget: list[int]) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise WireError(f"{where}: more than {self.max_items} values")
        if depth > self.max_depth:
            raise WireError(f"{where}: nested deeper than {self.max_depth}")
        if value is None or isinstance(value, (bool, str, bytes)):
            return value
        if isinstance(value, int):
            if not I64_MIN <= value <= U64_MAX:
                raise WireError(f"{where}: integer {value} does not fit 64 bits")
            return value
        if isinstance(value, float):
            return value
        if isinstance(value, (list, tuple)):
            return [self._value(v, f"{where}[{i}]", depth + 1, budget) for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            return self._mapping(value, where, depth, budget)
        raise _fail(where, "null, bool, number, string, bytes, list or mapping", value)


# Shared field types.
MAX_PROMPT_TOKENS: Final = 1 << 20


# --------------------------------------------------------------------------------------------
# Messages.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestForwarded(WireMessage):
    """edge -> agent: run this prompt; ``claimed_tokens`` is the prefix match the edge assumed."""

    request_id: str
    edge: str
    origin_region: str
    input_ids: tuple[int, ...]
    sampling_params: dict[str, Any]
    stream: bool
    claimed_tokens: int
    WIRE: ClassVar = {
        "request_id": REQUEST_ID,
        "edge": ID,
        "origin_region": REGION,
        "input_ids": TokenIds(MAX_PROMPT_TOKENS),
        "sampling_params": Params(),
        "stream": Bool(),
        "claimed_tokens": Int(0, MAX_PROMPT_TOKENS),
    }


@dataclass(frozen=True, slots=True)
class PrefillDecodeForwarded(WireMessage):
    """edge -> a prefill worker's agent: run this prompt on your prefill engine and on the decode
    worker ``decode_worker`` of your region, as SGLang's prefill-decode router does, with
    ``bootstrap_room`` as the pair's room; the replies are :class:`RequestForwarded`'s (a
    ``RequestFailed`` naming ``decode_worker`` says the decode half failed)."""

    request_id: str
    edge: str
    origin_region: str
    input_ids: tuple[int, ...]
    sampling_params: dict[str, Any]
    stream: bool
    claimed_tokens: int
    decode_worker: str
    bootstrap_room: int
    WIRE: ClassVar = {
        "request_id": REQUEST_ID,
        "edge": ID,
        "origin_region": REGION,
        "input_ids": TokenIds(MAX_PROMPT_TOKENS),
        "sampling_params": Params(),
        "stream": Bool(),
        "claimed_tokens": Int(0, MAX_PROMPT_TOKENS),
        "decode_worker": ID,
        "bootstrap_room": Int(0, I64_MAX),
    }


@dataclass(frozen=True, slots=True)
class MigrationRequested(WireMessage):
    """edge -> agent: load this prompt's prefix onto ``destination_worker`` (copy or recompute)."""

    request_id: str
    input_ids: tuple[int, ...]
    source_worker: str
    destination_worker: str
    mode: str
    WIRE: ClassVar = {
        "request_id": REQUEST_ID,
        "input_ids": TokenIds(MAX_PROMPT_TOKENS),
        "source_worker": ID,
        "destination_worker": ID,
        "mode": Choice("copy", "recompute"),
    }


@dataclass(frozen=True, slots=True)
class ResponseChunked(WireMessage):
    """agent -> edge: the next piece of a streamed response."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    WIRE: ClassVar = {
        "request_id": REQUEST_ID,
        "token_ids": TokenIds(1 << 18),
        "text": Text(4 * MiB, allow_empty=True),
        "finished": Bool(),
    }


@dataclass(frozen=True, slots=True)
class ResponseCompleted(WireMessage):
    """agent -> edge: the request finished; reuse figures feed the edge's cache belief.
    ``worker_latency_s``: the engine's own seconds from the request's arrival to its end
    (SGLang's ``e2e_latency``), negative if it did not say; the edge's learned rates take what
    it saw beyond that out of their prefill samples (``core/rates.py``)."""

    request_id: str
    worker: str
    cached_tokens: int
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    queue_vector: tuple[tuple[str, float], ...]
    worker_latency_s: float = -1.0
    WIRE: ClassVar = {
        "request_id": REQUEST_ID,
        "worker": ID,
        "cached_tokens": COUNT,
        "prompt_tokens": COUNT,
        "completion_tokens": COUNT,
        "finish_reason": Text(64, allow_empty=True),
        "queue_vector": QUEUE_VECTOR,
        "worker_latency_s": Float(-1.0, MAX_WORKER_LATENCY_S),
    }


@dataclass(frozen=True, slots=True)
class RequestFailed(WireMessage):
    """agent -> edge: the request failed; retryable elsewhere if ``before_first_token``."""

    request_id: str
    worker: str
    reason: str
    before_first_token: bool
    WIRE: ClassVar = {
        "request_id": REQUEST_ID,
        "worker": ID,
        "reason": Text(4 * KiB, allow_empty=True),
        "before_first_token": Bool(),
    }


@dataclass(frozen=True, slots=True)
class RequestRejected(WireMessage):
    """agent -> edge: the engine refused the request itself with a client error (HTTP
    ``status``, e.g. 400 for bad sampling parameters) and ``message``. The client's error, not
    the worker's: the edge answers the client with it and tries no other worker."""

    request_id: str
    worker: str
    status: int
    message: str
    WIRE: ClassVar = {
        "request_id": REQUEST_ID,
        "worker": ID,
        "status": Int(400, 499),
        "message": Text(4 * KiB, allow_empty=True),
    }


@dataclass(frozen=True, slots=True)
class ErrorReported(WireMessage):
    """any -> any: your frame was rejected (``code`` is one of :data:`ERROR_CODES`)."""

    code: str
    detail: str
    WIRE: ClassVar = {"code": Text(64), "detail": Text(4 * KiB, allow_empty=True)}


@dataclass(frozen=True, slots=True)
class AdminQueried(WireMessage):
    """admin -> any daemon: a kvcompassctl query (``what`` names it, ``args`` parameterise it)."""

    what: str
    args: dict[str, Any]
    WIRE: ClassVar = {"what": Text(64), "args": Params()}


@dataclass(frozen=True, slots=True)
class AdminAnswered(WireMessage):
    """daemon -> admin: the answer to an AdminQueried."""

    what: str
    body: dict[str, Any]
    WIRE: ClassVar = {"what": Text(64), "body": Params(max_depth=8, max_items=1 << 20)}


@dataclass(frozen=True, slots=True)
class TokenizationRequested(WireMessage):
    """edge -> agent: have your engine tokenise this text and this chat (``{"messages": [...]}``)
    with its ``/v1/tokenize``, so the edge can check it tokenises as the engine does."""

    edge: str
    text: str
    chat: dict[str, Any]
    WIRE: ClassVar = {"edge": ID, "text": Text(16 * KiB), "chat": Params()}


@dataclass(frozen=True, slots=True)
class TokenizationAnswered(WireMessage):
    """agent -> edge: the engine's ids for a TokenizationRequested, whether it says it is the
    emulator, the tokenizer it serves; ``error`` (and ``unreachable``: try again) when none."""

    worker: str
    text_ids: tuple[int, ...]
    chat_ids: tuple[int, ...]
    emulator: bool
    tokenizer_path: str
    error: str
    unreachable: bool
    WIRE: ClassVar = {"worker": ID, "text_ids": TokenIds(1 << 16), "chat_ids": TokenIds(1 << 16),
                      "emulator": Bool(), "tokenizer_path": Text(1 * KiB, allow_empty=True),
                      "error": Text(1 * KiB, allow_empty=True), "unreachable": Bool()}


Message = (
    PrefixEventsReported
    | WorkerWithdrawn
    | WorkerRegistered
    | UpdatesSubscribed
    | ResyncRequested
    | UpdateBatchPublished
    | ShardSnapshotSent
    | SnapshotTransferStarted
    | SnapshotChunkSent
    | SnapshotResumeRequested
    | ShardPositionAnnounced
    | QueueVectorBroadcast
    | RoomVectorBroadcast
    | ViewCopyRequested
    | RequestForwarded
    | PrefillDecodeForwarded
    | MigrationRequested
    | ResponseChunked
    | ResponseCompleted
    | RequestFailed
    | RequestRejected
    | WorkerLoadReported
    | WorkerRoomReported
    | WorkerPinnedReported
    | PiggybackSent
    | QueueVectorInterestReported
    | ErrorReported
    | AdminQueried
    | AdminAnswered
    | TokenizationRequested
    | TokenizationAnswered
)

# Codes used in ErrorReported.code.
ERROR_CODES: Final = ("malformed", "forbidden", "oversize", "unavailable", "internal")


# --------------------------------------------------------------------------------------------
# The dispatch table, the sender table, and the codec.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MessageSpec:
    """One row of the dispatch table."""

    tag: int
    cls: type
    fields: tuple[tuple[str, FieldType], ...]
    max_bytes: int
    # Per field: its name, its type's from_wire and the name a failure gives it (derived from
    # cls and fields, formatted once).
    decoders: tuple[tuple[str, Any, str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "decoders", tuple((name, field_type.from_wire, f"{self.cls.__name__}.{name}")
                                                   for name, field_type in self.fields))


def _spec(tag: int, cls: type, max_bytes: int) -> MessageSpec:
    declared = tuple(f.name for f in fields(cls))
    if declared != tuple(cls.WIRE):
        raise AssertionError(f"{cls.__name__}: WIRE keys {tuple(cls.WIRE)} != fields {declared}")
    return MessageSpec(tag, cls, tuple(cls.WIRE.items()), max_bytes)


MESSAGE_SPECS: Final[dict[int, MessageSpec]] = {
    spec.tag: spec
    for spec in (
        _spec(1, PrefixEventsReported, 16 * MiB),
        _spec(2, WorkerWithdrawn, 1 * KiB),
        _spec(3, WorkerRegistered, 1 * KiB),
        _spec(10, UpdatesSubscribed, 1 * KiB),
        _spec(11, ResyncRequested, 1 * KiB),
        _spec(12, UpdateBatchPublished, MAX_FRAME_BYTES),
        _spec(13, ShardSnapshotSent, MAX_FRAME_BYTES),
        _spec(14, SnapshotTransferStarted, 64 * KiB),
        _spec(15, SnapshotChunkSent, MAX_SNAPSHOT_CHUNK_BYTES + 1 * KiB),
        _spec(16, SnapshotResumeRequested, 1 * KiB),
        # Added within version 2 (a new tag, no version bump): a node without it answers it as an
        # unknown tag (ErrorReported "malformed") and its connection carries on; see README.
        _spec(17, ShardPositionAnnounced, 1 * KiB),
        _spec(20, QueueVectorBroadcast, 1 * MiB),
        _spec(21, ViewCopyRequested, 1 * KiB),
        _spec(22, RoomVectorBroadcast, 1 * MiB),  # added within version 2, as tag 17
        _spec(30, RequestForwarded, 8 * MiB),
        _spec(31, MigrationRequested, 8 * MiB),
        _spec(32, PrefillDecodeForwarded, 8 * MiB),
        _spec(40, ResponseChunked, 8 * MiB),
        _spec(41, ResponseCompleted, 1 * MiB),
        _spec(42, RequestFailed, 16 * KiB),
        _spec(43, WorkerLoadReported, 1 * KiB),
        _spec(44, PiggybackSent, 1 * KiB),
        _spec(45, RequestRejected, 16 * KiB),
        _spec(46, WorkerRoomReported, 64 * KiB),  # added within version 2, as tag 17
        _spec(47, WorkerPinnedReported, 1 * KiB),  # added within version 3
        _spec(48, QueueVectorInterestReported, 1 * KiB),  # added within version 3
        _spec(50, ErrorReported, 16 * KiB),
        _spec(60, AdminQueried, 1 * MiB),
        _spec(61, AdminAnswered, MAX_FRAME_BYTES),
        _spec(70, TokenizationRequested, 64 * KiB),
        _spec(71, TokenizationAnswered, 1 * MiB),
    )
}
assert COMPRESSED_TAG not in MESSAGE_SPECS, "tag 0 marks a compressed message"
_SPEC_BY_CLASS: Final = {spec.cls: spec for spec in MESSAGE_SPECS.values()}

_ANY_DAEMON = frozenset({Role.EDGE, Role.MAINTENANCE, Role.AGENT})
SENDER_ROLES: Final[Mapping[type, frozenset[Role]]] = {
    PrefixEventsReported: frozenset({Role.AGENT}),
    WorkerWithdrawn: frozenset({Role.AGENT}),
    WorkerRegistered: frozenset({Role.AGENT}),
    UpdatesSubscribed: frozenset({Role.EDGE}),
    ResyncRequested: frozenset({Role.EDGE}),
    # An edge relays its unit's live batches to the other edges of its region and stream
    # ([sync] relay); a receiver takes them only from such an edge (kvcompassd.core.streams.relays_to).
    UpdateBatchPublished: frozenset({Role.MAINTENANCE, Role.EDGE}),
    # A peer edge answers ViewCopyRequested with snapshots; the receiving edge must accept
    # snapshots from an edge only on an exchange it opened itself.
    ShardSnapshotSent: frozenset({Role.MAINTENANCE, Role.EDGE}),
    SnapshotTransferStarted: frozenset({Role.MAINTENANCE, Role.EDGE}),  # the same rule as ShardSnapshotSent
    SnapshotChunkSent: frozenset({Role.MAINTENANCE, Role.EDGE}),
    SnapshotResumeRequested: frozenset({Role.EDGE}),
    # The unit announces an idle stream's position to every edge following it; an edge takes one
    # only from the shard's owner or (as a batch) from an edge relaying its region's stream.
    ShardPositionAnnounced: frozenset({Role.MAINTENANCE, Role.EDGE}),
    QueueVectorBroadcast: frozenset({Role.EDGE}),
    RoomVectorBroadcast: frozenset({Role.EDGE}),
    ViewCopyRequested: frozenset({Role.EDGE}),
    RequestForwarded: frozenset({Role.EDGE}),
    PrefillDecodeForwarded: frozenset({Role.EDGE}),
    MigrationRequested: frozenset({Role.EDGE}),
    ResponseChunked: frozenset({Role.AGENT}),
    ResponseCompleted: frozenset({Role.AGENT}),
    RequestFailed: frozenset({Role.AGENT}),
    RequestRejected: frozenset({Role.AGENT}),
    WorkerLoadReported: frozenset({Role.AGENT}),
    WorkerRoomReported: frozenset({Role.AGENT}),
    WorkerPinnedReported: frozenset({Role.AGENT}),
    PiggybackSent: frozenset({Role.AGENT}),
    QueueVectorInterestReported: frozenset({Role.AGENT}),
    ErrorReported: frozenset(Role),
    AdminQueried: frozenset({Role.ADMIN}),
    AdminAnswered: _ANY_DAEMON,
    TokenizationRequested: frozenset({Role.EDGE}),
    TokenizationAnswered: frozenset({Role.AGENT}),
}
assert set(SENDER_ROLES) == set(_SPEC_BY_CLASS), "every message needs a sender rule"


def check_sender(role: Role | str, message: WireMessage) -> None:
    """Raise :class:`WireForbidden` unless a node of ``role`` may send ``message``."""
    allowed = SENDER_ROLES.get(type(message))
    if allowed is None:
        raise WireError(f"{type(message).__name__} is not a wire message")
    if Role(role) not in allowed:
        raise WireForbidden(
            f"a {Role(role).value} node may not send {type(message).__name__} "
            f"(allowed: {', '.join(sorted(r.value for r in allowed))})"
        )


def max_bytes_of(message_type: type) -> int:
    """The size bound of one encoded message of ``message_type``."""
    return _SPEC_BY_CLASS[message_type].max_bytes


def encode(message: WireMessage, *, compress: bool = False) -> bytes:
    """Encode a message as ``[version, tag, *fields]`` msgpack; raise WireError if oversize.

    With ``compress``, the encoding is wrapped as ``[version, 0, zlib bytes]`` when that is
    smaller: for large bodies on paths of small datagrams (an update batch's Ludo records are
    mostly zero bytes and shrink ~3x, so they need a third of the packets). ``decode`` unwraps it
    transparently; the inner message keeps its own size bound."""
    spec = _SPEC_BY_CLASS.get(type(message))
    if spec is None:
        raise WireError(f"cannot encode {type(message).__name__}: not a wire message")
    body = [PROTOCOL_VERSION, spec.tag]
    body.extend(field_type.to_wire(getattr(message, name)) for name, field_type in spec.fields)
    data = msgpack.packb(body, use_bin_type=True)
    if len(data) > spec.max_bytes:
        raise WireError(f"{spec.cls.__name__} encodes to {len(data)} bytes, over its bound {spec.max_bytes}")
    return compress_encoded(data) if compress else data


def compress_encoded(data: bytes) -> bytes:
    """An encoded message wrapped as ``[version, 0, zlib bytes]`` when that is smaller, else ``data``."""
    packed = msgpack.packb([PROTOCOL_VERSION, COMPRESSED_TAG, zlib.compress(data, 1)], use_bin_type=True)
    return packed if len(packed) < len(data) else data


def _decompress(raw: list, size: int) -> bytes:
    if len(raw) != 3 or type(raw[2]) is not bytes:
        raise WireError("a compressed message is [version, 0, zlib bytes]")
    inflater = zlib.decompressobj()
    try:
        inner = inflater.decompress(raw[2], MAX_FRAME_BYTES + 1)
    except zlib.error as exc:
        raise WireError(f"compressed message is not valid zlib: {exc}") from None
    if len(inner) > MAX_FRAME_BYTES or inflater.unconsumed_tail:
        raise WireError(f"compressed message of {size} bytes inflates beyond the {MAX_FRAME_BYTES}-byte frame bound")
    if not inflater.eof or inflater.unused_data:
        raise WireError("compressed message is truncated or has trailing bytes")
    return inner


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Decode one message; raise :class:`WireError` (and only that) on any malformed input."""
    return _decode(data, unwrap=True)


def _decode(data: bytes | bytearray | memoryview, *, unwrap: bool) -> Message:
    if len(data) > MAX_FRAME_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame bound")
    if not data:
        raise WireError("empty message")
    try:
        raw = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except msgpack.ExtraData:
        raise WireError("trailing bytes after the message") from None
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError(f"not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2:
        raise WireError(f"expected [version, tag, fields...], got {type(raw).__name__}")
    version, tag = raw[0], raw[1]
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise WireError(f"unsupported protocol version {version!r} (this node speaks {PROTOCOL_VERSION})")
    if tag == COMPRESSED_TAG and type(tag) is int:
        if not unwrap:
            raise WireError("a compressed message may not contain another compressed message")
        return _decode(_decompress(raw, len(data)), unwrap=False)
    spec = MESSAGE_SPECS.get(tag) if isinstance(tag, int) and not isinstance(tag, bool) else None
    if spec is None:
        raise WireError(f"unknown message tag {tag!r}")
    name = spec.cls.__name__
    if len(data) > spec.max_bytes:
        raise WireError(f"{name} of {len(data)} bytes exceeds its bound {spec.max_bytes}")
    values = raw[2:]
    if len(values) != len(spec.fields):
        expected = [n for n, _ in spec.fields]
        raise WireError(f"{name}: expected {len(expected)} fields {expected}, got {len(values)}")
    try:
        # Each field's from_wire checks it and returns its canonical form, the one the class's
        # own checks (its __post_init__) would return again: so the message is filled in as
        # decoded and only its cross-field checks run (tests/test_wire.py holds the two equal).
        message = object.__new__(spec.cls)
        for (field_name, from_wire, where), value in zip(spec.decoders, values):
            object.__setattr__(message, field_name, from_wire(value, where))
        message._check()
        return message
    except WireError:
        raise
    except (ValueError, TypeError) as exc:
        raise WireError(f"{name}: {exc}") from None
