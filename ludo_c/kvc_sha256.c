/*
 * kvc_sha256.c -- SHA-256 with a SHA-NI and a portable compression function (see kvc_sha256.h).
 *
 * The SHA-NI path is compiled with a per-function target attribute, so the rest of the build
 * needs no -msha and runs on any x86-64; it is only called after the CPU check says so.
 */
#include "kvc_sha256.h"

#include <stdatomic.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define KVC_SHA256_HAVE_SHANI 1
#include <immintrin.h>
#else
#define KVC_SHA256_HAVE_SHANI 0
#endif

static const uint32_t K256[64] = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u, 0xab1c5ed5u,
    0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu, 0x9bdc06a7u, 0xc19bf174u,
    0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu, 0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau,
    0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u, 0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u,
    0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu, 0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u,
    0xa2bfe8a1u, 0xa81a664bu, 0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u,
    0x19a4c116u, 0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u, 0xc67178f2u,
};

static const uint32_t H0[8] = {
    0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au, 0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u,
};

/* ---- portable compression ----------------------------------------------------------------- */

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))
#define BSIG0(x) (ROTR(x, 2) ^ ROTR(x, 13) ^ ROTR(x, 22))
#define BSIG1(x) (ROTR(x, 6) ^ ROTR(x, 11) ^ ROTR(x, 25))
#define SSIG0(x) (ROTR(x, 7) ^ ROTR(x, 18) ^ ((x) >> 3))
#define SSIG1(x) (ROTR(x, 17) ^ ROTR(x, 19) ^ ((x) >> 10))
#define CH(e, f, g) ((g) ^ ((e) & ((f) ^ (g))))
#define MAJ(a, b, c) (((a) & (b)) | ((c) & ((a) | (b))))
/* One round with the variables renamed instead of shifted: h becomes the new a, d the new e. */
#define ROUND(a, b, c, d, e, f, g, h, i)                                         \
    do {                                                                         \
        uint32_t t1 = (h) + BSIG1(e) + CH(e, f, g) + K256[i] + w[(i) & 15];      \
        (d) += t1;                                                               \
        (h) = t1 + BSIG0(a) + MAJ(a, b, c);                                      \
    } while (0)

static inline uint32_t load_be32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

/* The message schedule lives in a 16-word ring, refilled eight words ahead of the rounds. */
static void compress_portable(uint32_t h[8], const uint8_t *data, size_t blocks)
{
    for (; blocks; blocks--, data += 64) {
        uint32_t w[16];
        for (int i = 0; i < 16; i++)
            w[i] = load_be32(data + 4 * i);
        uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
        for (int r = 0; r < 64; r += 8) {
            if (r >= 16)
                for (int i = r; i < r + 8; i++)
                    w[i & 15] += SSIG1(w[(i - 2) & 15]) + w[(i - 7) & 15] + SSIG0(w[(i - 15) & 15]);
            ROUND(a, b, c, d, e, f, g, k, r + 0);
            ROUND(k, a, b, c, d, e, f, g, r + 1);
            ROUND(g, k, a, b, c, d, e, f, r + 2);
            ROUND(f, g, k, a, b, c, d, e, r + 3);
            ROUND(e, f, g, k, a, b, c, d, r + 4);
            ROUND(d, e, f, g, k, a, b, c, r + 5);
            ROUND(c, d, e, f, g, k, a, b, r + 6);
            ROUND(b, c, d, e, f, g, k, a, r + 7);
        }
        h[0] += a;
        h[1] += b;
        h[2] += c;
        h[3] += d;
        h[4] += e;
        h[5] += f;
        h[6] += g;
        h[7] += k;
    }
}

/* ---- SHA-NI compression ------------------------------------------------------------------- */

#if KVC_SHA256_HAVE_SHANI
/* The state lives in two registers as (A, B, E, F) and (C, D, G, H); each sha256rnds2 does two
 * rounds, and the message schedule runs four words ahead through sha256msg1/msg2. The loop over
 * the 16 four-round groups is unrolled by the compiler, which resolves the register rotation. */
__attribute__((target("sha,sse4.1")))
static void compress_shani(uint32_t h[8], const uint8_t *data, size_t blocks)
{
    const __m128i byteswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i tmp = _mm_loadu_si128((const __m128i *)&h[0]);      /* A B C D (low to high: D C B A) */
    __m128i state1 = _mm_loadu_si128((const __m128i *)&h[4]);   /* E F G H */
    tmp = _mm_shuffle_epi32(tmp, 0xB1);                          /* C D A B */
    state1 = _mm_shuffle_epi32(state1, 0x1B);                    /* H G F E */
    __m128i state0 = _mm_alignr_epi8(tmp, state1, 8);            /* A B E F */
    state1 = _mm_blend_epi16(state1, tmp, 0xF0);                 /* C D G H */

    for (; blocks; blocks--, data += 64) {
        const __m128i abef = state0, cdgh = state1;
        __m128i m[4];
#pragma GCC unroll 16
        for (int q = 0; q < 16; q++) {
            if (q < 4)
                m[q] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(data + 16 * q)), byteswap);
            __m128i msg = _mm_add_epi32(m[q & 3], _mm_loadu_si128((const __m128i *)&K256[4 * q]));
            state1 = _mm_sha256rnds2_epu32(state1, state0, msg);
            if (q >= 3 && q <= 14) { /* the next group's words: W[t] = msg2(msg1(...) + W[t-7]) */
                __m128i w7 = _mm_alignr_epi8(m[q & 3], m[(q + 3) & 3], 4);
                m[(q + 1) & 3] = _mm_sha256msg2_epu32(_mm_add_epi32(m[(q + 1) & 3], w7), m[q & 3]);
            }
            msg = _mm_shuffle_epi32(msg, 0x0E);
            state0 = _mm_sha256rnds2_epu32(state0, state1, msg);
            if (q >= 1 && q <= 12)
                m[(q + 3) & 3] = _mm_sha256msg1_epu32(m[(q + 3) & 3], m[q & 3]);
        }
        state0 = _mm_add_epi32(state0, abef);
        state1 = _mm_add_epi32(state1, cdgh);
    }

    tmp = _mm_shuffle_epi32(state0, 0x1B);                       /* F E B A */
    state1 = _mm_shuffle_epi32(state1, 0xB1);                    /* D C H G */
    state0 = _mm_blend_epi16(tmp, state1, 0xF0);                 /* D C B A */
    state1 = _mm_alignr_epi8(state1, tmp, 8);                    /* H G F E */
    _mm_storeu_si128((__m128i *)&h[0], state0);
    _mm_storeu_si128((__m128i *)&h[4], state1);
}
#endif

#if KVC_SHA256_HAVE_SHANI
/* compress_shani over one block of each of two independent chains, their instructions
 * interleaved: sha256rnds2 is latency-bound, so the second chain runs in the first one's shadow. */
__attribute__((target("sha,sse4.1")))
static void compress_shani_pair(uint32_t ha[8], const uint8_t *da, uint32_t hb[8], const uint8_t *db)
{
    const __m128i byteswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i s0[2], s1[2], save0[2], save1[2], m[2][4];
    uint32_t *h[2] = {ha, hb};
    const uint8_t *d[2] = {da, db};
    for (int c = 0; c < 2; c++) {
        __m128i tmp = _mm_loadu_si128((const __m128i *)&h[c][0]);
        __m128i st1 = _mm_loadu_si128((const __m128i *)&h[c][4]);
        tmp = _mm_shuffle_epi32(tmp, 0xB1);
        st1 = _mm_shuffle_epi32(st1, 0x1B);
        s0[c] = _mm_alignr_epi8(tmp, st1, 8);
        s1[c] = _mm_blend_epi16(st1, tmp, 0xF0);
        save0[c] = s0[c];
        save1[c] = s1[c];
    }
#pragma GCC unroll 16
    for (int q = 0; q < 16; q++) {
#pragma GCC unroll 2
        for (int c = 0; c < 2; c++) {
            if (q < 4)
                m[c][q] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(d[c] + 16 * q)), byteswap);
            __m128i msg = _mm_add_epi32(m[c][q & 3], _mm_loadu_si128((const __m128i *)&K256[4 * q]));
            s1[c] = _mm_sha256rnds2_epu32(s1[c], s0[c], msg);
            if (q >= 3 && q <= 14) {
                __m128i w7 = _mm_alignr_epi8(m[c][q & 3], m[c][(q + 3) & 3], 4);
                m[c][(q + 1) & 3] = _mm_sha256msg2_epu32(_mm_add_epi32(m[c][(q + 1) & 3], w7), m[c][q & 3]);
            }
            msg = _mm_shuffle_epi32(msg, 0x0E);
            s0[c] = _mm_sha256rnds2_epu32(s0[c], s1[c], msg);
            if (q >= 1 && q <= 12)
                m[c][(q + 3) & 3] = _mm_sha256msg1_epu32(m[c][(q + 3) & 3], m[c][q & 3]);
        }
    }
    for (int c = 0; c < 2; c++) {
        __m128i st0 = _mm_add_epi32(s0[c], save0[c]);
        __m128i st1 = _mm_add_epi32(s1[c], save1[c]);
        __m128i tmp = _mm_shuffle_epi32(st0, 0x1B);
        st1 = _mm_shuffle_epi32(st1, 0xB1);
        st0 = _mm_blend_epi16(tmp, st1, 0xF0);
        st1 = _mm_alignr_epi8(st1, tmp, 8);
        _mm_storeu_si128((__m128i *)&h[c][0], st0);
        _mm_storeu_si128((__m128i *)&h[c][4], st1);
    }
}
#endif

/* ---- dispatch ------------------------------------------------------------------------------- */

static int cpu_has_shani(void)
{
#if KVC_SHA256_HAVE_SHANI
    /* Cached (callers may run without the GIL: an atomic, so a race only computes it twice). */
    static atomic_int cached = -1;
    int has = atomic_load_explicit(&cached, memory_order_relaxed);
    if (has < 0) {
        __builtin_cpu_init();
        has = __builtin_cpu_supports("sha") && __builtin_cpu_supports("sse4.1") ? 1 : 0;
        atomic_store_explicit(&cached, has, memory_order_relaxed);
    }
    return has;
#else
    return 0;
#endif
}

int kvc_sha256_backend_available(int backend)
{
    switch (backend) {
    case KVC_SHA256_AUTO:
    case KVC_SHA256_PORTABLE:
        return 1;
    case KVC_SHA256_SHANI:
        return cpu_has_shani();
    default:
        return 0;
    }
}

int kvc_sha256_auto_backend(void)
{
    return cpu_has_shani() ? KVC_SHA256_SHANI : KVC_SHA256_PORTABLE;
}

static inline void compress(uint32_t backend, uint32_t h[8], const uint8_t *data, size_t blocks)
{
#if KVC_SHA256_HAVE_SHANI
    if (backend == KVC_SHA256_SHANI) {
        compress_shani(h, data, blocks);
        return;
    }
#else
    (void)backend;
#endif
    compress_portable(h, data, blocks);
}

/* ---- streaming -------------------------------------------------------------------------------- */

int kvc_sha256_init(kvc_sha256 *ctx, int backend)
{
    int rc = 0;
    memcpy(ctx->h, H0, sizeof H0);
    ctx->length = 0;
    ctx->used = 0;
    if (backend == KVC_SHA256_AUTO)
        backend = kvc_sha256_auto_backend();
    if (!kvc_sha256_backend_available(backend)) {
        backend = KVC_SHA256_PORTABLE;
        rc = -1;
    }
    ctx->backend = (uint32_t)backend;
    return rc;
}

void kvc_sha256_update(kvc_sha256 *ctx, const uint8_t *data, size_t len)
{
    ctx->length += len;
    if (ctx->used) {
        size_t take = 64 - ctx->used;
        if (take > len)
            take = len;
        memcpy(ctx->block + ctx->used, data, take);
        ctx->used += (uint32_t)take;
        data += take;
        len -= take;
        if (ctx->used < 64)
            return;
        compress(ctx->backend, ctx->h, ctx->block, 1);
        ctx->used = 0;
    }
    if (len >= 64) {
        size_t blocks = len / 64;
        compress(ctx->backend, ctx->h, data, blocks);
        data += 64 * blocks;
        len -= 64 * blocks;
    }
    if (len) {
        memcpy(ctx->block, data, len);
        ctx->used = (uint32_t)len;
    }
}

void kvc_sha256_final(const kvc_sha256 *ctx, uint8_t digest[32])
{
    uint8_t tail[128];
    uint32_t h[8];
    size_t used = ctx->used;
    /* The pending bytes, 0x80, zeros, and the bit length (big-endian) in the last 8 bytes. */
    size_t total = used + 9 <= 64 ? 64 : 128;
    memcpy(tail, ctx->block, used);
    tail[used] = 0x80;
    memset(tail + used + 1, 0, total - used - 9);
    uint64_t bits = ctx->length << 3;
    for (unsigned i = 0; i < 8; i++)
        tail[total - 1 - i] = (uint8_t)(bits >> (8 * i));
    memcpy(h, ctx->h, sizeof h);
    compress(ctx->backend, h, tail, total / 64);
    for (int i = 0; i < 8; i++) {
        digest[4 * i] = (uint8_t)(h[i] >> 24);
        digest[4 * i + 1] = (uint8_t)(h[i] >> 16);
        digest[4 * i + 2] = (uint8_t)(h[i] >> 8);
        digest[4 * i + 3] = (uint8_t)h[i];
    }
}

int kvc_sha256_digest(const uint8_t *data, size_t len, int backend, uint8_t digest[32])
{
    kvc_sha256 ctx;
    int rc = kvc_sha256_init(&ctx, backend);
    kvc_sha256_update(&ctx, data, len);
    kvc_sha256_final(&ctx, digest);
    return rc;
}

int kvc_sha256_page_chain(const uint8_t *seed, size_t seed_len, const uint8_t *data, size_t page_bytes,
                          size_t n_pages, int backend, uint8_t *out)
{
    kvc_sha256 root, ctx;
    int rc = kvc_sha256_init(&root, backend);
    for (size_t i = 0; i < n_pages; i++) {
        ctx = root;
        if (i == 0) {
            if (seed_len)
                kvc_sha256_update(&ctx, seed, seed_len);
        } else {
            kvc_sha256_update(&ctx, out + 32 * (i - 1), 32);
        }
        kvc_sha256_update(&ctx, data + i * page_bytes, page_bytes);
        kvc_sha256_final(&ctx, out + 32 * i);
    }
    return rc;
}

int kvc_sha256_compress_pair(int backend, uint32_t ha[8], const uint8_t *da, uint32_t hb[8], const uint8_t *db)
{
#if KVC_SHA256_HAVE_SHANI
    if (backend == KVC_SHA256_SHANI && cpu_has_shani()) {
        compress_shani_pair(ha, da, hb, db);
        return 1;
    }
#endif
    (void)backend;
    (void)ha;
    (void)da;
    (void)hb;
    (void)db;
    return 0;
}

void kvc_sha256_compress_blocks(int backend, uint32_t h[8], const uint8_t *data, size_t blocks)
{
    compress((uint32_t)backend, h, data, blocks);
}

void kvc_sha256_initial(uint32_t h[8])
{
    memcpy(h, H0, sizeof H0);
}
