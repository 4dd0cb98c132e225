"""A salted :class:`kvcompassd.engine.blocktree.BlockTree`'s state and per-page work in C
(``ludo_c/kvc_blocktree.c``): the thin wrapper over ``ffi``/``lib`` that lays events out as
columns, makes one C call per batch and turns the index events back into objects."""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from kvcompassd.core._ludo_cffi import ffi, lib
from kvcompassd.core.events import IndexEvent, PrefixCached, PrefixEvicted, Tier, TierChanged
from kvcompassd.engine.blocktree_py import _AnchorId, _Block, _medium_tier, _PythonTree
from kvcompassd.engine.kvevents import (
    RUN_MEDIUM_LEN,
    RUN_MEDIUM_OFF,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
    ScannedEvents,
    StorageTier,
    canonical_medium,
)

log = logging.getLogger("kvcompassd.engine.blocktree")  # one logger for the tree, whichever module logs


_OP_STORE, _OP_REMOVE, _OP_CLEAR = lib.KVC_BT_OP_STORE, lib.KVC_BT_OP_REMOVE, lib.KVC_BT_OP_CLEAR
_OP_HAS_PARENT, _OP_LORA, _MEDIUM_SHIFT = lib.KVC_BT_OP_HAS_PARENT, lib.KVC_BT_OP_LORA, lib.KVC_BT_OP_MEDIUM_SHIFT
_CACHED, _CHANGED = lib.KVC_BT_CACHED, lib.KVC_BT_CHANGED
_NOTE_RESTORED = lib.KVC_BT_NOTE_RESTORED
_INDEX_TIERS = (None, Tier.VRAM, Tier.DRAM)  # kvc_btree_event.tier -> Tier
_EVENT_DTYPE = np.dtype({"names": ["key", "length", "kind", "tier"], "formats": ["u8", "u4", "u1", "u1"],
                         "offsets": [ffi.offsetof("kvc_btree_event", name) for name in ("key", "length", "kind", "tier")],
                         "itemsize": ffi.sizeof("kvc_btree_event")})
_EVENT_BYTES = ffi.sizeof("kvc_btree_event")
_RUN_BYTES = ffi.sizeof("kvc_event_run")
_EMPTY_I64 = array("q", [0])
_EMPTY_U32 = array("I", [0])


class _Unsupported(Exception):
    """Input the C tree cannot hold (a bytes or out-of-range hash, a 33rd medium): the tree moves
    to the Python implementation and the call is made there."""


class _NativeTree:
    """A salted BlockTree's state and per-page work in C (ludo_c/kvc_blocktree.c): each call lays
    its events out as columns (a scanned payload's are already), applies them in one C call and
    turns the index events it returns into IndexEvent objects, the same ones in the same order as
    :class:`_PythonTree`. ``empty`` is the Python tree the state moves to (``to_python``)."""

    def __init__(self, empty: _PythonTree, salt: bytes) -> None:
        self._empty = empty
        self.worker = empty.worker
        self.indexed_lengths = empty.indexed_lengths
        self.refused_events = empty.refused_events  # the one dict, whichever implementation counts
        self._page_size = empty._page_size
        self._refuse = empty._refuse
        lengths = array("I", self.indexed_lengths)
        tree = lib.kvc_btree_new(ffi.from_buffer("uint32_t[]", lengths), len(lengths), salt, len(salt),
                                 empty._max_detached)
        if tree == ffi.NULL:
            raise MemoryError("creating a block tree: out of memory")
        self._tree = ffi.gc(tree, lib.kvc_btree_free)
        self._stats = ffi.new("kvc_btree_stats *")
        self._media: dict[str | None, int] = {}  # the engine's medium name -> index
        self._media_names: list[str] = []  # index -> canonical name
        if empty._trusted_events:
            self._evicted, self._cached, self._changed = PrefixEvicted.trusted, PrefixCached.trusted, TierChanged.trusted
        else:
            self._evicted, self._cached, self._changed = PrefixEvicted, PrefixCached, TierChanged

    # ----------------------------------------------------------------------------- queries

    def _stat(self) -> object:
        lib.kvc_btree_get_stats(self._tree, self._stats)
        return self._stats

    def __len__(self) -> int:
        return self._stat().blocks

    def __contains__(self, block_hash: object) -> bool:
        return type(block_hash) is int and -(1 << 63) <= block_hash < (1 << 63) \
            and lib.kvc_btree_block_state(self._tree, block_hash) >= 0

    def is_attached(self, block_hash: BlockHash) -> bool:
        return type(block_hash) is int and -(1 << 63) <= block_hash < (1 << 63) \
            and lib.kvc_btree_block_state(self._tree, block_hash) == 1

    @property
    def detached_count(self) -> int:
        return self._stat().detached

    @property
    def dropped_blocks(self) -> int:
        return self._stat().dropped_blocks

    @property
    def ignored_removals(self) -> int:
        return self._stat().ignored_removals

    def _registered_columns(self) -> tuple[list[int], list[int], list[int]]:
        n = self._stat().registered
        keys, tiers, lengths = ffi.new("uint64_t[]", n + 1), ffi.new("uint8_t[]", n + 1), ffi.new("uint32_t[]", n + 1)
        n = lib.kvc_btree_registered(self._tree, keys, tiers, lengths, n + 1)
        return ffi.unpack(keys, n), ffi.unpack(tiers, n), ffi.unpack(lengths, n)

    def registered(self) -> dict[int, Tier]:
        keys, tiers, _ = self._registered_columns()
        return {key: _INDEX_TIERS[tier] for key, tier in zip(keys, tiers)}

    def registered_with_lengths(self) -> dict[int, tuple[Tier, int]]:
        keys, tiers, lengths = self._registered_columns()
        return {key: (_INDEX_TIERS[tier], length) for key, tier, length in zip(keys, tiers, lengths)}

    def block_hashes(self) -> list[BlockHash]:
        info = ffi.new("kvc_btree_block_info *")
        return [info.hash for slot in range(lib.kvc_btree_slot_count(self._tree))
                if lib.kvc_btree_block_at(self._tree, slot, info, ffi.NULL, 0, ffi.NULL, ffi.NULL, 0)]

    def detached_hashes(self) -> list[BlockHash]:
        n = self._stat().detached
        out = ffi.new("int64_t[]", n + 1)
        return ffi.unpack(out, lib.kvc_btree_detached(self._tree, out, n + 1))

    # ----------------------------------------------------------------------------- updates

    def _medium(self, medium: str | None) -> int:
        index = self._media.get(medium)
        if index is None:
            name = canonical_medium(medium)
            if name in self._media_names:
                index = self._media_names.index(name)
            else:
                if len(self._media_names) >= lib.KVC_BT_MAX_MEDIA:
                    raise _Unsupported(f"more than {lib.KVC_BT_MAX_MEDIA} media")
                index = len(self._media_names)
                self._media_names.append(name)
                lib.kvc_btree_set_medium_tier(self._tree, index, int(_medium_tier(name)))
            if len(self._media) < 256:  # (engine-supplied names: bounded)
                self._media[medium] = index
        return index

    def _ops(self, events: Iterable[KvEvent]) -> tuple[array, array, array, list, TypeError | None]:
        """``events`` as kvc_btree_op columns; the refused events; a TypeError for a non-event
        (the events before it are applied, as the Python tree does, then it is raised)."""
        ops: list[int] = []
        hashes: list[BlockHash] = []
        tokens: list[int] = []
        refused: list[KvEvent] = []
        error = None
        page_size = self._page_size
        media = self._media
        for event in events:
            kind = type(event)
            if kind is BlockStored:
                if event.group_idx or (page_size is not None and event.block_size != page_size):
                    refused.append(event)
                    continue
                medium = media.get(event.medium)
                if medium is None:
                    medium = self._medium(event.medium)
                block_hashes, token_ids, parent = event.block_hashes, event.token_ids, event.parent_block_hash
                hashes += block_hashes
                tokens += token_ids
                flags = _OP_STORE | medium << _MEDIUM_SHIFT
                if event.lora_id is not None or event.lora_name is not None:
                    flags |= _OP_LORA
                if parent is None:
                    ops += (flags, 0, event.block_size, len(block_hashes), len(token_ids))
                else:
                    ops += (flags | _OP_HAS_PARENT, parent, event.block_size, len(block_hashes), len(token_ids))
            elif kind is BlockRemoved:
                if event.group_idx:
                    refused.append(event)
                    continue
                medium = media.get(event.medium)
                if medium is None:
                    medium = self._medium(event.medium)
                hashes += event.block_hashes
                ops += (_OP_REMOVE | medium << _MEDIUM_SHIFT, 0, 0, len(event.block_hashes), 0)
            elif kind is AllBlocksCleared:
                ops += (_OP_CLEAR, 0, 0, 0, 0)
            else:
                error = TypeError(f"not a KV event: {event!r}")
                break
        try:
            token_column = array("I")
            token_column.fromlist(tokens)
            return array("q", ops), array("q", hashes), token_column, refused, error
        except (OverflowError, TypeError) as exc:  # bytes hashes, ints past int64
            raise _Unsupported(str(exc)) from exc

    def _apply(self, events: Iterable[KvEvent], diff_each: int) -> tuple[list[IndexEvent], list[int]]:
        ops, hashes, tokens, refused, error = self._ops(events)
        n_ops = len(ops) // 5
        n = lib.kvc_btree_apply_ops(self._tree, ffi.from_buffer("kvc_btree_op[]", ops) if n_ops else ffi.NULL, n_ops,
                                    ffi.from_buffer("int64_t[]", hashes or _EMPTY_I64), len(hashes),
                                    ffi.from_buffer("uint32_t[]", tokens or _EMPTY_U32), len(tokens), diff_each)
        out = self._results(n)
        for event in refused:
            self._refuse(event)
        if error is not None:
            raise error
        return out

    def _results(self, n: int) -> tuple[list[IndexEvent], list[int]]:
        """The last C call's index events and their lengths; its notes logged."""
        tree = self._tree
        if n == lib.KVC_BT_BAD_INPUT:  # our own columns disagree with their runs: a bug, never engine input
            raise ValueError("block tree: malformed ops or runs; nothing applied")
        if n < 0:
            raise MemoryError("block tree: out of memory")
        if lib.kvc_btree_note_count(tree):
            notes = lib.kvc_btree_notes(tree)
            for i in range(lib.kvc_btree_note_count(tree)):
                if notes[i].code == _NOTE_RESTORED:
                    log.warning("block %r re-stored with a different parent or tokens; kept the first", notes[i].hash)
                else:
                    log.warning("dropping detached block %r: its parent never arrived (limit %d)", notes[i].hash,
                                self._empty._max_detached)
        if not n:
            return [], []
        worker, cached, changed, evicted, tiers = self.worker, self._cached, self._changed, self._evicted, _INDEX_TIERS
        out: list[IndexEvent] = []
        lengths: list[int] = []
        rows = np.frombuffer(ffi.buffer(lib.kvc_btree_events(tree), n * _EVENT_BYTES), dtype=_EVENT_DTYPE).tolist()
        for key, length, kind, tier in rows:
            if kind == _CACHED:
                out.append(cached(worker, key, tiers[tier]))
            elif kind == _CHANGED:
                out.append(changed(worker, key, tiers[tier]))
            else:
                out.append(evicted(worker, key))
            lengths.append(length)
        return out, lengths

    def apply(self, event: KvEvent) -> list[IndexEvent]:
        return self._apply((event,), 1)[0]

    def apply_each(self, events: Iterable[KvEvent]) -> list[IndexEvent]:
        if type(events) is ScannedEvents:
            return self._apply_scanned(events, 1)[0]
        return self._apply(events, 1)[0]

    def apply_batch(self, batch: EventBatch) -> list[IndexEvent]:
        return self.apply_each(batch.events)

    def apply_events(self, events: Iterable[KvEvent]) -> list[IndexEvent]:
        return self.apply_events_with_lengths(events)[0]

    def apply_events_with_lengths(self, events: Iterable[KvEvent]) -> tuple[list[IndexEvent], list[int]]:
        if type(events) is ScannedEvents:
            return self._apply_scanned(events, 0)
        return self._apply(events, 0)

    def _apply_scanned(self, events: ScannedEvents, diff_each: int) -> tuple[list[IndexEvent], list[int]]:
        try:
            runs, hashes, tokens = events.columns()
        except (OverflowError, TypeError) as exc:  # hand-made columns with hashes past int64
            raise _Unsupported(str(exc)) from exc
        n_runs = len(runs) // _RUN_BYTES
        if not n_runs:
            return [], []
        data = events.data
        runs_in, hashes_in = ffi.from_buffer("kvc_event_run[]", runs), ffi.from_buffer("int64_t[]", hashes or _EMPTY_I64)
        tokens_in = ffi.from_buffer("uint32_t[]", tokens or _EMPTY_U32)
        refused = bytearray(n_runs)
        media = ffi.NULL  # each run's medium found by its raw name in C (named below on first sight)
        while True:
            n = lib.kvc_btree_apply_runs(self._tree, runs_in, n_runs, hashes_in, len(hashes) // 8,
                                         tokens_in, len(tokens) // 4, media, data, len(data),
                                         self._page_size or 0, ffi.from_buffer("uint8_t[]", refused), diff_each)
            if n >= -2:
                break
            run = events.runs[-3 - n]  # a medium not named yet (nothing was applied)
            off, length = run[RUN_MEDIUM_OFF], run[RUN_MEDIUM_LEN]
            index = self._medium(events.medium(run))
            if lib.kvc_btree_name_medium(self._tree, data[off:off + length] if off >= 0 else b"", length, off < 0,
                                         index) < 0:  # (the table is full: the indices from here)
                media = ffi.from_buffer("uint8_t[]", bytes(0 if name is None else self._medium(name)
                                                           for name in events.canonical_media()))
        out = self._results(n)
        start = refused.find(1)
        while start >= 0:
            self._refuse(events.event(start))  # type: ignore[arg-type]
            start = refused.find(1, start + 1)
        return out

    def withdraw_all(self) -> list[IndexEvent]:
        return self.withdraw_all_with_lengths()[0]

    def withdraw_all_with_lengths(self) -> tuple[list[IndexEvent], list[int]]:
        n = lib.kvc_btree_withdraw_all(self._tree)
        if n < 0:
            raise MemoryError("block tree: out of memory")
        out, lengths = self._results(n)
        return [PrefixEvicted(self.worker, e.key) for e in out], lengths

    # ----------------------------------------------------------------------------- hand-over

    def to_python(self) -> _PythonTree:
        """This tree's state moved into the Python implementation (which recomputes SHA states
        from the root as it needs them): blocks, children in their order, detached blocks in
        theirs, holders, announced keys in theirs, counters."""
        py = self._empty
        tree = self._tree
        info = ffi.new("kvc_btree_block_info *")
        blocks: dict[BlockHash, _Block] = {}
        sibling_order: list[tuple[int, BlockHash, BlockHash | None]] = []
        detached: list[tuple[int, BlockHash]] = []
        holders: dict[int, dict[_AnchorId, StorageTier]] = {}
        for slot in range(lib.kvc_btree_slot_count(tree)):
            if not lib.kvc_btree_block_at(tree, slot, info, ffi.NULL, 0, ffi.NULL, ffi.NULL, 0):
                continue
            n_tokens, n_anchors = info.n_tokens, info.n_anchors
            tokens = ffi.new("uint32_t[]", n_tokens + 1)
            anchor_lengths, anchor_keys = ffi.new("uint32_t[]", n_anchors + 1), ffi.new("uint64_t[]", n_anchors + 1)
            lib.kvc_btree_block_at(tree, slot, info, tokens, n_tokens, anchor_lengths, anchor_keys, n_anchors)
            parent = info.parent if info.has_parent else None
            media = {name for i, name in enumerate(self._media_names) if info.media >> i & 1}
            block = _Block(info.hash, parent, tuple(ffi.unpack(tokens, n_tokens)), bool(info.lora), "", StorageTier(info.tier))
            block.media = media
            block.attached = bool(info.attached)
            block.start = info.start
            block.path_tier = StorageTier(info.path_tier)
            if n_anchors:
                block.anchors = list(zip(ffi.unpack(anchor_lengths, n_anchors), ffi.unpack(anchor_keys, n_anchors)))
                for length, key in block.anchors:
                    holders.setdefault(key, {})[(block.hash, length)] = block.path_tier
            blocks[block.hash] = block
            sibling_order.append((info.sibling_seq, block.hash, parent))
            if info.detached:
                detached.append((info.detached_seq, block.hash))
        children: dict[BlockHash | None, dict[BlockHash, None]] = {}
        for _, block_hash, parent in sorted(sibling_order):
            children.setdefault(parent, {})[block_hash] = None
        py._blocks = blocks
        py._children = children
        py._detached = OrderedDict((block_hash, None) for _, block_hash in sorted(detached))
        py._holders = holders
        keys, tiers, _ = self._registered_columns()
        py._registered = {key: _INDEX_TIERS[tier] for key, tier in zip(keys, tiers)}
        py.dropped_blocks = self.dropped_blocks
        py.ignored_removals = self.ignored_removals
        return py


