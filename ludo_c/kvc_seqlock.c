/*
 * kvc_seqlock.c -- the sequence lock of kvc_shared.h. One writer; readers never block it.
 * GCC/Clang atomic builtins on a plain counter: the counter lives in memory another process maps.
 */
#include "kvc_shared.h"

uint64_t kvc_seq_read_begin(const uint64_t *seq)
{
    return __atomic_load_n(seq, __ATOMIC_ACQUIRE);
}

int kvc_seq_read_valid(const uint64_t *seq, uint64_t start)
{
    /* The reads of the data happen before the re-read of the counter. */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return (start & 1u) == 0 && __atomic_load_n(seq, __ATOMIC_RELAXED) == start;
}

void kvc_seq_write_begin(uint64_t *seq)
{
    uint64_t s = __atomic_load_n(seq, __ATOMIC_RELAXED);
    __atomic_store_n(seq, s + 1u, __ATOMIC_RELAXED);
    /* The odd counter is visible before any data write. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

void kvc_seq_write_end(uint64_t *seq)
{
    uint64_t s = __atomic_load_n(seq, __ATOMIC_RELAXED);
    __atomic_store_n(seq, s + 1u, __ATOMIC_RELEASE);
}
