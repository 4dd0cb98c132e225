/*
 * ludo_internal.h -- hashing, byte order and blob layout shared by the table and the view.
 * Both sides MUST compute identical hashes, so every hash lives here and nowhere else.
 */
#ifndef KVC_LUDO_INTERNAL_H
#define KVC_LUDO_INTERNAL_H

#include <stdint.h>
#include <stddef.h>
#include <string.h>

#include "ludo.h"

#define KVC_KEY_LIMIT (UINT64_C(1) << 63)
#define KVC_GOLD UINT64_C(0x9E3779B97F4A7C15)
#define KVC_SEED_INLINE_MAX 30u  /* view seeds 0..30 live in 5 bits; 31 means "see overflow map" */
#define KVC_SEED_SENTINEL 31u
#define KVC_SEED_LIMIT 65535u    /* largest slot seed a bucket may use (P(need more) ~ 1e-2800) */
#define KVC_MAX_BUCKETS (UINT32_C(1) << 31)

/* ---- blob layout ---------------------------------------------------------------------------
 *  0 magic "KVLD" | 4 version u16 | 6 kind u16 | 8 table_id u64 | 16 epoch u64
 * 24 nb u32 | 28 ma u32 | 32 mb u32 | 36 value_bits u8 | 37 fp_bits u8 | 38 reserved u16 (0)
 * 40 bucket_seed u64 | 48 locator_seed u64 | 56 payload_len u64 | 64 crc32 u32 | 68 reserved u32
 * CRC-32 (IEEE) covers bytes [0,64) followed by the payload.
 * Snapshot payload: entries u64 | seeds nb*u16 | values 4nb*(vb/8) | [fps 4nb*u16] | words*u64
 * Record payload:   nbk u32 | nw u32 | nbk*(idx u32, seed u16, 4 values, [4 fps u16])
 *                   | nw*(word idx u32, word u64)
 */
#define KVC_MAGIC "KVLD"
#define KVC_FORMAT_VERSION 1u
#define KVC_HEADER_SIZE 72u

typedef struct kvc_geometry {
    uint64_t table_id;
    uint64_t epoch;
    uint32_t nb, ma, mb;
    unsigned value_bits, fp_bits;
    uint64_t bucket_seed, locator_seed;
} kvc_geometry;

typedef struct kvc_header {
    unsigned kind;
    kvc_geometry geo;
    uint64_t payload_len;
    uint32_t crc;
} kvc_header;

static inline uint64_t kvc_fmix64(uint64_t x)
{
    x ^= x >> 33;
    x *= UINT64_C(0xff51afd7ed558ccd);
    x ^= x >> 33;
    x *= UINT64_C(0xc4ceb9fe1a85ec53);
    x ^= x >> 33;
    return x;
}

/* Independent 64-bit seeds derived from one value and a tag. */
static inline uint64_t kvc_derive(uint64_t x, uint64_t tag)
{
    return kvc_fmix64(x ^ kvc_fmix64(tag * KVC_GOLD + UINT64_C(0x632BE59BD9B4E019)));
}

static inline uint32_t kvc_mulshift(uint64_t x32, uint32_t range)
{
    return (uint32_t)((x32 * (uint64_t)range) >> 32);
}

/* The two candidate buckets of a key; always distinct (nb >= 2). */
static inline void kvc_buckets(uint64_t key, uint64_t bucket_seed, uint32_t nb,
                               uint32_t *b0, uint32_t *b1)
{
    uint64_t h = kvc_fmix64(key ^ bucket_seed);
    uint32_t x = kvc_mulshift(h >> 32, nb);
    uint32_t y = kvc_mulshift(h & UINT32_MAX, nb);
    if (y == x)
        y = (x + 1 == nb) ? 0 : x + 1;
    *b0 = x;
    *b1 = y;
}

/* Othello cells of a key: a in [0, ma), b in [0, mb). */
static inline void kvc_cells(uint64_t key, uint64_t locator_seed, uint32_t ma, uint32_t mb,
                             uint32_t *a, uint32_t *b)
{
    uint64_t g = kvc_fmix64(key ^ locator_seed);
    *a = kvc_mulshift(g >> 32, ma);
    *b = kvc_mulshift(g & UINT32_MAX, mb);
}

static inline uint64_t kvc_slot_base(uint64_t bucket_seed) { return kvc_derive(bucket_seed, 3); }
static inline uint64_t kvc_fp_seed(uint64_t bucket_seed) { return kvc_derive(bucket_seed, 4); }

/* 64 hash bits of a key for slot seeds 32*group .. 32*group + 31 (2 bits per seed). */
static inline uint64_t kvc_slot_bits(uint64_t key, uint64_t slot_base, unsigned group)
{
    return kvc_fmix64(key ^ (slot_base + (uint64_t)group * KVC_GOLD));
}

/* Slot of a key inside its bucket under slot seed s: 2 bits of hash(key, s / 32), the pair at
 * position s % 32. One hash serves 32 consecutive seeds, so the writer's seed search is cheap. */
static inline unsigned kvc_slot(uint64_t key, uint64_t slot_base, unsigned s)
{
    return (unsigned)(kvc_slot_bits(key, slot_base, s >> 5) >> (2u * (s & 31u))) & 3u;
}

static inline unsigned kvc_fingerprint(uint64_t key, uint64_t fp_seed, unsigned d)
{
    return d ? (unsigned)(kvc_fmix64(key ^ fp_seed) >> (64 - d)) : 0u;
}

static inline uint32_t kvc_words_for(uint32_t bits) { return (bits + 63u) / 64u; }

/* ---- little-endian access (plain loads/stores on little-endian hosts) ---- */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
static inline void kvc_put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static inline void kvc_put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void kvc_put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static inline uint16_t kvc_get16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t kvc_get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t kvc_get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
#else
static inline void kvc_put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static inline void kvc_put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline void kvc_put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t kvc_get16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t kvc_get32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}
static inline uint64_t kvc_get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}
#endif

/* ---- ludo_wire.c ---- */
/* Allocate an array, 64-byte aligned (free() releases it). Arrays of 2 MiB or more are 2 MiB-aligned and
 * advised onto transparent huge pages: lookups and writes touch them at random, and TLB misses
 * would otherwise cost as much as the cache misses. `zero` clears the memory. */
void *kvc_alloc(size_t bytes, int zero);
uint32_t kvc_crc32_update(uint32_t crc, const uint8_t *p, size_t n);
/* Write the header for `payload_len` bytes already in place after it, including the CRC. */
void kvc_header_write(uint8_t *blob, unsigned kind, const kvc_geometry *geo, uint64_t payload_len);
/* Parse and check magic, version, kind, declared length and geometry sanity (not the CRC). */
int kvc_header_read(const uint8_t *blob, size_t len, kvc_header *out);
/* Check the CRC of a blob whose header was read. */
int kvc_blob_check_crc(const uint8_t *blob, const kvc_header *hdr);
size_t kvc_snapshot_payload_size(const kvc_geometry *geo);
size_t kvc_record_bucket_size(unsigned value_bits, unsigned fp_bits);
#define KVC_RECORD_WORD_SIZE 12u

#endif /* KVC_LUDO_INTERNAL_H */
