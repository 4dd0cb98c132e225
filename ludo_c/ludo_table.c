/*
 * ludo_table.c -- the maintenance side of a Ludo table: full keys, cuckoo placement, per-bucket
 * slot seeds, an Othello locator kept acyclic, growth by rebuild. Records: ludo_stream.c.
 */
#include <stdlib.h>
#include <math.h>

#include "ludo_table.h"

/* ---------------------------------------------------------------- store */

static void store_free(kvc_store *s)
{
    free(s->bk);
    memset(s, 0, sizeof *s);
}

static int store_alloc(kvc_store *s, uint32_t nb, uint64_t bucket_seed)
{
    memset(s, 0, sizeof *s);
    s->nb = nb;
    s->bucket_seed = bucket_seed;
    s->slot_base = kvc_slot_base(bucket_seed);
    s->bk = kvc_alloc((size_t)nb * sizeof *s->bk, 0);
    if (!s->bk)
        return KVC_ERR_NOMEM;
    for (uint32_t b = 0; b < nb; b++) {
        kvc_bucket *k = &s->bk[b];
        memset(k, 0, sizeof *k);
        for (unsigned i = 0; i < 4; i++) {
            k->key[i] = EMPTY_KEY;
            k->edge[i] = KVC_NO_EDGE;
        }
    }
    return KVC_OK;
}

static inline unsigned bucket_count(const kvc_store *s, uint32_t b)
{
    const uint64_t *k = s->bk[b].key;
    return (k[0] != EMPTY_KEY) + (k[1] != EMPTY_KEY) + (k[2] != EMPTY_KEY) + (k[3] != EMPTY_KEY);
}

static inline int64_t store_find(const kvc_store *s, uint64_t key)
{
    uint32_t b0, b1;
    kvc_buckets(key, s->bucket_seed, s->nb, &b0, &b1);
    const uint64_t *k0 = s->bk[b0].key, *k1 = s->bk[b1].key;
    for (unsigned i = 0; i < 4; i++) {
        if (k0[i] == key)
            return (int64_t)b0 * 4 + i;
        if (k1[i] == key)
            return (int64_t)b1 * 4 + i;
    }
    return -1;
}

/* Find the smallest seed sending the bucket's keys to distinct slots and lay them out by it. */
static int store_reseed(kvc_store *s, uint32_t b)
{
    size_t base = (size_t)b * 4u;
    uint64_t k[4], v[4];
    uint32_t e[4];
    unsigned n = 0;
    for (unsigned i = 0; i < 4; i++) {
        if (SKEY(s, base + i) != EMPTY_KEY) {
            k[n] = SKEY(s, base + i);
            v[n] = SVAL(s, base + i);
            e[n] = SEDGE(s, base + i);
            n++;
        }
    }
    /* Test 32 seeds at once: bits[i] holds key i's slot for each seed of the group as 2-bit
     * lanes; a seed works when every pair of keys differs in its lane. */
    const uint64_t lanes = UINT64_C(0x5555555555555555);
    unsigned seed = 0;
    for (unsigned group = 0;; group++) {
        if (group > KVC_SEED_LIMIT / 32u)
            return KVC_ERR_FULL; /* astronomically unlikely; the caller rebuilds */
        uint64_t bits[4], ok = lanes;
        for (unsigned i = 0; i < n; i++)
            bits[i] = kvc_slot_bits(k[i], s->slot_base, group);
        for (unsigned i = 0; i < n; i++)
            for (unsigned j = i + 1; j < n; j++) {
                uint64_t d = bits[i] ^ bits[j];
                ok &= (d | (d >> 1)) & lanes;
            }
        if (ok) {
            seed = group * 32u + (unsigned)__builtin_ctzll(ok) / 2u;
            break;
        }
    }
    unsigned slot[4];
    for (unsigned i = 0; i < n; i++)
        slot[i] = kvc_slot(k[i], s->slot_base, seed);
    for (unsigned i = 0; i < 4; i++) {
        SKEY(s, base + i) = EMPTY_KEY;
        SVAL(s, base + i) = 0;
        SEDGE(s, base + i) = KVC_NO_EDGE;
    }
    for (unsigned i = 0; i < n; i++) {
        SKEY(s, base + slot[i]) = k[i];
        SVAL(s, base + slot[i]) = v[i];
        SEDGE(s, base + slot[i]) = e[i];
    }
    s->overflow -= s->bk[b].seed > KVC_SEED_INLINE_MAX;
    s->overflow += seed > KVC_SEED_INLINE_MAX;
    s->bk[b].seed = (uint16_t)seed;
    return KVC_OK;
}

static void store_put_any(kvc_store *s, uint32_t b, uint64_t key, uint64_t val, uint32_t edge)
{
    size_t base = (size_t)b * 4u;
    for (unsigned i = 0; i < 4; i++) {
        if (SKEY(s, base + i) == EMPTY_KEY) {
            SKEY(s, base + i) = key;
            SVAL(s, base + i) = val;
            SEDGE(s, base + i) = edge;
            return;
        }
    }
}

static void touch_bucket(kvc_table *t, uint32_t b)
{
    for (unsigned i = 0; i < t->touched_n; i++)
        if (t->touched_buckets[i] == b)
            return;
    t->touched_buckets[t->touched_n++] = b;
}

static int path_has(const bfs_node *q, int32_t i, uint32_t bucket)
{
    for (; i >= 0; i = q[i].parent)
        if (q[i].bucket == bucket)
            return 1;
    return 0;
}

/* Place a new key in store s: a free slot of b0/b1, else a BFS cuckoo path of depth <= 5.
 * Records touched buckets and the locator edges of moved keys in t's scratch lists.
 * Returns KVC_OK, or KVC_ERR_FULL with s unchanged when there is no path. */
static int store_place(kvc_table *t, kvc_store *s, uint64_t key, uint64_t val, uint32_t *bucket_out)
{
    uint32_t b0, b1;
    kvc_buckets(key, s->bucket_seed, s->nb, &b0, &b1);
    unsigned c0 = bucket_count(s, b0), c1 = bucket_count(s, b1);
    t->moved_n = 0;
    t->touched_n = 0;
    if (c0 < 4 || c1 < 4) {
        uint32_t target = (c0 <= c1) ? b0 : b1;
        store_put_any(s, target, key, val, KVC_NO_EDGE);
        touch_bucket(t, target);
        *bucket_out = target;
        return store_reseed(s, target);
    }
    bfs_node *q = t->bfs;
    int32_t qn = 2, found = -1;
    q[0] = (bfs_node){key, b0, -1, 0};
    q[1] = (bfs_node){key, b1, -1, 0};
    for (int32_t head = 0; head < qn && found < 0; head++) {
        if (q[head].depth >= MAX_CUCKOO_DEPTH)
            continue;
        uint32_t b = q[head].bucket, alt[4];
        for (unsigned i = 0; i < 4; i++) { /* fetch the 4 alternate buckets together */
            uint32_t kb0, kb1;
            kvc_buckets(SKEY(s, (size_t)b * 4u + i), s->bucket_seed, s->nb, &kb0, &kb1);
            alt[i] = (kb0 == b) ? kb1 : kb0;
            __builtin_prefetch(&s->bk[alt[i]].key[0]);
        }
        for (unsigned i = 0; i < 4 && found < 0; i++) {
            if (path_has(q, head, alt[i]) || qn >= BFS_CAP)
                continue;
            q[qn] = (bfs_node){SKEY(s, (size_t)b * 4u + i), alt[i], head, q[head].depth + 1};
            if (bucket_count(s, alt[i]) < 4)
                found = qn;
            qn++;
        }
    }
    if (found < 0)
        return KVC_ERR_FULL;
    int32_t i = found;
    while (q[i].parent >= 0) {
        int32_t p = q[i].parent;
        size_t from = (size_t)q[p].bucket * 4u;
        unsigned j = 0;
        while (SKEY(s, from + j) != q[i].key)
            j++;
        uint32_t e = SEDGE(s, from + j);
        store_put_any(s, q[i].bucket, SKEY(s, from + j), SVAL(s, from + j), e);
        SKEY(s, from + j) = EMPTY_KEY;
        SVAL(s, from + j) = 0;
        SEDGE(s, from + j) = KVC_NO_EDGE;
        if (e != KVC_NO_EDGE) {
            t->moved_edges[t->moved_n++] = e;
            if (s == &t->st) /* its tree walk comes after the reseeds: start fetching now */
                __builtin_prefetch(&t->loc.half[2u * e]);
        }
        touch_bucket(t, q[i].bucket);
        i = p;
    }
    store_put_any(s, q[i].bucket, key, val, KVC_NO_EDGE);
    touch_bucket(t, q[i].bucket);
    *bucket_out = q[i].bucket;
    for (unsigned k = 0; k < t->touched_n; k++) {
        int rc = store_reseed(s, t->touched_buckets[k]);
        if (rc != KVC_OK)
            return rc;
    }
    return KVC_OK;
}

/* ---------------------------------------------------------------- rebuilds */

#ifndef KVC_LOCATOR_A_PER_SLOT
#define KVC_LOCATOR_A_PER_SLOT 1.6
#endif
#ifndef KVC_LOCATOR_B_PER_SLOT
#define KVC_LOCATOR_B_PER_SLOT 1.2
#endif
static uint32_t locator_cells_a(uint32_t nb) { return (uint32_t)ceil(KVC_LOCATOR_A_PER_SLOT * 4.0 * nb) + 64u; }
static uint32_t locator_cells_b(uint32_t nb) { return (uint32_t)ceil(KVC_LOCATOR_B_PER_SLOT * 4.0 * nb) + 64u; }

/* Build a fresh acyclic locator for store s, reseeding until the key graph has no cycle. */
static int build_locator_for(kvc_table *t, kvc_store *s, uint64_t epoch, kvc_locator *out)
{
    for (uint64_t attempt = 0; attempt < MAX_REBUILD_ATTEMPTS; attempt++) {
        uint64_t seed = kvc_derive(t->table_id, epoch * 1000003u + attempt + 0x10000u);
        int rc = kvc_locator_build(out, locator_cells_a(s->nb), locator_cells_b(s->nb), seed,
                                   s->bk, s->nb, s->bucket_seed);
        if (rc != KVC_LOC_CYCLE)
            return rc;
    }
    return KVC_ERR_FULL;
}

static int locator_rebuild(kvc_table *t)
{
    kvc_locator fresh;
    int rc = build_locator_for(t, &t->st, t->epoch + 1, &fresh);
    if (rc != KVC_OK)
        return rc;
    kvc_locator_free(&t->loc);
    t->loc = fresh;
    t->epoch++;
    t->needs_snapshot = 1;
    return KVC_OK;
}

static void set_max_size(kvc_table *t)
{
    t->max_size = (uint64_t)floor(t->max_load * 4.0 * (double)t->st.nb);
}

/* Rebuild into at least `nb` buckets under a new epoch: new bucket seed, new locator. */
static int grow(kvc_table *t, uint64_t nb)
{
    for (uint64_t attempt = 0;; attempt++) {
        if (nb >= KVC_MAX_BUCKETS)
            return KVC_ERR_FULL;
        kvc_store s;
        uint64_t bseed = kvc_derive(t->table_id, (t->epoch + 1) * 1000003u + attempt);
        int rc = store_alloc(&s, (uint32_t)nb, bseed);
        if (rc != KVC_OK)
            return rc;
        size_t slots = (size_t)t->st.nb * 4u;
        for (size_t i = 0; i < slots && rc == KVC_OK; i++) {
            uint32_t b;
            if (SKEY(&t->st, i) != EMPTY_KEY)
                rc = store_place(t, &s, SKEY(&t->st, i), SVAL(&t->st, i), &b);
        }
        t->touched_n = 0;
        if (rc == KVC_ERR_FULL) {
            store_free(&s);
            nb = nb + nb / 4u + 1u;
            continue;
        }
        kvc_locator fresh;
        if (rc == KVC_OK)
            rc = build_locator_for(t, &s, t->epoch + 1, &fresh);
        if (rc != KVC_OK) {
            store_free(&s);
            return rc;
        }
        store_free(&t->st);
        kvc_locator_free(&t->loc);
        t->st = s;
        t->loc = fresh;
        t->epoch++;
        t->needs_snapshot = 1;
        set_max_size(t);
        return KVC_OK;
    }
}

/* ---------------------------------------------------------------- public: lifecycle */

int kvc_table_new(kvc_table **out, uint64_t capacity, unsigned value_bits,
                  unsigned fingerprint_bits, double max_load, uint64_t seed)
{
    if (!out || (value_bits != 32 && value_bits != 64) || fingerprint_bits > 16 ||
        !(max_load > 0.0 && max_load <= 0.98))
        return KVC_ERR_ARG;
    double want = ceil((double)(capacity ? capacity : 1) / (4.0 * max_load));
    if (want >= (double)KVC_MAX_BUCKETS)
        return KVC_ERR_ARG;
    uint32_t nb = want < 2.0 ? 2u : (uint32_t)want;
    kvc_table *t = kvc_alloc((1) * sizeof *t, 1);
    if (!t)
        return KVC_ERR_NOMEM;
    t->table_id = seed;
    t->epoch = 1;
    t->value_bits = value_bits;
    t->fp_bits = fingerprint_bits;
    t->max_load = max_load;
    t->bfs = kvc_alloc(BFS_CAP * sizeof *t->bfs, 0);
    int rc = t->bfs ? store_alloc(&t->st, nb, kvc_derive(seed, t->epoch * 1000003u)) : KVC_ERR_NOMEM;
    if (rc == KVC_OK)
        rc = build_locator_for(t, &t->st, t->epoch, &t->loc);
    if (rc != KVC_OK) {
        kvc_table_free(t);
        return rc;
    }
    t->fp_seed = kvc_fp_seed(t->table_id);
    set_max_size(t);
    *out = t;
    return KVC_OK;
}

void kvc_table_free(kvc_table *t)
{
    if (!t)
        return;
    store_free(&t->st);
    kvc_locator_free(&t->loc);
    free(t->bfs);
    free(t->rec_buckets.p);
    free(t->rec_words.p);
    free(t);
}

/* ---------------------------------------------------------------- public: operations */

static int check_value(const kvc_table *t, uint64_t value)
{
    if (value == 0 || (t->value_bits == 32 && value > UINT32_MAX))
        return KVC_ERR_VALUE_RANGE;
    return KVC_OK;
}

int kvc_table_insert(kvc_table *t, uint64_t key, uint64_t value)
{
    if (key >= KVC_KEY_LIMIT)
        return KVC_ERR_KEY_RANGE;
    int rc = check_value(t, value);
    if (rc != KVC_OK)
        return rc;
    if (store_find(&t->st, key) >= 0)
        return KVC_ERR_PRESENT;
    if (t->size + 1 > t->max_size) {
        rc = grow(t, (uint64_t)t->st.nb + t->st.nb / 2u + 1u);
        if (rc != KVC_OK)
            return rc;
    }
    uint32_t bucket;
    for (;;) {
        rc = store_place(t, &t->st, key, value, &bucket);
        if (rc != KVC_ERR_FULL)
            break;
        /* No cuckoo path (or, never in practice, no slot seed): rebuild larger. A failed reseed
         * may have left a bucket unordered; the rebuild re-places every key from scratch. */
        t->touched_n = 0;
        int64_t at = store_find(&t->st, key);
        rc = grow(t, (uint64_t)t->st.nb + t->st.nb / 2u + 1u);
        if (rc != KVC_OK)
            return rc;
        if (at >= 0) { /* the key made it in before the reseed failure; the rebuild kept it */
            t->size++;
            return KVC_OK;
        }
    }
    if (rc != KVC_OK)
        return rc;
    kvc_locator *L = &t->loc;
    for (unsigned i = 0; i < t->moved_n; i++) { /* both ends of every moved key's edge */
        __builtin_prefetch(&L->head[L->half[2u * t->moved_edges[i]].node]);
        __builtin_prefetch(&L->head[L->half[2u * t->moved_edges[i] + 1u].node]);
    }
    for (unsigned i = 0; i < t->moved_n && rc == KVC_OK; i++)
        rc = kvc_locator_flip(L, t->moved_edges[i]);
    uint32_t b0, b1, edge;
    kvc_buckets(key, t->st.bucket_seed, t->st.nb, &b0, &b1);
    if (rc == KVC_OK)
        rc = kvc_locator_add(L, key, bucket == b1, &edge);
    t->size++;
    if (rc == KVC_OK) {
        SEDGE(&t->st, store_find(&t->st, key)) = edge;
    } else {
        /* a cycle (or, rarely, no memory for a tree walk): rebuild the locator from the store */
        rc = locator_rebuild(t);
        if (rc != KVC_OK)
            return rc;
    }
    return kvc_emit_touched(t);
}

int kvc_table_update(kvc_table *t, uint64_t key, uint64_t value)
{
    if (key >= KVC_KEY_LIMIT)
        return KVC_ERR_KEY_RANGE;
    int rc = check_value(t, value);
    if (rc != KVC_OK)
        return rc;
    int64_t at = store_find(&t->st, key);
    if (at < 0)
        return KVC_ERR_ABSENT;
    SVAL(&t->st, at) = value;
    t->touched_n = 0;
    touch_bucket(t, (uint32_t)(at / 4));
    return kvc_emit_touched(t);
}

int kvc_table_remove(kvc_table *t, uint64_t key)
{
    if (key >= KVC_KEY_LIMIT)
        return KVC_ERR_KEY_RANGE;
    int64_t at = store_find(&t->st, key);
    if (at < 0)
        return KVC_ERR_ABSENT;
    kvc_locator_remove(&t->loc, SEDGE(&t->st, at));
    SKEY(&t->st, at) = EMPTY_KEY;
    SVAL(&t->st, at) = 0;
    SEDGE(&t->st, at) = KVC_NO_EDGE;
    uint32_t b = (uint32_t)(at / 4);
    int rc = store_reseed(&t->st, b); /* fewer keys always fit: seed search ends quickly */
    t->size--;
    if (rc != KVC_OK)
        return rc;
    t->touched_n = 0;
    touch_bucket(t, b);
    return kvc_emit_touched(t);
}

int kvc_table_get(const kvc_table *t, uint64_t key, uint64_t *value_out)
{
    if (key >= KVC_KEY_LIMIT)
        return KVC_ERR_KEY_RANGE;
    int64_t at = store_find(&t->st, key);
    if (at < 0)
        return 0;
    if (value_out)
        *value_out = SVAL(&t->st, at);
    return 1;
}

/* Batches know their next keys: start fetching those keys' buckets (and, for inserts, locator
 * cells) a few operations ahead so the cache misses overlap with the current operation. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 8
#endif

static inline void prefetch_key(const kvc_table *t, uint64_t key, int with_locator)
{
    uint32_t b0, b1;
    kvc_buckets(key, t->st.bucket_seed, t->st.nb, &b0, &b1);
    __builtin_prefetch(&t->st.bk[b0].key[0]);
    __builtin_prefetch(&t->st.bk[b0].val[3]);
    __builtin_prefetch(&t->st.bk[b0].seed);
    __builtin_prefetch(&t->st.bk[b1].key[0]);
    __builtin_prefetch(&t->st.bk[b1].val[3]);
    __builtin_prefetch(&t->st.bk[b1].seed);
    if (with_locator) {
        uint32_t a, b;
        kvc_cells(key, t->loc.seed, t->loc.ma, t->loc.mb, &a, &b);
        __builtin_prefetch(&t->loc.head[a]);
        __builtin_prefetch(&t->loc.head[t->loc.ma + b]);
        __builtin_prefetch(&t->loc.words[a >> 6]);
        __builtin_prefetch(&t->loc.words[t->loc.wa + (b >> 6)]);
    }
}

int kvc_table_insert_many(kvc_table *t, const uint64_t *keys, const uint64_t *values,
                          size_t n, size_t *done)
{
    size_t i = 0;
    int rc = KVC_OK;
    for (; i < n && rc == KVC_OK; i++) {
        if (i + PREFETCH_AHEAD < n)
            prefetch_key(t, keys[i + PREFETCH_AHEAD], 1);
        rc = kvc_table_insert(t, keys[i], values[i]);
    }
    *done = rc == KVC_OK ? i : i - 1;
    return rc;
}

int kvc_table_update_many(kvc_table *t, const uint64_t *keys, const uint64_t *values,
                          size_t n, size_t *done)
{
    size_t i = 0;
    int rc = KVC_OK;
    for (; i < n && rc == KVC_OK; i++) {
        if (i + PREFETCH_AHEAD < n)
            prefetch_key(t, keys[i + PREFETCH_AHEAD], 0);
        rc = kvc_table_update(t, keys[i], values[i]);
    }
    *done = rc == KVC_OK ? i : i - 1;
    return rc;
}

int kvc_table_remove_many(kvc_table *t, const uint64_t *keys, size_t n, size_t *done)
{
    size_t i = 0;
    int rc = KVC_OK;
    for (; i < n && rc == KVC_OK; i++) {
        if (i + PREFETCH_AHEAD < n)
            prefetch_key(t, keys[i + PREFETCH_AHEAD], 0);
        rc = kvc_table_remove(t, keys[i]);
    }
    *done = rc == KVC_OK ? i : i - 1;
    return rc;
}

/* One field edit of kvc_table_edit_fields (arguments checked by the caller): the key's status,
 * or a table error (NOMEM, FULL) as a negative value. */
static inline int edit_field(kvc_table *t, uint64_t key, uint8_t op, const uint8_t *op_field,
                             const uint8_t *op_needs_held, unsigned shift, uint64_t mask)
{
    int64_t at = store_find(&t->st, key);
    uint64_t old = at >= 0 ? SVAL(&t->st, at) : 0;
    uint64_t field = (old & mask) >> shift, want = op_field[op];
    if (field == 0 && op_needs_held[op])
        return KVC_EDIT_REFUSED;
    if (field == want)
        return KVC_EDIT_UNCHANGED;
    uint64_t value = (old & ~mask) | (want << shift);
    int rc = at < 0 ? kvc_table_insert(t, key, value)
             : value == 0 ? kvc_table_remove(t, key)
                          : kvc_table_update(t, key, value);
    return rc != KVC_OK ? rc : KVC_EDIT_CHANGED;
}

static int edit_args_ok(const kvc_table *t, const uint8_t *op_field, unsigned n_ops, unsigned shift,
                        unsigned width)
{
    if (width == 0 || width > 8 || shift + width > t->value_bits)
        return 0;
    for (unsigned o = 0; o < n_ops; o++)
        if (op_field[o] >> width)
            return 0;
    return 1;
}

int kvc_table_edit_fields(kvc_table *t, const uint64_t *keys, const uint8_t *ops, size_t n,
                          const uint8_t *op_field, const uint8_t *op_needs_held, unsigned n_ops,
                          unsigned shift, unsigned width, uint8_t *status_out, size_t *done)
{
    *done = 0;
    if (!edit_args_ok(t, op_field, n_ops, shift, width))
        return KVC_ERR_ARG;
    const uint64_t mask = ((UINT64_C(1) << width) - 1u) << shift;
    for (size_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n)
            prefetch_key(t, keys[i + PREFETCH_AHEAD], 1);
        uint64_t key = keys[i];
        if (ops[i] >= n_ops)
            return KVC_ERR_ARG;
        if (key >= KVC_KEY_LIMIT)
            return KVC_ERR_KEY_RANGE;
        int rc = edit_field(t, key, ops[i], op_field, op_needs_held, shift, mask);
        if (rc < 0)
            return rc;
        status_out[i] = (uint8_t)rc;
        *done = i + 1;
    }
    return KVC_OK;
}

/* The header lines of a table that prefetch_key and an edit read first. */
static inline void prefetch_table(const kvc_table *t)
{
    const char *p = (const char *)t;
    __builtin_prefetch(p);
    __builtin_prefetch(p + 64);
    __builtin_prefetch(p + 128);
    __builtin_prefetch(p + 192);
}

/* The row of kvc_tables_edit_routed's membership an event of `length` uses: its index among the
 * ascending `known` lengths, or n_known when it is none of them. */
static inline size_t route_row(const uint32_t *known, size_t n_known, uint32_t length)
{
    size_t lo = 0, hi = n_known;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (known[mid] < length)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n_known && known[lo] == length ? lo : n_known;
}

int kvc_tables_edit_routed(kvc_table *full, kvc_table *const *streams, size_t n_streams,
                           const uint64_t *keys, const uint8_t *ops, const uint32_t *lengths, size_t n,
                           const uint32_t *known, size_t n_known,
                           const uint32_t *row_start, const uint32_t *row_streams,
                           const uint8_t *op_field, const uint8_t *op_needs_held, unsigned n_ops,
                           unsigned shift, unsigned width,
                           uint8_t *status_out, uint64_t *changed_out, size_t *failed, size_t *done)
{
    *done = 0;
    *failed = 0;
    for (size_t j = 0; j <= n_streams; j++)
        changed_out[j] = 0;
    /* Everything that can be refused is checked before any table changes. */
    if (!full || !edit_args_ok(full, op_field, n_ops, shift, width))
        return KVC_ERR_ARG;
    /* Only the pointers: a stream table's own fields are not read here, as most of a report's
     * streams are cold in the cache and most are not reached at all. */
    for (size_t j = 0; j < n_streams; j++)
        if (!streams[j])
            return KVC_ERR_ARG;
    /* Per event rather than over the whole membership: a report pays for the rows it uses. */
    for (size_t i = 0; i < n; i++) {
        if (ops[i] >= n_ops)
            return KVC_ERR_ARG;
        if (keys[i] >= KVC_KEY_LIMIT)
            return KVC_ERR_KEY_RANGE;
        size_t r = route_row(known, n_known, lengths[i]);
        if (row_start[r + 1] < row_start[r])
            return KVC_ERR_ARG;
        for (uint32_t k = row_start[r]; k < row_start[r + 1]; k++)
            if (row_streams[k] >= n_streams || (k > row_start[r] && row_streams[k] <= row_streams[k - 1]))
                return KVC_ERR_ARG;
    }
    const uint64_t mask = ((UINT64_C(1) << width) - 1u) << shift;
    /* Event by event: the full table, then each stream that takes it (ascending). Every table
     * sees its own events in report order, so its state and records are those of
     * kvc_table_edit_fields of just those events. Prefetched in two stages: the headers of the
     * tables an event reaches (cold: a stream's table is seldom reached twice in a row) 2 x
     * PREFETCH_AHEAD events ahead, then its buckets and locator cells, found through those
     * headers, PREFETCH_AHEAD ahead. */
    enum { RING = 2 * PREFETCH_AHEAD + 1 };
    size_t ring[RING];
    for (size_t i = 0; i < n && i < 2 * PREFETCH_AHEAD; i++) {
        size_t r = ring[i % RING] = route_row(known, n_known, lengths[i]);
        if (i < PREFETCH_AHEAD) {
            prefetch_key(full, keys[i], 1);
            for (uint32_t k = row_start[r]; k < row_start[r + 1]; k++)
                prefetch_key(streams[row_streams[k]], keys[i], 1);
        } else {
            for (uint32_t k = row_start[r]; k < row_start[r + 1]; k++)
                prefetch_table(streams[row_streams[k]]);
        }
    }
    for (size_t i = 0; i < n; i++) {
        size_t far = i + 2 * PREFETCH_AHEAD, ahead = i + PREFETCH_AHEAD;
        if (far < n) {
            size_t r = ring[far % RING] = route_row(known, n_known, lengths[far]);
            for (uint32_t k = row_start[r]; k < row_start[r + 1]; k++)
                prefetch_table(streams[row_streams[k]]);
        }
        if (ahead < n) {
            size_t r = ring[ahead % RING];
            prefetch_key(full, keys[ahead], 1);
            for (uint32_t k = row_start[r]; k < row_start[r + 1]; k++)
                prefetch_key(streams[row_streams[k]], keys[ahead], 1);
        }
        size_t r = ring[i % RING];
        int rc = edit_field(full, keys[i], ops[i], op_field, op_needs_held, shift, mask);
        if (rc < 0)
            return rc;
        status_out[i] = (uint8_t)rc;
        changed_out[0] += rc == KVC_EDIT_CHANGED;
        for (uint32_t k = row_start[r]; k < row_start[r + 1]; k++) {
            size_t j = row_streams[k];
            rc = edit_field(streams[j], keys[i], ops[i], op_field, op_needs_held, shift, mask);
            if (rc < 0) {
                *failed = j + 1;
                return rc;
            }
            changed_out[j + 1] += rc == KVC_EDIT_CHANGED;
        }
        *done = i + 1;
    }
    return KVC_OK;
}

int kvc_tables_edit_fields_each(kvc_table *const *tables, size_t n_tables, const uint32_t *places,
                                const uint64_t *keys, const uint8_t *ops, size_t n,
                                const uint8_t *op_field, const uint8_t *op_needs_held, unsigned n_ops,
                                unsigned width, uint8_t *status_out, size_t *done)
{
    *done = 0;
    /* Everything that can be refused is checked before any table changes. */
    if (width == 0 || width > 8)
        return KVC_ERR_ARG;
    for (unsigned o = 0; o < n_ops; o++)
        if (op_field[o] >> width)
            return KVC_ERR_ARG;
    for (size_t i = 0; i < n; i++) {
        uint32_t table = places[i] >> 8, shift = places[i] & 0xffu;
        if (table >= n_tables || !tables[table] || ops[i] >= n_ops || shift + width > tables[table]->value_bits)
            return KVC_ERR_ARG;
        if (keys[i] >= KVC_KEY_LIMIT)
            return KVC_ERR_KEY_RANGE;
    }
    const uint64_t field_mask = (UINT64_C(1) << width) - 1u;
    for (size_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n)
            prefetch_key(tables[places[i + PREFETCH_AHEAD] >> 8], keys[i + PREFETCH_AHEAD], 1);
        unsigned shift = places[i] & 0xffu;
        int rc = edit_field(tables[places[i] >> 8], keys[i], ops[i], op_field, op_needs_held, shift,
                            field_mask << shift);
        if (rc < 0)
            return rc;
        status_out[i] = (uint8_t)rc;
        *done = i + 1;
    }
    return KVC_OK;
}

void kvc_table_get_many(const kvc_table *t, const uint64_t *keys, size_t n,
                        uint64_t *values_out, uint8_t *found_out)
{
    for (size_t i = 0; i < n; i++) {
        uint64_t v = 0;
        int r = kvc_table_get(t, keys[i], &v);
        values_out[i] = r == 1 ? v : 0;
        found_out[i] = r == 1;
    }
}

/* ---------------------------------------------------------------- public: accounting */

uint64_t kvc_table_size(const kvc_table *t) { return t->size; }
uint64_t kvc_table_epoch(const kvc_table *t) { return t->epoch; }
uint64_t kvc_table_slots(const kvc_table *t) { return (uint64_t)t->st.nb * 4u; }
uint64_t kvc_table_overflow_buckets(const kvc_table *t) { return t->st.overflow; }

uint64_t kvc_table_memory_bytes(const kvc_table *t)
{
    return sizeof *t + (uint64_t)t->st.nb * sizeof(kvc_bucket) +
           kvc_locator_memory_bytes(&t->loc) + BFS_CAP * sizeof(bfs_node) +
           t->rec_buckets.cap + t->rec_words.cap;
}

