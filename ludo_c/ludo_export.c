/*
 * ludo_export.c -- read the maintenance table's full-key contents out in bulk (for withdrawing a
 * worker's fields, consistency checks and inspection).
 */
#include "ludo.h"
#include "ludo_table.h"

size_t kvc_table_export(const kvc_table *t, uint64_t *keys_out, uint64_t *values_out, size_t cap)
{
    const kvc_store *s = &t->st;
    size_t slots = (size_t)s->nb * 4u, n = 0;
    for (size_t i = 0; i < slots && n < cap; i++) {
        uint64_t key = SKEY(s, i);
        if (key == EMPTY_KEY)
            continue;
        keys_out[n] = key;
        values_out[n] = SVAL(s, i);
        n++;
    }
    return n;
}
