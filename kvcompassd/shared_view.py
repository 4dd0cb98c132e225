"""Every shard's view in shared memory: written by one process, read by many (``edge --workers``).

``SharedViewWriter`` is an ``EdgeIndexView`` (the index-sync protocol drives it unchanged) whose
(shard, group) views live in POSIX shared-memory segments instead of private memory: each view is
an *image* (``ludo_c/kvc_shared.h``: a header and the view's arrays), and a small *directory*
segment names the current image of every (shard, group), each shard's stream position, and holds
the sequence lock. ``SharedViewReader`` maps the directory and the images read-only and presents
the same ``state`` an ``EdgeIndexView`` has, so ``Router`` and its fused C kernel read the mapped
arrays exactly as they read a private view: one copy of the view per host, whatever the number of
front-door processes.

Coherence. Record batches are applied in place, inside one sequence-lock window per batch, so a
reader never acts on a torn table: ``SeqlockedKernel`` repeats a decision's (side-effect free) C
call when a write overlapped it. A snapshot (a rebuilt or grown table) or an overflow map out of
room makes a new image, written completely before the directory names it, inside the same window;
the old image is unlinked at once (a reader still mapping it keeps a consistent, retired copy
until it re-reads the directory, which it does before every decision).

Segments are named ``kvc-<edge>-<pid>-<random>-...`` under ``/dev/shm`` (Linux); the writer
unlinks every segment it made on ``close()``, and a reader holds nothing but mappings.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvcompassd.core._ludo_cffi import ffi, lib
from kvcompassd.core.index import BatchOutcome, EdgeIndexView, ShardViewState
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.ludo import LudoBlobError, LudoError, LudoView, _blob_buffer, _raise, peek_blob
from kvcompassd.core.messages import UpdateBatchPublished

SEGMENT_DIR = Path("/dev/shm")
DIRECTORY_MAGIC = 0x3152494443564B  # "KVCDIR1"
NAME_BYTES = 48
# Overflow-map headroom of a new image: buckets whose seed needs more than 5 bits are a few per
# cent of full buckets, so an eighth of the buckets (6 bytes each) lasts a table's whole life
# between its growth rebuilds (each of which makes a new image anyway).
OVERFLOW_ROOM_DIVISOR = 8
MIN_OVERFLOW_ROOM = 64
# A writer inside one batch for longer than this has died or hung there (a batch takes well under
# a millisecond; a grown image's copy, tens of ms): the read fails instead of spinning forever.
WRITER_STALL_S = 2.0

_HEADER_WORDS = 8  # magic, seq, generation, shards, groups, 3 reserved
_SLOT_DTYPE = np.dtype([("generation", "<u8"), ("bytes", "<u8"), ("name", f"S{NAME_BYTES}")])


class SharedViewError(RuntimeError):
    """A directory or image that is missing, of another layout, or damaged."""


def _directory_bytes(shards: int, groups: int) -> int:
    return 8 * _HEADER_WORDS + 16 * shards + _SLOT_DTYPE.itemsize * shards * groups


class _Directory:
    """Typed views over a directory segment's bytes (the writer's or a reader's mapping)."""

    __slots__ = ("buffer", "header", "positions", "slots", "seq_ptr", "generation_ptr", "_keep")

    def __init__(self, buffer: Any, shards: int, groups: int) -> None:
        self.buffer = buffer
        self.header = np.frombuffer(buffer, dtype="<u8", count=_HEADER_WORDS)
        self.positions = np.frombuffer(buffer, dtype="<i8", count=2 * shards, offset=8 * _HEADER_WORDS).reshape(shards, 2)
        self.slots = np.frombuffer(buffer, dtype=_SLOT_DTYPE, count=shards * groups,
                                   offset=8 * _HEADER_WORDS + 16 * shards).reshape(shards, groups)
        raw = ffi.from_buffer("uint8_t[]", buffer)
        self._keep = raw
        self.seq_ptr = ffi.cast("uint64_t *", raw) + 1
        self.generation_ptr = ffi.cast("uint64_t *", raw) + 2  # header[2], read per decision: no numpy


HUGE_PAGE = 2 << 20


def _advise_huge_pages(mapping: mmap.mmap) -> mmap.mmap:
    # Lookups touch the arrays at random, as a private view's (kvc_alloc advises those too); on a
    # host whose shmem_enabled is "advise" this gives the image huge pages, elsewhere it is a no-op.
    if len(mapping) >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return mapping


def _create_segment(name: str, size: int) -> mmap.mmap:
    fd = os.open(SEGMENT_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # Reserve the memory now: a tmpfs that runs out under a mapping answers writes with
        # SIGBUS, this answers ENOSPC here, where the caller can refuse the image instead.
        os.posix_fallocate(fd, 0, size)
        return _advise_huge_pages(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
    except BaseException:
        _unlink(name)
        raise
    finally:
        os.close(fd)


def _map_readonly(name: str) -> mmap.mmap:
    fd = os.open(SEGMENT_DIR / name, os.O_RDONLY)
    try:
        return _advise_huge_pages(mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ))
    finally:
        os.close(fd)


_SEGMENT_NAME = re.compile(r"^kvc-[A-Za-z0-9_]{1,12}-(\d+)-[0-9a-f]{8}-")


def reap_stale_segments() -> list[str]:
    """Unlink the segments (and front-door metrics directories) of writers whose process is gone
    (killed before ``close()``): each name carries its writer's pid. Segments of live writers, or of other users, are left alone."""
    reaped = []
    try:
        names = os.listdir(SEGMENT_DIR)
    except FileNotFoundError:
        return reaped
    for name in names:
        m = _SEGMENT_NAME.match(name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # alive (or a pid reused since: the segment then waits for a later reap)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's process: alive
        path = SEGMENT_DIR / name
        try:
            if path.is_dir():  # the metrics directory of the writer's front doors
                shutil.rmtree(path)
            else:
                os.unlink(path)
            reaped.append(name)
        except OSError:
            pass
    return reaped


def _unlink(name: str) -> None:
    try:
        os.unlink(SEGMENT_DIR / name)
    except FileNotFoundError:
        pass


class MappedView(LudoView):
    """A ``LudoView`` whose arrays are an image in shared memory (lookups as any view's)."""

    __slots__ = ("_image", "_buffer")

    @classmethod
    def attach(cls, image: Any) -> MappedView:
        buf = ffi.from_buffer("uint8_t[]", image)
        out = ffi.new("kvc_view **")
        rc = lib.kvc_view_attach(out, buf, len(buf))
        if rc != lib.KVC_OK:
            _raise(rc, "attaching a view image")
        view = object.__new__(cls)
        view._ptr = ffi.gc(out[0], lib.kvc_view_detach)
        view._image, view._buffer = image, buf  # the arrays the view reads
        return view

    def apply(self, blob: bytes) -> None:
        raise LudoError("a mapped view is written only by its image's writer (SharedViewWriter)")

    @property
    def image_bytes(self) -> int:
        return len(self._buffer)

    def apply_in_place(self, blob: Any) -> bool:
        """Apply a record blob to the image (writer only, inside the sequence lock); False when
        the image's overflow map has no room for it (nothing changed: write a bigger image)."""
        buf = _blob_buffer(blob)
        rc = lib.kvc_view_image_apply(self._ptr, buf, len(buf))
        if rc == lib.KVC_ERR_FULL:
            return False
        if rc != lib.KVC_OK:
            _raise(rc, f"applying a blob to the image of table {self.table_id} at epoch {self.epoch}")
        return True


def _overflow_room(view: LudoView) -> int:
    return max(MIN_OVERFLOW_ROOM, view.slots // 4 // OVERFLOW_ROOM_DIVISOR)


class SharedViewWriter(EdgeIndexView):
    """The edge's views, kept in shared-memory images other processes map (``SharedViewReader``)."""

    def __init__(self, layout: IndexLayout, shards: int, *, edge: str):
        super().__init__(layout, shards, edge=edge)
        reap_stale_segments()
        self.groups = len(layout.groups)
        self.prefix = f"kvc-{''.join(c if c.isalnum() else '_' for c in edge)[:12]}-{os.getpid()}-{secrets.token_hex(4)}"
        self.directory_name = f"{self.prefix}-dir"
        self._dir_map = _create_segment(self.directory_name, _directory_bytes(shards, self.groups))
        self._dir = _Directory(self._dir_map, shards, self.groups)
        self._dir.header[:5] = (DIRECTORY_MAGIC, 0, 0, shards, self.groups)
        self._dir.positions[:] = -1
        self._names: dict[tuple[int, int], str] = {}  # the published image of each (shard, group)
        self._pending: dict[tuple[int, int], str] = {}  # written, not yet published
        self._made = 0
        self.images_written = 0

    # -- the EdgeIndexView interface, over images -----------------------------------------------

    def install_tables(self, shard: int, epoch: int, seq: int, tables, *, entries: int | None = None) -> BatchOutcome:
        st = self.state[shard] if 0 <= shard < self.shards else None
        before = None if st is None else (st.views, st.epoch, st.seq)
        outcome = super().install_tables(shard, epoch, seq, tables, entries=entries)  # validates, builds private views
        if not outcome.applied:
            return outcome
        try:
            images = {g: self._new_image(shard, g, v) for g, v in st.views.items()}  # private copies freed below
        except OSError as exc:
            # No shared memory for it (/dev/shm full): the shard stays as it was; the sync
            # protocol asks for the snapshot again on its timer.
            st.views, st.epoch, st.seq = before
            self._drop_pending(shard)
            return BatchOutcome(False, reason=f"no shared memory for the view's images: {exc}")
        self._begin()
        try:
            for g, image in images.items():
                self._publish(shard, g, image)
            st.views = images
            self._dir.positions[shard] = (epoch, seq)
        finally:
            self._end()
        return outcome

    def apply_next(self, batch: UpdateBatchPublished) -> str | None:
        st = self.state[batch.shard]
        if not st.ready or batch.epoch != st.epoch or batch.seq != st.seq + 1:
            raise ValueError(f"batch {(batch.epoch, batch.seq)} is not next after {(st.epoch, st.seq)}")
        for group, _ in batch.tables:
            if group not in st.views:
                return f"batch names unknown group {group}"
        # Snapshot blobs (a rebuilt table) become new images before the window opens.
        ready: list[tuple[int, Any, bool]] = []
        for group, blob in batch.tables:
            try:
                kind, table_id, epoch = peek_blob(blob)
                if kind == "snapshot":
                    fresh = LudoView.from_snapshot(blob)
                    old = st.views[group]
                    if table_id != old.table_id:
                        raise LudoBlobError(f"snapshot of table {table_id} for the view of table {old.table_id}")
                    if epoch < old.epoch:
                        raise LudoBlobError(f"snapshot at epoch {epoch} older than the view's {old.epoch}")
                    ready.append((group, self._new_image(batch.shard, group, fresh), True))
                else:
                    ready.append((group, blob, False))
            except LudoError as exc:
                self._drop_pending(batch.shard)
                return f"batch rejected by the view: {exc}"
            except OSError as exc:
                self._drop_pending(batch.shard)
                return f"no shared memory for the view's images: {exc}"
        views = dict(st.views)
        self._begin()
        try:
            # Ludo blobs carry absolute state, so one failing part-way leaves earlier ones applied
            # harmlessly; the snapshot the sync protocol then asks for repairs the rest.
            for group, item, is_image in ready:
                if is_image:
                    views[group] = item
                    self._publish(batch.shard, group, item)
                    continue
                view = views[group]
                if not view.apply_in_place(item):  # the overflow map is out of room: a bigger image
                    # Room for every bucket record of the blob (each takes more than 16 bytes).
                    view = self._new_image(batch.shard, group, view, extra_room=len(item) // 16)
                    if not view.apply_in_place(item):
                        raise LudoError("a new image has no room for one batch")
                    views[group] = view
                    self._publish(batch.shard, group, view)
        except LudoError as exc:
            self._drop_pending(batch.shard)
            return f"batch rejected by the view: {exc}"
        except OSError as exc:  # a bigger image found no shared memory: the records not applied are repaired by a resync
            self._drop_pending(batch.shard)
            return f"no shared memory for the view's images: {exc}"
        finally:
            if any(views[g] is not st.views[g] for g in views):
                st.views = views  # a new dict: the readers' (and this process's) pointer arrays rebuild
            self._end()
        st.seq = batch.seq
        self._dir.positions[batch.shard, 1] = batch.seq
        self.batches_applied += 1
        return None

    def skip_to(self, shard: int, seq: int) -> None:
        super().skip_to(shard, seq)
        self._dir.positions[shard, 1] = seq

    # -- images ---------------------------------------------------------------------------------

    def _new_image(self, shard: int, group: int, source: LudoView, *, extra_room: int = 0) -> MappedView:
        room = _overflow_room(source) + extra_room
        size = int(lib.kvc_view_image_size(source._ptr, room))
        if size == 0:
            raise LudoError("view too large for an image")
        self._made += 1
        name = f"{self.prefix}-{shard}-{group}-{self._made}"
        image = _create_segment(name, size)
        raw = ffi.from_buffer("uint8_t[]", image)
        try:
            rc = lib.kvc_view_image_write(source._ptr, raw, size, room)
            if rc != lib.KVC_OK:
                _raise(rc, "writing a view image")
            view = MappedView.attach(image)
        except BaseException:
            _unlink(name)
            raise
        self.images_written += 1
        stale = self._pending.get((shard, group))
        if stale is not None:  # written for a batch that was then rejected: never published
            _unlink(stale)
        self._pending[(shard, group)] = name
        return view

    def _drop_pending(self, shard: int) -> None:
        """Unlink images written for a shard's install or batch that did not go through."""
        for key in [k for k in self._pending if k[0] == shard]:
            _unlink(self._pending.pop(key))

    def _publish(self, shard: int, group: int, view: MappedView) -> None:
        """Name the image in the directory (inside the window); unlink the one it replaces."""
        name = self._pending.pop((shard, group))
        slot = self._dir.slots[shard, group]
        slot["name"] = name.encode()
        slot["bytes"] = view.image_bytes
        slot["generation"] = int(slot["generation"]) + 1
        self._dir.header[2] += 1
        old = self._names.get((shard, group))
        self._names[(shard, group)] = name
        if old is not None:
            _unlink(old)  # readers still mapping it keep a retired, consistent copy

    def _begin(self) -> None:
        lib.kvc_seq_write_begin(self._dir.seq_ptr)

    def _end(self) -> None:
        lib.kvc_seq_write_end(self._dir.seq_ptr)

    def image_bytes(self) -> int:
        """Bytes of every current image (what readers map)."""
        return sum(v.image_bytes for st in self.state for v in st.views.values())

    def close(self) -> None:
        """Unlink every segment this writer made (mappings stay valid until dropped)."""
        for name in list(self._names.values()) + list(self._pending.values()):
            _unlink(name)
        self._names.clear()
        self._pending.clear()
        _unlink(self.directory_name)


_read_begin = lib.kvc_seq_read_begin
_read_valid = lib.kvc_seq_read_valid


class SharedViewReader:
    """A read-only ``EdgeIndexView`` look-alike over a ``SharedViewWriter``'s segments."""

    def __init__(self, layout: IndexLayout, shards: int, directory_name: str, *, edge: str):
        self.layout = layout
        self.shards = shards
        self.groups = len(layout.groups)
        self.edge = edge
        self.directory_name = directory_name
        self._dir_map = _map_readonly(directory_name)
        if len(self._dir_map) < _directory_bytes(shards, self.groups):
            raise SharedViewError(f"directory {directory_name} is smaller than {shards} shards x {self.groups} groups")
        self._dir = _Directory(self._dir_map, shards, self.groups)
        magic, _, _, dir_shards, dir_groups = (int(x) for x in self._dir.header[:5])
        if magic != DIRECTORY_MAGIC or (dir_shards, dir_groups) != (shards, self.groups):
            raise SharedViewError(f"directory {directory_name} is not one of {shards} shards x {self.groups} groups")
        changes = [0]  # view dicts replaced, over every shard (ShardViewState)
        self.state = [ShardViewState(changes) for _ in range(shards)]
        self._generation = -1
        self._slot_generation = np.zeros((shards, self.groups), dtype=np.uint64)
        self.refreshes = 0
        self.retries = 0

    @property
    def ready(self) -> bool:
        return bool((self._dir.positions[:, 1] >= 0).all())

    def position(self, shard: int) -> tuple[int, int]:
        epoch, seq = self._dir.positions[shard]
        return int(epoch), int(seq)

    def view(self, shard: int, group: int) -> LudoView | None:
        return self.state[shard].views.get(group)

    def begin(self) -> int:
        """Start a read: wait out a write in progress, re-map what the writer switched; the
        sequence number to pass to ``valid`` after the read."""
        start = _read_begin(self._dir.seq_ptr)
        if not start & 1 and self._dir.generation_ptr[0] == self._generation:
            return start  # the common case: two loads
        return self._begin_slowly()

    def _begin_slowly(self) -> int:
        seq_ptr = self._dir.seq_ptr
        waited_since = None
        while True:
            start = lib.kvc_seq_read_begin(seq_ptr)
            if start & 1:
                self.retries += 1
                now = time.monotonic()
                if waited_since is None:
                    waited_since = now
                elif now - waited_since > WRITER_STALL_S:
                    raise SharedViewError(f"the view's writer has been inside one write for over {WRITER_STALL_S} s")
                os.sched_yield()  # the writer is inside one batch: microseconds to a few ms
                continue
            if int(self._dir.header[2]) != self._generation:
                if not self._refresh(start):
                    continue
            return start

    def valid(self, start: int) -> bool:
        if _read_valid(self._dir.seq_ptr, start):
            return True
        self.retries += 1
        return False

    def _refresh(self, start: int) -> bool:
        """Map every image the directory names that this reader does not have yet."""
        generation = int(self._dir.header[2])
        slots = self._dir.slots.copy()
        positions = self._dir.positions.copy()
        if not lib.kvc_seq_read_valid(self._dir.seq_ptr, start):
            return False
        new_views: dict[int, dict[int, LudoView]] = {}
        for shard in range(self.shards):
            for group in range(self.groups):
                slot = slots[shard, group]
                if slot["generation"] == 0 or slot["generation"] == self._slot_generation[shard, group]:
                    continue
                try:
                    image = _map_readonly(slot["name"].decode())
                except FileNotFoundError:
                    return False  # switched again since: read the directory anew
                if len(image) < int(slot["bytes"]):
                    raise SharedViewError(f"image {slot['name'].decode()} is shorter than the directory says")
                new_views.setdefault(shard, dict(self.state[shard].views))[group] = MappedView.attach(image)
        for shard, views in new_views.items():
            self.state[shard].views = views  # a new dict: the kernel's pointer array rebuilds
        for shard in range(self.shards):
            self.state[shard].epoch, self.state[shard].seq = (int(x) for x in positions[shard])
            for group in range(self.groups):
                self._slot_generation[shard, group] = slots[shard, group]["generation"]
        self._generation = generation
        self.refreshes += 1
        return True

    def mapped_names(self) -> Sequence[str]:
        return [s["name"].decode() for s in self._dir.slots.ravel() if s["generation"]]


class SeqlockedKernel:
    """A router's fused C kernel run under the shared view's sequence lock: the call reads the
    mapped images and has no side effects, so a run a write overlapped is simply run again."""

    __slots__ = ("_inner", "_reader", "workers")

    def __init__(self, inner: Any, reader: SharedViewReader) -> None:
        self._inner = inner
        self._reader = reader
        self.workers = inner.workers

    def run(self, tokens: Any, queue: np.ndarray, belief: np.ndarray, eligible: np.ndarray | None):
        reader, inner = self._reader, self._inner
        while True:
            start = reader.begin()
            out = inner.run(tokens, queue, belief, eligible)
            if reader.valid(start):
                return out

    def keys(self) -> np.ndarray:
        return self._inner.keys()


def share_router_view(router: Any, reader: SharedViewReader) -> None:
    """Make a ``Router`` built over ``reader`` run its decisions under the sequence lock."""
    kernel = router._kernel
    if kernel is None:
        raise ValueError("a router over a shared view needs the native (C) decision")
    if not isinstance(kernel, SeqlockedKernel):
        router._kernel = SeqlockedKernel(kernel, reader)
    reader.begin()  # map what is there now
