/* kvc_level_reads.h - one level's view reads for a chunk of region groups (internal).
 *
 * kvc_lookup_plan (ludo_plan.c) and kvc_lookup_sparse (kvc_forward.c) read a prompt's keys level
 * by level, every still-live group's read of a level at once so their cache misses overlap. They
 * gather those reads here, from a list of the chunk's live groups ``live[0..*n_live)`` (indexes
 * into the chunk, in group order; kvc_live_groups makes it), so no level passes over every group
 * of the chunk. For each listed group ``first + i`` still ``alive``, the level's key index from
 * ``level_keys`` (row-major, ``max_levels`` per group) names the key, and the key's shard picks
 * the view: its row ``(key % shards) * groups``, taken from ``key_row`` for the first ``rows`` key
 * indexes (computed once per prompt) and divided out for the rest. A negative index (padding) or
 * one past ``n_keys`` (a length longer than the prompt) ends that group: ``alive[i]`` is cleared.
 * The list keeps the groups read at this level, in order. Returns the number of reads gathered. */
#ifndef KVC_LEVEL_READS_H
#define KVC_LEVEL_READS_H

#include <stddef.h>
#include <stdint.h>

#include "ludo.h"

/* The chunk's groups with a live field, in group order; returns how many. */
static inline __attribute__((always_inline)) size_t kvc_live_groups(const uint64_t *alive, size_t count,
                                                                   uint32_t *live)
{
    size_t n_live = 0;
    for (size_t i = 0; i < count; i++)
        if (alive[i])
            live[n_live++] = (uint32_t)i;
    return n_live;
}

static inline __attribute__((always_inline)) size_t
kvc_gather_level_reads(const kvc_view *const *views, size_t shards, size_t groups, size_t first, size_t level,
                       size_t max_levels, const int32_t *level_keys, const uint64_t *keys, size_t n_keys,
                       const size_t *key_row, size_t rows, uint64_t *alive, uint32_t *live, size_t *n_live,
                       const kvc_view **read_view, uint64_t *read_key, size_t *read_group)
{
    size_t reads = 0, kept = 0;
    for (size_t j = 0; j < *n_live; j++) {
        size_t i = live[j];
        if (!alive[i])
            continue;
        size_t g = first + i;
        int32_t k = level_keys[g * max_levels + level];
        if (k < 0 || (size_t)k >= n_keys) {
            alive[i] = 0; /* padding, or a length longer than the prompt: the group ends */
            continue;
        }
        live[kept++] = (uint32_t)i;
        size_t row = (size_t)k < rows ? key_row[k] : (size_t)(keys[k] % shards) * groups;
        read_view[reads] = views[row + g];
        read_key[reads] = keys[k];
        read_group[reads] = i;
        reads++;
    }
    *n_live = kept;
    return reads;
}

#endif
