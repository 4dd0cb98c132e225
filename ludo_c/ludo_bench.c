/* ludo_bench.c -- per-operation timing for tools/bench_ludo.py. Reads the monotonic clock, so it
 * lives apart from the index code, which never does. */
#define _POSIX_C_SOURCE 199309L
#include <stdlib.h>
#include <time.h>

#include "ludo_internal.h"

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Ship whatever the table has pending into the view, as take_updates + apply would. */
static int sync_view(kvc_table *t, kvc_view *v, uint8_t **buf, size_t *cap)
{
    size_t need = kvc_table_needs_snapshot(t) ? kvc_table_snapshot_size(t) : kvc_table_records_size(t);
    if (need == 0)
        return KVC_OK;
    if (need > *cap) {
        uint8_t *p = realloc(*buf, need);
        if (!p)
            return KVC_ERR_NOMEM;
        *buf = p;
        *cap = need;
    }
    int rc;
    if (kvc_table_needs_snapshot(t)) {
        rc = kvc_table_snapshot_write(t, *buf, need);
        kvc_table_clear_pending(t);
    } else {
        rc = kvc_table_records_drain(t, *buf, need);
    }
    return rc == KVC_OK ? kvc_view_apply(v, *buf, need) : rc;
}

int kvc_bench_table_ops(kvc_table *t, kvc_view *v, int op, const uint64_t *keys,
                        const uint64_t *values, size_t n, uint64_t *ns_out)
{
    uint8_t *buf = NULL;
    size_t cap = 0;
    int rc = sync_view(t, v, &buf, &cap);
    for (size_t i = 0; i < n && rc == KVC_OK; i++) {
        uint64_t t0 = now_ns();
        if (op == 1)
            rc = kvc_table_insert(t, keys[i], values[i]);
        else if (op == 2)
            rc = kvc_table_update(t, keys[i], values[i]);
        else if (op == 3)
            rc = kvc_table_remove(t, keys[i]);
        else
            rc = KVC_ERR_ARG;
        if (rc == KVC_OK)
            rc = sync_view(t, v, &buf, &cap);
        ns_out[i] = now_ns() - t0;
    }
    free(buf);
    return rc;
}

void kvc_bench_view_lookups(const kvc_view *v, const uint64_t *keys, size_t n,
                            uint64_t *ns_out, uint64_t *sink)
{
    uint64_t acc = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t t0 = now_ns();
        acc ^= kvc_view_lookup(v, keys[i]);
        ns_out[i] = now_ns() - t0;
    }
    *sink = acc;
}
