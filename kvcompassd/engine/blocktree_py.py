"""The Python implementation of :class:`kvcompassd.engine.blocktree.BlockTree`: trees with
``key_fn``, and salted trees once they meet what the C tree cannot hold (see that module
for the semantics). Also the reference the C tree is tested against."""

from __future__ import annotations

import hashlib
import itertools
import logging
import struct
import sys
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from kvcompassd.core.events import IndexEvent, PrefixCached, PrefixEvicted, Tier, TierChanged
from kvcompassd.engine.kvevents import (
    RUN_CLEARED,
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

log = logging.getLogger("kvcompassd.engine.blocktree")  # one logger for the tree, whichever module logs


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
    ``salt`` once a tree meets what the C tree cannot hold: see :class:`BlockTree` for the keys
    and the arguments). A salted tree keeps the SHA-256 state at blocks holding an indexed
    length, so each key hashes only the tokens since the nearest such ancestor."""

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
        usual store (one new page under an attached parent, nothing waiting under it) is applied
        inline here, anything else by ``_store_chain`` / ``_remove_hashes`` as an event's blocks are, and a run the
        mirror refuses (another KV-cache group, a partial block) is built as its event and
        refused as ``apply_events`` refuses it."""
        out: list[IndexEvent] = []
        lengths: list[int] = []
        touched: dict[int, int] = {}
        page_size = self._page_size
        blocks, children = self._blocks, self._children
        hashes, tokens = events.hashes, events.tokens
        media = events.canonical_media()
        for index, run in enumerate(events.runs):
            (kind, has_parent, has_lora_id, has_group, size, group_idx, parent, _, hash_start, hash_end, token_start,
             token_end, _, _, lora_name_off, _) = run
            if kind == RUN_REMOVED and not (has_group and group_idx):
                self._remove_hashes(hashes[hash_start:hash_end], media[index], touched)
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
        blocks, children = self._blocks, self._children
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
            self._forget(block)

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

