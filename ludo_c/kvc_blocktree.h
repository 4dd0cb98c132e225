/*
 * kvc_blocktree.h -- an engine's KV block tree mirrored in C, turned into index registrations
 * (the state and per-page work of kvcompassd.engine.blocktree.BlockTree with salted keys).
 *
 * The tree holds, per block: its hash (int64), its parent's, its tokens, the media holding it (a
 * bitmask of medium indices the caller names once with kvc_btree_set_medium_tier), whether it is
 * a LoRA block, its own tier, whether it is attached (its chain reaches a root), its start (tokens
 * before it) and path tier (the worst tier from the root to it), the (indexed length, key) pairs
 * it realises (its anchors) and, on anchored blocks, the SHA-256 state after salt + the path's
 * tokens through it. Beside the blocks: each parent hash's children in the order they were
 * stored, the detached blocks in the order they were detached (bounded: the oldest are dropped),
 * and per key its holders counted by tier, its indexed length and the tier announced for it.
 *
 * Keys equal kvcompassd.core.keys.prefix_keys(path tokens as uint32 little-endian, length, salt):
 * the first 8 bytes of SHA-256(salt || tokens[:length]), little-endian, masked to 63 bits.
 *
 * The semantics (which events are emitted, in what order, with what length; the log-worthy
 * cases) are exactly the Python BlockTree's; tests/test_blocktree_native.py holds the two equal.
 * An apply call emits index events (kvc_btree_events; valid until the next call) and notes
 * (kvc_btree_notes: a block re-stored with other content, a detached block dropped), which the
 * Python wrapper turns into IndexEvent objects and log lines. Not thread-safe (one tree, one
 * caller). On allocation failure a call returns -1 and the tree must be freed, not used.
 *
 * Everything between CDEF-BEGIN and CDEF-END is also fed to cffi's cdef: plain declarations only.
 */
#ifndef KVC_BLOCKTREE_H
#define KVC_BLOCKTREE_H

#include <stddef.h>
#include <stdint.h>

#include "kvc_kvevents.h"

/* CDEF-BEGIN */

enum kvc_btree_consts {
    KVC_BT_MAX_MEDIA = 32,      /* medium indices 0..31 */
    KVC_BT_OP_STORE = 1,        /* the same values as kvc_run_kind */
    KVC_BT_OP_REMOVE = 2,
    KVC_BT_OP_CLEAR = 3,
    KVC_BT_OP_HAS_PARENT = 4,
    KVC_BT_OP_LORA = 8,
    KVC_BT_OP_MEDIUM_SHIFT = 8,
    KVC_BT_CACHED = 0,          /* kvc_btree_event.kind: PrefixCached, TierChanged, PrefixEvicted */
    KVC_BT_CHANGED = 1,
    KVC_BT_EVICTED = 2,
    KVC_BT_NOTE_RESTORED = 1,   /* kvc_btree_note.code: re-stored with another parent or tokens */
    KVC_BT_NOTE_DROPPED = 2,    /* a detached block dropped at the bound */
    KVC_BT_BAD_INPUT = -2       /* kvc_btree_apply_ops / _runs: malformed ops or runs, nothing applied */
};

/* Storage tiers as kvcompassd.engine.kvevents.StorageTier: VRAM 1, DRAM 2, UNINDEXED 3.
 * Index tiers in events: 1 VRAM, 2 DRAM (an eviction carries 0). */

typedef struct kvc_btree kvc_btree;

/* One engine event, as the Python wrapper lays a list of event objects out (all int64 so the
 * wrapper fills them with one array('q'); ops take their hashes and tokens in turn from the
 * call's columns). flags: KVC_BT_OP_* in bits 0-1, KVC_BT_OP_HAS_PARENT, KVC_BT_OP_LORA, the
 * medium index from bit KVC_BT_OP_MEDIUM_SHIFT. A store's blocks are its n_hashes hashes, a chain
 * under `parent` (with KVC_BT_OP_HAS_PARENT) holding its n_tokens tokens, `size` per block (the
 * last may be short); a removal's blocks left the medium; a clear has neither hashes nor tokens. */
typedef struct {
    int64_t flags;
    int64_t parent;
    int64_t size;
    int64_t n_hashes;
    int64_t n_tokens;
} kvc_btree_op;

typedef struct {
    uint64_t key;      /* 63-bit prefix key */
    uint32_t length;   /* its indexed length (tokens) */
    uint8_t kind;      /* KVC_BT_CACHED, KVC_BT_CHANGED, KVC_BT_EVICTED */
    uint8_t tier;      /* 1 VRAM, 2 DRAM; 0 for an eviction */
    uint16_t pad;
} kvc_btree_event;

typedef struct {
    int64_t hash;
    int64_t code;      /* KVC_BT_NOTE_* */
} kvc_btree_note;

/* Counters and sizes. */
typedef struct {
    uint64_t blocks;            /* blocks mirrored */
    uint64_t detached;          /* of which detached */
    uint64_t dropped_blocks;    /* detached blocks dropped at the bound, ever */
    uint64_t ignored_removals;  /* removals of a block, or a medium, the tree did not hold */
    uint64_t registered;        /* keys announced */
} kvc_btree_stats;

/* A block as kvc_btree_block_at reads it (to move a tree's state to the Python implementation). */
typedef struct {
    int64_t hash;
    int64_t parent;
    uint64_t sibling_seq;   /* order among its parent's children (ascending = stored first) */
    uint64_t detached_seq;  /* order among detached blocks (when detached) */
    uint32_t start;
    uint32_t n_tokens;
    uint32_t media;         /* bitmask of medium indices */
    uint32_t n_anchors;
    uint8_t has_parent;
    uint8_t lora;
    uint8_t tier;
    uint8_t path_tier;
    uint8_t attached;
    uint8_t detached;       /* in the detached list */
} kvc_btree_block_info;

/* A tree with `lengths` (ascending, distinct, > 0) indexed, keys salted with `salt`, at most
 * `max_detached` detached blocks. NULL when out of memory. */
kvc_btree *kvc_btree_new(const uint32_t *lengths, size_t n_lengths, const uint8_t *salt, size_t salt_len,
                         uint64_t max_detached);
void kvc_btree_free(kvc_btree *tree);

/* Medium `medium` (< KVC_BT_MAX_MEDIA) is of storage tier `tier` (1..3). Set before first use. */
void kvc_btree_set_medium_tier(kvc_btree *tree, uint32_t medium, uint32_t tier);

/* Apply `n` ops over the columns `hashes` (n_hashes) and `tokens` (n_tokens). diff_each: each
 * op's own index events in turn (as BlockTree.apply on each); else one net diff at the end (and
 * before each clear), as BlockTree.apply_events. Returns the number of index events emitted, -1
 * when out of memory, or -2 with nothing applied when the ops are malformed: an unknown kind, a
 * medium index of KVC_BT_MAX_MEDIA or more, negative counts, counts past the columns, or a
 * store's block size outside 1..2^32-1. */
int64_t kvc_btree_apply_ops(kvc_btree *tree, const kvc_btree_op *ops, size_t n, const int64_t *hashes,
                            size_t n_hashes, const uint32_t *tokens, size_t n_tokens, int diff_each);

/* Medium index `medium` is also what the engine writes as the `len` bytes `raw` (its name as sent,
 * before any canonical spelling; `absent` 1 for a null or absent medium, then raw is unused).
 * For kvc_btree_apply_runs without `media`. Returns 0, or -1 when the table (64 names of up to
 * 48 bytes) cannot take it. */
int kvc_btree_name_medium(kvc_btree *tree, const uint8_t *raw, size_t len, int absent, uint32_t medium);

/* Apply a scanned payload's runs (kvc_kvevents_scan's output over `data`, with its n_hashes
 * hashes and n_tokens tokens). Run i's medium is media[i], or with `media` NULL the index named
 * for its raw name in `data` (kvc_btree_name_medium): when a run's name is not named, nothing is
 * applied and -3 - i is returned. A run of another KV-cache group, or a store whose block_size is
 * not `page_size` (when page_size > 0), is not applied: refused[i] is set to 1 (else 0) for the
 * caller to log. Runs are checked before anything applies: an unknown kind, a slice out of order
 * or past its column, a medium name past `data_len`, a media[i] of KVC_BT_MAX_MEDIA or more, or a
 * store's block_size of 0 returns -2.
 * diff_each and the result otherwise as kvc_btree_apply_ops. */
int64_t kvc_btree_apply_runs(kvc_btree *tree, const kvc_event_run *runs, size_t n, const int64_t *hashes,
                             size_t n_hashes, const uint32_t *tokens, size_t n_tokens, const uint8_t *media,
                             const uint8_t *data, size_t data_len, uint32_t page_size, uint8_t *refused,
                             int diff_each);

/* Forget every block; an eviction for every announced key, in the order they were announced,
 * with their lengths. Returns the number of events (or -1). */
int64_t kvc_btree_withdraw_all(kvc_btree *tree);

/* The last call's events and notes (valid until the next apply or withdraw call). */
const kvc_btree_event *kvc_btree_events(const kvc_btree *tree);
size_t kvc_btree_note_count(const kvc_btree *tree);
const kvc_btree_note *kvc_btree_notes(const kvc_btree *tree);

void kvc_btree_get_stats(const kvc_btree *tree, kvc_btree_stats *out);

/* Queries. kvc_btree_block_state: -1 absent, 0 detached, 1 attached. */
int kvc_btree_block_state(const kvc_btree *tree, int64_t hash);

/* Announced keys in the order they were announced: up to `cap` keys, tiers and lengths (0 when
 * no block holds the key any more). Returns the number of announced keys. */
size_t kvc_btree_registered(const kvc_btree *tree, uint64_t *keys, uint8_t *tiers, uint32_t *lengths, size_t cap);

/* Detached blocks' hashes, oldest first (up to `cap`); returns how many there are. */
size_t kvc_btree_detached(const kvc_btree *tree, int64_t *hashes, size_t cap);

/* Block slots: 0 <= slot < kvc_btree_slot_count. kvc_btree_block_at fills `info` (and up to
 * `token_cap` tokens, `anchor_cap` anchor lengths and keys) for a live slot and returns 1, or
 * returns 0 for a free slot. */
size_t kvc_btree_slot_count(const kvc_btree *tree);
int kvc_btree_block_at(const kvc_btree *tree, size_t slot, kvc_btree_block_info *info, uint32_t *tokens,
                       size_t token_cap, uint32_t *anchor_lengths, uint64_t *anchor_keys, size_t anchor_cap);

/* CDEF-END */

#endif /* KVC_BLOCKTREE_H */
