/* kvc_miss_term.h - why a request missed the cache, one worker at a time (internal).
 *
 * kvc_miss_summary (ludo_plan.c) visits every worker; kvc_miss_summary_holders (kvc_forward.c)
 * visits only the holders (every worker with matched > 0, each once). Both accumulate here, so
 * the two cannot drift apart:
 *
 *   KVC_MISS_LOCAL_HOLDER  a worker of the edge's region holds some of the prompt;
 *   KVC_MISS_REMOTE_WORTH  a worker of another region holds at least its floor;
 *   KVC_MISS_LOST_TO_LOAD  the winner holds nothing, and every local holder would have won
 *                          with the winner's queue term (in the numpy reference's order). */
#ifndef KVC_MISS_TERM_H
#define KVC_MISS_TERM_H

#include <stddef.h>
#include <stdint.h>

#include "ludo.h" /* the KVC_MISS_* flags */

typedef struct {
    unsigned flags;
    int lost;         /* no holder visited so far rules out "lost to load" */
    size_t chosen;
    double own;       /* the winner's score */
    double own_queue; /* the winner's queue term */
} kvc_miss_acc;

static inline __attribute__((always_inline)) kvc_miss_acc
kvc_miss_start(unsigned flags, const double *scores, const double *queue, size_t chosen)
{
    kvc_miss_acc acc = {flags, 1, chosen, scores[chosen], queue[chosen]};
    return acc;
}

static inline __attribute__((always_inline)) void
kvc_miss_visit(kvc_miss_acc *acc, size_t i, const int64_t *matched, const uint8_t *local, const int64_t *floors,
               const double *scores, const double *queue)
{
    if (local[i]) {
        if (matched[i] > 0) {
            acc->flags |= KVC_MISS_LOCAL_HOLDER;
            if (i == acc->chosen) {
                acc->lost = 0; /* the winner is a holder: nobody lost */
            } else {
                /* Would this holder have won with the winner's queue term? */
                double unloaded = scores[i] - queue[i] + acc->own_queue;
                if (!(unloaded < acc->own))
                    acc->lost = 0;
            }
        }
    } else if (matched[i] >= floors[i]) {
        acc->flags |= KVC_MISS_REMOTE_WORTH;
    }
}

static inline __attribute__((always_inline)) unsigned
kvc_miss_finish(const kvc_miss_acc *acc)
{
    if ((acc->flags & KVC_MISS_LOCAL_HOLDER) && acc->lost)
        return acc->flags | KVC_MISS_LOST_TO_LOAD;
    return acc->flags;
}

#endif /* KVC_MISS_TERM_H */
