/* kvc_score_term.h - one worker's joint score, the single C statement of it (internal).
 *
 *   s = WAN + Tq + c * L + min(b * m, L) * (gamma * [DRAM] - c),  c = beta * (1 + lam)
 *
 * kvc_score_joint (ludo_plan.c) and kvc_score_choose (kvc_forward.c) both score through this
 * function, so the two cannot drift apart. The operations and their order are those of the numpy
 * reference (no contraction into FMAs under -std=c11), so every score is bit-identical to it.
 * ``scale`` is whether lam is set (NaN counts as set, as Python's truth test does); an ineligible
 * worker scores +inf. */
#ifndef KVC_SCORE_TERM_H
#define KVC_SCORE_TERM_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "ludo.h" /* the KVC_SCORE_* flags */

static inline __attribute__((always_inline)) double
kvc_score_at(size_t i, double prompt_len, const double *wan, const double *beta, const double *queue,
             const double *belief, const int64_t *matched, const uint8_t *tier, const double *local_factor,
             const double *remote_penalty, const uint8_t *eligible, double gamma, int scale, double lam,
             unsigned flags)
{
    double s = (flags & KVC_SCORE_LOAD_AWARE) ? wan[i] + queue[i] : wan[i];
    double cost = scale ? beta[i] * (1.0 + lam) : beta[i];
    s = s + cost * prompt_len;
    double coef = (flags & KVC_SCORE_TIER_AWARE) ? (tier[i] == 2 ? gamma : 0.0) - cost : -cost;
    double effective = belief[i] * (double)matched[i];
    if (effective > prompt_len)
        effective = prompt_len;
    if (!(flags & KVC_SCORE_CROSS_REGION)) {
        effective = effective * local_factor[i];
        s = s + remote_penalty[i];
    }
    effective = effective * coef;
    s = s + effective;
    if (eligible && !eligible[i])
        s = INFINITY;
    return s;
}

#endif
