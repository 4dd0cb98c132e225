/*
 * kvc_keys.c -- prefix keys over an incremental SHA-256 (see kvc_keys.h).
 */
#include "kvc_keys.h"

#include "kvc_sha256.h"
#include "ludo.h"
#include "ludo_internal.h"


int kvc_prefix_keys(const uint8_t *salt, size_t salt_len, const uint8_t *token_bytes, size_t n_tokens,
                    const int64_t *lengths, size_t n_lengths, int backend, uint64_t *keys_out)
{
    int64_t previous = 0;
    for (size_t i = 0; i < n_lengths; i++) {
        if (lengths[i] <= previous || (uint64_t)lengths[i] > n_tokens)
            return KVC_ERR_ARG;
        previous = lengths[i];
    }
    if (!kvc_sha256_backend_available(backend))
        return KVC_ERR_ARG;

    kvc_sha256 ctx;
    kvc_sha256_init(&ctx, backend);
    kvc_sha256_update(&ctx, salt, salt_len);
    size_t done = 0; /* tokens hashed so far */
    for (size_t i = 0; i < n_lengths; i++) {
        size_t end = (size_t)lengths[i];
        kvc_sha256_update(&ctx, token_bytes + 4 * done, 4 * (end - done));
        done = end;
        uint8_t digest[32];
        kvc_sha256_final(&ctx, digest);
        uint64_t key = 0;
        for (int b = 7; b >= 0; b--)
            key = (key << 8) | digest[b];
        keys_out[i] = key & (KVC_KEY_LIMIT - 1);  /* 63 bits: keys fit a signed int64, as the index and wire expect */
    }
    return KVC_OK;
}
