/*
 * ludo_locator.h -- the maintenance side's Othello locator: one bit per key (which of its two
 * candidate buckets holds it) stored as A[a] xor B[b]. Keys are edges between cell a of A and
 * cell b of B; the graph is kept a forest so a key's bit can be set by flipping one side of it.
 */
#ifndef KVC_LUDO_LOCATOR_H
#define KVC_LUDO_LOCATOR_H

#include "ludo_internal.h"

#define KVC_NO_EDGE UINT32_MAX
#define KVC_LOC_CYCLE 1 /* internal, positive: the key's edge would close a cycle */

/* A maintenance-side bucket: keys and values share one cache line, edges and seed the next
 * (96 bytes: every bucket spans exactly two lines of a 64-byte-aligned array). */
typedef struct kvc_bucket {
    uint64_t key[4]; /* UINT64_MAX = empty */
    uint64_t val[4];
    uint32_t edge[4]; /* locator edge of each slot's key */
    uint16_t seed;    /* slot seed */
    uint16_t pad[7];
} kvc_bucket;

typedef struct kvc_locator {
    uint32_t ma, mb, wa, wb;
    uint64_t seed;
    uint64_t *words;          /* A words [0, wa) then B words [wa, wa + wb) */
    uint32_t *head;           /* per cell (A cells, then B cells at ma + b): first half-edge */
    struct kvc_half {         /* half-edge 2e (A end) / 2e+1 (B end): its cell, next at the cell */
        uint32_t node, next;  /* together, so a walk step costs one cache miss per edge */
    } *half;
    uint32_t ecap, efree;     /* edge capacity (= slots) and free-list head */
    struct kvc_walk {           /* a depth-first walk over one tree; two run side by side */
        uint32_t *node, *from;  /* stack: cell and the edge it was reached by */
        size_t sp, cap;
        uint32_t *comp;         /* cells visited so far */
        size_t comp_n, comp_cap;
    } walk[2];
    uint32_t *touched; /* indices of words changed since the table last emitted records */
    size_t touched_n, touched_cap;
} kvc_locator;

/* Build from every key in buckets[nb]; a key in its candidate bucket b1 gets bit 1. On success
 * writes each key's edge id into its bucket and returns KVC_OK; KVC_LOC_CYCLE if the graph under
 * this seed has a cycle (nothing written), or KVC_ERR_NOMEM. */
int kvc_locator_build(kvc_locator *out, uint32_t ma, uint32_t mb, uint64_t seed,
                      kvc_bucket *buckets, uint32_t nb, uint64_t bucket_seed);
void kvc_locator_free(kvc_locator *loc);
/* Add a key's edge with the given bit; KVC_LOC_CYCLE (nothing changed) if it would close a cycle. */
int kvc_locator_add(kvc_locator *loc, uint64_t key, unsigned bit, uint32_t *edge_out);
/* Invert the bit of the key owning `edge` (flips the cells on one side of it). */
int kvc_locator_flip(kvc_locator *loc, uint32_t edge);
/* Drop a key's edge; the remaining keys' bits are unchanged. */
void kvc_locator_remove(kvc_locator *loc, uint32_t edge);
uint64_t kvc_locator_memory_bytes(const kvc_locator *loc);

#endif
