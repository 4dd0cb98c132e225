"""Stream framing, without I/O: how wire messages are cut into frames on a QUIC stream.

Frame layout (all integers big-endian)::

    u32 length      -- bytes after this field (= 5 + len(body))
    u32 exchange    -- 0 = the sender's ordered control channel, else a request/response exchange
    u8  flags       -- bit 0 END: the sender will send nothing more on this exchange
                       bit 1 ABORT (with END): the sender abandons the exchange; the receiver
                       should stop sending on it too (e.g. the user went away mid-response)
    body            -- one msgpack message (kvcompassd.wire); empty only on a bare END frame

Many exchanges share one QUIC stream (see ``node.py`` for why), so a frame names its exchange.
A frame whose *body* is bad is rejected on its own; a frame whose *length* is out of bounds
leaves nothing to resynchronise on, so the whole QUIC stream is abandoned (:class:`StreamCorrupt`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from kvcompassd.wire import MAX_FRAME_BYTES

HEADER: Final = struct.Struct(">IIB")  # length, exchange, flags
LENGTH: Final = struct.Struct(">I")
HEADER_AFTER_LENGTH: Final = HEADER.size - LENGTH.size
MAX_FRAME_LENGTH: Final = MAX_FRAME_BYTES + HEADER_AFTER_LENGTH
MAX_EXCHANGE_ID: Final = (1 << 32) - 1
FLAG_END: Final = 0x01
FLAG_ABORT: Final = 0x02
KNOWN_FLAGS: Final = FLAG_END | FLAG_ABORT
CONTROL_EXCHANGE: Final = 0


class FrameError(ValueError):
    """One frame is malformed; the stream's framing is intact and the next frame can be read."""

    def __init__(self, exchange: int, detail: str) -> None:
        super().__init__(f"exchange {exchange}: {detail}")
        self.exchange = exchange


class StreamCorrupt(ValueError):
    """The stream's framing is lost (a length out of bounds); nothing more can be read from it."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One received frame: ``body`` is an encoded message, or empty on a bare END."""

    exchange: int
    end: bool
    body: bytes
    abort: bool = False


def encode_frame(exchange: int, body: bytes, *, end: bool = False, abort: bool = False) -> bytes:
    """Frame ``body`` (an encoded message, or b"" with ``end``) for ``exchange``; ``abort``
    implies ``end``."""
    end = end or abort
    if not 0 <= exchange <= MAX_EXCHANGE_ID:
        raise ValueError(f"exchange id {exchange} outside [0, 2^32)")
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"frame body of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    if not body and not end:
        raise ValueError("an empty frame is only allowed as a bare END")
    flags = (FLAG_END if end else 0) | (FLAG_ABORT if abort else 0)
    return HEADER.pack(HEADER_AFTER_LENGTH + len(body), exchange, flags) + body


class FrameDecoder:
    """Reassembles frames from the byte chunks of one QUIC stream."""

    __slots__ = ("_buffer", "corrupt")

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.corrupt = False

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes) -> Iterator[Frame | FrameError]:
        """Add ``data``; yield every complete frame, or a FrameError in its place.

        Raises :class:`StreamCorrupt` (once; afterwards the decoder ignores input) when a length
        field is out of bounds.
        """
        if self.corrupt:
            return
        self._buffer += data
        buffer = self._buffer
        offset = 0
        try:
            while len(buffer) - offset >= LENGTH.size:
                (length,) = LENGTH.unpack_from(buffer, offset)
                if not HEADER_AFTER_LENGTH <= length <= MAX_FRAME_LENGTH:
                    self.corrupt = True
                    buffer.clear()
                    offset = 0
                    raise StreamCorrupt(
                        f"frame length {length} outside [{HEADER_AFTER_LENGTH}, {MAX_FRAME_LENGTH}]"
                    )
                end = offset + LENGTH.size + length
                if len(buffer) < end:
                    break
                _, exchange, flags = HEADER.unpack_from(buffer, offset)
                body = bytes(buffer[offset + HEADER.size : end])
                offset = end
                if flags & ~KNOWN_FLAGS:
                    yield FrameError(exchange, f"unknown frame flags {flags:#04x}")
                elif not body and not flags & FLAG_END:
                    yield FrameError(exchange, "empty frame without END")
                elif flags & FLAG_ABORT and not flags & FLAG_END:
                    yield FrameError(exchange, "ABORT without END")
                else:
                    yield Frame(exchange, bool(flags & FLAG_END), body, bool(flags & FLAG_ABORT))
        finally:
            if offset:
                del buffer[:offset]
