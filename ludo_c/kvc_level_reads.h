/* kvc_level_reads.h - one level's view reads for a chunk of region groups (internal).
 *
 * kvc_lookup_plan (ludo_plan.c) reads a prompt's keys level by level, every still-live group's
 * read of a level at once so their cache misses overlap (kvc_lookup_sparse, kvc_forward.c, does
 * the same from a list of its live groups). It gathers those reads here: for each live group ``first + i`` of the chunk, the level's key index
 * from ``level_keys`` (row-major, ``max_levels`` per group) names the key, and the key's shard
 * picks the view. A negative index (padding) or one past ``n_keys`` (a length longer than the
 * prompt) ends that group: ``alive[i]`` is cleared. Returns the number of reads gathered. */
#ifndef KVC_LEVEL_READS_H
#define KVC_LEVEL_READS_H

#include <stddef.h>
#include <stdint.h>

#include "ludo.h"

static inline __attribute__((always_inline)) size_t
kvc_gather_level_reads(const kvc_view *const *views, size_t shards, size_t groups, size_t first, size_t count,
                       size_t level, size_t max_levels, const int32_t *level_keys, const uint64_t *keys,
                       size_t n_keys, uint64_t *alive, const kvc_view **read_view, uint64_t *read_key,
                       size_t *read_group) {
    size_t reads = 0;
    for (size_t i = 0; i < count; i++) {
        if (!alive[i])
            continue;
        size_t g = first + i;
        int32_t k = level_keys[g * max_levels + level];
        if (k < 0 || (size_t)k >= n_keys) {
            alive[i] = 0; /* padding, or a length longer than the prompt: the group ends */
            continue;
        }
        uint64_t key = keys[k];
        read_view[reads] = views[(key % shards) * groups + g];
        read_key[reads] = key;
        read_group[reads] = i;
        reads++;
    }
    return reads;
}

#endif
