/*
 * kvc_keys.h -- prefix keys (kvcompassd.core.keys) in C: one SHA-256 pass for every length.
 *
 *   key(c) = low 63 bits of SHA-256(salt || tokens[:c] as uint32 little-endian)
 *
 * "Low 63 bits": the first 8 digest bytes read as a little-endian uint64, top bit cleared. The
 * stream is hashed once; at each requested length the state is finalised on a copy, so n lengths
 * cost one pass plus about one block each. Bit-identical to the Python/hashlib reference.
 *
 * Everything between CDEF-BEGIN and CDEF-END is also fed to cffi's cdef: plain declarations only.
 */
#ifndef KVC_KEYS_H
#define KVC_KEYS_H

#include <stddef.h>
#include <stdint.h>

/* CDEF-BEGIN */

/* Keys of the first lengths[i] tokens, i < n_lengths, into keys_out[n_lengths].
 *   token_bytes   n_tokens tokens as uint32 little-endian (4 * n_tokens bytes);
 *   lengths       strictly ascending, each in 1..n_tokens;
 *   backend       a kvc_sha256_backend (KVC_SHA256_AUTO in production; tests force the others).
 * Returns KVC_OK, or KVC_ERR_ARG (bad lengths, or a backend this CPU lacks; keys_out untouched). */
int kvc_prefix_keys(const uint8_t *salt, size_t salt_len, const uint8_t *token_bytes, size_t n_tokens,
                    const int64_t *lengths, size_t n_lengths, int backend, uint64_t *keys_out);

/* kvc_prefix_keys' keys (the same arguments, checks and answers), each length's padding blocks
 * compressed beside the stream's next block (SHA-NI's rounds are latency-bound: two independent
 * chains cost about one) instead of after it; at an edge's 26-168 query lengths the finals were
 * a fifth to half of the hashing. The portable backend runs kvc_prefix_keys. */
int kvc_prefix_keys_paired(const uint8_t *salt, size_t salt_len, const uint8_t *token_bytes, size_t n_tokens,
                           const int64_t *lengths, size_t n_lengths, int backend, uint64_t *keys_out);

/* CDEF-END */

#endif /* KVC_KEYS_H */
