"""Snapshots of any size, sans-IO: a shard snapshot cut into bounded chunks, and put back together.

A snapshot's *image* is every region group's Ludo snapshot blob, end to end. The sender
(``SnapshotChunker``) announces it with ``SnapshotTransferStarted`` (shard, the position
``(epoch, seq)`` it is the state after, entry count, byte count, chunk size and count, the
blobs' lengths) and sends it as ``SnapshotChunkSent`` pieces of at most
``MAX_SNAPSHOT_CHUNK_BYTES``, each with its CRC-32. The image is taken at one position and never
changes, so any chunk can be sent again later: a receiver that lost the stream part-way asks to
resume from its next chunk (``SnapshotResumeRequested``) and the sender, while it still holds
the snapshot (``SnapshotSource`` keeps the last few), sends from there; otherwise it starts a
new snapshot.

The receiver (``SnapshotAssembly``) refuses a header beyond its configured bounds before it
buffers anything, takes chunks strictly in order, ignores duplicates, reports a chunk ahead of
the next one as a gap (resume from the next) and a chunk that fails its CRC or its length as
corrupt (the transfer is abandoned); the sync protocol (``kvcompassd.core.sync``) decides what
each outcome sends. Nothing here touches the view: the image is installed only once whole.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from .ludo import snapshot_blob_entries
from .messages import (
    MAX_SNAPSHOT_CHUNK_BYTES,
    ShardSnapshotSent,
    SnapshotChunkSent,
    SnapshotTransferStarted,
)

if TYPE_CHECKING:
    from .index import MaintenanceShard

__all__ = ["DEFAULT_CHUNK_BYTES", "ChunkOutcome", "SnapshotAssembly", "SnapshotChunker", "SnapshotRefused",
           "SnapshotSource"]

# Half the chunk bound: ~1 ms of a 4 Gbit/s path, so an update batch sent meanwhile waits little.
DEFAULT_CHUNK_BYTES: Final = MAX_SNAPSHOT_CHUNK_BYTES // 2


class SnapshotChunker:
    """The sender's side of one snapshot: its header and any of its chunks, on demand."""

    __slots__ = ("snapshot", "header", "_blobs", "_starts")

    def __init__(self, snapshot: ShardSnapshotSent, *, snapshot_id: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        if not 0 < chunk_bytes <= MAX_SNAPSHOT_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in (0, {MAX_SNAPSHOT_CHUNK_BYTES}], got {chunk_bytes}")
        if not snapshot.tables:
            raise ValueError("a snapshot without tables has nothing to send")
        self.snapshot = snapshot
        self._blobs = [blob for _, blob in snapshot.tables]
        self._starts: list[int] = []
        total = 0
        for blob in self._blobs:
            self._starts.append(total)
            total += len(blob)
        entries = sum(snapshot_blob_entries(blob) for blob in self._blobs)
        self.header = SnapshotTransferStarted(
            snapshot.shard, snapshot.epoch, snapshot.seq, snapshot_id, entries, total, chunk_bytes,
            -(-total // chunk_bytes), tuple((group, len(blob)) for group, blob in snapshot.tables))

    @property
    def snapshot_id(self) -> int:
        return self.header.snapshot_id

    @property
    def chunks(self) -> int:
        return self.header.chunks

    def chunk(self, index: int) -> SnapshotChunkSent:
        """Chunk ``index``: image bytes ``[index * chunk_bytes, ...)``, with their CRC-32."""
        if not 0 <= index < self.chunks:
            raise IndexError(f"chunk {index} of a {self.chunks}-chunk snapshot")
        start = index * self.header.chunk_bytes
        end = min(start + self.header.chunk_bytes, self.header.total_bytes)
        pieces = []
        for blob, blob_start in zip(self._blobs, self._starts):
            lo, hi = max(start, blob_start), min(end, blob_start + len(blob))
            if lo < hi:
                pieces.append(memoryview(blob)[lo - blob_start:hi - blob_start])
        data = pieces[0].tobytes() if len(pieces) == 1 else b"".join(pieces)
        return SnapshotChunkSent(self.header.shard, self.snapshot_id, index, zlib.crc32(data), data)

    def chunks_from(self, start: int = 0) -> Iterator[SnapshotChunkSent]:
        for index in range(start, self.chunks):
            yield self.chunk(index)


class SnapshotSource:
    """A maintenance unit's snapshots for catch-ups: the shard's state at its current position,
    taken once however many edges ask at that position, and the last ``keep`` snapshots for
    resumed transfers. ``new_id`` draws snapshot ids (the shell's randomness: ids must not repeat
    across the unit's lives, as an edge may resume after the unit restarted)."""

    def __init__(self, shard: MaintenanceShard, *, new_id: Callable[[], int], chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.shard = shard
        self.new_id = new_id
        self.chunk_bytes = chunk_bytes
        self.keep = keep
        self._kept: OrderedDict[int, SnapshotChunker] = OrderedDict()
        self.taken = 0

    def latest(self) -> SnapshotChunker:
        """A snapshot of the shard as it is now (pending edits must have been flushed)."""
        if self._kept:
            newest = next(reversed(self._kept.values()))
            if (newest.header.epoch, newest.header.seq) == (self.shard.epoch, self.shard.seq):
                return newest
        chunker = SnapshotChunker(self.shard.snapshot(), snapshot_id=self.new_id(), chunk_bytes=self.chunk_bytes)
        self._kept[chunker.snapshot_id] = chunker
        while len(self._kept) > self.keep:
            self._kept.popitem(last=False)
        self.taken += 1
        return chunker

    def get(self, snapshot_id: int) -> SnapshotChunker | None:
        """The kept snapshot ``snapshot_id``, or None once it was dropped (the edge restarts)."""
        return self._kept.get(snapshot_id)

    def release(self) -> None:
        """Drop every kept snapshot (a shard's images are its size again in memory)."""
        self._kept.clear()

    @property
    def kept_bytes(self) -> int:
        return sum(c.header.total_bytes for c in self._kept.values())


class SnapshotRefused(ValueError):
    """A transfer the receiver will not take (beyond its bounds); nothing was buffered."""


@dataclass(frozen=True, slots=True)
class ChunkOutcome:
    """What one chunk did: ``added`` (the next one, taken), ``duplicate`` (already taken),
    ``gap`` (ahead of the next one: resume from ``next_chunk``), ``corrupt`` (bad CRC or
    length: the transfer is void), ``foreign`` (not this transfer's)."""

    kind: str
    reason: str = ""


_ADDED = ChunkOutcome("added")


class SnapshotAssembly:
    """The receiver's side of one transfer: the header's bounds checked, chunks taken in order."""

    __slots__ = ("header", "next_chunk", "_image")

    def __init__(self, header: SnapshotTransferStarted, *, max_entries: int, max_bytes: int):
        if header.entries > max_entries:
            raise SnapshotRefused(f"snapshot {header.snapshot_id} of shard {header.shard} declares {header.entries} "
                                  f"entries, over this edge's bound of {max_entries} ([sync] max_snapshot_entries)")
        if header.total_bytes > max_bytes:
            raise SnapshotRefused(f"snapshot {header.snapshot_id} of shard {header.shard} declares "
                                  f"{header.total_bytes} bytes, over this edge's bound of {max_bytes} "
                                  f"([sync] max_snapshot_bytes)")
        self.header = header
        self.next_chunk = 0
        self._image = bytearray()  # grows with the chunks actually received, never by declaration

    @property
    def snapshot_id(self) -> int:
        return self.header.snapshot_id

    @property
    def position(self) -> tuple[int, int]:
        return self.header.epoch, self.header.seq

    @property
    def complete(self) -> bool:
        return self.next_chunk == self.header.chunks

    @property
    def received_bytes(self) -> int:
        return len(self._image)

    def add(self, chunk: SnapshotChunkSent) -> ChunkOutcome:
        header = self.header
        if chunk.snapshot_id != header.snapshot_id or chunk.shard != header.shard:
            return ChunkOutcome("foreign", f"chunk of snapshot {chunk.snapshot_id} (shard {chunk.shard}) during "
                                           f"transfer {header.snapshot_id} (shard {header.shard})")
        if chunk.index >= header.chunks:
            return ChunkOutcome("corrupt", f"chunk {chunk.index} of a {header.chunks}-chunk snapshot")
        if chunk.index < self.next_chunk:
            return ChunkOutcome("duplicate", f"chunk {chunk.index} again (next is {self.next_chunk})")
        if chunk.index > self.next_chunk:
            return ChunkOutcome("gap", f"chunk {chunk.index} out of order: expected {self.next_chunk}")
        expected = min(header.chunk_bytes, header.total_bytes - chunk.index * header.chunk_bytes)
        if len(chunk.data) != expected:
            return ChunkOutcome("corrupt", f"chunk {chunk.index} has {len(chunk.data)} bytes, the header says {expected}")
        if zlib.crc32(chunk.data) != chunk.crc32:
            return ChunkOutcome("corrupt", f"chunk {chunk.index} fails its CRC-32")
        self._image += chunk.data
        self.next_chunk += 1
        return _ADDED

    def tables(self) -> tuple[tuple[int, memoryview], ...]:
        """Each region group's blob, views into the image (no copy); only once complete."""
        if not self.complete:
            raise RuntimeError(f"snapshot {self.snapshot_id} has {self.next_chunk} of {self.header.chunks} chunks")
        image = memoryview(self._image)
        out, at = [], 0
        for group, length in self.header.tables:
            out.append((group, image[at:at + length]))
            at += length
        return tuple(out)

    def snapshot(self) -> ShardSnapshotSent:
        """The whole snapshot as one message (copies the image: for tests and tools)."""
        h = self.header
        return ShardSnapshotSent(h.shard, h.epoch, h.seq, tuple((g, bytes(b)) for g, b in self.tables()))

