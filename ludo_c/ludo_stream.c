/*
 * ludo_stream.c -- the maintenance table's update stream: pending records (absolute state of
 * touched buckets and locator words) drained as one blob, and full snapshots.
 */
#include <stdlib.h>

#include "ludo_table.h"

/* ---------------------------------------------------------------- records */

static int buf_reserve(byte_buf *b, size_t extra)
{
    if (b->len + extra <= b->cap)
        return KVC_OK;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra)
        cap *= 2;
    uint8_t *p = realloc(b->p, cap);
    if (!p)
        return KVC_ERR_NOMEM;
    b->p = p;
    b->cap = cap;
    return KVC_OK;
}

static void write_bucket_state(const kvc_table *t, uint32_t b, uint8_t *p)
{
    const kvc_store *s = &t->st;
    size_t base = (size_t)b * 4u;
    kvc_put32(p, b);
    kvc_put16(p + 4, s->bk[b].seed);
    p += 6;
    for (unsigned i = 0; i < 4; i++) {
        if (t->value_bits == 32) {
            kvc_put32(p, (uint32_t)SVAL(s, base + i));
            p += 4;
        } else {
            kvc_put64(p, SVAL(s, base + i));
            p += 8;
        }
    }
    if (t->fp_bits)
        for (unsigned i = 0; i < 4; i++) {
            uint64_t k = SKEY(s, base + i);
            kvc_put16(p + 2 * i, k == EMPTY_KEY ? 0 : (uint16_t)kvc_fingerprint(k, t->fp_seed, t->fp_bits));
        }
}

/* Give back a big record buffer once drained, so a burst does not pin memory forever. */
static void buf_release_if_big(byte_buf *b)
{
    if (b->cap > (1u << 20)) {
        free(b->p);
        b->p = NULL;
        b->cap = 0;
    }
    b->len = 0;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* Append the absolute state of everything the last operation touched. */
int kvc_emit_touched(kvc_table *t)
{
    kvc_locator *L = &t->loc;
    if (t->needs_snapshot) { /* a snapshot will carry it all */
        t->touched_n = 0;
        L->touched_n = 0;
        return KVC_OK;
    }
    size_t bsize = kvc_record_bucket_size(t->value_bits, t->fp_bits);
    if (L->touched_n > 1)
        qsort(L->touched, L->touched_n, sizeof *L->touched, cmp_u32);
    if (buf_reserve(&t->rec_buckets, bsize * t->touched_n) != KVC_OK ||
        buf_reserve(&t->rec_words, KVC_RECORD_WORD_SIZE * (size_t)L->touched_n) != KVC_OK)
        return KVC_ERR_NOMEM;
    for (unsigned i = 0; i < t->touched_n; i++) {
        write_bucket_state(t, t->touched_buckets[i], t->rec_buckets.p + t->rec_buckets.len);
        t->rec_buckets.len += bsize;
        t->rec_bucket_n++;
    }
    for (size_t i = 0; i < L->touched_n; i++) {
        if (i > 0 && L->touched[i] == L->touched[i - 1])
            continue;
        uint8_t *p = t->rec_words.p + t->rec_words.len;
        kvc_put32(p, L->touched[i]);
        kvc_put64(p + 4, L->words[L->touched[i]]);
        t->rec_words.len += KVC_RECORD_WORD_SIZE;
        t->rec_word_n++;
    }
    t->touched_n = 0;
    L->touched_n = 0;
    return KVC_OK;
}

/* ---------------------------------------------------------------- public: blobs */

static void table_geometry(const kvc_table *t, kvc_geometry *g)
{
    g->table_id = t->table_id;
    g->epoch = t->epoch;
    g->nb = t->st.nb;
    g->ma = t->loc.ma;
    g->mb = t->loc.mb;
    g->value_bits = t->value_bits;
    g->fp_bits = t->fp_bits;
    g->bucket_seed = t->st.bucket_seed;
    g->locator_seed = t->loc.seed;
}

size_t kvc_table_snapshot_size(const kvc_table *t)
{
    kvc_geometry g;
    table_geometry(t, &g);
    return KVC_HEADER_SIZE + kvc_snapshot_payload_size(&g);
}

int kvc_table_snapshot_write(const kvc_table *t, uint8_t *buf, size_t len)
{
    kvc_geometry g;
    table_geometry(t, &g);
    size_t payload = kvc_snapshot_payload_size(&g);
    if (!buf || len != KVC_HEADER_SIZE + payload)
        return KVC_ERR_ARG;
    const kvc_store *s = &t->st;
    size_t slots = (size_t)s->nb * 4u;
    uint8_t *p = buf + KVC_HEADER_SIZE;
    kvc_put64(p, t->size);
    p += 8;
    for (uint32_t b = 0; b < s->nb; b++, p += 2)
        kvc_put16(p, s->bk[b].seed);
    for (size_t i = 0; i < slots; i++) {
        if (t->value_bits == 32) {
            kvc_put32(p, (uint32_t)SVAL(s, i));
            p += 4;
        } else {
            kvc_put64(p, SVAL(s, i));
            p += 8;
        }
    }
    if (t->fp_bits)
        for (size_t i = 0; i < slots; i++, p += 2)
            kvc_put16(p, SKEY(s, i) == EMPTY_KEY ? 0
                                                 : (uint16_t)kvc_fingerprint(SKEY(s, i), t->fp_seed, t->fp_bits));
    size_t words = (size_t)t->loc.wa + t->loc.wb;
    for (size_t i = 0; i < words; i++, p += 8)
        kvc_put64(p, t->loc.words[i]);
    kvc_header_write(buf, KVC_BLOB_SNAPSHOT, &g, payload);
    return KVC_OK;
}

int kvc_table_needs_snapshot(const kvc_table *t) { return t->needs_snapshot; }

size_t kvc_table_records_size(const kvc_table *t)
{
    if (t->rec_bucket_n == 0 && t->rec_word_n == 0)
        return 0;
    return KVC_HEADER_SIZE + 8u + t->rec_buckets.len + t->rec_words.len;
}

void kvc_table_clear_pending(kvc_table *t)
{
    buf_release_if_big(&t->rec_buckets);
    buf_release_if_big(&t->rec_words);
    t->rec_bucket_n = t->rec_word_n = 0;
    t->needs_snapshot = 0;
}

int kvc_table_records_drain(kvc_table *t, uint8_t *buf, size_t len)
{
    size_t want = kvc_table_records_size(t);
    if (!buf || want == 0 || len != want)
        return KVC_ERR_ARG;
    kvc_geometry g;
    table_geometry(t, &g);
    uint8_t *p = buf + KVC_HEADER_SIZE;
    kvc_put32(p, t->rec_bucket_n);
    kvc_put32(p + 4, t->rec_word_n);
    memcpy(p + 8, t->rec_buckets.p, t->rec_buckets.len);
    memcpy(p + 8 + t->rec_buckets.len, t->rec_words.p, t->rec_words.len);
    kvc_header_write(buf, KVC_BLOB_RECORDS, &g, want - KVC_HEADER_SIZE);
    buf_release_if_big(&t->rec_buckets);
    buf_release_if_big(&t->rec_words);
    t->rec_bucket_n = t->rec_word_n = 0;
    return KVC_OK;
}
