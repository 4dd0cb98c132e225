/*
 * kvc_sha256.h -- incremental SHA-256 (FIPS 180-4) with a digest at any point of the stream.
 *
 * Two compression functions behind one interface: the x86 SHA extensions (SHA-NI, chosen at run
 * time when the CPU has them) and portable C. Both give the same digests; the backend can be
 * forced so tests can hold each one against a reference. No allocation, no library dependency
 * (CI machines have no libssl headers), no global state except the cached CPU check.
 *
 * Usage: kvc_sha256_init, then any number of kvc_sha256_update calls; kvc_sha256_final reads the
 * digest of everything fed so far without changing the state, so a stream can be finalised at
 * every prefix for the price of the padding blocks.
 *
 * Everything between CDEF-BEGIN and CDEF-END is also fed to cffi's cdef: plain declarations only.
 */
#ifndef KVC_SHA256_H
#define KVC_SHA256_H

#include <stddef.h>
#include <stdint.h>

/* CDEF-BEGIN */

/* Compression backends. AUTO picks SHA-NI when the CPU has it, else PORTABLE. */
enum kvc_sha256_backend {
    KVC_SHA256_AUTO = 0,
    KVC_SHA256_PORTABLE = 1,
    KVC_SHA256_SHANI = 2
};

/* Hash state; treat as opaque (the fields may change). Copy it by assignment. */
typedef struct kvc_sha256 {
    uint32_t h[8];        /* chaining value */
    uint64_t length;      /* bytes fed so far */
    uint8_t block[64];    /* pending partial block */
    uint32_t used;        /* bytes pending in block */
    uint32_t backend;     /* KVC_SHA256_PORTABLE or KVC_SHA256_SHANI, resolved */
} kvc_sha256;

/* 1 if `backend` can run on this CPU (AUTO and PORTABLE always can), else 0. */
int kvc_sha256_backend_available(int backend);

/* The backend AUTO resolves to on this CPU (KVC_SHA256_SHANI or KVC_SHA256_PORTABLE). */
int kvc_sha256_auto_backend(void);

/* Start a hash on `backend`. Returns 0, or -1 if the backend is unknown or unavailable here (the
 * state is then initialised on the portable backend, so it is still usable). */
int kvc_sha256_init(kvc_sha256 *ctx, int backend);

/* Feed `len` bytes. */
void kvc_sha256_update(kvc_sha256 *ctx, const uint8_t *data, size_t len);

/* The 32-byte digest of everything fed so far; ctx is not changed (the stream can go on). */
void kvc_sha256_final(const kvc_sha256 *ctx, uint8_t digest[32]);

/* One-shot digest of `len` bytes on `backend` (as init + update + final). Returns 0 or -1 as
 * kvc_sha256_init. */
int kvc_sha256_digest(const uint8_t *data, size_t len, int backend, uint8_t digest[32]);

/* A chain of page digests, as a prefix cache names its pages: digest 0 is
 * SHA-256(seed || page 0), digest i is SHA-256(digest i-1 || page i), page i being bytes
 * [i * page_bytes, (i + 1) * page_bytes) of `data`. Writes 32 * n_pages bytes to `out`; `seed` may
 * be NULL when seed_len is 0. Returns 0 or -1 as kvc_sha256_init (the digests are right either
 * way). One call per prompt instead of a hash object per page. */
int kvc_sha256_page_chain(const uint8_t *seed, size_t seed_len, const uint8_t *data, size_t page_bytes,
                          size_t n_pages, int backend, uint8_t *out);

/* CDEF-END */

/* For callers that run several chains at once (kvc_prefix_keys_paired); not part of the cffi API.
 * The compression function on `backend` (KVC_SHA256_PORTABLE or KVC_SHA256_SHANI, resolved) over
 * whole 64-byte blocks; the initial chaining value; and one block of each of two independent
 * chains compressed with their instructions interleaved, which only the SHA-NI backend does:
 * returns 1 when done, 0 (nothing done) otherwise. */
void kvc_sha256_compress_blocks(int backend, uint32_t h[8], const uint8_t *data, size_t blocks);
void kvc_sha256_initial(uint32_t h[8]);
int kvc_sha256_compress_pair(int backend, uint32_t ha[8], const uint8_t *da, uint32_t hb[8], const uint8_t *db);

#endif /* KVC_SHA256_H */
