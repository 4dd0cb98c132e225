/*
 * kvc_forward.c -- the fused forwarding decision (see kvc_forward.h).
 */
#include "kvc_forward.h"

#include "kvc_keys.h"

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
    int64_t best = kvc_score_joint(workers, (double)n_tokens, plan->wan, plan->beta, queue, belief, matched_out,
                                   tier_out, plan->local_factor, plan->remote_penalty, eligible, plan->gamma,
                                   plan->lambda_max, plan->tau, plan->score_flags, scores_out, &result->lam);
    size_t chosen = (size_t)best;
    if (last_sent) {
        /* Exact ties would all go to the lowest index between load reports: the first of the
         * least recently sent wins (best is the first of the ties, so only strictly less moves). */
        double top = scores_out[best];
        for (size_t i = (size_t)best + 1; i < workers; i++)
            if (scores_out[i] == top && last_sent[i] < last_sent[chosen])
                chosen = i;
    }
    result->best = best;
    result->chosen = (int64_t)chosen;
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
