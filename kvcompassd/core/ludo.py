"""Ludo hashing tables (Shi & Qian, SIGMETRICS 2020): the index's storage, from Python.

``LudoTable`` is the maintenance side of one table: it keeps the full 63-bit keys (exact ``get``)
and is the only writer. Every mutation leaves update records carrying the *absolute* new state of
what it touched; ``take_updates()`` hands them out as wire-ready ``bytes`` blobs (or one snapshot
after the table was rebuilt under a new epoch). ``LudoView`` is the keyless edge side: built from a
snapshot and kept identical by ``apply``-ing those blobs. It answers every query, so a key never
inserted may return a non-zero value (a false hit) unless fingerprint bits reject it.

This module hides cffi: batches go in and out as numpy ``uint64`` arrays, one C call per batch.
Value 0 means "no holder": a value may not be 0 (remove the key instead).

Objects are not thread-safe: cffi releases the GIL inside C calls, so use each table or view from
one thread at a time (different objects may be used from different threads).
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvcompassd.core._ludo_cffi import ffi, lib

KEY_LIMIT = 1 << 63
_U64_LIMIT = 1 << 64
# Per-element outcomes of LudoTable.edit_fields.
EDIT_CHANGED = lib.KVC_EDIT_CHANGED
EDIT_UNCHANGED = lib.KVC_EDIT_UNCHANGED
EDIT_REFUSED = lib.KVC_EDIT_REFUSED


class LudoError(ValueError):
    """Base class of every error raised by the Ludo wrapper."""


class LudoKeyRangeError(LudoError):
    """A key outside [0, 2^63)."""


class LudoValueRangeError(LudoError):
    """A value that is 0 or wider than the table's value bits."""


class LudoDuplicateKeyError(LudoError):
    """``insert`` of a key that is already present."""


class LudoMissingKeyError(LudoError):
    """``update`` or ``remove`` of a key that is not present."""


class LudoCapacityError(LudoError):
    """The table cannot grow any further."""


class LudoBlobError(LudoError):
    """A record or snapshot blob was rejected; the view it was applied to is unchanged."""


class LudoCorruptError(LudoBlobError):
    """Truncated, damaged (checksum), malformed, or not a Ludo blob at all."""


class LudoVersionError(LudoCorruptError):
    """A blob in a format version or of a kind this build does not understand."""


class LudoForeignError(LudoBlobError):
    """A blob made by another table (different table id)."""


class LudoEpochError(LudoBlobError):
    """Records for another epoch, or a snapshot older than the view: resync from a snapshot."""


_ERRORS: dict[int, tuple[type[Exception], str]] = {
    lib.KVC_ERR_NOMEM: (MemoryError, "out of memory"),
    lib.KVC_ERR_KEY_RANGE: (LudoKeyRangeError, "key must be in [0, 2^63)"),
    lib.KVC_ERR_VALUE_RANGE: (LudoValueRangeError, "value must be non-zero and fit the value bits"),
    lib.KVC_ERR_PRESENT: (LudoDuplicateKeyError, "key is already present"),
    lib.KVC_ERR_ABSENT: (LudoMissingKeyError, "key is not present"),
    lib.KVC_ERR_ARG: (LudoError, "invalid argument"),
    lib.KVC_ERR_TRUNCATED: (LudoCorruptError, "blob is truncated"),
    lib.KVC_ERR_MAGIC: (LudoCorruptError, "not a Ludo blob (bad magic)"),
    lib.KVC_ERR_VERSION: (LudoVersionError, "unknown blob format version or kind"),
    lib.KVC_ERR_CHECKSUM: (LudoCorruptError, "blob checksum mismatch (corrupted)"),
    lib.KVC_ERR_FOREIGN: (LudoForeignError, "blob belongs to another table"),
    lib.KVC_ERR_EPOCH: (LudoEpochError, "blob epoch does not match the view"),
    lib.KVC_ERR_GEOMETRY: (LudoCorruptError, "blob geometry is invalid or not the view's"),
    lib.KVC_ERR_MALFORMED: (LudoCorruptError, "blob payload is malformed"),
    lib.KVC_ERR_FULL: (LudoCapacityError, "table cannot grow any further"),
}


def _raise(rc: int, context: str) -> None:
    cls, text = _ERRORS.get(rc, (LudoError, f"unknown error code {rc}"))
    raise cls(f"{context}: {text}")


def _check_key(key: Any) -> int:
    if type(key) is not int:
        if isinstance(key, bool):
            raise LudoKeyRangeError(f"key must be an int in [0, 2^63), got {key!r}")
        try:
            key = operator.index(key)
        except TypeError:
            raise LudoKeyRangeError(f"key must be an int in [0, 2^63), got {key!r}") from None
    if not 0 <= key < KEY_LIMIT:
        raise LudoKeyRangeError(f"key must be in [0, 2^63), got {key}")
    return key


def _as_uint64(values: Any, what: str, limit: int, error: type[LudoError]) -> np.ndarray:
    """Contiguous uint64 copy-or-view of an integer sequence, every element in [0, limit)."""
    arr = np.asarray(values)
    if not isinstance(values, np.ndarray) and arr.dtype.kind == "f":
        # numpy turns a list mixing ints below 2^63 and at/above it into float64: check exactly
        arr = np.array(values, dtype=object)
    if arr.ndim != 1:
        raise error(f"{what} must be a 1-D sequence of integers, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if arr.dtype == object:  # Python ints beyond 64 bits, or mixed types
        try:
            items = [operator.index(x) for x in arr]
        except TypeError:
            raise error(f"{what} must be integers") from None
        bad = next((x for x in items if not 0 <= x < limit), None)
        if bad is not None:
            raise error(f"{what} must be in [0, {limit:#x}), got {bad}")
        return np.array(items, dtype=np.uint64)
    if arr.dtype.kind not in "iu" or arr.dtype == np.bool_:
        raise error(f"{what} must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise error(f"{what} must be non-negative, got {int(arr.min())}")
    arr = np.ascontiguousarray(arr, dtype=np.uint64)
    if limit < _U64_LIMIT and int(arr.max()) >= limit:
        raise error(f"{what} must be below {limit:#x}, got {int(arr.max())}")
    return arr


def _blob_buffer(blob: Any) -> Any:
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise LudoCorruptError(f"blob must be bytes, got {type(blob).__name__}")
    return ffi.from_buffer("uint8_t[]", blob)


def _u64_ptr(arr: np.ndarray) -> Any:
    return ffi.cast("uint64_t *", arr.ctypes.data)


class LudoTable:
    """Maintenance side of one Ludo table (full keys; the single writer)."""

    __slots__ = ("_ptr", "_value_bits", "_fingerprint_bits", "_max_load", "_seed")

    def __init__(
        self,
        capacity: int,
        *,
        value_bits: int = 32,
        fingerprint_bits: int = 0,
        max_load: float = 0.95,
        seed: int = 0,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 0 < capacity < 1 << 33:
            raise LudoError(f"capacity must be an int in (0, 2^33), got {capacity!r}")
        if value_bits not in (32, 64):
            raise LudoError(f"value_bits must be 32 or 64, got {value_bits!r}")
        if isinstance(fingerprint_bits, bool) or not isinstance(fingerprint_bits, int) or not 0 <= fingerprint_bits <= 16:
            raise LudoError(f"fingerprint_bits must be an int in [0, 16], got {fingerprint_bits!r}")
        if not isinstance(max_load, (int, float)) or not 0.0 < float(max_load) <= 0.98:
            raise LudoError(f"max_load must be in (0, 0.98], got {max_load!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _U64_LIMIT:
            raise LudoError(f"seed (the table id) must be an int in [0, 2^64), got {seed!r}")
        out = ffi.new("kvc_table **")
        rc = lib.kvc_table_new(out, capacity, value_bits, fingerprint_bits, float(max_load), seed)
        if rc != lib.KVC_OK:
            _raise(rc, "creating a Ludo table")
        self._ptr = ffi.gc(out[0], lib.kvc_table_free, size=int(lib.kvc_table_memory_bytes(out[0])))
        self._value_bits = value_bits
        self._fingerprint_bits = fingerprint_bits
        self._max_load = float(max_load)
        self._seed = seed

    # -- single-key operations --------------------------------------------------------------

    def _check_value(self, value: Any) -> int:
        try:
            value = operator.index(value)
        except TypeError:
            raise LudoValueRangeError(f"value must be an int, got {value!r}") from None
        if not 0 < value < 1 << self._value_bits:
            raise LudoValueRangeError(
                f"value must be in [1, 2^{self._value_bits}), got {value} (remove the key instead of storing 0)"
            )
        return value

    def insert(self, key: int, value: int) -> None:
        """Add a key that is not present (LudoDuplicateKeyError otherwise)."""
        rc = lib.kvc_table_insert(self._ptr, _check_key(key), self._check_value(value))
        if rc != lib.KVC_OK:
            _raise(rc, f"insert of key {key}")

    def update(self, key: int, value: int) -> None:
        """Replace the value of a present key (LudoMissingKeyError otherwise)."""
        rc = lib.kvc_table_update(self._ptr, _check_key(key), self._check_value(value))
        if rc != lib.KVC_OK:
            _raise(rc, f"update of key {key}")

    def remove(self, key: int) -> None:
        """Remove a present key (LudoMissingKeyError otherwise)."""
        rc = lib.kvc_table_remove(self._ptr, _check_key(key))
        if rc != lib.KVC_OK:
            _raise(rc, f"remove of key {key}")

    def get(self, key: int) -> int | None:
        """Exact lookup: the value, or None if the key is absent."""
        out = ffi.new("uint64_t *")
        return int(out[0]) if lib.kvc_table_get(self._ptr, _check_key(key), out) == 1 else None

    def __contains__(self, key: object) -> bool:
        try:
            key = _check_key(key)
        except LudoKeyRangeError:
            return False
        return lib.kvc_table_get(self._ptr, key, ffi.NULL) == 1

    def __len__(self) -> int:
        return int(lib.kvc_table_size(self._ptr))

    # -- batches: one C call each; applied in order, stopping at the first failure -------------

    def _keys_values(self, keys: Any, values: Any) -> tuple[np.ndarray, np.ndarray]:
        k = _as_uint64(keys, "keys", KEY_LIMIT, LudoKeyRangeError)
        v = _as_uint64(values, "values", 1 << self._value_bits, LudoValueRangeError)
        if k.shape != v.shape:
            raise LudoError(f"keys and values differ in length: {k.size} vs {v.size}")
        if v.size and int(v.min()) == 0:
            raise LudoValueRangeError("values must be non-zero (remove the key instead of storing 0)")
        return k, v

    def _batch_result(self, rc: int, done: Any, keys: np.ndarray, op: str) -> None:
        if rc != lib.KVC_OK:
            i = int(done[0])
            _raise(rc, f"{op} stopped at index {i} (key {int(keys[i])}); the {i} before it were applied")

    def insert_many(self, keys: Any, values: Any) -> None:
        """Insert keys[i] -> values[i] in order (all validated for range before any is applied)."""
        k, v = self._keys_values(keys, values)
        done = ffi.new("size_t *")
        rc = lib.kvc_table_insert_many(self._ptr, _u64_ptr(k), _u64_ptr(v), k.size, done)
        self._batch_result(rc, done, k, "insert_many")

    def update_many(self, keys: Any, values: Any) -> None:
        """Update keys[i] -> values[i] in order."""
        k, v = self._keys_values(keys, values)
        done = ffi.new("size_t *")
        rc = lib.kvc_table_update_many(self._ptr, _u64_ptr(k), _u64_ptr(v), k.size, done)
        self._batch_result(rc, done, k, "update_many")

    def remove_many(self, keys: Any) -> None:
        """Remove keys in order."""
        k = _as_uint64(keys, "keys", KEY_LIMIT, LudoKeyRangeError)
        done = ffi.new("size_t *")
        rc = lib.kvc_table_remove_many(self._ptr, _u64_ptr(k), k.size, done)
        self._batch_result(rc, done, k, "remove_many")

    def edit_fields(self, keys: np.ndarray, ops: np.ndarray, op_field: bytes, op_needs_held: bytes, *,
                    shift: int, width: int) -> np.ndarray:
        """Set the ``width``-bit field at bit ``shift`` of each key's value to ``op_field[op]``, in
        order, in one C call (inserting absent keys, removing values that become 0); an op with
        ``op_needs_held[op]`` set is refused where the field is 0. Returns one
        ``lib.KVC_EDIT_*`` status per key. ``keys`` must be uint64 and ``ops`` uint8 arrays."""
        if keys.dtype != np.uint64 or ops.dtype != np.uint8 or keys.shape != ops.shape or keys.ndim != 1:
            raise LudoError("edit_fields needs 1-d uint64 keys and uint8 ops of the same length")
        if len(op_field) != len(op_needs_held):
            raise LudoError("op_field and op_needs_held must describe the same ops")
        keys, ops = np.ascontiguousarray(keys), np.ascontiguousarray(ops)
        status = np.empty(keys.size, dtype=np.uint8)
        done = ffi.new("size_t *")
        rc = lib.kvc_table_edit_fields(self._ptr, _u64_ptr(keys), ffi.from_buffer("uint8_t[]", ops), keys.size,
                                       op_field, op_needs_held, len(op_field), shift, width,
                                       ffi.from_buffer("uint8_t[]", status), done)
        self._batch_result(rc, done, keys, "edit_fields")
        return status

    def get_many(self, keys: Any) -> tuple[np.ndarray, np.ndarray]:
        """Exact batch lookup: (values with 0 for absent keys, boolean presence mask)."""
        k = _as_uint64(keys, "keys", KEY_LIMIT, LudoKeyRangeError)
        values = np.zeros(k.size, dtype=np.uint64)
        found = np.zeros(k.size, dtype=np.uint8)
        lib.kvc_table_get_many(self._ptr, _u64_ptr(k), k.size, _u64_ptr(values), ffi.cast("uint8_t *", found.ctypes.data))
        return values, found.astype(bool)

    # -- update stream -----------------------------------------------------------------------

    def take_updates(self) -> list[bytes]:
        """Blobs to ship since the last call: one record blob, or one snapshot after a rebuild."""
        if lib.kvc_table_needs_snapshot(self._ptr):
            blob = self.snapshot()
            lib.kvc_table_clear_pending(self._ptr)
            return [blob]
        size = lib.kvc_table_records_size(self._ptr)
        if size == 0:
            return []
        buf = bytearray(size)
        rc = lib.kvc_table_records_drain(self._ptr, ffi.from_buffer("uint8_t[]", buf), size)
        if rc != lib.KVC_OK:
            _raise(rc, "draining update records")
        return [bytes(buf)]

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (key, value) in the table as two uint64 arrays (slot order), one C call."""
        n = len(self)
        keys = np.empty(n, dtype=np.uint64)
        values = np.empty(n, dtype=np.uint64)
        if n:
            got = lib.kvc_table_export(self._ptr, _u64_ptr(keys), _u64_ptr(values), n)
            keys, values = keys[:got], values[:got]
        return keys, values

    def snapshot(self) -> bytes:
        """A full snapshot of the current state (does not consume pending records)."""
        size = lib.kvc_table_snapshot_size(self._ptr)
        buf = bytearray(size)
        rc = lib.kvc_table_snapshot_write(self._ptr, ffi.from_buffer("uint8_t[]", buf), size)
        if rc != lib.KVC_OK:
            _raise(rc, "writing a snapshot")
        return bytes(buf)

    # -- accounting ----------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return int(lib.kvc_table_epoch(self._ptr))

    @property
    def table_id(self) -> int:
        return self._seed

    @property
    def value_bits(self) -> int:
        return self._value_bits

    @property
    def fingerprint_bits(self) -> int:
        return self._fingerprint_bits

    @property
    def slots(self) -> int:
        return int(lib.kvc_table_slots(self._ptr))

    @property
    def load(self) -> float:
        return len(self) / self.slots

    @property
    def memory_bytes(self) -> int:
        return int(lib.kvc_table_memory_bytes(self._ptr))

    @property
    def overflow_buckets(self) -> int:
        """Buckets whose slot seed exceeds the view's 5 bits (they live in its overflow map)."""
        return int(lib.kvc_table_overflow_buckets(self._ptr))

    def __repr__(self) -> str:
        return f"LudoTable(id={self._seed}, entries={len(self)}, slots={self.slots}, epoch={self.epoch})"


class RoutedEditError(LudoError):
    """``RoutedTables.edit_fields`` stopped at a table error (no memory, a table that cannot
    grow): ``changed`` counts what each table changed before it, as the call would have returned."""

    def __init__(self, message: str, changed: np.ndarray):
        super().__init__(message)
        self.changed = changed


class RoutedTables:
    """A table and tables that each take part of its edits, chosen by each edit's length: one
    report's ``edit_fields`` on all of them in one C call (``kvc_tables_edit_routed``).

    A maintenance shard's full table of a region group and that group's table in each region's
    stream (``kvcompassd.core.streams``): ``routes`` maps a length to the indices of ``streams``
    that take its events; a length it does not name goes to no stream. Every table ends as
    ``LudoTable.edit_fields`` of its own events alone would leave it, with the same pending
    records. Holds the tables (they live as long as this does); build it once, use it per report."""

    __slots__ = ("_full", "_streams", "_pointers", "_known", "_row_start", "_row_streams", "_arrays")

    def __init__(self, full: LudoTable, streams: Sequence[LudoTable], routes: Mapping[int, Iterable[int]]):
        self._full = full
        self._streams = tuple(streams)
        if not all(isinstance(t, LudoTable) for t in (full, *self._streams)):
            raise LudoError("RoutedTables takes LudoTable objects")
        if any(t.value_bits != full.value_bits for t in self._streams):
            raise LudoError("RoutedTables' tables must have the same value bits")
        self._pointers = ffi.new("kvc_table *[]", [t._ptr for t in self._streams] or 1)
        known = sorted(operator.index(n) for n in routes)
        if known and not 0 <= known[0] <= known[-1] < 1 << 32:
            raise LudoError("routed lengths must be in [0, 2^32)")
        rows: list[list[int]] = []
        for n in known:
            row = sorted(set(operator.index(j) for j in routes[n]))
            if row and not 0 <= row[0] <= row[-1] < len(self._streams):
                raise LudoError(f"length {n} routed to a stream index outside [0, {len(self._streams)})")
            rows.append(row)
        rows.append([])  # any other length: no stream
        # The C arrays of the membership, made once (the numpy arrays behind them live as long).
        arrays = (np.array(known, dtype=np.uint32), np.cumsum([0] + [len(r) for r in rows], dtype=np.uint32),
                  np.array([j for r in rows for j in r] or [0], dtype=np.uint32))
        self._known, self._row_start, self._row_streams = (ffi.from_buffer("uint32_t[]", a) for a in arrays)
        self._arrays = arrays

    @property
    def streams(self) -> int:
        return len(self._streams)

    def edit_fields(self, keys: np.ndarray, ops: np.ndarray, lengths: np.ndarray, op_field: bytes,
                    op_needs_held: bytes, *, shift: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """``LudoTable.edit_fields`` of (keys, ops) on the full table and of each event on the
        streams its length routes it to. Returns the full table's status per event and the
        fields changed per table (``[full, *streams]``). ``keys`` uint64, ``ops`` uint8 and
        ``lengths`` uint32, 1-d of one length. Raises before any change for bad arguments, and
        ``RoutedEditError`` (with the counts so far) when a table fails part-way."""
        n = keys.shape[0] if keys.ndim == 1 else -1
        if (keys.dtype != np.uint64 or ops.dtype != np.uint8 or lengths.dtype != np.uint32 or n < 0
                or ops.shape != (n,) or lengths.shape != (n,)):
            raise LudoError("RoutedTables.edit_fields needs 1-d uint64 keys, uint8 ops and uint32 lengths "
                            "of the same length")
        if len(op_field) != len(op_needs_held):
            raise LudoError("op_field and op_needs_held must describe the same ops")
        keys, ops, lengths = np.ascontiguousarray(keys), np.ascontiguousarray(ops), np.ascontiguousarray(lengths)
        status = np.empty(n, dtype=np.uint8)
        changed = np.empty(len(self._streams) + 1, dtype=np.uint64)
        out = ffi.new("size_t[2]")  # failed table, events done
        rc = lib.kvc_tables_edit_routed(
            self._full._ptr, self._pointers, len(self._streams),
            ffi.from_buffer("uint64_t[]", keys), ffi.from_buffer("uint8_t[]", ops),
            ffi.from_buffer("uint32_t[]", lengths), n,
            self._known, self._arrays[0].size, self._row_start, self._row_streams,
            op_field, op_needs_held, len(op_field), shift, width,
            ffi.from_buffer("uint8_t[]", status), ffi.from_buffer("uint64_t[]", changed), out, out + 1)
        if rc != lib.KVC_OK:
            cls, text = _ERRORS.get(rc, (LudoError, f"unknown error code {rc}"))
            i, table = int(out[1]), int(out[0])
            context = "routed edit_fields"
            if rc in (lib.KVC_ERR_ARG, lib.KVC_ERR_KEY_RANGE):
                raise cls(f"{context}: {text}; no table changed")
            where = "the full table" if table == 0 else f"stream table {table - 1}"
            raise RoutedEditError(f"{context} stopped at event {i} (key {int(keys[i])}) in {where}: {text}; "
                                  f"the {i} events before it were applied", changed) from cls(text)
        return status, changed


class LudoView:
    """Keyless edge-side replica of one Ludo table."""

    __slots__ = ("_ptr",)

    def __init__(self) -> None:
        raise TypeError("use LudoView.from_snapshot(blob)")

    @classmethod
    def from_snapshot(cls, blob: bytes) -> LudoView:
        buf = _blob_buffer(blob)
        out = ffi.new("kvc_view **")
        rc = lib.kvc_view_new(out, buf, len(buf))
        if rc != lib.KVC_OK:
            _raise(rc, "building a view from a snapshot")
        view = object.__new__(cls)
        view._ptr = ffi.gc(out[0], lib.kvc_view_free, size=int(lib.kvc_view_memory_bytes(out[0])))
        return view

    def copy(self) -> LudoView:
        """An independent view in the same state (as ``from_snapshot(self.snapshot())``, without
        writing and parsing the snapshot)."""
        return LudoView.copy_of(self._ptr)

    @classmethod
    def copy_of(cls, ptr: Any) -> LudoView:
        """An independent view in the state of a ``kvc_view *`` another owner holds (the
        simulator's shared versions hand out copies, never their own)."""
        out = ffi.new("kvc_view **")
        rc = lib.kvc_view_copy(out, ptr)
        if rc != lib.KVC_OK:
            _raise(rc, "copying a view")
        view = object.__new__(cls)
        view._ptr = ffi.gc(out[0], lib.kvc_view_free, size=int(lib.kvc_view_memory_bytes(out[0])))
        return view

    def apply(self, blob: bytes) -> None:
        """Apply a record blob or a snapshot; on any error the view is left unchanged."""
        buf = _blob_buffer(blob)
        rc = lib.kvc_view_apply(self._ptr, buf, len(buf))
        if rc != lib.KVC_OK:
            _raise(rc, f"applying a blob to the view of table {self.table_id} at epoch {self.epoch}")

    def lookup(self, key: int) -> int:
        """The value stored for key, 0 if none (or if fingerprints reject it)."""
        if type(key) is not int or not 0 <= key < KEY_LIMIT:
            key = _check_key(key)
        return lib.kvc_view_lookup(self._ptr, key)  # cffi hands back a Python int

    def lookup_many(self, keys: Any) -> np.ndarray:
        """Batch lookup (prefetching across the batch): a uint64 array aligned with keys."""
        k = _as_uint64(keys, "keys", KEY_LIMIT, LudoKeyRangeError)
        out = np.empty(k.size, dtype=np.uint64)
        if k.size:
            lib.kvc_view_lookup_many(self._ptr, _u64_ptr(k), k.size, _u64_ptr(out))
        return out

    def snapshot(self) -> bytes:
        """The view's current state as a snapshot blob: a peer builds an identical view from it."""
        size = int(lib.kvc_view_snapshot_size(self._ptr))
        buf = bytearray(size)
        rc = lib.kvc_view_snapshot_write(self._ptr, ffi.from_buffer("uint8_t[]", buf), size)
        if rc != lib.KVC_OK:
            _raise(rc, "exporting the view")
        return bytes(buf)

    @property
    def epoch(self) -> int:
        return int(lib.kvc_view_epoch(self._ptr))

    @property
    def table_id(self) -> int:
        return int(lib.kvc_view_table_id(self._ptr))

    @property
    def slots(self) -> int:
        return int(lib.kvc_view_slots(self._ptr))

    @property
    def value_bits(self) -> int:
        return int(lib.kvc_view_value_bits(self._ptr))

    @property
    def fingerprint_bits(self) -> int:
        return int(lib.kvc_view_fingerprint_bits(self._ptr))

    @property
    def snapshot_entries(self) -> int:
        """Entries in the table when this view's last snapshot was taken."""
        return int(lib.kvc_view_snapshot_entries(self._ptr))

    @property
    def overflow_count(self) -> int:
        return int(lib.kvc_view_overflow_count(self._ptr))

    @property
    def overflow_capacity(self) -> int:
        return int(lib.kvc_view_overflow_capacity(self._ptr))

    @property
    def memory_bytes(self) -> int:
        return int(lib.kvc_view_memory_bytes(self._ptr))

    def __repr__(self) -> str:
        return f"LudoView(id={self.table_id}, slots={self.slots}, epoch={self.epoch})"


class BatchApplyError(LudoError):
    """``apply_batch`` refused a blob: ``index`` is its position in the batch, ``cause`` the error
    ``LudoView.apply`` would have raised for it."""

    def __init__(self, index: int, cause: Exception):
        super().__init__(str(cause))
        self.index = index
        self.cause = cause


def apply_batch(views: list[LudoView], blobs: list[Any]) -> None:
    """Apply ``blobs[i]`` to ``views[i]`` for every i in one C call (``kvc_views_apply_batch``):
    record blobs of distinct views are all validated before any view changes, then written with
    one prefetch pipeline over the whole batch; with a snapshot among them or a view named twice
    they go one after the other, as ``LudoView.apply`` of each in order. Raises
    ``BatchApplyError`` naming the first blob refused."""
    n = len(views)
    if n != len(blobs):
        raise LudoError(f"{n} views for {len(blobs)} blobs")
    if n == 0:
        return
    if n == 1:  # one table changed (most batches of a region's stream): no arrays to build
        try:
            views[0].apply(blobs[0])
        except LudoError as exc:
            raise BatchApplyError(0, exc) from None
        return
    bufs = [_blob_buffer(b) for b in blobs]
    failed = ffi.new("size_t *")
    rc = lib.kvc_views_apply_batch(ffi.new("kvc_view *[]", [v._ptr for v in views]), ffi.new("uint8_t *[]", bufs),
                                   ffi.new("size_t[]", [len(b) for b in bufs]), n, failed)
    if rc != lib.KVC_OK:
        i = int(failed[0])
        cls, text = _ERRORS.get(rc, (LudoError, f"unknown error code {rc}"))
        raise BatchApplyError(i, cls(f"applying blob {i} of a batch to the view of table {views[i].table_id} at "
                                     f"epoch {views[i].epoch}: {text}"))


_from_buffer = ffi.from_buffer


def _new_size() -> Any:
    return ffi.new("size_t *")


class TablesEditor:
    """Field edits of events on several tables in one C call (``kvc_tables_edit_fields_each``),
    the tables' pointer array built once: a maintenance shard's tables, which receive a few
    events from each of a few workers between two flushes (where numpy's per-call cost, or one
    call per table, would be most of the work)."""

    __slots__ = ("_tables", "_pointers")

    def __init__(self, tables: Sequence[LudoTable]) -> None:
        self._tables = list(tables)  # keeps each table, and so its pointer, alive
        self._pointers = ffi.new("kvc_table *[]", [t._ptr for t in self._tables] or 1)

    def edit_fields_each(self, places: array, keys: array, ops: bytes | bytearray, op_field: bytes,
                         op_needs_held: bytes, *, width: int) -> bytearray:
        """``LudoTable.edit_fields`` of each event in order: event ``i`` sets the ``width``-bit
        field at bit ``places[i] & 0xff`` of ``keys[i]``'s value in table ``places[i] >> 8`` to
        ``op_field[ops[i]]``. ``places`` is an ``array('I')``, ``keys`` an ``array('Q')``, ``ops``
        bytes, of one length. Returns one ``EDIT_*`` status per event. Bad arguments raise
        before any table changes; a table error part-way raises naming the event it stopped at
        (those before it applied)."""
        n = len(ops)
        if (type(places) is not array or places.typecode != "I" or type(keys) is not array or keys.typecode != "Q"
                or len(places) != n or len(keys) != n):
            raise LudoError("edit_fields_each needs places as array('I'), keys as array('Q') and ops of one length")
        if len(op_field) != len(op_needs_held):
            raise LudoError("op_field and op_needs_held must describe the same ops")
        status = bytearray(n)
        if n == 0:
            return status
        done = _new_size()
        rc = lib.kvc_tables_edit_fields_each(self._pointers, len(self._tables), _from_buffer("uint32_t[]", places),
                                             _from_buffer("uint64_t[]", keys), _from_buffer("uint8_t[]", ops), n,
                                             op_field, op_needs_held, len(op_field), width,
                                             _from_buffer("uint8_t[]", status), done)
        if rc != lib.KVC_OK:
            i = int(done[0])
            _raise(rc, f"edit_fields_each stopped at event {i} (key {keys[i]}); the {i} before it were applied")
        return status


def peek_blob(blob: bytes) -> tuple[str, int, int]:
    """(kind "snapshot"/"records", table id, epoch) from a blob's header, for routing.

    Checks the header's shape only; ``LudoView.apply`` validates the whole blob.
    """
    buf = _blob_buffer(blob)
    kind = ffi.new("unsigned *")
    table_id = ffi.new("uint64_t *")
    epoch = ffi.new("uint64_t *")
    rc = lib.kvc_blob_peek(buf, len(buf), kind, table_id, epoch)
    if rc != lib.KVC_OK:
        _raise(rc, "reading a blob header")
    return ("snapshot" if kind[0] == lib.KVC_BLOB_SNAPSHOT else "records"), int(table_id[0]), int(epoch[0])


_MAGIC = b"KVLD"  # ludo_internal.h: a blob starts with the magic, then version u16, then kind u16
_SNAPSHOT_KIND = int(lib.KVC_BLOB_SNAPSHOT).to_bytes(2, "little")


def blob_is_snapshot(blob: bytes) -> bool:
    """``peek_blob(blob)[0] == "snapshot"`` for a blob this process's tables wrote, read from the
    header's kind field without a C call (the simulator's shared views ask it of every blob a
    shard publishes, ~24 per request at 1,024 x 64). Checks the magic only: ``peek_blob``
    checks the header's shape, ``LudoView.apply`` the whole blob."""
    if blob[:4] != _MAGIC:
        raise LudoCorruptError("not a Ludo blob (bad magic)")
    return blob[6:8] == _SNAPSHOT_KIND


_SNAPSHOT_ENTRIES_AT = 72  # ludo_internal.h: the snapshot payload starts with `entries u64` after the 72-byte header


def snapshot_blob_entries(blob: bytes | bytearray | memoryview) -> int:
    """The entry count a snapshot blob's payload declares (its table's size when it was taken),
    read from the header's shape only, like ``peek_blob``; ``LudoView.from_snapshot`` validates
    the whole blob (CRC included) and reports the same count as ``snapshot_entries``."""
    kind, _, _ = peek_blob(blob)
    if kind != "snapshot" or len(blob) < _SNAPSHOT_ENTRIES_AT + 8:
        raise LudoCorruptError(f"not a snapshot blob ({kind}, {len(blob)} bytes)")
    return int.from_bytes(bytes(memoryview(blob)[_SNAPSHOT_ENTRIES_AT:_SNAPSHOT_ENTRIES_AT + 8]), "little")


def set_huge_page_views(enabled: bool) -> bool:
    """Make this process's views from now on on transparent huge pages (``ludo_c/kvc_arena.h``)
    or not; returns the previous setting. An edge deciding over tens of thousands of small
    views turns it on: a decision's thousand random view reads then rarely miss the TLB."""
    return bool(lib.kvc_arena_set_enabled(1 if enabled else 0))


def huge_page_view_stats() -> dict[str, Any]:
    """Whether views are made on huge pages now, and the bytes their arena has reserved, holds
    in live views and keeps freed for views of the same size (it never returns chunks)."""
    stats = ffi.new("kvc_arena_stats *")
    lib.kvc_arena_get_stats(stats)
    return {"enabled": bool(stats.enabled), "reserved": int(stats.reserved), "live": int(stats.live),
            "kept": int(stats.kept), "chunks": int(stats.chunks)}
