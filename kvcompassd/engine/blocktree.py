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

import logging
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence

from kvcompassd.core.events import IndexEvent, Tier
from kvcompassd.engine.blocktree_native import _NativeTree, _Unsupported
from kvcompassd.engine.blocktree_py import KeyFn, _PythonTree
from kvcompassd.engine.kvevents import (
    BlockHash,
    EventBatch,
    KvEvent,
)

log = logging.getLogger(__name__)


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

