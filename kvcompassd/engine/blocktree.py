"""Mirror of an engine's KV block tree, turned into index registrations (sans-IO).

Each block is hash -> (parent hash, its tokens, the media holding it). A block is *attached*
when its whole chain reaches the root; only attached blocks count, because an engine reuses a
prefix only up to its first missing block. An indexed length ``L`` (a token count) is realised
by the attached block holding token ``L - 1``; its prefix key is ``key_fn(path_tokens, [L])``
and its tier is the WORST tier on the path from the root to that block (a prefix half in VRAM
and half in DRAM must be reloaded: it is a DRAM hit). The block's own tier is the best medium
holding it (a block copied to host and still on the GPU is a VRAM hit). A key realised by
several blocks (the same tokens under two LoRA ids, say) takes the best of them.

Blocks whose parent is unknown (stored after a gap, or orphaned because their parent was
removed) are kept *detached*: they are attached, and registered, as soon as the parent is
stored (again). Detached blocks are bounded; the oldest are dropped with a log line.

With salted keys (the agent's and the simulator's trees) the state and the per-page work are in
C (ludo_c/kvc_blocktree.c: one call per batch, the index events handed back as columns); the
Python implementation below serves ``key_fn`` trees and any salted tree that meets what the C
tree cannot hold, which then moves there whole.

Only changes are emitted: PrefixCached when a key gains its first indexed tier, TierChanged
when that tier changes, PrefixEvicted when it loses the last one. LoRA blocks and blocks only on
disk/remote media are mirrored but never registered.

What the engines send beyond plain blocks, deliberately:

- **LoRA** (``lora_id`` or ``lora_name`` set; vLLM sends both, SGLang ``lora_id``): mirrored,
  never registered. The index keys a prefix by model and tokens only; an adapter's KV differs
  from the base model's for the same tokens, so registering it would send base-model prompts
  to a cache they cannot reuse.
- **KV-cache groups** (vLLM's ``group_idx``, hybrid models: full attention plus sliding window
  or Mamba layers): only group 0 (or no group) is mirrored; other groups' stores and removals
  are refused with a log line per group. vLLM names a block by the same hash in every group,
  so mixing groups would let one group's removal erase another's block. Group 0 is vLLM's
  first (full-attention) group; a prefix a sliding-window group dropped is then still
  claimed, which the edges' cache belief absorbs.
- **Partial blocks** (vLLM's partial prefix entries: ``block_size`` below its page size): with
  ``page_size`` given, a store whose ``block_size`` differs from it is refused with a log line.
  Such an entry is a second name for tokens of a block already stored; the tree's blocks are
  pages of ``page_size`` tokens and the indexed lengths are counted in them.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import struct
import sys
import weakref
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from kvcompassd.core._ludo_cffi import ffi, lib
from kvcompassd.core.events import IndexEvent, PrefixCached, PrefixEvicted, Tier, TierChanged
from kvcompassd.engine.kvevents import (
    RUN_CLEARED,
    RUN_MEDIUM_LEN,
    RUN_MEDIUM_OFF,
    RUN_REMOVED,
    RUN_STORED,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
    ScannedEvents,
    StorageTier,
    canonical_medium,
    tier_of_medium,
)

log = logging.getLogger(__name__)

KeyFn = Callable[[np.ndarray, Sequence[int]], Sequence[int]]
"""``key_fn(tokens, lengths) -> keys``: ``tokens`` is a uint32 array holding at least
``max(lengths)`` tokens, ``lengths`` ascending; one 63-bit key per length."""

_AnchorId = tuple[BlockHash, int]
_KEY_MASK = (1 << 63) - 1  # kvcompassd.core.keys.KEY_MASK (the engine layer does not import core keys)
_first_u64_le = struct.Struct("<Q").unpack_from  # a digest's first 8 bytes, without slicing them off
_NATIVE_U32_LE = sys.byteorder == "little" and array("I").itemsize == 4
_VRAM = StorageTier.VRAM  # enum member lookups are not free on the per-block path
_UNINDEXED = StorageTier.UNINDEXED
_NO_ANCHORS: tuple[tuple[int, int], ...] = ()


_MEDIUM_TIERS: dict[str, StorageTier] = {}
_INDEX_TIER = {t: t.index_tier() for t in StorageTier}  # StorageTier.index_tier, without its call


def _medium_tier(medium: str) -> StorageTier:
    """``tier_of_medium`` memoised (media names come from the engine: keep at most 64)."""
    tier = _MEDIUM_TIERS.get(medium)
    if tier is None:
        tier = tier_of_medium(medium)
        if len(_MEDIUM_TIERS) < 64:
            _MEDIUM_TIERS[medium] = tier
    return tier


def _token_bytes(tokens: tuple[int, ...]) -> bytes:
    """Tokens as uint32 little-endian bytes (array() is ~5x cheaper than numpy for one block)."""
    if _NATIVE_U32_LE:
        return array("I", tokens).tobytes()
    return np.asarray(tokens, dtype="<u4").tobytes()


class _Block:
    __slots__ = ("hash", "parent", "tokens", "media", "lora", "tier", "attached", "start", "path_tier", "anchors",
                 "hash_state")

    def __init__(self, block_hash: BlockHash, parent: BlockHash | None, tokens: tuple[int, ...], lora: bool,
                 medium: str, tier: StorageTier) -> None:
        self.hash = block_hash
        self.parent = parent
        self.tokens = tokens
        self.media: set[str] = {medium}
        self.lora = lora
        # own_tier() as of the last change of media (read once per attach and per refresh);
        # the caller passes it for the new block's one medium (the same for a whole event)
        self.tier = tier
        self.attached = False
        self.start = 0  # tokens before this block (valid while attached)
        self.path_tier = _VRAM
        # (indexed length, key) realised by this block; replaced, never changed in place, so
        # the blocks holding none (most) share one empty tuple
        self.anchors: Sequence[tuple[int, int]] = _NO_ANCHORS
        # Salted mode only: SHA-256 state after salt + the path's tokens through this block.
        # Kept on attached blocks that hold anchors, so a key below costs only the tokens since
        # the nearest such ancestor (not the whole path).
        self.hash_state: hashlib._Hash | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def own_tier(self) -> StorageTier:
        """The best tier of ``media`` (``tier`` holds it: call after changing media)."""
        if self.lora:
            return _UNINDEXED
        media = self.media
        if len(media) == 1:  # the usual case: skip min() over a generator
            for medium in media:
                return _medium_tier(medium)
        return min(map(_medium_tier, media))


class _PythonTree:
    """One worker's block mirror in Python (BlockTree's implementation with ``key_fn``, and with
    ``salt`` once a tree meets what the C tree cannot hold: see :class:`BlockTree`).

    Keys come either from ``key_fn`` (any function of the path's tokens) or, given ``salt``,
    are ``kvcompassd.core.keys.prefix_keys(path, lengths, salt)`` computed incrementally: the
    SHA-256 state is kept at blocks holding an indexed length, so each key hashes only the
    tokens since the nearest such ancestor. Pass exactly one of the two."""

    def __init__(
        self,
        worker: str,
        indexed_lengths: Sequence[int],
        key_fn: KeyFn | None = None,
        *,
        salt: bytes | None = None,
        max_detached_blocks: int = 100_000,
        page_size: int | None = None,
    ) -> None:
        if (key_fn is None) == (salt is None):
            raise ValueError("pass exactly one of key_fn and salt")
        if salt is not None and not isinstance(salt, bytes):
            raise ValueError(f"salt must be bytes, got {type(salt).__name__}")
        lengths = list(indexed_lengths)
        if any(not isinstance(n, int) or n <= 0 for n in lengths) or lengths != sorted(set(lengths)):
            raise ValueError(f"indexed_lengths must be ascending distinct positive ints, got {lengths}")
        if max_detached_blocks < 0:
            raise ValueError("max_detached_blocks must be >= 0")
        self.worker = worker
        self.indexed_lengths = lengths
        self._key_fn = key_fn
        self._root_state = hashlib.sha256(salt) if salt is not None else None
        # Salted keys are 63-bit by construction, tiers come from index_tier(): with a valid
        # worker id, the index events need no validation per event (it was 15 % of this mirror's
        # time in the simulator). key_fn's keys are the caller's, so they stay validated.
        self._trusted_events = salt is not None and isinstance(worker, str) and bool(worker)
        self._max_detached = max_detached_blocks
        self._blocks: dict[BlockHash, _Block] = {}
        # each parent's children in the order they were stored (a dict as an ordered set: the order
        # decides which detached blocks are oldest when a subtree is detached)
        self._children: dict[BlockHash | None, dict[BlockHash, None]] = {}
        self._detached: OrderedDict[BlockHash, None] = OrderedDict()
        self._holders: dict[int, dict[_AnchorId, StorageTier]] = {}
        self._registered: dict[int, Tier] = {}
        self.dropped_blocks = 0
        self.ignored_removals = 0
        self._page_size = page_size
        self.refused_events: dict[str, int] = {}  # why -> count (other KV groups, partial blocks)

    # ----------------------------------------------------------------------------- queries

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    @property
    def detached_count(self) -> int:
        return len(self._detached)

    def registered(self) -> dict[int, Tier]:
        """Key -> tier as announced so far (a copy)."""
        return dict(self._registered)

    def registered_with_lengths(self) -> dict[int, tuple[Tier, int]]:
        """Key -> (tier, indexed length) as announced so far (a re-registration's content)."""
        return {key: (tier, self._length_of(key)) for key, tier in self._registered.items()}

    def _length_of(self, key: int) -> int:
        """The indexed length of a registered key (the length of any block realising it: a key
        hashes its length's tokens, so every one has the same); 0 if none does."""
        holders = self._holders.get(key)
        if not holders:
            return 0
        for _, length in holders:
            return length
        return 0

    def is_attached(self, block_hash: BlockHash) -> bool:
        block = self._blocks.get(block_hash)
        return block is not None and block.attached

    # ----------------------------------------------------------------------------- updates

    def apply_batch(self, batch: EventBatch) -> list[IndexEvent]:
        out: list[IndexEvent] = []
        for event in batch.events:
            out.extend(self.apply(event))
        return out

    def apply_events(self, events: Iterable[KvEvent]) -> list[IndexEvent]:
        """Apply ``events`` in order in one pass and return the net change of the keys they
        touched (one diff at the end, not one per event): the same final state as ``apply``
        on each, and index events that take the registrations from where they were to where
        they are (a key stored and evicted within the events is not announced at all)."""
        return self.apply_events_with_lengths(events)[0]

    def apply_events_with_lengths(self, events: Iterable[KvEvent]) -> tuple[list[IndexEvent], list[int]]:
        """``apply_events``, and each index event's indexed length (what a maintenance unit
        filters the edge regions' streams by: kvcompassd.core.streams)."""
        if type(events) is ScannedEvents:
            return self._apply_scanned(events)
        out: list[IndexEvent] = []
        lengths: list[int] = []
        touched: dict[int, int] = {}
        page_size = self._page_size
        for event in events:
            kind = type(event)
            if kind is BlockStored:
                if event.group_idx or (page_size is not None and event.block_size != page_size):  # type: ignore[union-attr]
                    self._refuse(event)  # type: ignore[arg-type]
                else:
                    self._store(event, touched)  # type: ignore[arg-type]
            elif kind is BlockRemoved:
                if event.group_idx:  # type: ignore[union-attr]
                    self._refuse(event)  # type: ignore[arg-type]
                else:
                    self._remove(event, touched)  # type: ignore[arg-type]
            elif kind is AllBlocksCleared:
                if touched:
                    out.extend(self._diff(touched, lengths))
                    touched = {}
                withdrawn, withdrawn_lengths = self.withdraw_all_with_lengths()
                out.extend(withdrawn)
                lengths.extend(withdrawn_lengths)
            else:
                raise TypeError(f"not a KV event: {event!r}")
        if touched:
            out.extend(self._diff(touched, lengths))
        return out, lengths

    def _apply_scanned(self, events: ScannedEvents) -> tuple[list[IndexEvent], list[int]]:
        """``apply_events_with_lengths`` straight from a scanned payload's columns: each run's
        blocks are stored or removed from the flat hash and token lists, with no event object.
        The engines send one event per page, strictly alternating an eviction and a store once
        the cache is full, so coalescing leaves about one run per page; an object for each was
        most of the agent's decoding time, and a call for each most of this mirror's. So the
        usual run (one new page under an attached parent, nothing waiting under it; one page
        leaving its only medium, no child, no indexed length) is applied inline here, anything
        else by ``_store_chain`` / ``_remove_hashes`` as an event's blocks are, and a run the
        mirror refuses (another KV-cache group, a partial block) is built as its event and
        refused as ``apply_events`` refuses it."""
        out: list[IndexEvent] = []
        lengths: list[int] = []
        touched: dict[int, int] = {}
        page_size = self._page_size
        blocks, children, detached = self._blocks, self._children, self._detached
        hashes, tokens = events.hashes, events.tokens
        media = events.canonical_media()
        for index, run in enumerate(events.runs):
            (kind, has_parent, has_lora_id, has_group, size, group_idx, parent, _, hash_start, hash_end, token_start,
             token_end, _, _, lora_name_off, _) = run
            if kind == RUN_REMOVED and not (has_group and group_idx):
                medium = media[index]
                if hash_end - hash_start == 1:
                    block_hash = hashes[hash_start]
                    block = blocks.get(block_hash)
                    if block is not None and len(block.media) == 1 and medium in block.media and not block.anchors \
                            and block_hash not in children:
                        # the usual eviction, as _remove_hashes does it: a leaf leaving its one medium
                        del blocks[block_hash]
                        if detached:
                            detached.pop(block_hash, None)
                        siblings = children.get(block.parent)
                        if siblings is not None:
                            siblings.pop(block_hash, None)
                            if not siblings:
                                del children[block.parent]
                        continue
                self._remove_hashes(hashes[hash_start:hash_end], medium, touched)
            elif kind == RUN_STORED and not (has_group and group_idx) and (page_size is None or size == page_size):
                lora = bool(has_lora_id) or lora_name_off >= 0
                medium = media[index]
                if not has_parent:
                    parent = None
                if hash_end - hash_start == 1 and not lora:
                    block_hash = hashes[hash_start]
                    parent_block = blocks.get(parent) if parent is not None else None
                    if (parent is None or (parent_block is not None and parent_block.attached)) \
                            and block_hash not in blocks and block_hash not in children:
                        # the usual page, as _store_chain does it: new, under an attached parent
                        self._put_page(block_hash, parent, parent_block, tuple(tokens[token_start:token_end]),
                                       False, medium, _medium_tier(medium), touched)
                        continue
                self._store_chain(hashes[hash_start:hash_end], parent, tokens, token_start, token_end, size, lora,
                                  medium, touched)
            elif kind == RUN_CLEARED:
                if touched:
                    out.extend(self._diff(touched, lengths))
                    touched = {}
                withdrawn, withdrawn_lengths = self.withdraw_all_with_lengths()
                out.extend(withdrawn)
                lengths.extend(withdrawn_lengths)
            else:
                self._refuse(events.event(index))  # type: ignore[arg-type]
        if touched:
            out.extend(self._diff(touched, lengths))
        return out, lengths

    def apply_each(self, events: Iterable[KvEvent]) -> list[IndexEvent]:
        """``apply`` on each event in turn, their index events concatenated: each event's own
        diff in order (not ``apply_events``' one net diff over all of them), so the same events,
        order and state as the loop. The event a prefix cache sends per page (one new unLoRA
        block stored under an attached parent, or as a root, nothing waiting under it) runs
        inlined when the keys are salted: ``_store``, ``_attach`` and ``_register_anchors``
        for one block were a call each per page, ~30 % of this mirror's time in the simulator
        (issue 31); registering the anchors and the diff stay calls, made only for a page that
        holds an indexed length."""
        out: list[IndexEvent] = []
        if self._root_state is None or not self._trusted_events:
            for event in events:
                out.extend(self.apply(event))
            return out
        blocks, children = self._blocks, self._children
        indexed = self.indexed_lengths
        n_indexed = len(indexed)
        page_size = self._page_size
        for event in events:
            if type(event) is not BlockStored or event.group_idx or event.lora_id is not None \
                    or event.lora_name is not None or (page_size is not None and event.block_size != page_size):
                out.extend(self.apply(event))
                continue
            hashes = event.block_hashes
            block_hash = hashes[0]
            if len(hashes) != 1 or block_hash in blocks or block_hash in children:  # not new, or blocks wait under it
                out.extend(self.apply(event))
                continue
            parent = event.parent_block_hash
            if parent is None:
                start, parent_tier = 0, _VRAM
            else:
                parent_block = blocks.get(parent)
                if parent_block is None or not parent_block.attached:
                    out.extend(self.apply(event))
                    continue
                start, parent_tier = parent_block.start + len(parent_block.tokens), parent_block.path_tier
            # _store: a new block, then _attach it (nothing waits under it)
            medium = canonical_medium(event.medium)
            tier = _medium_tier(medium)
            tokens = event.token_ids
            block = self._new_block(block_hash, parent, tokens, False, medium, tier)
            block.start = start
            path_tier = tier if tier > parent_tier else parent_tier
            block.path_tier = path_tier
            block.attached = True
            end = start + len(tokens)
            first = bisect_right(indexed, start)
            if first >= n_indexed or indexed[first] > end:
                continue  # no indexed length inside: nothing touched, no index event
            touched: dict[int, int] = {}
            self._register_anchors(block, touched, first)
            out.extend(self._diff(touched))
        return out

    def apply(self, event: KvEvent) -> list[IndexEvent]:
        touched: dict[int, int] = {}
        if isinstance(event, BlockStored):
            if event.group_idx or (self._page_size is not None and event.block_size != self._page_size):
                self._refuse(event)
                return []
            self._store(event, touched)
        elif isinstance(event, BlockRemoved):
            if event.group_idx:
                self._refuse(event)
                return []
            self._remove(event, touched)
        elif isinstance(event, AllBlocksCleared):
            return self.withdraw_all()
        else:
            raise TypeError(f"not a KV event: {event!r}")
        return self._diff(touched) if touched else []  # most blocks hold no indexed length

    def _refuse(self, event: BlockStored | BlockRemoved) -> None:
        if event.group_idx:
            why = f"KV-cache group {event.group_idx}"
        else:
            why = f"block_size {event.block_size} (pages are {self._page_size})"  # type: ignore[union-attr]
        count = self.refused_events.get(why, 0)
        if count == 0:
            log.warning("not indexing %s events of %s: only group 0 and whole pages are mirrored",
                        type(event).__name__, why)
        if count or len(self.refused_events) < 64:  # reasons come from the engine: bounded
            self.refused_events[why] = count + 1

    def withdraw_all(self) -> list[IndexEvent]:
        """Forget every block; PrefixEvicted for every registered key (AllBlocksCleared, restart)."""
        return self.withdraw_all_with_lengths()[0]

    def withdraw_all_with_lengths(self) -> tuple[list[IndexEvent], list[int]]:
        """``withdraw_all``, and each eviction's indexed length."""
        lengths = [self._length_of(key) for key in self._registered]
        out: list[IndexEvent] = [PrefixEvicted(self.worker, key) for key in self._registered]
        self._blocks.clear()
        self._children.clear()
        self._detached.clear()
        self._holders.clear()
        self._registered.clear()
        return out, lengths

    # ----------------------------------------------------------------------------- internals

    def _store(self, event: BlockStored, touched: dict[int, int]) -> None:
        tokens = event.token_ids
        self._store_chain(event.block_hashes, event.parent_block_hash, tokens, 0, len(tokens), event.block_size,
                          event.is_lora, canonical_medium(event.medium), touched)

    def _put_page(self, block_hash: int, parent: int | None, parent_block: _Block | None, tokens: tuple,
                  lora: bool, medium: str, tier: StorageTier, touched: dict[int, int]) -> _Block:
        """The usual page: a new block under an attached parent (or a root) with nothing waiting
        under it, attached at once. _new_block and _attach in one call (a call each per page
        were a third of this mirror's time on the gateway workload)."""
        block = self._blocks[block_hash] = _Block(block_hash, parent, tokens, lora, medium, tier)
        children = self._children
        siblings = children.get(parent)
        if siblings is None:
            children[parent] = {block_hash: None}
        else:
            siblings[block_hash] = None
        if parent_block is None:
            start, parent_tier = 0, _VRAM
        else:
            start, parent_tier = parent_block.start + len(parent_block.tokens), parent_block.path_tier
        block.start = start
        block.path_tier = tier if tier > parent_tier else parent_tier
        block.attached = True
        indexed = self.indexed_lengths
        first = bisect_right(indexed, start)  # the first indexed length past the block's start
        if first < len(indexed) and indexed[first] <= start + len(tokens):
            self._register_anchors(block, touched, first)
        # (else its anchors and hash state stay the new block's empty ones)
        return block

    def _store_chain(self, hashes: Sequence[BlockHash], parent: BlockHash | None, all_tokens: Sequence[int],
                     token_start: int, token_end: int, size: int, lora: bool, medium: str,
                     touched: dict[int, int]) -> None:
        """Store the chain ``hashes`` (each block's parent the previous one, the first's
        ``parent``) holding ``all_tokens[token_start:token_end]``, ``size`` per block (the last
        may be short): a BlockStored event's blocks, or a scanned run's."""
        tier = _UNINDEXED if lora else _medium_tier(medium)
        blocks_by_hash, children = self._blocks, self._children
        parent_block = blocks_by_hash.get(parent) if parent is not None else None
        cut = token_start
        for block_hash in hashes:
            tokens = tuple(all_tokens[cut : min(cut + size, token_end)])  # (a tuple's slice is one already)
            cut += size
            block = blocks_by_hash.get(block_hash)
            if block is None and (parent is None or (parent_block is not None and parent_block.attached)) \
                    and block_hash not in children:
                # What an engine sends per page: a new block under an attached parent (or a
                # root) with nothing waiting under it.
                block = self._put_page(block_hash, parent, parent_block, tokens, lora, medium, tier, touched)
            elif block is not None:
                if block.parent != parent or block.tokens != tokens:
                    # Same hash, different content: engines hash content, so this is a
                    # collision or a reused id. Keep what we mirror; the engine's next removal
                    # of this hash still applies.
                    log.warning("block %r re-stored with a different parent or tokens; kept the first", block_hash)
                before = block.tier
                block.media.add(medium)
                block.tier = block.own_tier()
                if block.attached and block.tier != before:
                    self._refresh_subtree(block, touched)
            else:
                block = self._new_block(block_hash, parent, tokens, lora, medium, tier)
                if parent is None or (parent_block is not None and parent_block.attached):
                    self._attach(block, touched)
                else:
                    self._mark_detached(block)
                    if block_hash not in blocks_by_hash:  # trimmed at once as the oldest detached block
                        block = None
            parent, parent_block = block_hash, block

    def _remove(self, event: BlockRemoved, touched: dict[int, int]) -> None:
        self._remove_hashes(event.block_hashes, canonical_medium(event.medium), touched)

    def _remove_hashes(self, hashes: Iterable[BlockHash], medium: str, touched: dict[int, int]) -> None:
        """The blocks ``hashes`` left ``medium`` (a BlockRemoved event's, or a scanned run's)."""
        blocks, children, detached = self._blocks, self._children, self._detached
        for block_hash in hashes:
            block = blocks.get(block_hash)
            if block is None or medium not in block.media:
                self.ignored_removals += 1
                continue
            media = block.media
            if len(media) > 1:
                before = block.tier
                media.discard(medium)
                block.tier = block.own_tier()
                if block.attached and block.tier != before:
                    self._refresh_subtree(block, touched)
                continue
            # Gone from every medium: its descendants stay mirrored but detached, waiting
            # for the block to be stored again.
            if block.attached:
                waiting = children.get(block_hash)
                if waiting:
                    # a copy: detaching trims the oldest detached blocks, which may be these children
                    for child_hash in list(waiting):
                        child = blocks.get(child_hash)
                        if child is not None:
                            self._detach_subtree(child, touched)
                if block.anchors:
                    self._withdraw_anchors(block, touched)
            # _forget, inlined (an evicted page is usually a leaf without anchors: this is all it costs)
            del blocks[block_hash]
            if detached:
                detached.pop(block_hash, None)
            siblings = children.get(block.parent)
            if siblings is not None:
                siblings.pop(block_hash, None)
                if not siblings:
                    del children[block.parent]

    def _forget(self, block: _Block) -> None:
        del self._blocks[block.hash]
        self._detached.pop(block.hash, None)
        siblings = self._children.get(block.parent)
        if siblings is not None:
            siblings.pop(block.hash, None)
            if not siblings:
                del self._children[block.parent]

    def _new_block(self, block_hash: BlockHash, parent: BlockHash | None, tokens: tuple[int, ...], lora: bool,
                   medium: str, tier: StorageTier) -> _Block:
        """A block the tree did not hold, mirrored and listed under its parent (not attached yet)."""
        block = self._blocks[block_hash] = _Block(block_hash, parent, tokens, lora, medium, tier)
        siblings = self._children.get(parent)
        if siblings is None:
            self._children[parent] = {block_hash: None}
        else:
            siblings[block_hash] = None
        return block

    def _mark_detached(self, block: _Block) -> None:
        self._detached[block.hash] = None
        self._trim_detached()

    def _attach(self, root: _Block, touched: dict[int, int]) -> None:
        """Attach ``root`` (its parent is attached or it is a root) and every detached
        descendant waiting under it."""
        blocks, children, detached = self._blocks, self._children, self._detached
        indexed = self.indexed_lengths
        n_indexed = len(indexed)
        stack = [root]
        while stack:
            block = stack.pop()
            parent = blocks.get(block.parent) if block.parent is not None else None
            if parent is None:
                start = 0
                parent_tier = _VRAM
            else:
                start = parent.start + len(parent.tokens)  # parent.end
                parent_tier = parent.path_tier
            block.start = start
            own = block.tier
            block.path_tier = own if own > parent_tier else parent_tier  # max(), without its call
            block.attached = True
            if detached:
                detached.pop(block.hash, None)
            first = bisect_right(indexed, start)  # the first indexed length past the block's start
            if first < n_indexed and indexed[first] <= start + len(block.tokens):
                self._register_anchors(block, touched, first)
            else:  # no indexed length inside (most blocks): what _register_anchors would set
                block.anchors = _NO_ANCHORS
                block.hash_state = None
            waiting = children.get(block.hash)
            if waiting:
                for child_hash in waiting:
                    child = blocks.get(child_hash)
                    if child is not None and not child.attached:
                        stack.append(child)

    def _detach_subtree(self, root: _Block, touched: dict[int, int]) -> None:
        stack = [root]
        while stack:
            block = stack.pop()
            if not block.attached:
                continue
            self._withdraw_anchors(block, touched)
            block.attached = False
            self._detached[block.hash] = None
            for child_hash in self._children.get(block.hash, ()):
                stack.append(self._blocks[child_hash])
        self._trim_detached()

    def _trim_detached(self) -> None:
        while len(self._detached) > self._max_detached:
            oldest, _ = self._detached.popitem(last=False)
            log.warning("dropping detached block %r: its parent never arrived (limit %d)", oldest, self._max_detached)
            self.dropped_blocks += 1
            self._forget(self._blocks[oldest])

    def _refresh_subtree(self, root: _Block, touched: dict[int, int]) -> None:
        """Recompute path tiers below ``root`` after its own tier changed."""
        stack = [root]
        while stack:
            block = stack.pop()
            parent = self._blocks.get(block.parent) if block.parent is not None else None
            parent_tier = parent.path_tier if parent is not None else StorageTier.VRAM
            new_tier = max(parent_tier, block.tier)
            if new_tier == block.path_tier and block is not root:
                continue  # unchanged here, so unchanged below
            block.path_tier = new_tier
            for length, key in block.anchors:
                self._holders[key][(block.hash, length)] = new_tier
                touched[key] = length
            for child_hash in self._children.get(block.hash, ()):
                child = self._blocks[child_hash]
                if child.attached:
                    stack.append(child)

    def _register_anchors(self, block: _Block, touched: dict[int, int], first: int) -> None:
        """Register the indexed lengths inside ``block`` (at least one: ``indexed_lengths[first]``,
        the first past its start)."""
        indexed = self.indexed_lengths
        lengths = indexed[first : bisect_right(indexed, block.start + len(block.tokens), first)]
        if self._root_state is not None:
            block.anchors = self._salted_anchors(block, lengths)
        else:
            keys = self._key_fn(self._path_tokens(block), lengths)
            block.anchors = [(length, int(key)) for length, key in zip(lengths, keys, strict=True)]
        all_holders, tier, block_hash = self._holders, block.path_tier, block.hash
        for length, key in block.anchors:
            holders = all_holders.get(key)
            if holders is None:
                all_holders[key] = {(block_hash, length): tier}
            else:
                holders[(block_hash, length)] = tier
            touched[key] = length

    def _salted_anchors(self, block: _Block, lengths: Sequence[int]) -> list[tuple[int, int]]:
        """(length, key) for ``lengths`` inside ``block``, equal to ``prefix_keys`` over the
        path. Every attached ancestor holding a state got it when it was (re)attached, after
        its own ancestors, so the states it starts from describe the current path."""
        own = _token_bytes(block.tokens)
        between: list[bytes] = []
        node = self._blocks.get(block.parent) if block.parent is not None else None
        while node is not None and node.hash_state is None:
            between.append(_token_bytes(node.tokens))
            node = self._blocks.get(node.parent) if node.parent is not None else None
        state = (node.hash_state if node is not None else self._root_state).copy()  # type: ignore[union-attr]
        if between:
            between.reverse()
            state.update(b"".join(between))
        start = block.start
        anchors = []
        done = 0
        for length in lengths:
            cut = 4 * (length - start)
            state.update(own[done:cut])
            done = cut
            # digest() leaves the state as it was (hashlib finishes a copy): no copy made here
            anchors.append((length, _first_u64_le(state.digest())[0] & _KEY_MASK))
        state.update(own[done:])
        block.hash_state = state
        return anchors

    def _withdraw_anchors(self, block: _Block, touched: dict[int, int]) -> None:
        block.hash_state = None  # its path is changing; a re-attach recomputes it
        for length, key in block.anchors:
            holders = self._holders.get(key)
            if holders is not None:
                holders.pop((block.hash, length), None)
                if not holders:
                    del self._holders[key]
            touched[key] = length
        block.anchors = _NO_ANCHORS

    def _path_tokens(self, block: _Block) -> np.ndarray:
        parts: list[tuple[int, ...]] = []
        node: _Block | None = block
        while node is not None:
            parts.append(node.tokens)
            node = self._blocks.get(node.parent) if node.parent is not None else None
        parts.reverse()
        return np.fromiter(itertools.chain.from_iterable(parts), dtype=np.uint32, count=block.end)

    def _diff(self, touched: dict[int, int], lengths: list[int] | None = None) -> list[IndexEvent]:
        """Index events taking the touched keys (key -> indexed length) from what was announced
        to what the mirror holds now; their lengths appended to ``lengths`` if given."""
        out: list[IndexEvent] = []
        worker, registered, all_holders = self.worker, self._registered, self._holders
        if self._trusted_events:
            evicted, cached, changed = PrefixEvicted.trusted, PrefixCached.trusted, TierChanged.trusted
        else:
            evicted, cached, changed = PrefixEvicted, PrefixCached, TierChanged
        for key in sorted(touched) if len(touched) > 1 else touched:  # one key: most diffs
            holders = all_holders.get(key)
            new = _INDEX_TIER[min(holders.values()) if holders else _UNINDEXED]
            old = registered.get(key)
            if new == old:
                continue
            if new is None:
                del registered[key]
                out.append(evicted(worker, key))
            elif old is None:
                registered[key] = new
                out.append(cached(worker, key, new))
            else:
                registered[key] = new
                out.append(changed(worker, key, new))
            if lengths is not None:
                lengths.append(touched[key])
        return out


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
                                    ffi.from_buffer("int64_t[]", hashes or _EMPTY_I64),
                                    ffi.from_buffer("uint32_t[]", tokens or _EMPTY_U32), diff_each)
        out = self._results(n)
        for event in refused:
            self._refuse(event)
        if error is not None:
            raise error
        return out

    def _results(self, n: int) -> tuple[list[IndexEvent], list[int]]:
        """The last C call's index events and their lengths; its notes logged."""
        tree = self._tree
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
            n = lib.kvc_btree_apply_runs(self._tree, runs_in, n_runs, hashes_in, tokens_in, media, data, len(data),
                                         self._page_size or 0, ffi.from_buffer("uint8_t[]", refused), diff_each)
            if n >= -1:
                break
            run = events.runs[-2 - n]  # a medium not named yet (nothing was applied)
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


class BlockTree:
    """One worker's block mirror; feed it decoded events, get index events back.

    Keys come either from ``key_fn`` (any function of the path's tokens) or, given ``salt``,
    are ``kvcompassd.core.keys.prefix_keys(path, lengths, salt)`` computed incrementally: the
    SHA-256 state is kept at blocks holding an indexed length, so each key hashes only the
    tokens since the nearest such ancestor. Pass exactly one of the two.

    With ``salt`` the tree's state and per-page work are in C (ludo_c/kvc_blocktree.c, one call
    per batch); with ``key_fn`` in Python. A salted tree that meets what the C tree cannot hold
    (a bytes or out-of-range block hash, more than 32 media) moves its whole state to the Python
    implementation for good, so the state is always in one place. Both give the same index
    events in the same order (tests/test_blocktree_native.py)."""

    def __init__(
        self,
        worker: str,
        indexed_lengths: Sequence[int],
        key_fn: KeyFn | None = None,
        *,
        salt: bytes | None = None,
        max_detached_blocks: int = 100_000,
        page_size: int | None = None,
        native: bool = True,
    ) -> None:
        """``native=False`` keeps a salted tree in Python (a reference for tests and benchmarks)."""
        python = _PythonTree(worker, indexed_lengths, key_fn, salt=salt, max_detached_blocks=max_detached_blocks,
                             page_size=page_size)
        self.worker = python.worker
        self.indexed_lengths = python.indexed_lengths
        if salt is not None and native and all(n < (1 << 32) for n in python.indexed_lengths):
            self._use(_NativeTree(python, salt))
        else:
            self._use(python)

    def _use(self, impl: _PythonTree | _NativeTree) -> None:
        self._impl = impl
        self._native = type(impl) is _NativeTree
        # the calls, bound once (no delegation per call); a native tree's wrapped to move on
        for name in ("apply", "apply_each", "apply_batch", "apply_events", "apply_events_with_lengths",
                     "withdraw_all", "withdraw_all_with_lengths"):
            method = getattr(impl, name)
            setattr(self, name, self._falling_back(name, method) if self._native else method)

    def _falling_back(self, name: str, method: Callable) -> Callable:
        impl = self._impl
        owner = weakref.ref(self)  # (no cycle through the instance's dict: trees are freed by refcount)

        def call(*args):
            tree = owner()
            if tree is None:  # (a call kept past its tree: the state is still the native one)
                return method(*args)
            if tree._impl is not impl:  # (a reference kept from before the state moved to Python)
                return getattr(tree, name)(*args)
            try:
                return method(*args)
            except _Unsupported as why:
                log.info("block tree of %s moves to Python: %s", tree.worker, why)
                tree._use(impl.to_python())
                return getattr(tree, name)(*args)
        call.__doc__ = method.__doc__
        return call

    # The calls (bound per instance by _use; these document them and serve the class itself).

    def apply(self, event: KvEvent) -> list[IndexEvent]:
        """``event``'s index events."""
        return self._impl.apply(event)

    def apply_each(self, events: Iterable[KvEvent]) -> list[IndexEvent]:
        """``apply`` on each event in turn, their index events concatenated: each event's own
        diff in order (not ``apply_events``' one net diff over all of them)."""
        return self._impl.apply_each(events)

    def apply_batch(self, batch: EventBatch) -> list[IndexEvent]:
        return self._impl.apply_batch(batch)

    def apply_events(self, events: Iterable[KvEvent]) -> list[IndexEvent]:
        """Apply ``events`` in order in one pass and return the net change of the keys they
        touched (one diff at the end, and before each AllBlocksCleared)."""
        return self._impl.apply_events(events)

    def apply_events_with_lengths(self, events: Iterable[KvEvent]) -> tuple[list[IndexEvent], list[int]]:
        """``apply_events``, and each index event's indexed length."""
        return self._impl.apply_events_with_lengths(events)

    def withdraw_all(self) -> list[IndexEvent]:
        """Forget every block; PrefixEvicted for every registered key (AllBlocksCleared, restart)."""
        return self._impl.withdraw_all()

    def withdraw_all_with_lengths(self) -> tuple[list[IndexEvent], list[int]]:
        return self._impl.withdraw_all_with_lengths()

    # ----------------------------------------------------------------------------- queries

    def __len__(self) -> int:
        return len(self._impl)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._impl

    def is_attached(self, block_hash: BlockHash) -> bool:
        return self._impl.is_attached(block_hash)

    @property
    def detached_count(self) -> int:
        return self._impl.detached_count

    @property
    def dropped_blocks(self) -> int:
        return self._impl.dropped_blocks

    @property
    def ignored_removals(self) -> int:
        return self._impl.ignored_removals

    @property
    def refused_events(self) -> dict[str, int]:
        return self._impl.refused_events

    @property
    def is_native(self) -> bool:
        """The state is in C (else in Python)."""
        return self._native

    def registered(self) -> dict[int, Tier]:
        """Key -> tier as announced so far (a copy)."""
        return self._impl.registered()

    def registered_with_lengths(self) -> dict[int, tuple[Tier, int]]:
        """Key -> (tier, indexed length) as announced so far (a re-registration's content)."""
        return self._impl.registered_with_lengths()

    @property
    def _blocks(self) -> Iterable[BlockHash]:
        """The mirrored blocks' hashes (for tests)."""
        return self._impl.block_hashes() if self._native else self._impl._blocks  # type: ignore[union-attr]

    @property
    def _detached(self) -> Sequence[BlockHash]:
        """The detached blocks' hashes, oldest first (for tests)."""
        return self._impl.detached_hashes() if self._native else self._impl._detached  # type: ignore[union-attr]


def lengths_covered(indexed_lengths: Sequence[int], tokens: int) -> list[int]:
    """The indexed lengths a prefix of ``tokens`` tokens covers."""
    return list(indexed_lengths[: bisect_left(indexed_lengths, tokens + 1)])
