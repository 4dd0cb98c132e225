/*
 * kvc_keys.c -- prefix keys over an incremental SHA-256 (see kvc_keys.h).
 */
#include "kvc_keys.h"

#include "kvc_sha256.h"
#include "ludo.h"
#include "ludo_internal.h"

#include <string.h>


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

/* ---- kvc_prefix_keys_paired: the finals in the stream's shadow ------------------------------ */

/* A length's final waiting for its padding blocks: the chain at its last whole block and the
 * padded tail (one or two blocks). */
typedef struct kvc_final_job {
    uint32_t h[8];
    uint8_t tail[128];
    unsigned blocks, done;
    size_t index;
} kvc_final_job;

/* Finals held at once; more wait until two of them run as a pair. */
#define KVC_FINAL_JOBS 16

/* `n` bytes of the stream salt || tokens from offset `at` into dst. */
static void stream_copy(uint8_t *dst, size_t at, size_t n, const uint8_t *salt, size_t salt_len,
                        const uint8_t *token_bytes)
{
    if (at < salt_len) {
        size_t take = salt_len - at < n ? salt_len - at : n;
        memcpy(dst, salt + at, take);
        dst += take;
        at += take;
        n -= take;
    }
    if (n)
        memcpy(dst, token_bytes + (at - salt_len), n);
}

static void job_key(const kvc_final_job *job, uint64_t *keys_out)
{
    /* The first 8 digest bytes (h0, h1 big-endian) read as a little-endian uint64. */
    uint64_t key = (uint64_t)__builtin_bswap32(job->h[0]) | ((uint64_t)__builtin_bswap32(job->h[1]) << 32);
    keys_out[job->index] = key & (KVC_KEY_LIMIT - 1);
}

/* The first job still running at or after `from`, or n_jobs. */
static size_t next_running(const kvc_final_job *jobs, size_t n_jobs, size_t from)
{
    while (from < n_jobs && jobs[from].done == jobs[from].blocks)
        from++;
    return from;
}

/* Drop finished jobs, keeping the order of the others; returns how many are left. */
static size_t compact_jobs(kvc_final_job *jobs, size_t n_jobs)
{
    size_t kept = 0;
    for (size_t j = 0; j < n_jobs; j++)
        if (jobs[j].done < jobs[j].blocks) {
            if (kept != j)
                jobs[kept] = jobs[j];
            kept++;
        }
    return kept;
}

/* Run the first two running jobs one block each, side by side (one alone: by itself). Returns 0
 * when no job was running. */
static int step_jobs(int backend, kvc_final_job *jobs, size_t n_jobs, uint64_t *keys_out)
{
    size_t a = next_running(jobs, n_jobs, 0);
    if (a == n_jobs)
        return 0;
    size_t b = next_running(jobs, n_jobs, a + 1);
    kvc_final_job *ja = &jobs[a];
    if (b < n_jobs) {
        kvc_final_job *jb = &jobs[b];
        kvc_sha256_compress_pair(backend, ja->h, ja->tail + 64 * ja->done, jb->h, jb->tail + 64 * jb->done);
        if (++jb->done == jb->blocks)
            job_key(jb, keys_out);
    } else {
        kvc_sha256_compress_blocks(backend, ja->h, ja->tail + 64 * ja->done, 1);
    }
    if (++ja->done == ja->blocks)
        job_key(ja, keys_out);
    return 1;
}

int kvc_prefix_keys_paired(const uint8_t *salt, size_t salt_len, const uint8_t *token_bytes, size_t n_tokens,
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
    if (backend == KVC_SHA256_AUTO)
        backend = kvc_sha256_auto_backend();
    if (backend != KVC_SHA256_SHANI) /* no paired compression there: one final after another */
        return kvc_prefix_keys(salt, salt_len, token_bytes, n_tokens, lengths, n_lengths, backend, keys_out);

    uint32_t h[8];
    kvc_sha256_initial(h);
    kvc_final_job jobs[KVC_FINAL_JOBS];
    size_t n_jobs = 0, at = 0; /* bytes of the stream compressed so far (whole blocks) */
    uint8_t block[64];
    for (size_t i = 0; i < n_lengths; i++) {
        size_t end = salt_len + 4 * (size_t)lengths[i];
        size_t whole = end & ~(size_t)63;
        while (at < whole) {
            const uint8_t *data;
            if (at >= salt_len) {
                data = token_bytes + (at - salt_len);
            } else {
                stream_copy(block, at, 64, salt, salt_len, token_bytes);
                data = block;
            }
            size_t run = next_running(jobs, n_jobs, 0);
            if (run < n_jobs) {
                /* this block of the stream, and a block of the oldest final beside it */
                kvc_final_job *job = &jobs[run];
                kvc_sha256_compress_pair(backend, h, data, job->h, job->tail + 64 * job->done);
                if (++job->done == job->blocks)
                    job_key(job, keys_out);
                at += 64;
            } else if (at >= salt_len) {
                size_t blocks = (whole - at) / 64; /* no final waiting: the whole run at once */
                kvc_sha256_compress_blocks(backend, h, data, blocks);
                at += 64 * blocks;
            } else {
                kvc_sha256_compress_blocks(backend, h, data, 1);
                at += 64;
            }
        }
        if (n_jobs == KVC_FINAL_JOBS)
            n_jobs = compact_jobs(jobs, n_jobs);
        while (n_jobs == KVC_FINAL_JOBS) {
            step_jobs(backend, jobs, n_jobs, keys_out);
            n_jobs = compact_jobs(jobs, n_jobs);
        }
        /* This length's final: the pending bytes, 0x80, zeros and the bit length (big-endian). */
        kvc_final_job *job = &jobs[n_jobs++];
        memcpy(job->h, h, sizeof h);
        size_t used = end - whole;
        size_t total = used + 9 <= 64 ? 64 : 128;
        stream_copy(job->tail, whole, used, salt, salt_len, token_bytes);
        job->tail[used] = 0x80;
        memset(job->tail + used + 1, 0, total - used - 9);
        uint64_t bits = (uint64_t)end << 3;
        for (unsigned b = 0; b < 8; b++)
            job->tail[total - 1 - b] = (uint8_t)(bits >> (8 * b));
        job->blocks = (unsigned)(total / 64);
        job->done = 0;
        job->index = i;
    }
    while (step_jobs(backend, jobs, n_jobs, keys_out))
        ;
    return KVC_OK;
}
