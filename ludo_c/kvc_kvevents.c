/* kvc_kvevents.c -- see kvc_kvevents.h. */
#include "kvc_kvevents.h"

#include <string.h>

#define MAX_SKIP_DEPTH 32

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} reader;

static int have(const reader *r, size_t n) { return (size_t)(r->end - r->p) >= n; }

static uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* Strict UTF-8, as Python's decoder: no overlongs, no surrogates, nothing above U+10FFFF. */
static int valid_utf8(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) { i++; continue; }
        size_t need;
        uint8_t lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) need = 1;
        else if (c == 0xE0) { need = 2; lo = 0xA0; }
        else if (c == 0xED) { need = 2; hi = 0x9F; }
        else if (c >= 0xE1 && c <= 0xEF) need = 2;
        else if (c == 0xF0) { need = 3; lo = 0x90; }
        else if (c == 0xF4) { need = 3; hi = 0x8F; }
        else if (c >= 0xF1 && c <= 0xF3) need = 3;
        else return 0;
        if (n - i - 1 < need) return 0;
        if (s[i + 1] < lo || s[i + 1] > hi) return 0;
        for (size_t k = 2; k <= need; k++)
            if ((s[i + k] & 0xC0) != 0x80) return 0;
        i += need + 1;
    }
    return 1;
}

/* An integer of any msgpack encoding. *big is set when it is a uint64 >= 2^63 (*v then holds
 * its bits). Returns 0 (nothing consumed) when the next item is not an integer. */
static int read_int(reader *r, int64_t *v, int *big) {
    if (!have(r, 1)) return 0;
    uint8_t b = r->p[0];
    *big = 0;
    if (b <= 0x7f) { *v = b; r->p += 1; return 1; }
    if (b >= 0xe0) { *v = (int8_t)b; r->p += 1; return 1; }
    int n;
    int is_signed;
    switch (b) {
        case 0xcc: n = 1; is_signed = 0; break;
        case 0xcd: n = 2; is_signed = 0; break;
        case 0xce: n = 4; is_signed = 0; break;
        case 0xcf: n = 8; is_signed = 0; break;
        case 0xd0: n = 1; is_signed = 1; break;
        case 0xd1: n = 2; is_signed = 1; break;
        case 0xd2: n = 4; is_signed = 1; break;
        case 0xd3: n = 8; is_signed = 1; break;
        default: return 0;
    }
    if (!have(r, 1 + (size_t)n)) return 0;
    uint64_t u = be(r->p + 1, n);
    if (is_signed) {
        if (n == 1) *v = (int8_t)u;
        else if (n == 2) *v = (int16_t)u;
        else if (n == 4) *v = (int32_t)u;
        else *v = (int64_t)u;
    } else {
        *v = (int64_t)u;
        *big = u > (uint64_t)INT64_MAX;
    }
    r->p += 1 + n;
    return 1;
}

static int read_nil(reader *r) {
    if (have(r, 1) && r->p[0] == 0xc0) { r->p++; return 1; }
    return 0;
}

/* A container's header (fix form at fix..fix+15, then the 16- and 32-bit counts' markers). */
static int read_header(reader *r, uint32_t *n, uint8_t fix, uint8_t wide16, uint8_t wide32) {
    if (!have(r, 1)) return 0;
    uint8_t b = r->p[0];
    if (b >= fix && b <= fix + 0x0f) { *n = b & 0x0f; r->p += 1; return 1; }
    if (b == wide16 && have(r, 3)) { *n = (uint32_t)be(r->p + 1, 2); r->p += 3; return 1; }
    if (b == wide32 && have(r, 5)) { *n = (uint32_t)be(r->p + 1, 4); r->p += 5; return 1; }
    return 0;
}

static int read_array(reader *r, uint32_t *n) { return read_header(r, n, 0x90, 0xdc, 0xdd); }

static int read_map(reader *r, uint32_t *n) { return read_header(r, n, 0x80, 0xde, 0xdf); }

/* A valid UTF-8 string; returns 0 (maybe partly consumed: the scan is abandoned) otherwise. */
static int read_str(reader *r, const uint8_t **s, uint32_t *n) {
    if (!have(r, 1)) return 0;
    uint8_t b = r->p[0];
    size_t head;
    uint64_t len;
    if (b >= 0xa0 && b <= 0xbf) { head = 1; len = b & 0x1f; }
    else if (b == 0xd9 && have(r, 2)) { head = 2; len = be(r->p + 1, 1); }
    else if (b == 0xda && have(r, 3)) { head = 3; len = be(r->p + 1, 2); }
    else if (b == 0xdb && have(r, 5)) { head = 5; len = be(r->p + 1, 4); }
    else return 0;
    if (!have(r, head + len) || !valid_utf8(r->p + head, (size_t)len)) return 0;
    *s = r->p + head;
    *n = (uint32_t)len;
    r->p += head + len;
    return 1;
}

static int str_is(const uint8_t *s, uint32_t n, const char *want) {
    size_t w = strlen(want);
    return n == w && memcmp(s, want, w) == 0;
}

/* Skip one value of the kinds msgpack-python turns into plain objects the decoder may ignore.
 * Ext types (msgpack-python decodes some itself), map keys that are arrays or maps (unhashable
 * in Python), 0xc1 and truncation answer 0. */
static int skip(reader *r, int depth) {
    if (depth > MAX_SKIP_DEPTH || !have(r, 1)) return 0;
    uint8_t b = r->p[0];
    int64_t v;
    int big;
    uint32_t n;
    const uint8_t *s;
    if (read_int(r, &v, &big)) return 1;
    if (b == 0xc0 || b == 0xc2 || b == 0xc3) { r->p++; return 1; }
    if (b == 0xca) { if (!have(r, 5)) return 0; r->p += 5; return 1; }
    if (b == 0xcb) { if (!have(r, 9)) return 0; r->p += 9; return 1; }
    if ((b >= 0xa0 && b <= 0xbf) || b == 0xd9 || b == 0xda || b == 0xdb) return read_str(r, &s, &n);
    if (b == 0xc4 || b == 0xc5 || b == 0xc6) {
        int h = b == 0xc4 ? 1 : b == 0xc5 ? 2 : 4;
        if (!have(r, 1 + (size_t)h)) return 0;
        uint64_t len = be(r->p + 1, h);
        if (!have(r, 1 + (size_t)h + len)) return 0;
        r->p += 1 + h + len;
        return 1;
    }
    if (read_array(r, &n)) {
        for (uint32_t i = 0; i < n; i++)
            if (!skip(r, depth + 1)) return 0;
        return 1;
    }
    if (read_map(r, &n)) {
        for (uint32_t i = 0; i < n; i++) {
            if (!have(r, 1)) return 0;
            uint8_t k = r->p[0];
            if ((k >= 0x80 && k <= 0x9f) || k == 0xdc || k == 0xdd || k == 0xde || k == 0xdf) return 0;
            if (!skip(r, depth + 1) || !skip(r, depth + 1)) return 0;
        }
        return 1;
    }
    return 0;
}

/* Null, or a valid string: *off -1 for null. */
static int read_optional_str(reader *r, const uint8_t *base, int64_t *off, uint32_t *len) {
    const uint8_t *s;
    if (read_nil(r)) { *off = -1; *len = 0; return 1; }
    if (!read_str(r, &s, len)) return 0;
    *off = s - base;
    return 1;
}

enum { F_TYPE = 1, F_HASHES = 2, F_PARENT = 4, F_TOKENS = 8, F_SIZE = 16, F_LORA_ID = 32, F_MEDIUM = 64,
       F_LORA_NAME = 128, F_GROUP = 256 };

typedef struct {
    int kind;
    uint32_t hash_start, hash_end, token_start, token_end;
    int has_parent, has_lora_id, has_group;
    int64_t parent, lora_id, size;
    uint32_t group_idx;
    int64_t medium_off, lora_name_off;
    uint32_t medium_len, lora_name_len;
} event_fields;

static int same_str(const uint8_t *base, int64_t a_off, uint32_t a_len, int64_t b_off, uint32_t b_len) {
    if (a_off < 0 || b_off < 0) return a_off < 0 && b_off < 0;
    return a_len == b_len && memcmp(base + a_off, base + b_off, a_len) == 0;
}

int64_t kvc_kvevents_scan(const uint8_t *payload, size_t len, kvc_event_run *runs_out, size_t runs_cap,
                          int64_t *hashes_out, size_t hashes_cap, uint32_t *tokens_out, size_t tokens_cap,
                          double *ts_out, int64_t *dp_rank_out, int *has_dp_rank_out) {
    reader rd = {payload, payload + len};
    reader *r = &rd;
    uint32_t fields, n_events;
    if (!read_array(r, &fields) || fields < 2) return KVC_KVEVENTS_FALLBACK;
    /* ts: a float or an int (not a bool, not NaN) */
    int64_t iv;
    int big;
    if (have(r, 9) && r->p[0] == 0xcb) {
        uint64_t u = be(r->p + 1, 8);
        double d;
        memcpy(&d, &u, 8);
        *ts_out = d;
        r->p += 9;
    } else if (have(r, 5) && r->p[0] == 0xca) {
        uint32_t u = (uint32_t)be(r->p + 1, 4);
        float f;
        memcpy(&f, &u, 4);
        *ts_out = f;
        r->p += 5;
    } else if (read_int(r, &iv, &big) && !big) {
        *ts_out = (double)iv;
    } else {
        return KVC_KVEVENTS_FALLBACK;
    }
    if (*ts_out != *ts_out) return KVC_KVEVENTS_FALLBACK;
    if (!read_array(r, &n_events)) return KVC_KVEVENTS_FALLBACK;

    size_t n_runs = 0, n_hashes = 0, n_tokens = 0;
    int open = 0; /* kind of the open run (0: none), which is runs_out[n_runs - 1] */
    for (uint32_t e = 0; e < n_events; e++) {
        uint32_t n_fields;
        if (!read_map(r, &n_fields)) return KVC_KVEVENTS_FALLBACK;
        event_fields f;
        memset(&f, 0, sizeof f);
        f.medium_off = f.lora_name_off = -1;
        unsigned seen = 0;
        size_t event_hashes = n_hashes, event_tokens = n_tokens; /* this event's arrays start here */
        for (uint32_t i = 0; i < n_fields; i++) {
            const uint8_t *key;
            uint32_t key_len, n;
            if (!read_str(r, &key, &key_len)) return KVC_KVEVENTS_FALLBACK;
            unsigned bit = 0;
            if (str_is(key, key_len, "type")) {
                const uint8_t *s;
                uint32_t sl;
                bit = F_TYPE;
                if (!read_str(r, &s, &sl)) return KVC_KVEVENTS_FALLBACK;
                if (str_is(s, sl, "BlockStored")) f.kind = KVC_RUN_STORED;
                else if (str_is(s, sl, "BlockRemoved")) f.kind = KVC_RUN_REMOVED;
                else if (str_is(s, sl, "AllBlocksCleared")) f.kind = KVC_RUN_CLEARED;
                else return KVC_KVEVENTS_FALLBACK;
            } else if (str_is(key, key_len, "block_hashes")) {
                bit = F_HASHES;
                if (!read_array(r, &n) || n == 0 || n > hashes_cap - n_hashes) return KVC_KVEVENTS_FALLBACK;
                for (uint32_t k = 0; k < n; k++) {
                    if (!read_int(r, &iv, &big) || big) return KVC_KVEVENTS_FALLBACK;
                    hashes_out[n_hashes++] = iv;
                }
            } else if (str_is(key, key_len, "parent_block_hash")) {
                bit = F_PARENT;
                if (!read_nil(r)) {
                    if (!read_int(r, &f.parent, &big) || big) return KVC_KVEVENTS_FALLBACK;
                    f.has_parent = 1;
                }
            } else if (str_is(key, key_len, "token_ids")) {
                bit = F_TOKENS;
                if (!read_array(r, &n) || n == 0 || n > tokens_cap - n_tokens) return KVC_KVEVENTS_FALLBACK;
                for (uint32_t k = 0; k < n; k++) {
                    if (!read_int(r, &iv, &big) || big || iv < 0 || iv > (int64_t)UINT32_MAX)
                        return KVC_KVEVENTS_FALLBACK;
                    tokens_out[n_tokens++] = (uint32_t)iv;
                }
            } else if (str_is(key, key_len, "block_size")) {
                bit = F_SIZE;
                if (!read_int(r, &f.size, &big) || big || f.size <= 0 || f.size > INT32_MAX)
                    return KVC_KVEVENTS_FALLBACK;
            } else if (str_is(key, key_len, "lora_id")) {
                bit = F_LORA_ID;
                if (!read_nil(r)) {
                    if (!read_int(r, &f.lora_id, &big) || big) return KVC_KVEVENTS_FALLBACK;
                    f.has_lora_id = 1;
                }
            } else if (str_is(key, key_len, "medium")) {
                bit = F_MEDIUM;
                if (!read_optional_str(r, payload, &f.medium_off, &f.medium_len)) return KVC_KVEVENTS_FALLBACK;
            } else if (str_is(key, key_len, "lora_name")) {
                bit = F_LORA_NAME;
                if (!read_optional_str(r, payload, &f.lora_name_off, &f.lora_name_len)) return KVC_KVEVENTS_FALLBACK;
            } else if (str_is(key, key_len, "group_idx")) {
                bit = F_GROUP;
                if (!read_nil(r)) {
                    int64_t g;
                    if (!read_int(r, &g, &big) || big || g < 0 || g > (int64_t)UINT32_MAX) return KVC_KVEVENTS_FALLBACK;
                    f.group_idx = (uint32_t)g;
                    f.has_group = 1;
                }
            } else if (!skip(r, 0)) {
                return KVC_KVEVENTS_FALLBACK;
            }
            if (bit & seen) return KVC_KVEVENTS_FALLBACK; /* a repeated field: Python keeps the last */
            seen |= bit;
        }
        if (!(seen & F_TYPE)) return KVC_KVEVENTS_FALLBACK;
        f.hash_start = (uint32_t)event_hashes;
        f.hash_end = (uint32_t)n_hashes;
        f.token_start = (uint32_t)event_tokens;
        f.token_end = (uint32_t)n_tokens;
        size_t nh = n_hashes - event_hashes, nt = n_tokens - event_tokens;
        if (f.kind == KVC_RUN_CLEARED) {
            /* any other fields are ignored, as the Python decoder does; their arrays are dropped */
            n_hashes = event_hashes;
            n_tokens = event_tokens;
            if (n_runs == runs_cap) return KVC_KVEVENTS_FALLBACK;
            memset(&runs_out[n_runs], 0, sizeof runs_out[n_runs]);
            runs_out[n_runs].kind = KVC_RUN_CLEARED;
            runs_out[n_runs].medium_off = runs_out[n_runs].lora_name_off = -1;
            n_runs++;
            open = 0;
            continue;
        }
        if (f.kind == KVC_RUN_REMOVED) {
            if (!(seen & F_HASHES)) return KVC_KVEVENTS_FALLBACK;
            n_tokens = event_tokens; /* token_ids on a removal are ignored, as the Python decoder does */
            kvc_event_run *run = n_runs ? &runs_out[n_runs - 1] : NULL;
            if (open == KVC_RUN_REMOVED && run->has_group == f.has_group && run->group_idx == f.group_idx &&
                same_str(payload, run->medium_off, run->medium_len, f.medium_off, f.medium_len)) {
                run->hash_end = (uint32_t)n_hashes; /* this event's hashes follow the run's */
                continue;
            }
            if (n_runs == runs_cap) return KVC_KVEVENTS_FALLBACK;
            run = &runs_out[n_runs++];
            memset(run, 0, sizeof *run);
            run->kind = KVC_RUN_REMOVED;
            run->has_group = (uint8_t)f.has_group;
            run->group_idx = f.group_idx;
            run->hash_start = f.hash_start;
            run->hash_end = f.hash_end;
            run->medium_off = f.medium_off;
            run->medium_len = f.medium_len;
            run->lora_name_off = -1;
            open = KVC_RUN_REMOVED;
            continue;
        }
        /* BlockStored: the Python fast path's checks */
        if ((seen & (F_HASHES | F_TOKENS | F_SIZE)) != (F_HASHES | F_TOKENS | F_SIZE)) return KVC_KVEVENTS_FALLBACK;
        if (!((int64_t)(nh - 1) * f.size < (int64_t)nt && (int64_t)nt <= (int64_t)nh * f.size))
            return KVC_KVEVENTS_FALLBACK;
        kvc_event_run *run = n_runs ? &runs_out[n_runs - 1] : NULL;
        if (open == KVC_RUN_STORED && run->block_size == (uint32_t)f.size && run->has_lora_id == f.has_lora_id &&
            (!f.has_lora_id || run->lora_id == f.lora_id) && run->has_group == f.has_group &&
            run->group_idx == f.group_idx &&
            same_str(payload, run->medium_off, run->medium_len, f.medium_off, f.medium_len) &&
            same_str(payload, run->lora_name_off, run->lora_name_len, f.lora_name_off, f.lora_name_len) &&
            f.has_parent && f.parent == hashes_out[run->hash_end - 1] &&
            (uint64_t)(run->token_end - run->token_start) == (uint64_t)(run->hash_end - run->hash_start) * f.size) {
            run->hash_end = f.hash_end;
            run->token_end = f.token_end;
            continue;
        }
        if (n_runs == runs_cap) return KVC_KVEVENTS_FALLBACK;
        run = &runs_out[n_runs++];
        memset(run, 0, sizeof *run);
        run->kind = KVC_RUN_STORED;
        run->has_parent = (uint8_t)f.has_parent;
        run->parent = f.parent;
        run->has_lora_id = (uint8_t)f.has_lora_id;
        run->lora_id = f.lora_id;
        run->has_group = (uint8_t)f.has_group;
        run->group_idx = f.group_idx;
        run->block_size = (uint32_t)f.size;
        run->hash_start = f.hash_start;
        run->hash_end = f.hash_end;
        run->token_start = f.token_start;
        run->token_end = f.token_end;
        run->medium_off = f.medium_off;
        run->medium_len = f.medium_len;
        run->lora_name_off = f.lora_name_off;
        run->lora_name_len = f.lora_name_len;
        open = KVC_RUN_STORED;
    }
    *has_dp_rank_out = 0;
    *dp_rank_out = 0;
    if (fields >= 3 && !read_nil(r)) {
        if (!read_int(r, dp_rank_out, &big) || big) return KVC_KVEVENTS_FALLBACK;
        *has_dp_rank_out = 1;
    }
    for (uint32_t i = 3; i < fields; i++) /* fields a newer engine may append */
        if (!skip(r, 0)) return KVC_KVEVENTS_FALLBACK;
    if (r->p != r->end) return KVC_KVEVENTS_FALLBACK; /* extra data after the batch */
    return (int64_t)n_runs;
}
