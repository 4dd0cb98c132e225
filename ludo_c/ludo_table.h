/*
 * ludo_table.h -- private to the maintenance table: its structures, shared by ludo_table.c (the
 * operations) and ludo_stream.c (update records and snapshots).
 */
#ifndef KVC_LUDO_TABLE_H
#define KVC_LUDO_TABLE_H

#include "ludo_internal.h"
#include "ludo_locator.h"

#define EMPTY_KEY UINT64_MAX
#define MAX_CUCKOO_DEPTH 5
#define BFS_CAP 4096 /* 2 roots x (1 + 4 + ... + 4^5) = 2730 nodes at most */
#define MAX_REBUILD_ATTEMPTS 64

/* Buckets of 4 slots; a key sits at the slot its bucket's seed sends it to. A slot is named by
 * its global index b * 4 + i. */
typedef struct kvc_store {
    uint32_t nb;
    uint64_t bucket_seed, slot_base;
    kvc_bucket *bk;
    uint64_t overflow; /* buckets with seed > KVC_SEED_INLINE_MAX */
} kvc_store;

#define SKEY(s, x) ((s)->bk[(x) >> 2].key[(x) & 3u])
#define SVAL(s, x) ((s)->bk[(x) >> 2].val[(x) & 3u])
#define SEDGE(s, x) ((s)->bk[(x) >> 2].edge[(x) & 3u])

typedef struct bfs_node {
    uint64_t key;   /* key moved from the parent bucket into this one */
    uint32_t bucket;
    int32_t parent;
    uint32_t depth;
} bfs_node;

typedef struct byte_buf {
    uint8_t *p;
    size_t len, cap;
} byte_buf;

struct kvc_table {
    uint64_t table_id, epoch;
    unsigned value_bits, fp_bits;
    double max_load;
    uint64_t fp_seed;
    uint64_t size, max_size;
    kvc_store st;
    kvc_locator loc;
    bfs_node *bfs;
    uint32_t moved_edges[MAX_CUCKOO_DEPTH + 1];
    unsigned moved_n;
    uint32_t touched_buckets[2 * MAX_CUCKOO_DEPTH + 4];
    unsigned touched_n;
    byte_buf rec_buckets, rec_words;
    uint32_t rec_bucket_n, rec_word_n;
    int needs_snapshot;
};

/* Append the absolute state of every bucket and locator word the last operation touched to the
 * pending records (nothing while a snapshot is due). */
int kvc_emit_touched(kvc_table *t);

#endif /* KVC_LUDO_TABLE_H */
