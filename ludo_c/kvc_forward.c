/*
 * kvc_forward.c -- the fused forwarding decision (see kvc_forward.h).
 */
#include "kvc_forward.h"

#include "kvc_keys.h"
#include "kvc_score_term.h"
#include "kvc_miss_term.h"
#include "kvc_level_reads.h"

#include <math.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

int kvc_forward_decide(const kvc_forward_plan *plan, const uint8_t *token_bytes, size_t n_tokens,
                       const double *queue, const double *belief, const uint8_t *eligible,
                       const int64_t *last_sent, uint64_t *keys_out, int64_t *matched_out,
                       uint8_t *tier_out, double *scores_out, kvc_forward_result *result)
{
    size_t workers = plan->workers;
    if (workers == 0)
        return KVC_ERR_ARG;
    /* The query lengths that fit the prompt (ascending: a prefix of them). */
    size_t n_keys = 0;
    while (n_keys < plan->n_query && plan->query_lengths[n_keys] <= (int64_t)n_tokens)
        n_keys++;
    int rc = kvc_prefix_keys(plan->salt, plan->salt_len, token_bytes, n_tokens, plan->query_lengths, n_keys,
                             plan->sha_backend, keys_out);
    if (rc != KVC_OK)
        return rc;
    rc = kvc_lookup_plan(plan->views, plan->shards, plan->groups, keys_out, n_keys, plan->level_lengths,
                         plan->level_keys, plan->max_levels, plan->worker_group, plan->worker_shift, workers,
                         plan->consistency, plan->values_scratch, matched_out, tier_out);
    if (rc != KVC_OK)
        return rc;
    /* Exact ties would all go to the lowest index between load reports: the first of the least
     * recently sent wins. */
    int64_t chosen_index;
    int64_t best = kvc_score_choose(workers, (double)n_tokens, plan->wan, plan->beta, queue, belief, matched_out,
                                    tier_out, plan->local_factor, plan->remote_penalty, eligible, plan->gamma,
                                    plan->lambda_max, plan->tau, plan->score_flags, last_sent, scores_out,
                                    &result->lam, &chosen_index);
    size_t chosen = (size_t)chosen_index;
    result->best = best;
    result->chosen = chosen_index;
    result->n_keys = n_keys;
    result->miss = kvc_miss_summary(workers, matched_out, plan->local, plan->floors, scores_out, queue, chosen);
    int64_t family = plan->family_index;
    result->family = family >= 0 && (size_t)family < n_keys ? (int64_t)keys_out[family] : -1;
    return isfinite(scores_out[best]) ? KVC_OK : KVC_FORWARD_NONE_ELIGIBLE;
}

void kvc_queue_aged(size_t n, const double *ms, const double *taken_at, const double *rate, double now,
                    double *out)
{
    for (size_t i = 0; i < n; i++) {
        double age = (now - taken_at[i]) * 1000.0;
        age = 0.0 >= age ? 0.0 : age; /* np.maximum(0.0, age): a NaN age stays NaN */
        double value = ms[i] + rate[i] * age;
        out[i] = 0.0 >= value ? 0.0 : value;
    }
}

/* a ranks before b (a scanned after b, so only strictly better moves it up) */
static int kvc_top_before(double a, double b)
{
    return !isnan(a) && (isnan(b) || a < b);
}

size_t kvc_top_k(size_t n, const double *scores, size_t k, int64_t *out)
{
    size_t held = 0;
    for (size_t i = 0; i < n && k > 0; i++) {
        double s = scores[i];
        if (held == k && !kvc_top_before(s, scores[out[held - 1]]))
            continue;
        /* insert i after every held index it does not rank before (ties keep index order) */
        size_t at = held < k ? held : k - 1;
        while (at > 0 && kvc_top_before(s, scores[out[at - 1]])) {
            out[at] = out[at - 1];
            at--;
        }
        out[at] = (int64_t)i;
        if (held < k)
            held++;
    }
    return held;
}

/* The queue's least value as kvc_score_joint takes it: queue[0] if it is NaN, else the first
 * of the least non-NaN values (a strict `<` keeps the first of equals, which only shows for a
 * -0.0 and a 0.0); four independent lanes instead of one chain of dependent compares. */
static double kvc_queue_low(size_t n, const double *queue)
{
    double low = queue[0];
    if (isnan(low) || n < 8) {
        for (size_t i = 1; i < n; i++)
            if (queue[i] < low)
                low = queue[i];
        return low;
    }
    double lane[4] = {low, low, low, low};
    size_t i = 1;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++)
            if (queue[i + j] < lane[j])
                lane[j] = queue[i + j];
    for (; i < n; i++)
        if (queue[i] < lane[0])
            lane[0] = queue[i];
    low = lane[0];
    for (int j = 1; j < 4; j++)
        if (lane[j] < low)
            low = lane[j];
    if (low == 0.0) /* which zero: the first in index order */
        for (i = 0; i < n; i++)
            if (queue[i] == 0.0)
                return queue[i];
    return low;
}

/* One pass: each worker's score (kvc_score_joint's statement, operation for operation), the
 * running argmin and the running tie rotation. Inlined per flag combination, so each loop
 * carries no flag tests. */
static inline __attribute__((always_inline)) int64_t
kvc_score_choose_flags(size_t n, double prompt_len, const double *wan, const double *beta, const double *queue,
                       const double *belief, const int64_t *matched, const uint8_t *tier,
                       const double *local_factor, const double *remote_penalty, const uint8_t *eligible,
                       double gamma, double lam, const int64_t *last_sent, double *scores_out,
                       int64_t *chosen_out, const unsigned flags)
{
    int scale = lam != 0.0; /* NaN counts as set, as Python's truth test does */
    size_t best = 0, chosen = 0;
    double best_score = 0.0;
    int nan_seen = 0;
    for (size_t i = 0; i < n; i++) {
        double s = kvc_score_at(i, prompt_len, wan, beta, queue, belief, matched, tier, local_factor,
                                remote_penalty, eligible, gamma, scale, lam, flags);
        scores_out[i] = s;
        /* numpy's argmin (the first minimum, or the first NaN), and among the scores equal to
         * it the first with the least last_sent */
        if (nan_seen)
            continue;
        if (i == 0 || s < best_score) {
            best = chosen = i;
            best_score = s;
            if (isnan(s))
                nan_seen = 1;
        } else if (isnan(s)) {
            best = chosen = i;
            nan_seen = 1;
        } else if (last_sent && s == best_score && last_sent[i] < last_sent[chosen]) {
            chosen = i;
        }
    }
    *chosen_out = (int64_t)chosen;
    return (int64_t)best;
}

int64_t kvc_score_choose(size_t n, double prompt_len, const double *wan, const double *beta, const double *queue,
                         const double *belief, const int64_t *matched, const uint8_t *tier,
                         const double *local_factor, const double *remote_penalty, const uint8_t *eligible,
                         double gamma, double lambda_max, double tau, unsigned flags, const int64_t *last_sent,
                         double *scores_out, double *lam_out, int64_t *chosen_out)
{
    double lam = 0.0;
    if (flags & KVC_SCORE_LOAD_AWARE) {
        if (n > 0) {
            double ratio = kvc_queue_low(n, queue) / tau;
            lam = ratio < lambda_max ? ratio : lambda_max;
        } else {
            lam = lambda_max;
        }
    }
    *lam_out = lam;
    if (n == 0) {
        *chosen_out = -1;
        return -1;
    }
#define KVC_SCORE_CHOOSE(F)                                                                                  \
    return kvc_score_choose_flags(n, prompt_len, wan, beta, queue, belief, matched, tier, local_factor,      \
                                  remote_penalty, eligible, gamma, lam, last_sent, scores_out, chosen_out, (F))
    switch (flags & 7u) {
    case 0: KVC_SCORE_CHOOSE(0);
    case 1: KVC_SCORE_CHOOSE(1);
    case 2: KVC_SCORE_CHOOSE(2);
    case 3: KVC_SCORE_CHOOSE(3);
    case 4: KVC_SCORE_CHOOSE(4);
    case 5: KVC_SCORE_CHOOSE(5);
    case 6: KVC_SCORE_CHOOSE(6);
    default: KVC_SCORE_CHOOSE(7);
    }
#undef KVC_SCORE_CHOOSE
}

/* ---- the sparse decision (see kvc_forward.h) ------------------------------------------------ */

/* One bit per 2-bit field: the low bit of each field. */
#define KVC_SPARSE_LOW_BITS 0x5555555555555555ULL
/* Groups read together, level by level (their state lives on the stack, ~56 bytes a group): a
 * fleet's groups in one chunk read each level in one round of overlapped misses, where two
 * chunks would take a round per level each. */
#define KVC_SPARSE_CHUNK 512
/* Keys whose view row (key % shards) * groups is computed once per lookup, not per read (a
 * 64-bit division each); a prompt with more keys divides per read past them. */
#define KVC_SPARSE_KEY_ROWS 1024
/* At most this many reads in all (every group at every level that fits): read them in one batch
 * rather than level by level. A small fleet's lookup is then one round of overlapped misses
 * instead of one per level; the reads an early stop would have saved are few, and the decode
 * reads the same values either way. */
#define KVC_SPARSE_ONE_BATCH 64

/* Give the fields of `fields` (low bits of 2-bit fields) of group g their match at `level`.
 * Returns the holders written so far, or SIZE_MAX once they would pass `workers` (a field_worker
 * map naming one worker twice: refused rather than written past holders_out's end). */
static size_t kvc_sparse_assign(uint64_t fields, size_t g, size_t level, uint64_t value, const int32_t *field_worker,
                                const int64_t *level_lengths, size_t max_levels, int64_t *matched_out,
                                uint8_t *tier_out, int32_t *holders_out, size_t held, size_t workers)
{
    int64_t length = level_lengths[g * max_levels + level];
    while (fields) {
        unsigned bit = (unsigned)__builtin_ctzll(fields);
        fields &= fields - 1;
        int32_t w = field_worker[g * 32 + bit / 2];
        if (held >= workers) /* also SIZE_MAX: refused already */
            return SIZE_MAX;
        matched_out[w] = length;
        tier_out[w] = (uint8_t)((value >> bit) & 3u);
        holders_out[held++] = w;
    }
    return held;
}

int kvc_field_masks(const int32_t *field_worker, size_t groups, size_t workers, uint64_t *masks_out)
{
    for (size_t g = 0; g < groups; g++) {
        uint64_t fields = 0;
        for (unsigned f = 0; f < 32; f++) {
            int32_t w = field_worker[g * 32 + f];
            if (w < 0)
                continue;
            if ((size_t)w >= workers)
                return KVC_ERR_ARG;
            fields |= UINT64_C(1) << (2 * f);
        }
        masks_out[g] = fields;
    }
    return KVC_OK;
}

/* kvc_lookup_sparse, with each group's field mask from group_fields when given (kvc_field_masks:
 * computed once per edge) instead of from field_worker per call (32 entries per group: at 372
 * groups, ~60,000 instructions a decision). */
static int kvc_lookup_sparse_masked(const kvc_view *const *views, size_t shards, size_t groups,
                                    const uint64_t *keys, size_t n_keys,
                                    const int64_t *level_lengths, const int32_t *level_keys, size_t max_levels,
                                    const int32_t *field_worker, const uint64_t *group_fields, size_t workers,
                                    int consistency, uint64_t *values_scratch, int64_t *matched_out,
                                    uint8_t *tier_out, int32_t *holders_out, size_t *n_holders_out, int zeroed);

int kvc_lookup_sparse(const kvc_view *const *views, size_t shards, size_t groups,
                      const uint64_t *keys, size_t n_keys,
                      const int64_t *level_lengths, const int32_t *level_keys, size_t max_levels,
                      const int32_t *field_worker, size_t workers, int consistency, uint64_t *values_scratch,
                      int64_t *matched_out, uint8_t *tier_out, int32_t *holders_out, size_t *n_holders_out)
{
    return kvc_lookup_sparse_masked(views, shards, groups, keys, n_keys, level_lengths, level_keys, max_levels,
                                    field_worker, NULL, workers, consistency, values_scratch, matched_out, tier_out,
                                    holders_out, n_holders_out, 0);
}

static int kvc_lookup_sparse_masked(const kvc_view *const *views, size_t shards, size_t groups,
                                    const uint64_t *keys, size_t n_keys,
                                    const int64_t *level_lengths, const int32_t *level_keys, size_t max_levels,
                                    const int32_t *field_worker, const uint64_t *group_fields, size_t workers,
                                    int consistency, uint64_t *values_scratch, int64_t *matched_out,
                                    uint8_t *tier_out, int32_t *holders_out, size_t *n_holders_out, int zeroed)
{
    *n_holders_out = 0;
    if (shards == 0 || (groups != 0 && max_levels == 0))
        return KVC_ERR_ARG;
    if (!zeroed) {
        memset(matched_out, 0, workers * sizeof *matched_out);
        memset(tier_out, 0, workers);
    }
    size_t held = 0;
    uint64_t present[KVC_SPARSE_CHUNK], alive[KVC_SPARSE_CHUNK];
    size_t levels_read[KVC_SPARSE_CHUNK];
    const kvc_view *read_view[KVC_SPARSE_CHUNK];
    uint64_t read_key[KVC_SPARSE_CHUNK], read_value[KVC_SPARSE_CHUNK];
    size_t read_group[KVC_SPARSE_CHUNK];
    uint32_t live[KVC_SPARSE_CHUNK]; /* the chunk's groups still read on, in group order */
    size_t key_row[KVC_SPARSE_KEY_ROWS];
    size_t rows = n_keys < KVC_SPARSE_KEY_ROWS ? n_keys : KVC_SPARSE_KEY_ROWS;
    for (size_t k = 0; k < rows; k++)
        key_row[k] = (size_t)(keys[k] % shards) * groups;
#define KVC_SPARSE_ROW(k) ((size_t)(k) < rows ? key_row[k] : (size_t)(keys[k] % shards) * groups)
    for (size_t first = 0; first < groups; first += KVC_SPARSE_CHUNK) {
        size_t count = groups - first < KVC_SPARSE_CHUNK ? groups - first : KVC_SPARSE_CHUNK;
        if (group_fields) {
            for (size_t i = 0; i < count; i++) {
                present[i] = alive[i] = group_fields[first + i];
                levels_read[i] = 0;
            }
        } else {
            if (kvc_field_masks(field_worker + first * 32, count, workers, present) != KVC_OK)
                return KVC_ERR_ARG;
            for (size_t i = 0; i < count; i++) {
                alive[i] = present[i];
                levels_read[i] = 0;
            }
        }
        /* Few reads in all: every group's fitting levels in one batch. */
        size_t all_reads = 0;
        for (size_t i = 0; i < count && all_reads <= KVC_SPARSE_ONE_BATCH; i++) {
            size_t g = first + i;
            for (size_t level = 0; level < max_levels && present[i]; level++) {
                int32_t k = level_keys[g * max_levels + level];
                if (k < 0 || (size_t)k >= n_keys)
                    break;
                all_reads++;
            }
        }
        if (all_reads <= KVC_SPARSE_ONE_BATCH) {
            const kvc_view *batch_view[KVC_SPARSE_ONE_BATCH];
            uint64_t batch_key[KVC_SPARSE_ONE_BATCH], batch_value[KVC_SPARSE_ONE_BATCH];
            size_t batch_at[KVC_SPARSE_ONE_BATCH], reads = 0;
            for (size_t i = 0; i < count; i++) {
                size_t g = first + i;
                for (size_t level = 0; level < max_levels && present[i]; level++) {
                    int32_t k = level_keys[g * max_levels + level];
                    if (k < 0 || (size_t)k >= n_keys)
                        break;
                    batch_view[reads] = views[KVC_SPARSE_ROW(k) + g];
                    batch_key[reads] = keys[k];
                    batch_at[reads] = level * groups + g;
                    reads++;
                    levels_read[i] = level + 1;
                }
                alive[i] = 0;
            }
            kvc_view_lookup_spread(batch_view, batch_key, reads, batch_value);
            for (size_t r = 0; r < reads; r++)
                values_scratch[batch_at[r]] = batch_value[r];
        }
        /* Level by level, the live groups' reads at once (their misses overlap); under
         * consistency a group is read on while one of its workers' runs of hits is unbroken.
         * The groups read on are kept in a list (kvc_level_reads.h), without a pass over every
         * group of the chunk at every level. */
        size_t n_live = kvc_live_groups(alive, count, live);
        for (size_t level = 0; level < max_levels && n_live; level++) {
            size_t reads = kvc_gather_level_reads(views, shards, groups, first, level, max_levels, level_keys, keys,
                                                  n_keys, key_row, rows, alive, live, &n_live, read_view, read_key,
                                                  read_group);
            if (!reads)
                break;
            kvc_view_lookup_spread(read_view, read_key, reads, read_value);
            for (size_t r = 0; r < reads; r++) {
                size_t i = read_group[r];
                uint64_t v = read_value[r];
                values_scratch[level * groups + first + i] = v;
                levels_read[i] = level + 1;
                if (consistency)
                    alive[i] &= (v | (v >> 1)) & KVC_SPARSE_LOW_BITS;
            }
        }
        /* Each group's fields by where their rule ends them. */
        for (size_t i = 0; i < count && held != SIZE_MAX; i++) {
            size_t g = first + i, read = levels_read[i];
            const uint64_t *values = values_scratch + g; /* level-major: level l at values[l * groups] */
            if (consistency) {
                /* A field's match is the last level of its unbroken run of hits from level 0. */
                uint64_t run = present[i];
                size_t level = 0;
                for (; level < read && run; level++) {
                    uint64_t v = values[level * groups];
                    uint64_t still = run & (v | (v >> 1)) & KVC_SPARSE_LOW_BITS;
                    if (level > 0 && run != still)
                        held = kvc_sparse_assign(run & ~still, g, level - 1, values[(level - 1) * groups], field_worker,
                                                 level_lengths, max_levels, matched_out, tier_out, holders_out, held,
                                                 workers);
                    run = still;
                }
                if (run && read) /* unbroken through every level read */
                    held = kvc_sparse_assign(run, g, read - 1, values[(read - 1) * groups], field_worker, level_lengths,
                                             max_levels, matched_out, tier_out, holders_out, held, workers);
            } else {
                /* A field's match is the longest level where it hits. */
                uint64_t left = present[i];
                for (size_t level = read; level-- > 0 && left;) {
                    uint64_t v = values[level * groups];
                    uint64_t hit = left & (v | (v >> 1)) & KVC_SPARSE_LOW_BITS;
                    if (hit) {
                        held = kvc_sparse_assign(hit, g, level, v, field_worker, level_lengths, max_levels,
                                                 matched_out, tier_out, holders_out, held, workers);
                        left &= ~hit;
                    }
                }
            }
        }
        if (held == SIZE_MAX)
            return KVC_ERR_ARG;
    }
#undef KVC_SPARSE_ROW
    *n_holders_out = held;
    return KVC_OK;
}

/* The queue's least value `low` as kvc_queue_low takes it when there is no NaN: of zeros, the
 * first in index order (which only shows for a -0.0 and a 0.0). */
static double kvc_queue_first_zero(size_t n, const double *queue, double low, int nan)
{
    if (!nan && low == 0.0)
        for (size_t i = 0; i < n; i++)
            if (queue[i] == 0.0)
                return queue[i];
    return low;
}

/* kvc_queue_low's answer for a queue without NaN (the least value; of zeros, the first in index
 * order), in one pass that also says whether there is a NaN (then the answer is unused). With
 * SSE2, eight lanes of minpd and cmpunordpd: minpd(q, low) is `q < low ? q : low` lane by lane,
 * the scalar loop's statement, and without NaN the least value does not depend on the lanes'
 * order except for the sign of a zero, which the scan for the first zero settles as before. The
 * scalar form compiled to a chain of flag tests per value (~5 µs at 10,000 workers). */
static double kvc_queue_low_checked(size_t n, const double *queue, int *nan_out)
{
    double low = queue[0];
    int nan = 0;
    size_t i = 0;
#ifdef __SSE2__
    if (n >= 8) {
        __m128d low0 = _mm_loadu_pd(queue), low1 = _mm_loadu_pd(queue + 2);
        __m128d low2 = _mm_loadu_pd(queue + 4), low3 = _mm_loadu_pd(queue + 6);
        __m128d odd0 = _mm_cmpunord_pd(low0, low0), odd1 = _mm_cmpunord_pd(low1, low1);
        __m128d odd2 = _mm_cmpunord_pd(low2, low2), odd3 = _mm_cmpunord_pd(low3, low3);
        for (i = 8; i + 8 <= n; i += 8) {
            __m128d q0 = _mm_loadu_pd(queue + i), q1 = _mm_loadu_pd(queue + i + 2);
            __m128d q2 = _mm_loadu_pd(queue + i + 4), q3 = _mm_loadu_pd(queue + i + 6);
            odd0 = _mm_or_pd(odd0, _mm_cmpunord_pd(q0, q0));
            odd1 = _mm_or_pd(odd1, _mm_cmpunord_pd(q1, q1));
            odd2 = _mm_or_pd(odd2, _mm_cmpunord_pd(q2, q2));
            odd3 = _mm_or_pd(odd3, _mm_cmpunord_pd(q3, q3));
            low0 = _mm_min_pd(q0, low0);
            low1 = _mm_min_pd(q1, low1);
            low2 = _mm_min_pd(q2, low2);
            low3 = _mm_min_pd(q3, low3);
        }
        nan = _mm_movemask_pd(_mm_or_pd(_mm_or_pd(odd0, odd1), _mm_or_pd(odd2, odd3))) != 0;
        double lanes[8];
        _mm_storeu_pd(lanes, low0);
        _mm_storeu_pd(lanes + 2, low1);
        _mm_storeu_pd(lanes + 4, low2);
        _mm_storeu_pd(lanes + 6, low3);
        low = lanes[0];
        for (int j = 1; j < 8; j++)
            low = lanes[j] < low ? lanes[j] : low;
    }
#else
    double lane[4] = {queue[0], queue[0], queue[0], queue[0]};
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++) {
            double q = queue[i + j];
            nan |= q != q;
            lane[j] = q < lane[j] ? q : lane[j];
        }
    low = lane[0];
    for (int j = 1; j < 4; j++)
        if (lane[j] < low)
            low = lane[j];
#endif
    for (; i < n; i++) {
        double q = queue[i];
        nan |= q != q;
        low = q < low ? q : low;
    }
    *nan_out = nan;
    return kvc_queue_first_zero(n, queue, low, nan);
}

/* kvc_queue_aged's values (bit for bit: its statement's operations in its order, two lanes at a
 * time) with, in the same pass, their least value and whether one is NaN, as
 * kvc_queue_low_checked finds them in a pass of its own over the output (before its first-zero
 * rule, which the caller applies). For the fused decision when the aged values are the scored
 * ones: one pass over 10,000 estimates instead of two. */
static void kvc_queue_aged_low(size_t n, const double *ms, const double *taken_at, const double *rate, double now,
                               double *out, double *low_out, int *nan_out)
{
    double low = INFINITY;
    int nan = 0;
    size_t i = 0;
#ifdef __SSE2__
    const __m128d now2 = _mm_set1_pd(now), thousand = _mm_set1_pd(1000.0), zero = _mm_setzero_pd();
    __m128d low0 = _mm_set1_pd(INFINITY), low1 = low0, odd0 = zero, odd1 = zero;
#define KVC_AGED_PAIR(at, lowv, oddv)                                                                     \
    do {                                                                                                  \
        __m128d age = _mm_mul_pd(_mm_sub_pd(now2, _mm_loadu_pd(taken_at + (at))), thousand);              \
        age = _mm_andnot_pd(_mm_cmple_pd(age, zero), age); /* 0.0 >= age ? 0.0 : age */                     \
        __m128d value = _mm_add_pd(_mm_mul_pd(_mm_loadu_pd(rate + (at)), age), _mm_loadu_pd(ms + (at)));   \
        value = _mm_andnot_pd(_mm_cmple_pd(value, zero), value);                                         \
        _mm_storeu_pd(out + (at), value);                                                                 \
        oddv = _mm_or_pd(oddv, _mm_cmpunord_pd(value, value));                                            \
        lowv = _mm_min_pd(value, lowv);                                                                   \
    } while (0)
    for (; i + 4 <= n; i += 4) {
        KVC_AGED_PAIR(i, low0, odd0);
        KVC_AGED_PAIR(i + 2, low1, odd1);
    }
#undef KVC_AGED_PAIR
    nan = _mm_movemask_pd(_mm_or_pd(odd0, odd1)) != 0;
    double lanes[4];
    _mm_storeu_pd(lanes, low0);
    _mm_storeu_pd(lanes + 2, low1);
    for (int j = 0; j < 4; j++)
        low = lanes[j] < low ? lanes[j] : low;
#endif
    for (; i < n; i++) {
        double age = (now - taken_at[i]) * 1000.0;
        age = 0.0 >= age ? 0.0 : age;
        double value = ms[i] + rate[i] * age;
        value = 0.0 >= value ? 0.0 : value;
        out[i] = value;
        nan |= value != value;
        low = value < low ? value : low;
    }
    *low_out = low;
    *nan_out = nan;
}

/* The running argmin and tie rotation, order-free: best is the least (score, index), chosen the
 * least (score, last_sent, index): the first minimum and, among the scores equal to it, the first
 * of the least last_sent, whichever order the workers come in. */
typedef struct kvc_running_choice {
    double score;
    size_t best, chosen;
    int any;
} kvc_running_choice;

static inline void kvc_choice_offer(kvc_running_choice *c, double s, size_t i, const int64_t *last_sent)
{
    if (!c->any || s < c->score) {
        c->score = s;
        c->best = c->chosen = i;
        c->any = 1;
    } else if (s == c->score) {
        if (i < c->best)
            c->best = i;
        if (last_sent ? (last_sent[i] < last_sent[c->chosen] ||
                         (last_sent[i] == last_sent[c->chosen] && i < c->chosen))
                      : i < c->chosen)
            c->chosen = i;
    }
}

/* The queue's least value and whether it holds a NaN, found while it was made (kvc_queue_aged_low). */
typedef struct kvc_known_low {
    double low;
    int nan;
} kvc_known_low;

/* kvc_score_choose_pruned, the queue's least value taken from `known` when given. */
static int64_t score_choose_pruned(size_t n, double prompt_len, const double *wan, const double *beta,
                                   const double *queue, const double *belief, const int64_t *matched,
                                   const uint8_t *tier, const double *local_factor, const double *remote_penalty,
                                   const uint8_t *eligible, double gamma, double lambda_max, double tau,
                                   unsigned flags, const int64_t *last_sent, const int32_t *holders, size_t n_holders,
                                   const kvc_score_blocks *blocks, double *scores_out, double *lam_out,
                                   int64_t *chosen_out, int *complete_out, const kvc_known_low *known)
{
    *complete_out = 1;
    size_t block = blocks->block, n_blocks = blocks->n_blocks;
    double low = 0.0, lam = 0.0;
    int nan = 0;
    if (n > 0 && (flags & KVC_SCORE_LOAD_AWARE)) {
        if (known) {
            nan = known->nan;
            low = kvc_queue_first_zero(n, queue, known->low, nan);
        } else {
            low = kvc_queue_low_checked(n, queue, &nan);
        }
        double ratio = low / tau;
        lam = ratio < lambda_max ? ratio : lambda_max;
    }
    int scale = lam != 0.0;
    if (n == 0 || nan || block == 0 || n_blocks != (n + block - 1) / block || !(1.0 + lam >= 0.0) ||
        !(prompt_len >= 0.0))
        goto full;
    kvc_running_choice c = {0.0, 0, 0, 0};
    for (size_t h = 0; h < n_holders; h++) {
        size_t i = (size_t)holders[h];
        double s = kvc_score_at(i, prompt_len, wan, beta, queue, belief, matched, tier, local_factor, remote_penalty,
                                eligible, gamma, scale, lam, flags);
        scores_out[i] = s;
        if (s != s)
            goto full;
        kvc_choice_offer(&c, s, i, last_sent);
    }
    /* The block with the least bound first (it sets a low best), then every block whose bound
     * can still reach the best so far. */
#define KVC_BLOCK_BOUND(b)                                                                                   \
    ((flags & KVC_SCORE_CROSS_REGION)                                                                     \
         ? ((flags & KVC_SCORE_LOAD_AWARE) ? blocks->wan_min[b] + low : blocks->wan_min[b]) +               \
               (scale ? blocks->beta_min[b] * (1.0 + lam) : blocks->beta_min[b]) * prompt_len               \
         : ((flags & KVC_SCORE_LOAD_AWARE) ? blocks->wan_min[b] + low : blocks->wan_min[b]) +               \
               (scale ? blocks->beta_min[b] * (1.0 + lam) : blocks->beta_min[b]) * prompt_len +             \
               blocks->penalty_min[b])
    size_t first = 0;
    double first_bound = KVC_BLOCK_BOUND(0);
    for (size_t b = 1; b < n_blocks; b++) {
        double bound = KVC_BLOCK_BOUND(b);
        if (bound < first_bound) {
            first_bound = bound;
            first = b;
        }
    }
    size_t scored = 0;
    for (size_t step = 0; step <= n_blocks; step++) {
        size_t b = step == 0 ? first : step - 1;
        if (step > 0 && b == first)
            continue;
        if (c.any && KVC_BLOCK_BOUND(b) > c.score)
            continue; /* every worker there scores above the best (a holder was scored above) */
        size_t end = (b + 1) * block < n ? (b + 1) * block : n;
        for (size_t i = b * block; i < end; i++) {
            double s = kvc_score_at(i, prompt_len, wan, beta, queue, belief, matched, tier, local_factor,
                                    remote_penalty, eligible, gamma, scale, lam, flags);
            scores_out[i] = s;
            if (s != s)
                goto full;
            kvc_choice_offer(&c, s, i, last_sent);
        }
        scored++;
    }
#undef KVC_BLOCK_BOUND
    if (!c.any || !isfinite(c.score))
        goto full;
    *lam_out = lam;
    *complete_out = scored == n_blocks;
    *chosen_out = (int64_t)c.chosen;
    return (int64_t)c.best;
full:
    *complete_out = 1;
    return kvc_score_choose(n, prompt_len, wan, beta, queue, belief, matched, tier, local_factor, remote_penalty,
                            eligible, gamma, lambda_max, tau, flags, last_sent, scores_out, lam_out, chosen_out);
}

int64_t kvc_score_choose_pruned(size_t n, double prompt_len, const double *wan, const double *beta,
                                const double *queue, const double *belief, const int64_t *matched,
                                const uint8_t *tier, const double *local_factor, const double *remote_penalty,
                                const uint8_t *eligible, double gamma, double lambda_max, double tau, unsigned flags,
                                const int64_t *last_sent, const int32_t *holders, size_t n_holders,
                                const kvc_score_blocks *blocks, double *scores_out, double *lam_out,
                                int64_t *chosen_out, int *complete_out)
{
    return score_choose_pruned(n, prompt_len, wan, beta, queue, belief, matched, tier, local_factor, remote_penalty,
                               eligible, gamma, lambda_max, tau, flags, last_sent, holders, n_holders, blocks,
                               scores_out, lam_out, chosen_out, complete_out, NULL);
}

unsigned kvc_miss_summary_holders(const int32_t *holders, size_t n_holders, const int64_t *matched,
                                  const uint8_t *local, const int64_t *floors, int remote_floor_free,
                                  const double *scores, const double *queue, size_t chosen, size_t n)
{
    if (chosen >= n)
        return 0;
    kvc_miss_acc acc = kvc_miss_start(remote_floor_free ? KVC_MISS_REMOTE_WORTH : 0, scores, queue, chosen);
    for (size_t h = 0; h < n_holders; h++)
        kvc_miss_visit(&acc, (size_t)holders[h], matched, local, floors, scores, queue);
    return kvc_miss_finish(&acc);
}

/* kvc_forward_decide_sparse; `zeroed`: matched_out and tier_out are all 0 already; `known`: the
 * queue's least value (NULL: the score finds it). */
static int forward_decide_sparse(const kvc_forward_plan *plan, const kvc_forward_sparse *sparse,
                                 const uint8_t *token_bytes, size_t n_tokens, const double *queue,
                                 const double *belief, const uint8_t *eligible, const int64_t *last_sent,
                                 uint64_t *keys_out, int64_t *matched_out, uint8_t *tier_out, double *scores_out,
                                 kvc_forward_sparse_result *result, int zeroed, const kvc_known_low *known)
{
    size_t workers = plan->workers;
    if (workers == 0)
        return KVC_ERR_ARG;
    size_t n_keys = 0;
    while (n_keys < plan->n_query && plan->query_lengths[n_keys] <= (int64_t)n_tokens)
        n_keys++;
    int rc = kvc_prefix_keys_paired(plan->salt, plan->salt_len, token_bytes, n_tokens, plan->query_lengths, n_keys,
                                    plan->sha_backend, keys_out);
    if (rc != KVC_OK)
        return rc;
    size_t held;
    rc = kvc_lookup_sparse_masked(plan->views, plan->shards, plan->groups, keys_out, n_keys, plan->level_lengths,
                                  plan->level_keys, plan->max_levels, sparse->field_worker, sparse->group_fields,
                                  workers, plan->consistency, plan->values_scratch, matched_out, tier_out,
                                  sparse->holders, &held, zeroed);
    if (rc != KVC_OK)
        return rc;
    int64_t chosen_index;
    int complete;
    int64_t best = score_choose_pruned(workers, (double)n_tokens, plan->wan, plan->beta, queue, belief, matched_out,
                                       tier_out, plan->local_factor, plan->remote_penalty, eligible, plan->gamma,
                                       plan->lambda_max, plan->tau, plan->score_flags, last_sent, sparse->holders,
                                       held, &sparse->blocks, scores_out, &result->lam, &chosen_index, &complete,
                                       known);
    result->best = best;
    result->chosen = chosen_index;
    result->n_keys = n_keys;
    result->n_holders = held;
    result->complete = complete;
    result->miss = kvc_miss_summary_holders(sparse->holders, held, matched_out, plan->local, plan->floors,
                                            sparse->remote_floor_free, scores_out, queue, (size_t)chosen_index,
                                            workers);
    int64_t family = plan->family_index;
    result->family = family >= 0 && (size_t)family < n_keys ? (int64_t)keys_out[family] : -1;
    return isfinite(scores_out[best]) ? KVC_OK : KVC_FORWARD_NONE_ELIGIBLE;
}

int kvc_forward_decide_sparse(const kvc_forward_plan *plan, const kvc_forward_sparse *sparse,
                              const uint8_t *token_bytes, size_t n_tokens, const double *queue,
                              const double *belief, const uint8_t *eligible, const int64_t *last_sent,
                              uint64_t *keys_out, int64_t *matched_out, uint8_t *tier_out, double *scores_out,
                              kvc_forward_sparse_result *result)
{
    return forward_decide_sparse(plan, sparse, token_bytes, n_tokens, queue, belief, eligible, last_sent, keys_out,
                                 matched_out, tier_out, scores_out, result, 0, NULL);
}

/* kvc_forward_decide_sparse_aged; `zeroed`: matched_out and tier_out are all 0 already. */
static int forward_decide_sparse_aged(const kvc_forward_plan *plan, const kvc_forward_sparse *sparse,
                                      const uint8_t *token_bytes, size_t n_tokens, const double *ms, double now,
                                      const double *correction, int add_occupancy, const double *belief,
                                      const uint8_t *eligible, const int64_t *last_sent, uint64_t *keys_out,
                                      int64_t *matched_out, uint8_t *tier_out, double *scores_out, double *aged_out,
                                      double *queue_out, kvc_forward_sparse_result *result, int zeroed)
{
    size_t n = plan->workers;
    if (!sparse->taken_at || !sparse->rate || (correction && !sparse->region_slot) ||
        (add_occupancy && !sparse->occupancy))
        return KVC_ERR_ARG;
    if (!correction && !add_occupancy) { /* the aged values are scored: their least value in the same pass */
        kvc_known_low known;
        kvc_queue_aged_low(n, ms, sparse->taken_at, sparse->rate, now, aged_out, &known.low, &known.nan);
        if (queue_out != aged_out)
            memcpy(queue_out, aged_out, n * sizeof *aged_out);
        return forward_decide_sparse(plan, sparse, token_bytes, n_tokens, queue_out, belief, eligible, last_sent,
                                     keys_out, matched_out, tier_out, scores_out, result, zeroed, &known);
    }
    kvc_queue_aged(n, ms, sparse->taken_at, sparse->rate, now, aged_out);
    if (correction || add_occupancy) {
        for (size_t i = 0; i < n; i++) {
            double value = aged_out[i];
            if (correction)
                value = value + correction[sparse->region_slot[i]];
            if (add_occupancy)
                value = value + sparse->occupancy[i];
            queue_out[i] = value;
        }
    } else if (queue_out != aged_out) {
        memcpy(queue_out, aged_out, n * sizeof *aged_out);
    }
    return forward_decide_sparse(plan, sparse, token_bytes, n_tokens, queue_out, belief, eligible, last_sent,
                                 keys_out, matched_out, tier_out, scores_out, result, zeroed, NULL);
}

int kvc_forward_decide_sparse_aged(const kvc_forward_plan *plan, const kvc_forward_sparse *sparse,
                                   const uint8_t *token_bytes, size_t n_tokens, const double *ms, double now,
                                   const double *correction, int add_occupancy, const double *belief,
                                   const uint8_t *eligible, const int64_t *last_sent, uint64_t *keys_out,
                                   int64_t *matched_out, uint8_t *tier_out, double *scores_out, double *aged_out,
                                   double *queue_out, kvc_forward_sparse_result *result)
{
    return forward_decide_sparse_aged(plan, sparse, token_bytes, n_tokens, ms, now, correction, add_occupancy,
                                      belief, eligible, last_sent, keys_out, matched_out, tier_out, scores_out,
                                      aged_out, queue_out, result, 0);
}

/* ---- the aging record (kvc_forward.h): a reused buffer's aged estimates kept current ---------- */

/* Workers per block of the record's least values. */
#define KVC_AGED_BLOCK 16u
/* The aging record's flag when current: made for the aged values scored alone, or for the aged
 * values plus the occupancy (the queue then scored; its blocks' least values are that queue's). */
#define KVC_AGED_ALONE 1.0
#define KVC_AGED_WITH_OCCUPANCY 2.0
/* Past this magnitude a time is not taken as settled (so that (now - taken_at) x 1000 stays finite). */
#define KVC_AGED_BOUND 1e300

/* The aging record's parts, laid over the buffer after the zeroing record. */
typedef struct kvc_aging_record {
    double *head;       /* flag, change count it is current to, now, moving workers */
    double *block_low;  /* [blocks] least scored value of each block (no NaN counted) */
    double *block_nan;  /* [blocks] 1.0 when the block holds a NaN */
    int32_t *moving;    /* [n] workers whose value may differ at a later now */
    uint64_t *listed;   /* [ceil(n / 64)] bit i: i is in `moving` */
    uint64_t *touched;  /* [ceil(blocks / 64)] blocks to recompute, cleared after */
    size_t blocks;
} kvc_aging_record;

static kvc_aging_record kvc_aging_record_at(double *out, size_t n)
{
    kvc_aging_record r;
    r.blocks = (n + KVC_AGED_BLOCK - 1) / KVC_AGED_BLOCK;
    r.head = out + 4 * n + (n + 7) / 8 + 3 + (n + 1) / 2;
    r.block_low = r.head + 4;
    r.block_nan = r.block_low + r.blocks;
    r.moving = (int32_t *)(r.block_nan + r.blocks);
    r.listed = (uint64_t *)(r.block_nan + r.blocks + (n + 1) / 2);
    r.touched = r.listed + (n + 63) / 64;
    return r;
}

/* kvc_queue_aged's statement for one worker. */
static inline double kvc_aged_one(double ms, double taken_at, double rate, double now)
{
    double age = (now - taken_at) * 1000.0;
    age = 0.0 >= age ? 0.0 : age;
    double value = ms + rate * age;
    return 0.0 >= value ? 0.0 : value;
}

/* Whether the worker's aged value at `now` is its value at every later now (within the bound):
 * a rate of zero adds zero to ms whatever the (finite) age; a finite negative rate whose sum is
 * <= 0 only goes lower as the age grows (each operation rounds monotonically), and 0.0 clamps it. */
static inline int kvc_aged_settled(double ms, double taken_at, double rate, double now)
{
    if (!(fabs(taken_at) <= KVC_AGED_BOUND))
        return 0;
    if (rate == 0.0)
        return 1;
    if (!(rate < 0.0 && rate > -INFINITY) || ms != ms)
        return 0;
    double age = (now - taken_at) * 1000.0;
    age = 0.0 >= age ? 0.0 : age;
    return ms + rate * age <= 0.0;
}

/* Block b's least value and NaN flag from the scored values (aged, or aged plus occupancy). */
static void kvc_aging_block(const kvc_aging_record *r, const double *aged, size_t n, size_t b)
{
    size_t end = (b + 1) * KVC_AGED_BLOCK < n ? (b + 1) * KVC_AGED_BLOCK : n;
    double low = INFINITY;
    int nan = 0;
    for (size_t i = b * KVC_AGED_BLOCK; i < end; i++) {
        double v = aged[i];
        nan |= v != v;
        low = v < low ? v : low;
    }
    r->block_low[b] = low;
    r->block_nan[b] = nan ? 1.0 : 0.0;
}

/* The least value and NaN flag over the blocks: kvc_queue_aged_low's (the least of values that
 * are never -0.0 does not depend on the order they are taken in). */
static void kvc_aging_low(const kvc_aging_record *r, double *low_out, int *nan_out)
{
    double low = INFINITY;
    int nan = 0;
    for (size_t b = 0; b < r->blocks; b++) {
        double v = r->block_low[b];
        low = v < low ? v : low;
        nan |= r->block_nan[b] != 0.0;
    }
    *low_out = low;
    *nan_out = nan;
}

/* The aged estimates into `aged` and, with `occupancy` (else NULL, and `queue` is `aged`), the
 * scored ones into `queue` as aged[i] + occupancy[i], with the scored values' least value and NaN
 * flag as kvc_queue_aged_low gives them for the aged ones, from the buffer's aging record when it
 * is current enough (and was made for the same queue: the record's flag says which): then only
 * the workers the change log names since the record's count, and those the record lists as
 * moving, are aged again (the rest hold their value, which their inputs did not change and a
 * later now does not move; a worker's occupancy changes only with its logged reading), and only
 * their blocks' least values taken again. Otherwise every worker, and the record made anew. */
static void kvc_aged_tracked(size_t n, const double *ms, const double *taken_at, const double *rate, double now,
                             const double *occupancy, const int64_t *changes, double *out, double *aged,
                             double *queue, double *low_out, int *nan_out)
{
    kvc_aging_record r = kvc_aging_record_at(out, n);
    int64_t count = changes[0], floor = changes[1], cap = changes[2];
    double *head = r.head;
    double made_for = occupancy ? KVC_AGED_WITH_OCCUPANCY : KVC_AGED_ALONE;
    int bounded = fabs(now) <= KVC_AGED_BOUND;
    int current = head[0] == made_for && bounded && cap > 0 && now >= head[2] && head[1] >= (double)floor &&
                  head[1] <= (double)count && (double)count - head[1] <= (double)cap && head[3] >= 0.0 &&
                  head[3] <= (double)n;
    if (current) {
        for (int64_t s = (int64_t)head[1]; s < count; s++) { /* the log names workers in range */
            int64_t i = changes[3 + s % cap];
            if (i < 0 || (uint64_t)i >= n) {
                current = 0;
                break;
            }
        }
    }
    head[0] = 0.0;
    if (!current) {
        if (occupancy) {
            kvc_queue_aged(n, ms, taken_at, rate, now, aged);
            double low = INFINITY;
            int nan = 0;
            for (size_t i = 0; i < n; i++) {
                double value = aged[i] + occupancy[i];
                queue[i] = value;
                nan |= value != value;
                low = value < low ? value : low;
            }
            *low_out = low;
            *nan_out = nan;
        } else {
            kvc_queue_aged_low(n, ms, taken_at, rate, now, aged, low_out, nan_out);
        }
        if (!bounded || cap <= 0 || floor > count)
            return; /* nothing the record could keep: left unset */
        size_t moving = 0;
        memset(r.listed, 0, ((n + 63) / 64) * sizeof *r.listed);
        memset(r.touched, 0, ((r.blocks + 63) / 64) * sizeof *r.touched);
        for (size_t i = 0; i < n; i++)
            if (!kvc_aged_settled(ms[i], taken_at[i], rate[i], now)) {
                r.moving[moving++] = (int32_t)i;
                r.listed[i / 64] |= UINT64_C(1) << (i % 64);
            }
        for (size_t b = 0; b < r.blocks; b++)
            kvc_aging_block(&r, queue, n, b);
        head[3] = (double)moving;
    } else {
        size_t kept = 0, moving = (size_t)head[3];
        for (size_t k = 0; k < moving; k++) {
            size_t i = (size_t)r.moving[k];
            aged[i] = kvc_aged_one(ms[i], taken_at[i], rate[i], now);
            if (occupancy)
                queue[i] = aged[i] + occupancy[i];
            r.touched[i / KVC_AGED_BLOCK / 64] |= UINT64_C(1) << (i / KVC_AGED_BLOCK % 64);
            if (kvc_aged_settled(ms[i], taken_at[i], rate[i], now))
                r.listed[i / 64] &= ~(UINT64_C(1) << (i % 64));
            else
                r.moving[kept++] = (int32_t)i;
        }
        for (int64_t s = (int64_t)head[1]; s < count; s++) {
            size_t i = (size_t)changes[3 + s % cap];
            aged[i] = kvc_aged_one(ms[i], taken_at[i], rate[i], now);
            if (occupancy)
                queue[i] = aged[i] + occupancy[i];
            r.touched[i / KVC_AGED_BLOCK / 64] |= UINT64_C(1) << (i / KVC_AGED_BLOCK % 64);
            if (!(r.listed[i / 64] >> (i % 64) & 1u) && !kvc_aged_settled(ms[i], taken_at[i], rate[i], now)) {
                r.moving[kept++] = (int32_t)i;
                r.listed[i / 64] |= UINT64_C(1) << (i % 64);
            }
        }
        for (size_t w = 0; w < (r.blocks + 63) / 64; w++) {
            uint64_t bits = r.touched[w];
            r.touched[w] = 0;
            while (bits) {
                size_t b = w * 64 + (size_t)__builtin_ctzll(bits);
                bits &= bits - 1;
                kvc_aging_block(&r, queue, n, b);
            }
        }
        head[3] = (double)kept;
        kvc_aging_low(&r, low_out, nan_out);
    }
    head[1] = (double)count;
    head[2] = now;
    head[0] = made_for;
}

int kvc_forward_decide_sparse_out(const kvc_forward_plan *plan, const kvc_forward_sparse *sparse,
                                  const uint8_t *token_bytes, size_t n_tokens, const double *ms, double now,
                                  const double *correction, int add_occupancy, const double *belief,
                                  const uint8_t *eligible, const int64_t *last_sent, uint64_t *keys_out,
                                  double *out, kvc_forward_sparse_result *result, int64_t *fields_out,
                                  const int64_t *changes)
{
    size_t n = plan->workers;
    double *aged = out + n;
    double *queue = correction || add_occupancy ? out + 2 * n : aged;
    int64_t *matched = (int64_t *)(out + 3 * n);
    uint8_t *tier = (uint8_t *)(out + 4 * n);
    result->chosen_matched = result->best_matched = 0;
    result->chosen_tier = result->best_tier = 0;
    /* The zeroing record (kvc_forward.h): zero what the buffer's last decision listed, or all. */
    double *record = out + 4 * n + (n + 7) / 8 + 1;
    int32_t *listed = (int32_t *)(record + 2);
    double count = record[1];
    if (record[0] == 1.0 && count >= 0.0 && count <= (double)n) {
        for (size_t h = 0; h < (size_t)count; h++) {
            size_t i = (size_t)listed[h];
            if (i < n) {
                matched[i] = 0;
                tier[i] = 0;
            }
        }
    } else {
        memset(matched, 0, n * sizeof *matched);
        memset(tier, 0, n);
    }
    record[0] = 0.0;
    int rc;
    if (changes && !correction && n > 0 && sparse->taken_at && sparse->rate &&
        (!add_occupancy || sparse->occupancy)) {
        kvc_known_low known;
        kvc_aged_tracked(n, ms, sparse->taken_at, sparse->rate, now, add_occupancy ? sparse->occupancy : NULL,
                         changes, out, aged, queue, &known.low, &known.nan);
        rc = forward_decide_sparse(plan, sparse, token_bytes, n_tokens, queue, belief, eligible, last_sent,
                                   keys_out, matched, tier, out, result, 1, &known);
    } else {
        kvc_aging_record_at(out, n).head[0] = 0.0; /* its aged values are not the record's */
        rc = forward_decide_sparse_aged(plan, sparse, token_bytes, n_tokens, ms, now, correction, add_occupancy,
                                        belief, eligible, last_sent, keys_out, matched, tier, out, aged, queue,
                                        result, 1);
    }
    if (rc != KVC_OK && rc != KVC_FORWARD_NONE_ELIGIBLE)
        return rc;
    /* The lookup ran: its matches are at its holders alone. */
    memcpy(listed, sparse->holders, result->n_holders * sizeof *listed);
    record[1] = (double)result->n_holders;
    record[0] = 1.0;
    if (result->chosen >= 0 && (size_t)result->chosen < n) {
        result->chosen_matched = matched[result->chosen];
        result->chosen_tier = tier[result->chosen];
    }
    if (result->best >= 0 && (size_t)result->best < n) {
        result->best_matched = matched[result->best];
        result->best_tier = tier[result->best];
    }
    out[4 * n + (n + 7) / 8] = result->lam;
    fields_out[KVC_OUT_BEST] = result->best;
    fields_out[KVC_OUT_CHOSEN] = result->chosen;
    fields_out[KVC_OUT_MISS] = (int64_t)result->miss;
    fields_out[KVC_OUT_FAMILY] = result->family;
    fields_out[KVC_OUT_COMPLETE] = result->complete;
    fields_out[KVC_OUT_CHOSEN_MATCHED] = result->chosen_matched;
    fields_out[KVC_OUT_CHOSEN_TIER] = result->chosen_tier;
    fields_out[KVC_OUT_BEST_MATCHED] = result->best_matched;
    fields_out[KVC_OUT_BEST_TIER] = result->best_tier;
    return rc;
}
