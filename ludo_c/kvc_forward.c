/*
 * kvc_forward.c -- the fused forwarding decision (see kvc_forward.h).
 */
#include "kvc_forward.h"

#include "kvc_keys.h"
#include "kvc_score_term.h"

#include <math.h>

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
