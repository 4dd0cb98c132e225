/*
 * kvc_forward.h -- one edge forwarding decision in one C call (kvcompassd issue 3, paper 3.4).
 *
 * Hashes the prompt at the edge's query lengths (kvc_prefix_keys), reads every (shard, region
 * group) view at them (kvc_lookup_plan), scores every worker and rotates exact ties toward the
 * least recently sent worker in one pass (kvc_score_choose: kvc_score_joint's scores, its argmin
 * and the tie rotation) and summarises the decision for the hot-prefix detector
 * (kvc_miss_summary): the functions the Python Router's wrappers call, so the results are the
 * same bit for bit. The caller owns every buffer; nothing
 * is allocated, no clock is read.
 *
 * Everything between CDEF-BEGIN and CDEF-END is also fed to cffi's cdef: plain declarations only.
 */
#ifndef KVC_FORWARD_H
#define KVC_FORWARD_H

#include <stddef.h>
#include <stdint.h>

#include "ludo.h"

/* CDEF-BEGIN */

/* An edge's constants, filled once; arrays are borrowed (they must outlive every call). */
typedef struct kvc_forward_plan {
    /* prefix keys: salt, and the query lengths (strictly ascending, positive) */
    const uint8_t *salt;
    size_t salt_len;
    const int64_t *query_lengths;
    size_t n_query;
    int sha_backend;                 /* a kvc_sha256_backend; KVC_SHA256_AUTO in production */
    /* lookup: the arguments of kvc_lookup_plan */
    const kvc_view *const *views;    /* [shards * groups], may be rewritten between calls */
    size_t shards;
    size_t groups;
    const int64_t *level_lengths;
    const int32_t *level_keys;
    size_t max_levels;
    const int32_t *worker_group;
    const uint8_t *worker_shift;
    size_t workers;
    int consistency;
    uint64_t *values_scratch;        /* [groups * max_levels] */
    /* score: the constants of kvc_score_joint, all [workers] */
    const double *wan;
    const double *beta;
    const double *local_factor;
    const double *remote_penalty;
    double gamma;
    double lambda_max;
    double tau;
    unsigned score_flags;            /* KVC_SCORE_* */
    /* miss summary: the constants of kvc_miss_summary, [workers] */
    const uint8_t *local;
    const int64_t *floors;
    /* the prompt's family: the key at query_lengths[family_index] (-1: no family length) */
    int64_t family_index;
} kvc_forward_plan;

/* What a decision returns besides its arrays. */
typedef struct kvc_forward_result {
    int64_t best;      /* the score's argmin (kvc_score_joint's return value) */
    int64_t chosen;    /* best, or among workers scoring exactly as best the first one with the
                          least last_sent (when last_sent is given) */
    double lam;        /* the capacity price used */
    size_t n_keys;     /* query lengths that fit the prompt: keys written */
    unsigned miss;     /* kvc_miss_summary of chosen (KVC_MISS_* bits) */
    int64_t family;    /* the family key, or -1 if the prompt is shorter than the family length */
} kvc_forward_result;

/* kvc_forward_decide's answer when every worker scores +inf or NaN (none is eligible). */
enum kvc_forward_status {
    KVC_FORWARD_NONE_ELIGIBLE = 1
};

/* One decision for a prompt of n_tokens tokens (uint32 little-endian bytes).
 *   queue, belief [workers]: per-request score inputs; eligible [workers] or NULL (all);
 *   last_sent [workers] or NULL (no tie rotation): the dispatch counter of each worker;
 *   keys_out [n_query]: the prompt's keys at the lengths that fit (result->n_keys of them);
 *   matched_out, tier_out, scores_out [workers]: as kvc_lookup_plan and kvc_score_joint.
 * Returns KVC_OK; KVC_FORWARD_NONE_ELIGIBLE if the best score is +inf or NaN (the arrays and
 * result are still written); or KVC_ERR_ARG (no worker, bad query lengths or backend, a bad
 * lookup plan). */
int kvc_forward_decide(const kvc_forward_plan *plan, const uint8_t *token_bytes, size_t n_tokens,
                       const double *queue, const double *belief, const uint8_t *eligible,
                       const int64_t *last_sent, uint64_t *keys_out, int64_t *matched_out,
                       uint8_t *tier_out, double *scores_out, kvc_forward_result *result);

/* kvc_score_joint's scores (the same operations in the same order: the same bits) with its
 * argmin and the decision's tie rotation folded into the one pass over the workers: returns the
 * argmin (the first minimum, or the first NaN; -1 if n == 0) and writes to chosen_out the first
 * of the workers scoring exactly as it with the least last_sent (last_sent NULL: the argmin).
 * The queue's minimum (for lam) is taken in four lanes. What kvc_forward_decide runs. */
int64_t kvc_score_choose(size_t n, double prompt_len, const double *wan, const double *beta, const double *queue,
                         const double *belief, const int64_t *matched, const uint8_t *tier,
                         const double *local_factor, const double *remote_penalty, const uint8_t *eligible,
                         double gamma, double lambda_max, double tau, unsigned flags, const int64_t *last_sent,
                         double *scores_out, double *lam_out, int64_t *chosen_out);

/* The queue estimates carried to `now` (kvcompassd.core.queues, QueueEstimates._aged_ms):
 *   out[i] = max(0, ms[i] + rate[i] * max(0, (now - taken_at[i]) * 1000))
 * numpy's operations in numpy's order (np.maximum(0, x) keeps a NaN x), so the values are the
 * same bit for bit. out may be ms. */
void kvc_queue_aged(size_t n, const double *ms, const double *taken_at, const double *rate, double now,
                    double *out);

/* The indexes of the k lowest scores, best first, as the first k of numpy's stable argsort:
 * ascending score, equal scores in index order, NaN after every number. Writes min(k, n)
 * indexes to out and returns how many. O(n * k): for the few best candidates of a decision. */
size_t kvc_top_k(size_t n, const double *scores, size_t k, int64_t *out);

/* ---- the sparse decision: work in the holders, not in the workers ----------------------------
 *
 * At thousands of workers most of a decision's time went into per-worker passes whose answer
 * was known in advance: decoding every worker's field although a few groups hold the prompt, and
 * scoring every worker although a whole region's non-holders cannot beat the best score. The
 * sparse path decodes from per-group bit masks and scores holders first, then only the blocks of
 * workers whose lower bound can still reach the best score; its answers are those of the
 * functions above (tests hold them equal). */

/* kvc_lookup_plan's matched and tier for every worker, decoded from each group's run of hits
 * (bit masks) instead of a pass over every worker's levels: the work grows with the groups read
 * and the holders found, not with the workers. Reads go level by level over up to 512 groups
 * at a time, their views' headers fetched ahead (kvc_view_lookup_spread); a group's fields
 * without a worker are not read on.
 *   field_worker [groups * 32]: the worker whose 2-bit field is field f of group g at
 *                g * 32 + f, or -1 (each worker once: the inverse of worker_group/worker_shift).
 *   values_scratch [groups * max_levels]: left holding the values read, level-major (the value
 *                of group g at level l at l * groups + g: a level's reads are stored into a few
 *                lines, not one line per group; kvc_lookup_plan's are group-major); entries not
 *                read are left as they were: not zeroed.
 *   holders_out [workers]: the workers with a match, group by group; *n_holders_out of them.
 * Other arguments as kvc_lookup_plan. Returns KVC_OK, or KVC_ERR_ARG (no shard, a field_worker
 * entry out of range). */
int kvc_lookup_sparse(const kvc_view *const *views, size_t shards, size_t groups,
                      const uint64_t *keys, size_t n_keys,
                      const int64_t *level_lengths, const int32_t *level_keys, size_t max_levels,
                      const int32_t *field_worker, size_t workers, int consistency, uint64_t *values_scratch,
                      int64_t *matched_out, uint8_t *tier_out, int32_t *holders_out, size_t *n_holders_out);

/* Each group's mask of the fields field_worker names a worker for (the low bit of each such
 * 2-bit field), as kvc_lookup_sparse computes it on every call: masks_out [groups]. Returns
 * KVC_OK, or KVC_ERR_ARG (an entry naming a worker >= workers). */
int kvc_field_masks(const int32_t *field_worker, size_t groups, size_t workers, uint64_t *masks_out);

/* The score's lower bounds per block of `block` consecutive workers (n_blocks = ceil(n / block)):
 * each block's least wan, beta and remote_penalty. */
typedef struct kvc_score_blocks {
    size_t block;
    size_t n_blocks;
    const double *wan_min;
    const double *beta_min;
    const double *penalty_min;
} kvc_score_blocks;

/* kvc_score_choose's argmin, lam and tie rotation, scoring only the workers that can reach the
 * best score: first the `holders` (every worker with matched > 0 must be among them), then each
 * block whose bound (least wan + least queue + least beta x (1 + lam) x L [+ least penalty]: at
 * most any non-holder's score there, the same operations being monotone) is not above the best
 * so far. A skipped worker scores more than the best, so the argmin (the first minimum) and the
 * tie rotation (among scores equal to it, the first of the least last_sent) are kvc_score_choose's.
 * Its scores are written for the workers scored, bit for bit kvc_score_choose's; *complete_out
 * says whether that was every worker. The bound holds for finite wan, beta, belief, local_factor
 * and matched >= 0: the caller checks those (lookup_plan.SparseForwardKernel checks each belief
 * array once; the rest are the edge's constants and its lookup's output). A NaN in the queue, a
 * NaN score or a best score that is not finite take kvc_score_choose's full pass (complete).
 * Returns the argmin (-1 if n == 0). */
int64_t kvc_score_choose_pruned(size_t n, double prompt_len, const double *wan, const double *beta,
                                const double *queue, const double *belief, const int64_t *matched,
                                const uint8_t *tier, const double *local_factor, const double *remote_penalty,
                                const uint8_t *eligible, double gamma, double lambda_max, double tau, unsigned flags,
                                const int64_t *last_sent, const int32_t *holders, size_t n_holders,
                                const kvc_score_blocks *blocks, double *scores_out, double *lam_out,
                                int64_t *chosen_out, int *complete_out);

/* kvc_miss_summary from the holders alone (every worker with matched > 0, each once):
 * remote_floor_free says whether some remote worker has floors[i] <= 0 (a match of 0 reaches
 * it). The same bits as kvc_miss_summary. */
unsigned kvc_miss_summary_holders(const int32_t *holders, size_t n_holders, const int64_t *matched,
                                  const uint8_t *local, const int64_t *floors, int remote_floor_free,
                                  const double *scores, const double *queue, size_t chosen, size_t n);

/* The sparse decision's constants besides kvc_forward_plan's; arrays borrowed. */
typedef struct kvc_forward_sparse {
    const int32_t *field_worker;  /* [groups * 32], as kvc_lookup_sparse */
    kvc_score_blocks blocks;      /* the caller refreshes beta_min when beta changes */
    int remote_floor_free;        /* as kvc_miss_summary_holders */
    int32_t *holders;             /* [workers] scratch, left holding the holders */
    /* the queue estimates' arrays kvc_forward_decide_sparse_aged reads, [workers] each: when each
     * value was taken, its rate (ms per ms), the occupancy added, the worker's correction slot */
    const double *taken_at;
    const double *rate;
    const double *occupancy;
    const int64_t *region_slot;
    /* [groups] or NULL: kvc_field_masks of field_worker, made once (else computed per call) */
    const uint64_t *group_fields;
} kvc_forward_sparse;

typedef struct kvc_forward_sparse_result {
    int64_t best;
    int64_t chosen;
    double lam;
    size_t n_keys;
    unsigned miss;
    int64_t family;
    size_t n_holders;   /* holders written to sparse->holders */
    int complete;       /* every worker's score was written (else holders' and unpruned blocks') */
    /* kvc_forward_decide_sparse_out only: the matched length and tier of `chosen` and of `best`
     * (0 when out of range), so that a caller reading no more than the winner needs no view of
     * the arrays */
    int64_t chosen_matched;
    int64_t best_matched;
    uint8_t chosen_tier;
    uint8_t best_tier;
} kvc_forward_sparse_result;

/* kvc_forward_decide on the sparse path: kvc_prefix_keys, kvc_lookup_sparse,
 * kvc_score_choose_pruned, kvc_miss_summary_holders. The same answers as kvc_forward_decide
 * except that scores_out holds only the scores result->complete says (the workers not scored
 * score above the best). Returns as kvc_forward_decide. */
int kvc_forward_decide_sparse(const kvc_forward_plan *plan, const kvc_forward_sparse *sparse,
                              const uint8_t *token_bytes, size_t n_tokens, const double *queue,
                              const double *belief, const uint8_t *eligible, const int64_t *last_sent,
                              uint64_t *keys_out, int64_t *matched_out, uint8_t *tier_out, double *scores_out,
                              kvc_forward_sparse_result *result);

/* kvc_forward_decide_sparse scoring the queue estimates it first carries to `now`
 * (kvcompassd.core.queues, QueueEstimates.queue_ms(now)) from the values `ms` and the arrays
 * sparse->aging names: aged_out[i] as kvc_queue_aged, then
 *   queue_out[i] = (aged_out[i] + correction[region_slot[i]]) + occupancy[i]
 * in numpy's order, the correction left out when NULL and the occupancy unless add_occupancy
 * (queue_out may be aged_out when neither is added). One call for the decision and the
 * estimates it reads. */
int kvc_forward_decide_sparse_aged(const kvc_forward_plan *plan, const kvc_forward_sparse *sparse,
                                   const uint8_t *token_bytes, size_t n_tokens, const double *ms, double now,
                                   const double *correction, int add_occupancy, const double *belief,
                                   const uint8_t *eligible, const int64_t *last_sent, uint64_t *keys_out,
                                   int64_t *matched_out, uint8_t *tier_out, double *scores_out, double *aged_out,
                                   double *queue_out, kvc_forward_sparse_result *result);

/* kvc_forward_decide_sparse_aged writing every per-worker output into one caller-owned buffer
 * `out` of 4 * workers + ceil(workers / 8) + 3 + ceil(workers / 2) doubles and an aging record of
 * 4 + 2 * B + ceil(workers / 2) + ceil(workers / 64) + ceil(B / 64) doubles, B = ceil(workers / 16)
 * (one allocation and one pointer per decision instead of five), laid out as
 *   out[0, n)            scores (as scores_out; result->complete says which were written)
 *   out[n, 2n)           the estimates carried to now (aged_out)
 *   out[2n, 3n)          the estimates scored (queue_out), written only when `correction` is
 *                        given or add_occupancy is set; otherwise the decision scored out[n, 2n)
 *   out[3n, 4n)          matched lengths, as int64_t (matched_out)
 *   out[4n, ...)         tiers, as n uint8_t (tier_out)
 *   out[4n + ceil(n / 8)] lam
 *   then the zeroing record: a flag, 1.0 when the matched lengths and tiers are 0 except at the
 *   workers listed after it (what this call leaves), anything else when they are unknown (a new
 *   buffer, or one the caller wrote into: the caller sets the flag to 0.0); their count; the
 *   listed workers as int32_t. A buffer reused with the flag set has only the listed entries
 *   zeroed before the lookup instead of all n (at 10,000 workers, 90 KB written per decision);
 *   otherwise all of them.
 *   then the aging record, used when `changes` is given and no correction is added: a flag
 *   (1.0 when the record is current for the aged values scored alone, 2.0 when current for the
 *   aged values and the scored ones with the occupancy added; anything else: unknown, as in a new
 *   buffer, which the caller sets to 0.0; a record made for the other kind is not current), the
 *   change count and the now it is current to, how many workers it lists as moving; each block of
 *   16 workers' least scored value and whether it holds a NaN; the moving workers as int32_t, and
 *   bit sets of them and of blocks to redo. With add_occupancy, the caller logs a worker whose
 *   occupancy it changes too (out[2n, 3n) then carries over with the aged values).
 *   `changes` is the change log of `ms`, sparse->taken_at and sparse->rate (NULL: none; the
 *   aging record is then cleared): changes[0] counts the workers logged so far, changes[1] is a
 *   count below which a record is not current (everything changed then), changes[2] the log's
 *   capacity C, and change number s names its worker at changes[3 + s % C]. The caller logs every
 *   worker whose ms, taken_at or rate it changes (ms: a new array with the same values elsewhere).
 *   A record current to count k, at a now not after this one, with at most C changes logged since
 *   k, lets the call age only the workers logged since and those listed as moving (a worker not
 *   moving holds its aged value at any later now: its rate is 0, or negative with its value
 *   clamped to 0), and take the least estimate from the blocks; otherwise it ages every worker and
 *   makes the record anew. The aged values are kvc_queue_aged's, bit for bit, either way.
 * and the matched length and tier of the chosen and the best worker in result->chosen_matched,
 * chosen_tier, best_matched and best_tier. `fields_out` [KVC_OUT_FIELDS] receives the result's
 * integers as the kvc_forward_out_field enum orders them (a caller reads them in one go rather
 * than field by field: cffi's struct reads cost ~0.1 us each).
 * Returns as kvc_forward_decide_sparse_aged. */
enum kvc_forward_out_field {
    KVC_OUT_BEST, KVC_OUT_CHOSEN, KVC_OUT_MISS, KVC_OUT_FAMILY, KVC_OUT_COMPLETE, KVC_OUT_CHOSEN_MATCHED,
    KVC_OUT_CHOSEN_TIER, KVC_OUT_BEST_MATCHED, KVC_OUT_BEST_TIER, KVC_OUT_FIELDS
};
int kvc_forward_decide_sparse_out(const kvc_forward_plan *plan, const kvc_forward_sparse *sparse,
                                  const uint8_t *token_bytes, size_t n_tokens, const double *ms, double now,
                                  const double *correction, int add_occupancy, const double *belief,
                                  const uint8_t *eligible, const int64_t *last_sent, uint64_t *keys_out,
                                  double *out, kvc_forward_sparse_result *result, int64_t *fields_out,
                                  const int64_t *changes);

/* CDEF-END */

#endif /* KVC_FORWARD_H */
