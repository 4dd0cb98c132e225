/*
 * kvc_arena.h -- edge views' memory on transparent huge pages.
 *
 * An edge at thousands of workers holds tens of thousands of small views (one per shard and
 * region group), and one decision reads about a thousand of them at random: with 4 KiB pages
 * nearly every read also misses the TLB. While the arena is on, a view's arrays (and the view
 * itself) come from 32 MiB chunks advised MADV_HUGEPAGE, so the views of a whole edge span a few
 * hundred TLB entries. Blocks are 64-byte aligned, sized in 64-byte steps up to 256 KiB (larger
 * arrays keep kvc_alloc, which advises huge pages itself from 2 MiB); a freed block is kept for
 * the next block of its size (views are rebuilt at the sizes they had: a snapshot of the same
 * table, a table grown to the next size another view had), and chunks are never returned.
 * Off (the default) every call is kvc_alloc / free. Thread-safe.
 */
#ifndef KVC_ARENA_H
#define KVC_ARENA_H

#include <stddef.h>
#include <stdint.h>

/* CDEF-BEGIN */

/* Turn the arena on (1) or off (0) for views made from now on; returns the previous setting.
 * A block is freed where it came from whichever the setting is then. */
int kvc_arena_set_enabled(int enabled);

/* What the arena holds: chunk bytes reserved, bytes in live blocks, bytes in freed blocks kept;
 * whether views are made in it now. */
typedef struct kvc_arena_stats {
    uint64_t enabled;
    uint64_t reserved;
    uint64_t live;
    uint64_t kept;
    uint64_t chunks;
} kvc_arena_stats;

void kvc_arena_get_stats(kvc_arena_stats *out);

/* CDEF-END */

/* Internal: a block of `bytes` (zeroed if `zero`), and its release with the same size. */
void *kvc_arena_alloc(size_t bytes, int zero);
void kvc_arena_free(void *p, size_t bytes);

#endif /* KVC_ARENA_H */
