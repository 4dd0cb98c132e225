/*
 * ludo_view.c -- the keyless edge side: 5-bit packed slot seeds (31 = look in the overflow map,
 * which grows as needed), 4 values per bucket, optional d-bit fingerprints, locator words.
 * Every blob is validated completely before the view changes.
 */
#include <stddef.h>
#include <stdlib.h>

#include "kvc_arena.h"
#include "ludo_internal.h"

#define SEEDS_PER_WORD 12u /* 12 x 5 bits in a 64-bit word */
#define LOOKUP_BLOCK 32u

/* Every field a lookup reads (geo through fps) lies in the first KVC_VIEW_LOOKUP_BYTES: with the
 * view 64-byte aligned (the arena's blocks), a read touches two of its lines, not three (entries
 * and the overflow map, which a lookup reads only for a bucket whose seed overflowed, follow). */
struct kvc_view {
    kvc_geometry geo;
    uint64_t slot_base, fp_seed;
    uint32_t wa, wb;
    uint64_t *words;   /* wa + wb locator words */
    uint64_t *seeds;   /* ceil(nb / 12) words of packed 5-bit seeds */
    uint32_t *vals32;  /* 4 nb values when value_bits == 32 */
    uint64_t *vals64;  /* 4 nb values when value_bits == 64 */
    uint8_t *fps;      /* 4 nb x d bits, packed, + 8 bytes of slack for unaligned reads */
    uint64_t entries;
    uint32_t *ov_bucket; /* overflow map, open addressing, bucket + 1 (0 = empty) */
    uint16_t *ov_seed;
    uint32_t ov_cap, ov_n;
};
#define KVC_VIEW_LOOKUP_BYTES 128u
_Static_assert(offsetof(struct kvc_view, fps) + sizeof(uint8_t *) <= KVC_VIEW_LOOKUP_BYTES,
               "a lookup's fields of a view lie in its first two cache lines");

/* ---------------------------------------------------------------- small helpers */

/* The prefetch helpers are inlined before GCC's IPA passes run: as out-of-line static functions
 * whose only effect is __builtin_prefetch, GCC finds them pure and drops every call (gcc 12 -O3
 * emitted none of the batched lookups' or the apply's prefetches). */
#define KVC_PREFETCH_HELPER __attribute__((always_inline))

static inline unsigned seed5_get(const uint64_t *seeds, uint32_t b)
{
    return (unsigned)(seeds[b / SEEDS_PER_WORD] >> (5u * (b % SEEDS_PER_WORD))) & 31u;
}

static inline void seed5_set(uint64_t *seeds, uint32_t b, unsigned s)
{
    unsigned shift = 5u * (b % SEEDS_PER_WORD);
    uint64_t *w = &seeds[b / SEEDS_PER_WORD];
    *w = (*w & ~(UINT64_C(31) << shift)) | ((uint64_t)s << shift);
}

static inline unsigned fp_get(const uint8_t *fps, unsigned d, uint64_t slot)
{
    uint64_t bit = slot * d, w;
    memcpy(&w, fps + (bit >> 3), 8);
    return (unsigned)(w >> (bit & 7)) & ((1u << d) - 1u);
}

static inline void fp_set(uint8_t *fps, unsigned d, uint64_t slot, unsigned fp)
{
    uint64_t bit = slot * d, w;
    memcpy(&w, fps + (bit >> 3), 8);
    uint64_t mask = (uint64_t)((1u << d) - 1u) << (bit & 7);
    w = (w & ~mask) | ((uint64_t)fp << (bit & 7));
    memcpy(fps + (bit >> 3), &w, 8);
}

/* The overflow map: open addressing with linear probing over any capacity (it grows by half, so
 * it never sits far below its maximum load of 0.85). Every lookup in it is for a bucket that is
 * there, so probes stay short even when it is full-ish; only inserts pay for long probes. */
static inline uint32_t ov_home(uint32_t bucket, uint32_t cap)
{
    return kvc_mulshift(kvc_fmix64(bucket) >> 32, cap);
}

static inline uint32_t ov_next(uint32_t i, uint32_t cap) { return i + 1u == cap ? 0u : i + 1u; }

/* Distance going forward from slot a to slot b on the ring. */
static inline uint32_t ov_dist(uint32_t a, uint32_t b, uint32_t cap) { return b >= a ? b - a : b + cap - a; }

static unsigned ov_get(const kvc_view *v, uint32_t bucket)
{
    /* At most one lap: a map read while another process writes it (kvc_shared.h) may be full. */
    uint32_t i = ov_home(bucket, v->ov_cap);
    for (uint32_t probes = 0; probes < v->ov_cap; probes++, i = ov_next(i, v->ov_cap)) {
        if (v->ov_bucket[i] == bucket + 1u)
            return v->ov_seed[i];
        if (v->ov_bucket[i] == 0)
            return 0; /* cannot happen for a sentinel bucket; seed 0 keeps lookup defined */
    }
    return 0;
}

static void ov_put_nogrow(kvc_view *v, uint32_t bucket, unsigned seed)
{
    for (uint32_t i = ov_home(bucket, v->ov_cap);; i = ov_next(i, v->ov_cap)) {
        if (v->ov_bucket[i] == bucket + 1u) {
            v->ov_seed[i] = (uint16_t)seed;
            return;
        }
        if (v->ov_bucket[i] == 0) {
            v->ov_bucket[i] = bucket + 1u;
            v->ov_seed[i] = (uint16_t)seed;
            v->ov_n++;
            return;
        }
    }
}

/* Backward-shift deletion keeps linear probing chains intact without tombstones. */
static void ov_remove(kvc_view *v, uint32_t bucket)
{
    uint32_t cap = v->ov_cap, i = ov_home(bucket, cap);
    while (v->ov_bucket[i] != bucket + 1u) {
        if (v->ov_bucket[i] == 0)
            return;
        i = ov_next(i, cap);
    }
    for (uint32_t j = ov_next(i, cap); v->ov_bucket[j] != 0; j = ov_next(j, cap)) {
        uint32_t home = ov_home(v->ov_bucket[j] - 1u, cap);
        if (ov_dist(home, j, cap) >= ov_dist(i, j, cap)) { /* home not in (i, j]: fill the hole */
            v->ov_bucket[i] = v->ov_bucket[j];
            v->ov_seed[i] = v->ov_seed[j];
            i = j;
        }
    }
    v->ov_bucket[i] = 0;
    v->ov_n--;
}

/* Make room for `extra` more overflow entries at load <= 0.85 (rehash into a bigger array). */
static int ov_reserve(kvc_view *v, uint64_t extra)
{
    uint64_t need = (uint64_t)v->ov_n + extra;
    if (v->ov_cap && need * 20u <= (uint64_t)v->ov_cap * 17u)
        return KVC_OK;
    uint64_t cap = v->ov_cap > 16u ? v->ov_cap : 16u;
    while (need * 20u > cap * 17u)
        cap += cap / 2u;
    if (cap >= (UINT64_C(1) << 32))
        return KVC_ERR_NOMEM;
    uint32_t *nbk = kvc_alloc((cap) * sizeof *nbk, 1);
    uint16_t *nsd = kvc_alloc((cap) * sizeof *nsd, 1);
    if (!nbk || !nsd) {
        free(nbk);
        free(nsd);
        return KVC_ERR_NOMEM;
    }
    uint32_t *obk = v->ov_bucket, ocap = v->ov_cap;
    uint16_t *osd = v->ov_seed;
    v->ov_bucket = nbk;
    v->ov_seed = nsd;
    v->ov_cap = (uint32_t)cap;
    v->ov_n = 0;
    for (uint32_t i = 0; i < ocap; i++)
        if (obk[i])
            ov_put_nogrow(v, obk[i] - 1u, osd[i]);
    free(obk);
    free(osd);
    return KVC_OK;
}

/* Set a bucket's seed; the overflow map must already have room (ov_reserve). */
static void set_seed(kvc_view *v, uint32_t b, unsigned seed)
{
    unsigned old = seed5_get(v->seeds, b);
    if (seed <= KVC_SEED_INLINE_MAX) {
        if (old == KVC_SEED_SENTINEL)
            ov_remove(v, b);
        seed5_set(v->seeds, b, seed);
    } else {
        ov_put_nogrow(v, b, seed);
        seed5_set(v->seeds, b, KVC_SEED_SENTINEL);
    }
}

/* The sizes of a view's arrays (from the arena while it is on, kvc_arena.h), by its geometry. */
static size_t words_bytes(uint32_t wa, uint32_t wb) { return ((size_t)wa + wb) * sizeof(uint64_t); }
static size_t seeds_bytes(size_t nb) { return ((nb + SEEDS_PER_WORD - 1) / SEEDS_PER_WORD) * sizeof(uint64_t); }
static size_t fps_bytes(size_t slots, unsigned d) { return (slots * d + 7) / 8 + 8; }

static void view_release(kvc_view *v)
{
    size_t nb = v->geo.nb, slots = 4u * nb;
    kvc_arena_free(v->words, words_bytes(v->wa, v->wb));
    kvc_arena_free(v->seeds, seeds_bytes(nb));
    kvc_arena_free(v->vals32, slots * sizeof *v->vals32);
    kvc_arena_free(v->vals64, slots * sizeof *v->vals64);
    kvc_arena_free(v->fps, fps_bytes(slots, v->geo.fp_bits));
    free(v->ov_bucket);
    free(v->ov_seed);
}

static inline uint64_t get_value(const kvc_view *v, uint64_t slot)
{
    return v->geo.value_bits == 32 ? v->vals32[slot] : v->vals64[slot];
}

static inline void set_value(kvc_view *v, uint64_t slot, uint64_t value)
{
    if (v->geo.value_bits == 32)
        v->vals32[slot] = (uint32_t)value;
    else
        v->vals64[slot] = value;
}

/* ---------------------------------------------------------------- building from a snapshot */

/* Build a complete view from a header-checked, CRC-checked snapshot into *v (zeroed first). */
static int build_from_snapshot(kvc_view *v, const uint8_t *blob, const kvc_header *hdr)
{
    memset(v, 0, sizeof *v);
    const kvc_geometry *g = &hdr->geo;
    unsigned d = g->fp_bits;
    size_t nb = g->nb, slots = nb * 4u;
    v->geo = *g;
    v->slot_base = kvc_slot_base(g->bucket_seed);
    v->fp_seed = kvc_fp_seed(g->table_id);
    v->wa = kvc_words_for(g->ma);
    v->wb = kvc_words_for(g->mb);
    const uint8_t *p = blob + KVC_HEADER_SIZE;
    const uint8_t *pseeds = p + 8, *pvals = pseeds + 2 * nb;
    const uint8_t *pfps = pvals + slots * (g->value_bits / 8u);
    const uint8_t *pwords = pfps + (d ? slots * 2u : 0u);
    /* validate payload fields before allocating anything large */
    uint64_t overflow = 0;
    for (size_t b = 0; b < nb; b++)
        overflow += kvc_get16(pseeds + 2 * b) > KVC_SEED_INLINE_MAX;
    if (d)
        for (size_t i = 0; i < slots; i++)
            if (kvc_get16(pfps + 2 * i) >> d)
                return KVC_ERR_MALFORMED;
    v->entries = kvc_get64(p);
    if (v->entries > slots)
        return KVC_ERR_MALFORMED;
    v->words = kvc_arena_alloc(words_bytes(v->wa, v->wb), 0);
    v->seeds = kvc_arena_alloc(seeds_bytes(nb), 1);
    if (g->value_bits == 32)
        v->vals32 = kvc_arena_alloc(slots * sizeof *v->vals32, 0);
    else
        v->vals64 = kvc_arena_alloc(slots * sizeof *v->vals64, 0);
    if (d)
        v->fps = kvc_arena_alloc(fps_bytes(slots, d), 1);
    if (!v->words || !v->seeds || (!v->vals32 && !v->vals64) || (d && !v->fps) ||
        ov_reserve(v, overflow) != KVC_OK) {
        view_release(v);
        return KVC_ERR_NOMEM;
    }
    for (size_t b = 0; b < nb; b++)
        set_seed(v, (uint32_t)b, kvc_get16(pseeds + 2 * b));
    if (g->value_bits == 32)
        for (size_t i = 0; i < slots; i++)
            v->vals32[i] = kvc_get32(pvals + 4 * i);
    else
        for (size_t i = 0; i < slots; i++)
            v->vals64[i] = kvc_get64(pvals + 8 * i);
    if (d)
        for (size_t i = 0; i < slots; i++)
            fp_set(v->fps, d, i, kvc_get16(pfps + 2 * i));
    for (size_t i = 0; i < (size_t)v->wa + v->wb; i++)
        v->words[i] = kvc_get64(pwords + 8 * i);
    return KVC_OK;
}

static int read_checked(const uint8_t *blob, size_t len, kvc_header *hdr)
{
    int rc = kvc_header_read(blob, len, hdr);
    if (rc != KVC_OK)
        return rc;
    return kvc_blob_check_crc(blob, hdr);
}

int kvc_view_new(kvc_view **out, const uint8_t *blob, size_t len)
{
    if (!out)
        return KVC_ERR_ARG;
    kvc_header hdr;
    int rc = read_checked(blob, len, &hdr);
    if (rc != KVC_OK)
        return rc;
    if (hdr.kind != KVC_BLOB_SNAPSHOT)
        return KVC_ERR_VERSION;
    kvc_view *v = kvc_arena_alloc(sizeof *v, 0);
    if (!v)
        return KVC_ERR_NOMEM;
    rc = build_from_snapshot(v, blob, &hdr);
    if (rc != KVC_OK) {
        kvc_arena_free(v, sizeof *v);
        return rc;
    }
    *out = v;
    return KVC_OK;
}

/* A copy of an array: from the arena (in_arena) or kvc_alloc, as view_release will free it. */
static void *dup_array(const void *src, size_t bytes, int in_arena)
{
    if (!src)
        return NULL;
    void *out = in_arena ? kvc_arena_alloc(bytes, 0) : kvc_alloc(bytes, 0);
    if (out)
        memcpy(out, src, bytes);
    return out;
}

int kvc_view_copy(kvc_view **out, const kvc_view *src)
{
    if (!out || !src)
        return KVC_ERR_ARG;
    kvc_view *v = kvc_arena_alloc(sizeof *v, 1);
    if (!v)
        return KVC_ERR_NOMEM;
    *v = *src;
    uint64_t nb = src->geo.nb, slots = 4u * nb;
    unsigned d = src->geo.fp_bits;
    v->words = dup_array(src->words, words_bytes(src->wa, src->wb), 1);
    v->seeds = dup_array(src->seeds, seeds_bytes(nb), 1);
    v->vals32 = dup_array(src->vals32, slots * sizeof *src->vals32, 1);
    v->vals64 = dup_array(src->vals64, slots * sizeof *src->vals64, 1);
    v->fps = d ? dup_array(src->fps, fps_bytes(slots, d), 1) : NULL;
    v->ov_bucket = dup_array(src->ov_bucket, (size_t)src->ov_cap * sizeof *src->ov_bucket, 0);
    v->ov_seed = dup_array(src->ov_seed, (size_t)src->ov_cap * sizeof *src->ov_seed, 0);
    if ((src->words && !v->words) || (src->seeds && !v->seeds) || (src->vals32 && !v->vals32) ||
        (src->vals64 && !v->vals64) || (src->fps && d && !v->fps) || (src->ov_bucket && !v->ov_bucket) ||
        (src->ov_seed && !v->ov_seed)) {
        view_release(v);
        kvc_arena_free(v, sizeof *v);
        return KVC_ERR_NOMEM;
    }
    *out = v;
    return KVC_OK;
}

void kvc_view_free(kvc_view *v)
{
    if (!v)
        return;
    view_release(v);
    kvc_arena_free(v, sizeof *v);
}

/* ---------------------------------------------------------------- applying blobs */

static int same_geometry(const kvc_geometry *a, const kvc_geometry *b)
{
    return a->nb == b->nb && a->ma == b->ma && a->mb == b->mb && a->value_bits == b->value_bits &&
           a->fp_bits == b->fp_bits && a->bucket_seed == b->bucket_seed &&
           a->locator_seed == b->locator_seed;
}

/* A record blob's payload, checked against its view. */
typedef struct {
    const uint8_t *pb, *pw; /* bucket records, then locator word records */
    uint64_t nbk, nw;
    size_t bsize;
    uint64_t big_seeds; /* new overflow entries it may need (over-counts repeats: harmless) */
} records_part;

/* Validate a record blob's payload against the view (header and CRC already checked); changes
 * nothing. */
static int check_records(const kvc_view *v, const uint8_t *blob, const kvc_header *hdr, records_part *out)
{
    const kvc_geometry *g = &v->geo;
    const uint8_t *p = blob + KVC_HEADER_SIZE;
    uint64_t nbk = kvc_get32(p), nw = kvc_get32(p + 4);
    size_t bsize = kvc_record_bucket_size(g->value_bits, g->fp_bits);
    if (hdr->payload_len != 8u + nbk * bsize + nw * KVC_RECORD_WORD_SIZE)
        return KVC_ERR_MALFORMED;
    const uint8_t *pb = p + 8, *pw = pb + nbk * bsize;
    unsigned d = g->fp_bits, vbytes = g->value_bits / 8u;
    uint64_t big_seeds = 0;
    for (uint64_t i = 0; i < nbk; i++) {
        const uint8_t *r = pb + i * bsize;
        if (kvc_get32(r) >= g->nb)
            return KVC_ERR_MALFORMED;
        /* room is needed only for buckets not in the map yet (over-counts repeats: harmless) */
        big_seeds += kvc_get16(r + 4) > KVC_SEED_INLINE_MAX &&
                     seed5_get(v->seeds, kvc_get32(r)) != KVC_SEED_SENTINEL;
        if (d)
            for (unsigned s = 0; s < 4; s++)
                if (kvc_get16(r + 6 + 4 * vbytes + 2 * s) >> d)
                    return KVC_ERR_MALFORMED;
    }
    for (uint64_t i = 0; i < nw; i++)
        if (kvc_get32(pw + i * KVC_RECORD_WORD_SIZE) >= (uint64_t)v->wa + v->wb)
            return KVC_ERR_MALFORMED;
    *out = (records_part){pb, pw, nbk, nw, bsize, big_seeds};
    return KVC_OK;
}

/* Prefetch, for writing, every line one bucket record will touch. */
static inline KVC_PREFETCH_HELPER void prefetch_bucket(const kvc_view *v, uint32_t b)
{
    __builtin_prefetch(&v->seeds[b / SEEDS_PER_WORD], 1);
    if (v->vals32)
        __builtin_prefetch(&v->vals32[(uint64_t)b * 4u], 1);
    else
        __builtin_prefetch(&v->vals64[(uint64_t)b * 4u], 1);
    if (v->fps)
        __builtin_prefetch(&v->fps[((uint64_t)b * 4u * v->geo.fp_bits) >> 3], 1);
}

/* A bucket's four d-bit fingerprints in one read-modify-write (plus one byte when they reach past
 * 64 bits): four fp_set calls would each reload the word the previous one just stored at another
 * offset, which the CPU cannot forward from its store buffer (a stall each). */
static inline void fp4_set(uint8_t *fps, unsigned d, uint32_t bucket, const uint8_t *rec_fps)
{
    uint64_t bit = (uint64_t)bucket * 4u * d, fields = 0;
    for (unsigned s = 0; s < 4; s++)
        fields |= (uint64_t)kvc_get16(rec_fps + 2 * s) << (s * d);
    unsigned shift = (unsigned)(bit & 7), width = 4u * d;
    uint8_t *p = fps + (bit >> 3);
    uint64_t mask = width == 64 ? ~UINT64_C(0) : (UINT64_C(1) << width) - 1u, w;
    memcpy(&w, p, 8);
    w = (w & ~(mask << shift)) | (fields << shift);
    memcpy(p, &w, 8);
    if (shift + width > 64) { /* the top bits spill into the ninth byte */
        unsigned spill = shift + width - 64;
        uint8_t high = (uint8_t)(fields >> (64 - shift)), keep = (uint8_t)~((1u << spill) - 1u);
        p[8] = (uint8_t)((p[8] & keep) | (high & (uint8_t)~keep));
    }
}

static inline void write_bucket(kvc_view *v, const uint8_t *r)
{
    unsigned d = v->geo.fp_bits;
    uint32_t b = kvc_get32(r);
    uint64_t base = (uint64_t)b * 4u;
    set_seed(v, b, kvc_get16(r + 4));
    if (v->vals32) {
        for (unsigned s = 0; s < 4; s++)
            v->vals32[base + s] = kvc_get32(r + 6 + 4 * s);
        if (d)
            fp4_set(v->fps, d, b, r + 6 + 16);
    } else {
        for (unsigned s = 0; s < 4; s++)
            v->vals64[base + s] = kvc_get64(r + 6 + 8 * s);
        if (d)
            fp4_set(v->fps, d, b, r + 6 + 32);
    }
}

/* Write a checked part; the overflow map must have room for its big seeds (ov_reserve). */
static void write_records(kvc_view *v, const records_part *pt)
{
    for (uint64_t i = 0; i < pt->nbk; i++) {
        const uint8_t *r = pt->pb + i * pt->bsize;
        if (i + 8 < pt->nbk) /* overlap the misses of later records with this one */
            prefetch_bucket(v, kvc_get32(r + 8 * pt->bsize));
        write_bucket(v, r);
    }
    for (uint64_t i = 0; i < pt->nw; i++) {
        const uint8_t *r = pt->pw + i * KVC_RECORD_WORD_SIZE;
        if (i + 8 < pt->nw)
            __builtin_prefetch(&v->words[kvc_get32(r + 8 * KVC_RECORD_WORD_SIZE)], 1);
        v->words[kvc_get32(r)] = kvc_get64(r + 4);
    }
}

static int apply_records(kvc_view *v, const uint8_t *blob, const kvc_header *hdr)
{
    records_part pt;
    int rc = check_records(v, blob, hdr, &pt);
    if (rc != KVC_OK)
        return rc;
    if (ov_reserve(v, pt.big_seeds) != KVC_OK) /* the only step that can fail; nothing changed yet */
        return KVC_ERR_NOMEM;
    write_records(v, &pt);
    return KVC_OK;
}

int kvc_view_apply(kvc_view *v, const uint8_t *blob, size_t len)
{
    kvc_header hdr;
    int rc = kvc_header_read(blob, len, &hdr);
    if (rc != KVC_OK)
        return rc;
    if ((rc = kvc_blob_check_crc(blob, &hdr)) != KVC_OK)
        return rc;
    if (hdr.geo.table_id != v->geo.table_id)
        return KVC_ERR_FOREIGN;
    if (hdr.kind == KVC_BLOB_RECORDS) {
        if (hdr.geo.epoch != v->geo.epoch)
            return KVC_ERR_EPOCH;
        if (!same_geometry(&hdr.geo, &v->geo))
            return KVC_ERR_GEOMETRY;
    } else if (hdr.geo.epoch < v->geo.epoch) {
        return KVC_ERR_EPOCH; /* a stale snapshot would roll the view back */
    }
    if (hdr.kind == KVC_BLOB_RECORDS)
        return apply_records(v, blob, &hdr);
    kvc_view fresh;
    if ((rc = build_from_snapshot(&fresh, blob, &hdr)) != KVC_OK)
        return rc;
    view_release(v);
    *v = fresh;
    return KVC_OK;
}

/* ---------------------------------------------------------------- applying a whole batch */

#define BATCH_STACK 64u  /* parts kept on the stack; a bigger batch allocates */

static int cmp_ptr(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t)*(void *const *)a, y = (uintptr_t)*(void *const *)b;
    return x < y ? -1 : x > y;
}

/* 1 if some view appears twice (a later blob must then be checked against an earlier one's result). */
static int views_repeat(kvc_view *const *views, size_t n)
{
    if (n < 2)
        return 0;
    if (n <= 8) {
        for (size_t i = 0; i < n; i++)
            for (size_t j = i + 1; j < n; j++)
                if (views[i] == views[j])
                    return 1;
        return 0;
    }
    kvc_view **sorted = malloc(n * sizeof *sorted);
    if (!sorted)
        return 1; /* the sequential path needs no memory */
    memcpy(sorted, views, n * sizeof *sorted);
    qsort(sorted, n, sizeof *sorted, cmp_ptr);
    int repeat = 0;
    for (size_t i = 1; i < n && !repeat; i++)
        repeat = sorted[i] == sorted[i - 1];
    free(sorted);
    return repeat;
}

int kvc_views_apply_batch(kvc_view *const *views, const uint8_t *const *blobs, const size_t *lens,
                          size_t n, size_t *failed)
{
    if (!failed)
        return KVC_ERR_ARG;
    *failed = 0;
    if (n == 0)
        return KVC_OK;
    if (!views || !blobs || !lens)
        return KVC_ERR_ARG;
    for (size_t i = 0; i < n; i++)
        if (!views[i] || !blobs[i]) {
            *failed = i;
            return KVC_ERR_ARG;
        }
    kvc_header stack_hdrs[BATCH_STACK];
    records_part stack_parts[BATCH_STACK];
    kvc_header *hdrs = n <= BATCH_STACK ? stack_hdrs : malloc(n * sizeof *hdrs);
    records_part *parts = n <= BATCH_STACK ? stack_parts : malloc(n * sizeof *parts);
    int rc = hdrs && parts ? KVC_OK : KVC_ERR_NOMEM;
    /* Every header, checksum and owner first: a damaged or foreign blob changes nothing. */
    int simple = rc == KVC_OK && !views_repeat(views, n);
    for (size_t i = 0; i < n && rc == KVC_OK; i++) {
        rc = kvc_header_read(blobs[i], lens[i], &hdrs[i]);
        if (rc == KVC_OK)
            rc = kvc_blob_check_crc(blobs[i], &hdrs[i]);
        if (rc == KVC_OK && hdrs[i].geo.table_id != views[i]->geo.table_id)
            rc = KVC_ERR_FOREIGN;
        if (rc != KVC_OK)
            *failed = i;
        simple = simple && hdrs[i].kind == KVC_BLOB_RECORDS;
    }
    if (rc == KVC_OK && !simple) {
        /* A snapshot among them (a table that grew) or a table named twice: one blob after the
         * other, each checked against what the blobs before it left. */
        for (size_t i = 0; i < n && rc == KVC_OK; i++)
            if ((rc = kvc_view_apply(views[i], blobs[i], lens[i])) != KVC_OK)
                *failed = i;
    } else if (rc == KVC_OK) {
        for (size_t i = 0; i < n && rc == KVC_OK; i++) { /* the rest of every check: nothing changes yet */
            const kvc_view *v = views[i];
            if (hdrs[i].geo.epoch != v->geo.epoch)
                rc = KVC_ERR_EPOCH;
            else if (!same_geometry(&hdrs[i].geo, &v->geo))
                rc = KVC_ERR_GEOMETRY;
            else
                rc = check_records(v, blobs[i], &hdrs[i], &parts[i]);
            if (rc != KVC_OK)
                *failed = i;
        }
        for (size_t i = 0; i < n && rc == KVC_OK; i++) /* only capacity: no lookup sees it */
            if (ov_reserve(views[i], parts[i].big_seeds) != KVC_OK) {
                rc = KVC_ERR_NOMEM;
                *failed = i;
            }
        /* Each blob's records go in with their own prefetch pipeline (one pipeline across the
         * blobs measured slower: its bookkeeping cost more than the restarts), the next blob's
         * first buckets fetched while this one goes in. */
        for (size_t i = 0; i < n && rc == KVC_OK; i++) {
            if (i + 1 < n)
                for (uint64_t j = 0; j < parts[i + 1].nbk && j < 8; j++)
                    prefetch_bucket(views[i + 1], kvc_get32(parts[i + 1].pb + j * parts[i + 1].bsize));
            write_records(views[i], &parts[i]);
        }
    }
    if (hdrs != stack_hdrs)
        free(hdrs);
    if (parts != stack_parts)
        free(parts);
    return rc;
}

/* ---------------------------------------------------------------- lookups */

static inline uint32_t locate_bucket(const kvc_view *v, uint64_t key)
{
    uint32_t b0, b1, a, b;
    kvc_buckets(key, v->geo.bucket_seed, v->geo.nb, &b0, &b1);
    kvc_cells(key, v->geo.locator_seed, v->geo.ma, v->geo.mb, &a, &b);
    unsigned bit = (unsigned)((v->words[a >> 6] >> (a & 63)) ^ (v->words[v->wa + (b >> 6)] >> (b & 63))) & 1u;
    return bit ? b1 : b0;
}

static inline uint64_t finish_lookup(const kvc_view *v, uint64_t key, uint32_t bucket)
{
    unsigned seed = seed5_get(v->seeds, bucket);
    if (seed == KVC_SEED_SENTINEL)
        seed = ov_get(v, bucket);
    uint64_t slot = (uint64_t)bucket * 4u + kvc_slot(key, v->slot_base, seed);
    unsigned d = v->geo.fp_bits;
    if (d && fp_get(v->fps, d, slot) != kvc_fingerprint(key, v->fp_seed, d))
        return 0;
    return get_value(v, slot);
}

uint64_t kvc_view_lookup(const kvc_view *v, uint64_t key)
{
    if (key >= KVC_KEY_LIMIT)
        return 0;
    return finish_lookup(v, key, locate_bucket(v, key));
}

/* The batched lookups' first two passes: the key's two locator words, then its bucket's seed,
 * values and fingerprints, fetched ahead so that a block's cache misses overlap. */
static inline KVC_PREFETCH_HELPER void prefetch_locator(const kvc_view *v, uint64_t key)
{
    uint32_t a, b;
    kvc_cells(key, v->geo.locator_seed, v->geo.ma, v->geo.mb, &a, &b);
    __builtin_prefetch(&v->words[a >> 6]);
    __builtin_prefetch(&v->words[v->wa + (b >> 6)]);
}

static inline KVC_PREFETCH_HELPER void prefetch_bucket_read(const kvc_view *v, uint32_t bk)
{
    __builtin_prefetch(&v->seeds[bk / SEEDS_PER_WORD]);
    if (v->vals32)
        __builtin_prefetch(&v->vals32[(uint64_t)bk * 4u]);
    else
        __builtin_prefetch(&v->vals64[(uint64_t)bk * 4u]);
    if (v->fps)
        __builtin_prefetch(&v->fps[((uint64_t)bk * 4u * v->geo.fp_bits) >> 3]);
}

/* Three passes over blocks of keys: prefetch locator words, then the bucket's seed word and
 * values, then finish. Each pass issues independent misses so their latencies overlap. */
void kvc_view_lookup_many(const kvc_view *v, const uint64_t *keys, size_t n, uint64_t *out)
{
    uint32_t bucket[LOOKUP_BLOCK];
    for (size_t base = 0; base < n; base += LOOKUP_BLOCK) {
        size_t m = n - base < LOOKUP_BLOCK ? n - base : LOOKUP_BLOCK;
        const uint64_t *k = keys + base;
        for (size_t i = 0; i < m; i++) {
            prefetch_locator(v, k[i]);
        }
        for (size_t i = 0; i < m; i++) {
            bucket[i] = locate_bucket(v, k[i]);
            prefetch_bucket_read(v, bucket[i]);
        }
        for (size_t i = 0; i < m; i++)
            out[base + i] = k[i] >= KVC_KEY_LIMIT ? 0 : finish_lookup(v, k[i], bucket[i]);
    }
}

/* kvc_view_lookup_many's three passes over (view, key) pairs, each key read in its own view
 * (NULL: 0): the reads of one forwarding decision span every (shard, group) view. */
void kvc_view_lookup_multi(const kvc_view *const *views, const uint64_t *keys, size_t n, uint64_t *out)
{
    uint32_t bucket[LOOKUP_BLOCK];
    for (size_t base = 0; base < n; base += LOOKUP_BLOCK) {
        size_t m = n - base < LOOKUP_BLOCK ? n - base : LOOKUP_BLOCK;
        const uint64_t *k = keys + base;
        const kvc_view *const *vs = views + base;
        for (size_t i = 0; i < m; i++) {
            const kvc_view *v = vs[i];
            if (!v)
                continue;
            prefetch_locator(v, k[i]);
        }
        for (size_t i = 0; i < m; i++) {
            const kvc_view *v = vs[i];
            if (!v)
                continue;
            bucket[i] = locate_bucket(v, k[i]);
            prefetch_bucket_read(v, bucket[i]);
        }
        for (size_t i = 0; i < m; i++) {
            const kvc_view *v = vs[i];
            out[base + i] = !v || k[i] >= KVC_KEY_LIMIT ? 0 : finish_lookup(v, k[i], bucket[i]);
        }
    }
}

/* kvc_view_lookup_multi with a pass before the three: each read's view header, fetched ahead.
 * For reads that each land in a different view of many (an edge's lookup at thousands of workers
 * spans thousands of views): there the header is itself a cache miss that the first pass would
 * otherwise take one at a time. */
void kvc_view_lookup_spread(const kvc_view *const *views, const uint64_t *keys, size_t n, uint64_t *out)
{
    for (size_t base = 0; base < n; base += LOOKUP_BLOCK) {
        size_t m = n - base < LOOKUP_BLOCK ? n - base : LOOKUP_BLOCK;
        const kvc_view *const *vs = views + base;
        for (size_t i = 0; i < m; i++) {
            const char *v = (const char *)vs[i];
            if (!v)
                continue;
            __builtin_prefetch(v);
            __builtin_prefetch(v + KVC_VIEW_LOOKUP_BYTES - 1);
        }
        kvc_view_lookup_multi(vs, keys + base, m, out + base);
    }
}

/* ---------------------------------------------------------------- accounting */

uint64_t kvc_view_epoch(const kvc_view *v) { return v->geo.epoch; }
uint64_t kvc_view_table_id(const kvc_view *v) { return v->geo.table_id; }
uint64_t kvc_view_slots(const kvc_view *v) { return (uint64_t)v->geo.nb * 4u; }
unsigned kvc_view_value_bits(const kvc_view *v) { return v->geo.value_bits; }
unsigned kvc_view_fingerprint_bits(const kvc_view *v) { return v->geo.fp_bits; }
uint64_t kvc_view_snapshot_entries(const kvc_view *v) { return v->entries; }
uint64_t kvc_view_overflow_count(const kvc_view *v) { return v->ov_n; }
uint64_t kvc_view_overflow_capacity(const kvc_view *v) { return v->ov_cap; }

uint64_t kvc_view_memory_bytes(const kvc_view *v)
{
    uint64_t slots = (uint64_t)v->geo.nb * 4u;
    uint64_t bytes = sizeof *v;
    bytes += 8u * ((uint64_t)v->wa + v->wb);
    bytes += 8u * (((uint64_t)v->geo.nb + SEEDS_PER_WORD - 1) / SEEDS_PER_WORD);
    bytes += slots * (v->geo.value_bits / 8u);
    if (v->fps)
        bytes += (slots * v->geo.fp_bits + 7) / 8 + 8;
    bytes += (uint64_t)v->ov_cap * (sizeof *v->ov_bucket + sizeof *v->ov_seed);
    return bytes;
}

/* ---------------------------------------------------------------- export */

size_t kvc_view_snapshot_size(const kvc_view *v) { return KVC_HEADER_SIZE + kvc_snapshot_payload_size(&v->geo); }

int kvc_view_snapshot_write(const kvc_view *v, uint8_t *buf, size_t len)
{
    size_t payload = kvc_snapshot_payload_size(&v->geo);
    if (!buf || len != KVC_HEADER_SIZE + payload)
        return KVC_ERR_ARG;
    size_t nb = v->geo.nb, slots = nb * 4u;
    unsigned d = v->geo.fp_bits;
    uint8_t *p = buf + KVC_HEADER_SIZE;
    uint64_t entries = 0; /* records carry no counts: an occupied slot is a non-zero value */
    for (size_t i = 0; i < slots; i++)
        entries += get_value(v, i) != 0;
    kvc_put64(p, entries);
    p += 8;
    for (size_t b = 0; b < nb; b++, p += 2) {
        unsigned seed = seed5_get(v->seeds, (uint32_t)b);
        kvc_put16(p, (uint16_t)(seed == KVC_SEED_SENTINEL ? ov_get(v, (uint32_t)b) : seed));
    }
    for (size_t i = 0; i < slots; i++) {
        if (v->geo.value_bits == 32) {
            kvc_put32(p, (uint32_t)get_value(v, i));
            p += 4;
        } else {
            kvc_put64(p, get_value(v, i));
            p += 8;
        }
    }
    if (d)
        for (size_t i = 0; i < slots; i++, p += 2)
            kvc_put16(p, (uint16_t)fp_get(v->fps, d, i));
    for (size_t i = 0; i < (size_t)v->wa + v->wb; i++, p += 8)
        kvc_put64(p, v->words[i]);
    kvc_header_write(buf, KVC_BLOB_SNAPSHOT, &v->geo, payload);
    return KVC_OK;
}

/* ---------------------------------------------------------------- images in shared memory */
/* kvc_shared.h: a view whose arrays live in a buffer other processes map. */

#include "kvc_shared.h"

#define KVC_IMAGE_MAGIC UINT64_C(0x31474D4943564B) /* "KVCIMG1" */
#define KVC_IMAGE_ALIGN 64u

typedef struct kvc_image_header {
    uint64_t magic, bytes;
    uint64_t table_id, epoch, bucket_seed, locator_seed, entries;
    uint32_t nb, ma, mb, value_bits, fp_bits, wa, wb, ov_cap, ov_n, reserved;
    uint64_t off_words, off_seeds, off_vals, off_fps, off_ov_bucket, off_ov_seed;
} kvc_image_header;

typedef struct image_sections {
    uint64_t words, seeds, vals, fps, ov_bucket, ov_seed, bytes;
} image_sections;

static uint64_t align_up(uint64_t x) { return (x + KVC_IMAGE_ALIGN - 1u) & ~(uint64_t)(KVC_IMAGE_ALIGN - 1u); }

/* Smallest map capacity holding `need` buckets at load <= 0.85 (ov_reserve's rule), 16 at least. */
static uint64_t image_ov_cap(uint64_t need)
{
    uint64_t cap = 16u;
    while (need * 20u > cap * 17u)
        cap += cap / 2u;
    return cap;
}

/* Offsets of every section for a geometry; bytes = 0 when the image cannot be described. */
static image_sections image_layout(uint32_t nb, uint32_t wa, uint32_t wb, unsigned value_bits, unsigned d,
                                   uint64_t ov_cap)
{
    image_sections s;
    uint64_t slots = (uint64_t)nb * 4u;
    s.words = align_up(sizeof(kvc_image_header));
    s.seeds = align_up(s.words + 8u * ((uint64_t)wa + wb));
    s.vals = align_up(s.seeds + 8u * (((uint64_t)nb + SEEDS_PER_WORD - 1) / SEEDS_PER_WORD));
    s.fps = align_up(s.vals + slots * (value_bits / 8u));
    s.ov_bucket = align_up(s.fps + (d ? (slots * d + 7) / 8 + 8 : 0u));
    s.ov_seed = align_up(s.ov_bucket + 4u * ov_cap);
    s.bytes = align_up(s.ov_seed + 2u * ov_cap);
    return s;
}

size_t kvc_view_image_size(const kvc_view *v, uint64_t overflow_room)
{
    uint64_t cap = image_ov_cap((uint64_t)v->ov_n + overflow_room);
    if (cap >= (UINT64_C(1) << 32))
        return 0;
    return (size_t)image_layout(v->geo.nb, v->wa, v->wb, v->geo.value_bits, v->geo.fp_bits, cap).bytes;
}

int kvc_view_image_write(const kvc_view *v, uint8_t *buf, size_t len, uint64_t overflow_room)
{
    uint64_t cap = image_ov_cap((uint64_t)v->ov_n + overflow_room);
    if (!buf || cap >= (UINT64_C(1) << 32) || ((uintptr_t)buf & (KVC_IMAGE_ALIGN - 1u)))
        return KVC_ERR_ARG;
    unsigned d = v->geo.fp_bits;
    image_sections s = image_layout(v->geo.nb, v->wa, v->wb, v->geo.value_bits, d, cap);
    if (len != s.bytes)
        return KVC_ERR_ARG;
    uint64_t slots = (uint64_t)v->geo.nb * 4u;
    memset(buf, 0, s.bytes);
    kvc_image_header h;
    memset(&h, 0, sizeof h);
    h.magic = KVC_IMAGE_MAGIC;
    h.bytes = s.bytes;
    h.table_id = v->geo.table_id;
    h.epoch = v->geo.epoch;
    h.bucket_seed = v->geo.bucket_seed;
    h.locator_seed = v->geo.locator_seed;
    h.entries = v->entries;
    h.nb = v->geo.nb;
    h.ma = v->geo.ma;
    h.mb = v->geo.mb;
    h.value_bits = v->geo.value_bits;
    h.fp_bits = d;
    h.wa = v->wa;
    h.wb = v->wb;
    h.ov_cap = (uint32_t)cap;
    h.ov_n = v->ov_n;
    h.off_words = s.words;
    h.off_seeds = s.seeds;
    h.off_vals = s.vals;
    h.off_fps = d ? s.fps : 0u;
    h.off_ov_bucket = s.ov_bucket;
    h.off_ov_seed = s.ov_seed;
    memcpy(buf, &h, sizeof h);
    memcpy(buf + s.words, v->words, 8u * ((uint64_t)v->wa + v->wb));
    memcpy(buf + s.seeds, v->seeds, 8u * (((uint64_t)v->geo.nb + SEEDS_PER_WORD - 1) / SEEDS_PER_WORD));
    if (v->geo.value_bits == 32)
        memcpy(buf + s.vals, v->vals32, slots * 4u);
    else
        memcpy(buf + s.vals, v->vals64, slots * 8u);
    if (d)
        memcpy(buf + s.fps, v->fps, (slots * d + 7) / 8 + 8);
    /* The map's probe sequences depend on its capacity: re-insert every bucket. */
    kvc_view img;
    memset(&img, 0, sizeof img);
    img.ov_bucket = (uint32_t *)(buf + s.ov_bucket);
    img.ov_seed = (uint16_t *)(buf + s.ov_seed);
    img.ov_cap = (uint32_t)cap;
    for (uint32_t i = 0; i < v->ov_cap; i++)
        if (v->ov_bucket[i])
            ov_put_nogrow(&img, v->ov_bucket[i] - 1u, v->ov_seed[i]);
    return KVC_OK;
}

static int section_ok(uint64_t off, uint64_t size, uint64_t bytes)
{
    return off % 8u == 0 && off >= sizeof(kvc_image_header) && off <= bytes && size <= bytes - off;
}

int kvc_view_attach(kvc_view **out, const uint8_t *buf, size_t len)
{
    if (!out || !buf || ((uintptr_t)buf & 7u) || len < sizeof(kvc_image_header))
        return KVC_ERR_ARG;
    kvc_image_header h;
    memcpy(&h, buf, sizeof h);
    if (h.magic != KVC_IMAGE_MAGIC)
        return KVC_ERR_MAGIC;
    if (h.bytes > len)
        return KVC_ERR_TRUNCATED;
    if ((h.value_bits != 32 && h.value_bits != 64) || h.fp_bits > 16 || h.nb < 2 || h.nb > KVC_MAX_BUCKETS ||
        h.ma == 0 || h.mb == 0 || h.wa != kvc_words_for(h.ma) || h.wb != kvc_words_for(h.mb) || h.ov_cap < 16 ||
        (uint64_t)h.ov_n * 20u > (uint64_t)h.ov_cap * 17u || (h.fp_bits == 0) != (h.off_fps == 0))
        return KVC_ERR_GEOMETRY;
    uint64_t slots = (uint64_t)h.nb * 4u;
    if (!section_ok(h.off_words, 8u * ((uint64_t)h.wa + h.wb), h.bytes) ||
        !section_ok(h.off_seeds, 8u * (((uint64_t)h.nb + SEEDS_PER_WORD - 1) / SEEDS_PER_WORD), h.bytes) ||
        !section_ok(h.off_vals, slots * (h.value_bits / 8u), h.bytes) ||
        (h.fp_bits && !section_ok(h.off_fps, (slots * h.fp_bits + 7) / 8 + 8, h.bytes)) ||
        !section_ok(h.off_ov_bucket, 4u * (uint64_t)h.ov_cap, h.bytes) ||
        !section_ok(h.off_ov_seed, 2u * (uint64_t)h.ov_cap, h.bytes) || h.entries > slots)
        return KVC_ERR_MALFORMED;
    kvc_view *v = calloc(1, sizeof *v);
    if (!v)
        return KVC_ERR_NOMEM;
    uint8_t *base = (uint8_t *)(uintptr_t)buf; /* a reader never writes through it (kvc_shared.h) */
    v->geo.table_id = h.table_id;
    v->geo.epoch = h.epoch;
    v->geo.nb = h.nb;
    v->geo.ma = h.ma;
    v->geo.mb = h.mb;
    v->geo.value_bits = h.value_bits;
    v->geo.fp_bits = h.fp_bits;
    v->geo.bucket_seed = h.bucket_seed;
    v->geo.locator_seed = h.locator_seed;
    v->entries = h.entries;
    v->slot_base = kvc_slot_base(h.bucket_seed);
    v->fp_seed = kvc_fp_seed(h.table_id); /* as build_from_snapshot derives it */
    v->wa = h.wa;
    v->wb = h.wb;
    v->words = (uint64_t *)(base + h.off_words);
    v->seeds = (uint64_t *)(base + h.off_seeds);
    if (h.value_bits == 32)
        v->vals32 = (uint32_t *)(base + h.off_vals);
    else
        v->vals64 = (uint64_t *)(base + h.off_vals);
    v->fps = h.fp_bits ? base + h.off_fps : NULL;
    v->ov_bucket = (uint32_t *)(base + h.off_ov_bucket);
    v->ov_seed = (uint16_t *)(base + h.off_ov_seed);
    v->ov_cap = h.ov_cap;
    v->ov_n = h.ov_n;
    *out = v;
    return KVC_OK;
}

void kvc_view_detach(kvc_view *v)
{
    free(v); /* the arrays belong to the image */
}

uint64_t kvc_view_overflow_room(const kvc_view *v)
{
    uint64_t most = (uint64_t)v->ov_cap * 17u / 20u;
    return most > v->ov_n ? most - v->ov_n : 0u;
}

int kvc_view_image_apply(kvc_view *v, const uint8_t *blob, size_t len)
{
    kvc_header hdr;
    int rc = read_checked(blob, len, &hdr);
    if (rc != KVC_OK)
        return rc;
    if (hdr.geo.table_id != v->geo.table_id)
        return KVC_ERR_FOREIGN;
    if (hdr.kind != KVC_BLOB_RECORDS)
        return KVC_ERR_ARG;
    if (hdr.geo.epoch != v->geo.epoch)
        return KVC_ERR_EPOCH;
    if (!same_geometry(&hdr.geo, &v->geo))
        return KVC_ERR_GEOMETRY;
    /* Room for every record's big seed (an over-count: some buckets are in the map already), so
     * apply_records' ov_reserve finds room and never reallocates the image's map. */
    const uint8_t *p = blob + KVC_HEADER_SIZE;
    uint64_t nbk = kvc_get32(p), nw = kvc_get32(p + 4);
    size_t bsize = kvc_record_bucket_size(v->geo.value_bits, v->geo.fp_bits);
    if (hdr.payload_len != 8u + nbk * bsize + nw * KVC_RECORD_WORD_SIZE)
        return KVC_ERR_MALFORMED;
    uint64_t big = 0;
    for (uint64_t i = 0; i < nbk; i++)
        big += kvc_get16(p + 8 + i * bsize + 4) > KVC_SEED_INLINE_MAX;
    if (big > kvc_view_overflow_room(v))
        return KVC_ERR_FULL;
    return apply_records(v, blob, &hdr);
}
