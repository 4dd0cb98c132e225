/*
 * ludo_plan.c -- the edge's per-request hot path in two C calls: the multi-level lookup over every
 * (shard, region group) view, and the joint score over every worker (kvcompassd issue 3).
 *
 * Built only on the public view API of ludo.h (kvc_view_lookup). No allocation, no global state:
 * the caller owns every buffer. Python reference implementations of both (kvcompassd.core.lookup
 * with native=False, JointScorer's numpy path) are tested equal to these.
 */
#include "ludo.h"
#include "kvc_score_term.h"
#include "kvc_level_reads.h"
#include "kvc_miss_term.h"

#include <math.h>

/* One bit per 2-bit field: the low bit of each field. */
#define KVC_FIELD_LOW_BITS 0x5555555555555555ULL
/* Groups read together, level by level (their early-stop state lives on the stack). */
#define KVC_PLAN_CHUNK_GROUPS 64

int kvc_lookup_plan(const kvc_view *const *views, size_t shards, size_t groups,
                    const uint64_t *keys, size_t n_keys,
                    const int64_t *level_lengths, const int32_t *level_keys, size_t max_levels,
                    const int32_t *worker_group, const uint8_t *worker_shift, size_t workers,
                    int consistency, uint64_t *values_out,
                    int64_t *matched_out, uint8_t *tier_out)
{
    if (shards == 0 || (groups != 0 && max_levels == 0))
        return KVC_ERR_ARG;
    /* Each worker's group and shift are checked where the decode below reads them (the reads
     * before it do not use them): a bad one returns KVC_ERR_ARG with the outputs unspecified. */

    /* Read every group's levels, shortest first, while they fit the prompt (keys in range).
     * Level by level across groups, so that consecutive reads are independent and their cache
     * misses overlap. `alive` holds, per group, the fields whose run of hits is still unbroken
     * (a field is a hit when either of its bits is set); under consistency a group whose fields
     * have all missed is not read further: longer levels cannot change any worker's result. */
    for (size_t i = 0; i < groups * max_levels; i++)
        values_out[i] = 0;
    uint64_t alive[KVC_PLAN_CHUNK_GROUPS];
    for (size_t first = 0; first < groups; first += KVC_PLAN_CHUNK_GROUPS) {
        size_t count = groups - first < KVC_PLAN_CHUNK_GROUPS ? groups - first : KVC_PLAN_CHUNK_GROUPS;
        for (size_t i = 0; i < count; i++)
            alive[i] = KVC_FIELD_LOW_BITS;
        uint32_t live[KVC_PLAN_CHUNK_GROUPS];
        size_t n_live = kvc_live_groups(alive, count, live);
        for (size_t level = 0; level < max_levels && n_live; level++) {
            /* This level's reads of the chunk's live groups, then all of them at once
             * (kvc_view_lookup_multi overlaps their cache misses). */
            const kvc_view *read_view[KVC_PLAN_CHUNK_GROUPS];
            uint64_t read_key[KVC_PLAN_CHUNK_GROUPS], read_value[KVC_PLAN_CHUNK_GROUPS];
            size_t read_group[KVC_PLAN_CHUNK_GROUPS];
            size_t reads = kvc_gather_level_reads(views, shards, groups, first, level, max_levels, level_keys, keys,
                                                  n_keys, NULL, 0, alive, live, &n_live, read_view, read_key,
                                                  read_group);
            if (!reads)
                break;
            kvc_view_lookup_multi(read_view, read_key, reads, read_value);
            for (size_t r = 0; r < reads; r++) {
                size_t i = read_group[r];
                uint64_t v = read_value[r];
                values_out[(first + i) * max_levels + level] = v;
                if (consistency)
                    alive[i] &= (v | (v >> 1)) & KVC_FIELD_LOW_BITS;
            }
        }
    }

    /* Per worker: the level its rule selects, and its 2-bit field there. */
    for (size_t w = 0; w < workers; w++) {
        if (worker_group[w] < 0 || (size_t)worker_group[w] >= groups || worker_shift[w] > 62 || (worker_shift[w] & 1))
            return KVC_ERR_ARG;
        size_t g = (size_t)worker_group[w];
        unsigned shift = worker_shift[w];
        const uint64_t *values = values_out + g * max_levels;
        size_t best = max_levels; /* none */
        unsigned field = 0;
        if (consistency) {
            for (size_t level = 0; level < max_levels; level++) {
                unsigned f = (unsigned)((values[level] >> shift) & 3u);
                if (!f)
                    break;
                best = level;
                field = f;
            }
        } else {
            for (size_t level = max_levels; level-- > 0;) {
                unsigned f = (unsigned)((values[level] >> shift) & 3u);
                if (f) {
                    best = level;
                    field = f;
                    break;
                }
            }
        }
        if (best < max_levels) {
            matched_out[w] = level_lengths[g * max_levels + best];
            tier_out[w] = (uint8_t)field;
        } else {
            matched_out[w] = 0;
            tier_out[w] = 0;
        }
    }
    return KVC_OK;
}

int64_t kvc_score_joint(size_t n, double prompt_len,
                        const double *wan, const double *beta, const double *queue,
                        const double *belief, const int64_t *matched, const uint8_t *tier,
                        const double *local_factor, const double *remote_penalty,
                        const uint8_t *eligible, double gamma, double lambda_max, double tau,
                        unsigned flags, double *scores_out, double *lam_out)
{
    /* The same operations in the same order as the numpy path (no contraction into FMAs under
     * -std=c11), so every score is bit-identical:
     *   s = WAN + Tq + c * L + min(b * m, L) * (gamma * [DRAM] - c),  c = beta * (1 + lam). */
    double lam = 0.0;
    if (flags & KVC_SCORE_LOAD_AWARE) {
        if (n > 0) {
            double low = queue[0];
            for (size_t i = 1; i < n; i++)
                if (queue[i] < low)
                    low = queue[i];
            double ratio = low / tau;
            lam = ratio < lambda_max ? ratio : lambda_max;
        } else {
            lam = lambda_max;
        }
    }
    *lam_out = lam;
    int scale = lam != 0.0; /* NaN counts as set, as Python's truth test does */
    for (size_t i = 0; i < n; i++) {
        double s = kvc_score_at(i, prompt_len, wan, beta, queue, belief, matched, tier, local_factor,
                                remote_penalty, eligible, gamma, scale, lam, flags);
        scores_out[i] = s;
    }
    /* numpy's argmin: the first minimum, or the first NaN if any. */
    if (n == 0)
        return -1;
    size_t best = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(scores_out[i])) {
            best = i;
            break;
        }
        if (scores_out[i] < scores_out[best])
            best = i;
    }
    return (int64_t)best;
}

unsigned kvc_miss_summary(size_t n, const int64_t *matched, const uint8_t *local,
                          const int64_t *floors, const double *scores, const double *queue,
                          size_t chosen)
{
    if (chosen >= n)
        return 0;
    kvc_miss_acc acc = kvc_miss_start(0, scores, queue, chosen);
    for (size_t i = 0; i < n; i++)
        kvc_miss_visit(&acc, i, matched, local, floors, scores, queue);
    return kvc_miss_finish(&acc);
}
