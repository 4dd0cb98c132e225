/*
 * kvc_blocktree.c -- see kvc_blocktree.h. A port of kvcompassd/engine/blocktree.py's BlockTree
 * (salted keys): each function names the Python method it mirrors. Blocks live in one pool of
 * slots (indices, never pointers, across anything that may allocate); three open-addressing maps
 * (block hash -> slot, parent hash -> first child's slot, key -> key record).
 */
#include "kvc_blocktree.h"

#include <stdlib.h>
#include <string.h>

#include "kvc_sha256.h"

#define NONE UINT32_MAX
#define INLINE_TOKENS 16
#define VRAM 1
#define DRAM 2
#define UNINDEXED 3
#define KEY_MASK ((UINT64_C(1) << 63) - 1)

typedef struct {
    uint64_t key;
    uint32_t length;
    uint32_t pad;
} anchor;

typedef struct {
    int64_t hash;
    int64_t parent;
    uint64_t sibling_seq;
    uint64_t detached_seq;
    uint32_t *heap_tokens;   /* NULL: the tokens are inline */
    anchor *anchors;
    kvc_sha256 *state;       /* set on attached blocks holding anchors */
    uint32_t n_tokens, start, media, n_anchors;
    uint32_t next_sib, prev_sib;  /* the head's prev_sib is the list's tail */
    uint32_t det_next, det_prev;
    uint8_t has_parent, lora, tier, path_tier, attached, in_detached, live;
    uint32_t inline_tokens[INLINE_TOKENS];
} block;

typedef struct {
    uint64_t key;
    uint64_t seq;            /* announcement order */
    uint32_t n[4];           /* holders by path tier (1..3) */
    uint32_t length;
    uint8_t registered;      /* 0, or the announced index tier */
} key_record;

typedef struct {
    uint64_t *keys;
    uint32_t *vals;          /* NONE: empty */
    size_t cap, n;
} kmap;

typedef struct {
    uint64_t key;
    uint32_t length;
    uint32_t pad;
} touch;

#define RAW_MEDIA 64
#define RAW_MEDIUM_BYTES 48

typedef struct {
    uint32_t len;
    int32_t absent;
    uint32_t medium;
    uint8_t raw[RAW_MEDIUM_BYTES];
} raw_medium;

struct kvc_btree {
    raw_medium raw_media[RAW_MEDIA];
    size_t n_raw_media;
    uint8_t *run_media;
    size_t run_media_cap;
    uint32_t *lengths;
    size_t n_lengths;
    kvc_sha256 root;
    uint64_t max_detached;
    uint8_t medium_tier[KVC_BT_MAX_MEDIA];

    block *blocks;
    size_t slots, slot_cap, live;
    uint32_t *free_slots;
    size_t n_free, free_cap;
    kmap by_hash, children, by_key;

    key_record *records;
    size_t rec_slots, rec_cap;
    uint32_t *free_recs;
    size_t n_free_recs, free_recs_cap;
    size_t registered;

    uint32_t det_head, det_tail;
    size_t detached;
    uint64_t seq;

    uint64_t dropped, ignored;

    touch *touched;
    size_t n_touched, touched_cap;
    kvc_btree_event *events;
    size_t n_events, events_cap;
    kvc_btree_note *notes;
    size_t n_notes, notes_cap;
    uint32_t *stack;
    size_t stack_cap;
    int64_t *snapshot;
    size_t snapshot_cap;
    int oom;
};

/* ------------------------------------------------------------------------------ growth */

static int grow(void **array, size_t *cap, size_t need, size_t item) {
    if (need <= *cap) return 0;
    size_t new_cap = *cap ? *cap : 16;
    while (new_cap < need) new_cap *= 2;
    void *p = realloc(*array, new_cap * item);
    if (!p) return -1;
    *array = p;
    *cap = new_cap;
    return 0;
}

#define GROW(t, arr, cap, need) (grow((void **)&(arr), &(cap), (need), sizeof(*(arr))) ? ((t)->oom = 1, -1) : 0)

/* ------------------------------------------------------------------------------ maps */

static inline size_t mix(uint64_t k) {
    k ^= k >> 33;
    k *= UINT64_C(0xff51afd7ed558ccd);
    k ^= k >> 33;
    k *= UINT64_C(0xc4ceb9fe1a85ec53);
    k ^= k >> 33;
    return (size_t)k;
}

static uint32_t kmap_get(const kmap *m, uint64_t k) {
    if (!m->cap) return NONE;
    size_t mask = m->cap - 1, i = mix(k) & mask;
    for (;;) {
        uint32_t v = m->vals[i];
        if (v == NONE) return NONE;
        if (m->keys[i] == k) return v;
        i = (i + 1) & mask;
    }
}

static int kmap_resize(kmap *m, size_t cap) {
    uint64_t *keys = malloc(cap * sizeof(*keys));
    uint32_t *vals = malloc(cap * sizeof(*vals));
    if (!keys || !vals) {
        free(keys);
        free(vals);
        return -1;
    }
    memset(vals, 0xff, cap * sizeof(*vals));
    size_t mask = cap - 1;
    for (size_t j = 0; j < m->cap; j++) {
        if (m->vals[j] == NONE) continue;
        size_t i = mix(m->keys[j]) & mask;
        while (vals[i] != NONE) i = (i + 1) & mask;
        keys[i] = m->keys[j];
        vals[i] = m->vals[j];
    }
    free(m->keys);
    free(m->vals);
    m->keys = keys;
    m->vals = vals;
    m->cap = cap;
    return 0;
}

/* Insert or overwrite. */
static int kmap_put(kmap *m, uint64_t k, uint32_t v) {
    if ((m->n + 1) * 4 > m->cap * 3 && kmap_resize(m, m->cap ? m->cap * 2 : 64)) return -1;
    size_t mask = m->cap - 1, i = mix(k) & mask;
    for (;;) {
        if (m->vals[i] == NONE) {
            m->keys[i] = k;
            m->vals[i] = v;
            m->n++;
            return 0;
        }
        if (m->keys[i] == k) {
            m->vals[i] = v;
            return 0;
        }
        i = (i + 1) & mask;
    }
}

/* Delete (linear probing, backward shift: no tombstones). */
static void kmap_del(kmap *m, uint64_t k) {
    if (!m->cap) return;
    size_t mask = m->cap - 1, i = mix(k) & mask;
    for (;;) {
        if (m->vals[i] == NONE) return;
        if (m->keys[i] == k) break;
        i = (i + 1) & mask;
    }
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (m->vals[j] == NONE) break;
        size_t ideal = mix(m->keys[j]) & mask;
        /* leave j where it is when its ideal slot lies cyclically in (i, j] */
        int stays = (i <= j) ? (ideal > i && ideal <= j) : (ideal > i || ideal <= j);
        if (stays) continue;
        m->keys[i] = m->keys[j];
        m->vals[i] = m->vals[j];
        i = j;
    }
    m->vals[i] = NONE;
    m->n--;
}

static void kmap_clear(kmap *m) {
    if (m->cap) memset(m->vals, 0xff, m->cap * sizeof(*m->vals));
    m->n = 0;
}

static void kmap_free(kmap *m) {
    free(m->keys);
    free(m->vals);
}

/* ------------------------------------------------------------------------------ helpers */

#define B(t, i) (&(t)->blocks[(i)])

static inline uint32_t find(const kvc_btree *t, int64_t hash) { return kmap_get(&t->by_hash, (uint64_t)hash); }

static inline const uint32_t *tokens_of(const block *b) { return b->heap_tokens ? b->heap_tokens : b->inline_tokens; }

static inline uint32_t parent_slot(const kvc_btree *t, const block *b) {
    return b->has_parent ? find(t, b->parent) : NONE;
}

static uint8_t own_tier(const kvc_btree *t, const block *b) {
    if (b->lora) return UNINDEXED;
    uint8_t best = UNINDEXED + 1;
    for (uint32_t media = b->media; media; media &= media - 1) {
        uint8_t tier = t->medium_tier[__builtin_ctz(media)];
        if (tier < best) best = tier;
    }
    return best > UNINDEXED ? UNINDEXED : best;
}

static int note(kvc_btree *t, int64_t hash, int64_t code) {
    if (GROW(t, t->notes, t->notes_cap, t->n_notes + 1)) return -1;
    t->notes[t->n_notes].hash = hash;
    t->notes[t->n_notes].code = code;
    t->n_notes++;
    return 0;
}

static int touch_key(kvc_btree *t, uint64_t key, uint32_t length) {
    if (GROW(t, t->touched, t->touched_cap, t->n_touched + 1)) return -1;
    t->touched[t->n_touched].key = key;
    t->touched[t->n_touched].length = length;
    t->n_touched++;
    return 0;
}

static int emit(kvc_btree *t, uint8_t kind, uint64_t key, uint8_t tier, uint32_t length) {
    if (GROW(t, t->events, t->events_cap, t->n_events + 1)) return -1;
    kvc_btree_event *e = &t->events[t->n_events++];
    e->key = key;
    e->length = length;
    e->kind = kind;
    e->tier = tier;
    e->pad = 0;
    return 0;
}

static int push(kvc_btree *t, size_t *n, uint32_t slot) {
    if (GROW(t, t->stack, t->stack_cap, *n + 1)) return -1;
    t->stack[(*n)++] = slot;
    return 0;
}

/* ------------------------------------------------------------------------------ key records */

static uint32_t record_for(kvc_btree *t, uint64_t key) {
    uint32_t r = kmap_get(&t->by_key, key);
    if (r != NONE) return r;
    if (t->n_free_recs) {
        r = t->free_recs[--t->n_free_recs];
    } else {
        if (GROW(t, t->records, t->rec_cap, t->rec_slots + 1)) return NONE;
        r = (uint32_t)t->rec_slots++;
    }
    key_record *rec = &t->records[r];
    memset(rec, 0, sizeof(*rec));
    rec->key = key;
    if (kmap_put(&t->by_key, key, r)) {
        t->oom = 1;
        return NONE;
    }
    return r;
}

static void record_release_if_empty(kvc_btree *t, uint32_t r) {
    key_record *rec = &t->records[r];
    if (rec->registered || rec->n[1] || rec->n[2] || rec->n[3]) return;
    kmap_del(&t->by_key, rec->key);
    if (GROW(t, t->free_recs, t->free_recs_cap, t->n_free_recs + 1)) return; /* (leaks the slot) */
    t->free_recs[t->n_free_recs++] = r;
}

/* ------------------------------------------------------------------------------ lists */

static void detached_unlink(kvc_btree *t, block *b) {
    if (!b->in_detached) return;
    if (b->det_prev != NONE) B(t, b->det_prev)->det_next = b->det_next;
    else t->det_head = b->det_next;
    if (b->det_next != NONE) B(t, b->det_next)->det_prev = b->det_prev;
    else t->det_tail = b->det_prev;
    b->in_detached = 0;
    t->detached--;
}

/* detached[hash] = None: appended when new, kept in place when already there. */
static void detached_put(kvc_btree *t, uint32_t slot) {
    block *b = B(t, slot);
    if (b->in_detached) return;
    b->in_detached = 1;
    b->detached_seq = ++t->seq;
    b->det_next = NONE;
    b->det_prev = t->det_tail;
    if (t->det_tail != NONE) B(t, t->det_tail)->det_next = slot;
    else t->det_head = slot;
    t->det_tail = slot;
    t->detached++;
}

static int child_link(kvc_btree *t, uint32_t slot) {
    block *b = B(t, slot);
    b->sibling_seq = ++t->seq;
    b->next_sib = NONE;
    uint32_t head = kmap_get(&t->children, (uint64_t)b->parent);
    if (head == NONE) {
        b->prev_sib = slot;
        if (kmap_put(&t->children, (uint64_t)b->parent, slot)) {
            t->oom = 1;
            return -1;
        }
        return 0;
    }
    uint32_t tail = B(t, head)->prev_sib;
    B(t, tail)->next_sib = slot;
    b->prev_sib = tail;
    B(t, head)->prev_sib = slot;
    return 0;
}

static void child_unlink(kvc_btree *t, uint32_t slot) {
    block *b = B(t, slot);
    uint32_t head = kmap_get(&t->children, (uint64_t)b->parent);
    if (head == NONE) return;
    if (head == slot) {
        if (b->next_sib == NONE) {
            kmap_del(&t->children, (uint64_t)b->parent);
        } else {
            B(t, b->next_sib)->prev_sib = b->prev_sib;
            kmap_put(&t->children, (uint64_t)b->parent, b->next_sib); /* overwrite: no growth */
        }
        return;
    }
    B(t, b->prev_sib)->next_sib = b->next_sib;
    if (b->next_sib != NONE) B(t, b->next_sib)->prev_sib = b->prev_sib;
    else B(t, head)->prev_sib = b->prev_sib;
}

static inline uint32_t first_child(const kvc_btree *t, int64_t hash) {
    return kmap_get(&t->children, (uint64_t)hash);
}

/* ------------------------------------------------------------------------------ blocks */

static void block_release_memory(block *b) {
    free(b->heap_tokens);
    free(b->anchors);
    free(b->state);
    b->heap_tokens = NULL;
    b->anchors = NULL;
    b->state = NULL;
    b->n_anchors = 0;
}

/* _new_block: a block the tree did not hold, listed under its parent (not attached yet). */
static uint32_t new_block(kvc_btree *t, int64_t hash, int has_parent, int64_t parent, const uint32_t *tokens,
                          uint32_t n_tokens, int lora, uint32_t medium, uint8_t tier) {
    uint32_t slot;
    if (t->n_free) {
        slot = t->free_slots[--t->n_free];
    } else {
        if (GROW(t, t->blocks, t->slot_cap, t->slots + 1)) return NONE;
        slot = (uint32_t)t->slots++;
    }
    block *b = B(t, slot);
    memset(b, 0, offsetof(block, inline_tokens));
    if (n_tokens > INLINE_TOKENS) {
        b->heap_tokens = malloc(n_tokens * sizeof(uint32_t));
        if (!b->heap_tokens) {
            t->oom = 1;
            return NONE;
        }
        memcpy(b->heap_tokens, tokens, n_tokens * sizeof(uint32_t));
    } else if (n_tokens) {
        memcpy(b->inline_tokens, tokens, n_tokens * sizeof(uint32_t));
    }
    b->hash = hash;
    b->parent = has_parent ? parent : 0;
    b->has_parent = (uint8_t)(has_parent != 0);
    b->n_tokens = n_tokens;
    b->media = UINT32_C(1) << medium;
    b->lora = (uint8_t)(lora != 0);
    b->tier = tier;
    b->path_tier = VRAM;
    b->live = 1;
    b->det_next = b->det_prev = NONE;
    if (kmap_put(&t->by_hash, (uint64_t)hash, slot)) {
        t->oom = 1;
        return NONE;
    }
    t->live++;
    if (b->has_parent && child_link(t, slot)) return NONE;
    return slot;
}

/* _forget */
static void forget(kvc_btree *t, uint32_t slot) {
    block *b = B(t, slot);
    kmap_del(&t->by_hash, (uint64_t)b->hash);
    detached_unlink(t, b);
    if (b->has_parent) child_unlink(t, slot);
    block_release_memory(b);
    b->live = 0;
    t->live--;
    if (GROW(t, t->free_slots, t->free_cap, t->n_free + 1)) return;
    t->free_slots[t->n_free++] = slot;
}

/* ------------------------------------------------------------------------------ anchors */

static void sha_tokens(kvc_sha256 *st, const uint32_t *tokens, size_t n) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    kvc_sha256_update(st, (const uint8_t *)tokens, n * 4);
#else
    uint8_t buf[256];
    while (n) {
        size_t k = n < 64 ? n : 64;
        for (size_t i = 0; i < k; i++) {
            buf[4 * i] = (uint8_t)tokens[i];
            buf[4 * i + 1] = (uint8_t)(tokens[i] >> 8);
            buf[4 * i + 2] = (uint8_t)(tokens[i] >> 16);
            buf[4 * i + 3] = (uint8_t)(tokens[i] >> 24);
        }
        kvc_sha256_update(st, buf, 4 * k);
        tokens += k;
        n -= k;
    }
#endif
}

static size_t bisect_right(const uint32_t *a, size_t lo, size_t hi, uint64_t x) {
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (x < a[mid]) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

/* _register_anchors with _salted_anchors: the indexed lengths inside the block (at least
 * lengths[first]), their keys from the nearest anchored ancestor's SHA state, and their holders. */
static int register_anchors(kvc_btree *t, uint32_t slot, size_t first, size_t base) {
    block *b = B(t, slot);
    uint32_t start = b->start, n_tokens = b->n_tokens;
    size_t last = bisect_right(t->lengths, first, t->n_lengths, (uint64_t)start + n_tokens);
    size_t count = last - first;
    anchor *anchors = malloc(count * sizeof(anchor));
    kvc_sha256 *state = malloc(sizeof(kvc_sha256));
    if (!anchors || !state) {
        free(anchors);
        free(state);
        t->oom = 1;
        return -1;
    }
    /* the ancestors without a state, nearest first, on the stack above the caller's `base` */
    size_t n_between = base;
    uint32_t node = parent_slot(t, b);
    while (node != NONE && B(t, node)->state == NULL) {
        if (push(t, &n_between, node)) {
            free(anchors);
            free(state);
            return -1;
        }
        node = parent_slot(t, B(t, node));
    }
    b = B(t, slot);
    *state = node != NONE ? *B(t, node)->state : t->root;
    for (size_t i = n_between; i-- > base;) {
        const block *a = B(t, t->stack[i]);
        sha_tokens(state, tokens_of(a), a->n_tokens);
    }
    const uint32_t *own = tokens_of(b);
    uint32_t done = 0;
    uint8_t digest[32];
    for (size_t i = 0; i < count; i++) {
        uint32_t length = t->lengths[first + i], cut = length - start;
        sha_tokens(state, own + done, cut - done);
        done = cut;
        kvc_sha256_final(state, digest);
        uint64_t key = 0;
        for (int k = 7; k >= 0; k--) key = (key << 8) | digest[k];
        anchors[i].key = key & KEY_MASK;
        anchors[i].length = length;
        anchors[i].pad = 0;
    }
    sha_tokens(state, own + done, n_tokens - done);
    free(b->anchors);
    free(b->state);
    b->anchors = anchors;
    b->state = state;
    b->n_anchors = (uint32_t)count;
    uint8_t tier = b->path_tier;
    for (size_t i = 0; i < count; i++) {
        uint32_t r = record_for(t, anchors[i].key);
        if (r == NONE) return -1;
        key_record *rec = &t->records[r];
        rec->n[tier]++;
        rec->length = anchors[i].length;
        if (touch_key(t, anchors[i].key, anchors[i].length)) return -1;
    }
    return 0;
}

/* _withdraw_anchors */
static int withdraw_anchors(kvc_btree *t, uint32_t slot) {
    block *b = B(t, slot);
    free(b->state);
    b->state = NULL;
    uint8_t tier = b->path_tier;
    for (uint32_t i = 0; i < b->n_anchors; i++) {
        uint32_t r = kmap_get(&t->by_key, b->anchors[i].key);
        if (r != NONE) {
            if (t->records[r].n[tier]) t->records[r].n[tier]--;
            record_release_if_empty(t, r);
        }
        if (touch_key(t, b->anchors[i].key, b->anchors[i].length)) return -1;
    }
    free(b->anchors);
    b->anchors = NULL;
    b->n_anchors = 0;
    return 0;
}

/* ------------------------------------------------------------------------------ subtrees */

/* _trim_detached */
static int trim_detached(kvc_btree *t) {
    while (t->detached > t->max_detached) {
        uint32_t oldest = t->det_head;
        if (note(t, B(t, oldest)->hash, KVC_BT_NOTE_DROPPED)) return -1;
        t->dropped++;
        forget(t, oldest);
    }
    return 0;
}

/* the block's start and path tier under its (attached) parent, or as a root */
static inline void place(kvc_btree *t, block *b, uint8_t *parent_tier) {
    uint32_t p = parent_slot(t, b);
    if (p == NONE) {
        b->start = 0;
        *parent_tier = VRAM;
    } else {
        b->start = B(t, p)->start + B(t, p)->n_tokens;
        *parent_tier = B(t, p)->path_tier;
    }
}

/* after a block's start and path tier are set and it is attached: its anchors */
static int anchor_if_indexed(kvc_btree *t, uint32_t slot, size_t base) {
    block *b = B(t, slot);
    size_t first = bisect_right(t->lengths, 0, t->n_lengths, b->start);
    if (first < t->n_lengths && t->lengths[first] <= (uint64_t)b->start + b->n_tokens)
        return register_anchors(t, slot, first, base);
    free(b->anchors);
    free(b->state);
    b->anchors = NULL;
    b->state = NULL;
    b->n_anchors = 0;
    return 0;
}

/* _attach: `root` (its parent attached, or a root) and every detached descendant waiting. */
static int attach(kvc_btree *t, uint32_t root) {
    size_t n = 0;
    if (push(t, &n, root)) return -1;
    while (n) {
        uint32_t slot = t->stack[--n];
        block *b = B(t, slot);
        uint8_t parent_tier;
        place(t, b, &parent_tier);
        b->path_tier = b->tier > parent_tier ? b->tier : parent_tier;
        b->attached = 1;
        detached_unlink(t, b);
        if (anchor_if_indexed(t, slot, n)) return -1; /* (its walk uses the stack above n) */
        for (uint32_t c = first_child(t, B(t, slot)->hash); c != NONE; c = B(t, c)->next_sib) {
            if (!B(t, c)->attached && push(t, &n, c)) return -1;
        }
    }
    return 0;
}

/* _detach_subtree */
static int detach_subtree(kvc_btree *t, uint32_t root) {
    size_t n = 0;
    if (push(t, &n, root)) return -1;
    while (n) {
        uint32_t slot = t->stack[--n];
        block *b = B(t, slot);
        if (!b->attached) continue;
        if (withdraw_anchors(t, slot)) return -1;
        b = B(t, slot);
        b->attached = 0;
        detached_put(t, slot);
        for (uint32_t c = first_child(t, b->hash); c != NONE; c = B(t, c)->next_sib) {
            if (push(t, &n, c)) return -1;
        }
    }
    return trim_detached(t);
}

/* _refresh_subtree: path tiers below `root` after its own tier changed. */
static int refresh_subtree(kvc_btree *t, uint32_t root) {
    size_t n = 0;
    if (push(t, &n, root)) return -1;
    while (n) {
        uint32_t slot = t->stack[--n];
        block *b = B(t, slot);
        uint32_t p = parent_slot(t, b);
        uint8_t parent_tier = p != NONE ? B(t, p)->path_tier : VRAM;
        uint8_t new_tier = parent_tier > b->tier ? parent_tier : b->tier;
        if (new_tier == b->path_tier && slot != root) continue;
        uint8_t old = b->path_tier;
        b->path_tier = new_tier;
        for (uint32_t i = 0; i < b->n_anchors; i++) {
            uint32_t r = kmap_get(&t->by_key, b->anchors[i].key);
            if (r != NONE) {
                key_record *rec = &t->records[r];
                if (rec->n[old]) rec->n[old]--;
                rec->n[new_tier]++;
            }
            if (touch_key(t, b->anchors[i].key, b->anchors[i].length)) return -1;
            b = B(t, slot);
        }
        for (uint32_t c = first_child(t, b->hash); c != NONE; c = B(t, c)->next_sib) {
            if (B(t, c)->attached && push(t, &n, c)) return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------ events */

/* _store_chain */
static int store_chain(kvc_btree *t, const int64_t *hashes, size_t n_hashes, int has_parent, int64_t parent,
                       const uint32_t *tokens, size_t token_start, size_t token_end, size_t size, int lora,
                       uint32_t medium) {
    uint8_t tier = lora ? UNINDEXED : t->medium_tier[medium];
    uint32_t parent_block = has_parent ? find(t, parent) : NONE;
    size_t cut = token_start;
    for (size_t i = 0; i < n_hashes; i++) {
        int64_t hash = hashes[i];
        size_t end = cut + size < token_end ? cut + size : token_end;
        const uint32_t *own = tokens + cut;
        uint32_t n_tokens = cut < end ? (uint32_t)(end - cut) : 0;
        cut += size;
        uint32_t slot = find(t, hash);
        int parent_ok = !has_parent || (parent_block != NONE && B(t, parent_block)->attached);
        if (slot == NONE && parent_ok && first_child(t, hash) == NONE) {
            /* _put_page: new, under an attached parent or a root, nothing waiting under it */
            slot = new_block(t, hash, has_parent, parent, own, n_tokens, lora, medium, tier);
            if (slot == NONE) return -1;
            block *b = B(t, slot);
            uint8_t parent_tier;
            place(t, b, &parent_tier);
            b->path_tier = tier > parent_tier ? tier : parent_tier;
            b->attached = 1;
            size_t first = bisect_right(t->lengths, 0, t->n_lengths, b->start);
            if (first < t->n_lengths && t->lengths[first] <= (uint64_t)b->start + n_tokens &&
                register_anchors(t, slot, first, 0))
                return -1;
        } else if (slot != NONE) {
            block *b = B(t, slot);
            int same_parent = b->has_parent == (has_parent != 0) && (!has_parent || b->parent == parent);
            if (!same_parent || b->n_tokens != n_tokens ||
                (n_tokens && memcmp(tokens_of(b), own, n_tokens * sizeof(uint32_t)))) {
                if (note(t, hash, KVC_BT_NOTE_RESTORED)) return -1;
                b = B(t, slot);
            }
            uint8_t before = b->tier;
            b->media |= UINT32_C(1) << medium;
            b->tier = own_tier(t, b);
            if (b->attached && b->tier != before && refresh_subtree(t, slot)) return -1;
        } else {
            slot = new_block(t, hash, has_parent, parent, own, n_tokens, lora, medium, tier);
            if (slot == NONE) return -1;
            if (parent_ok) {
                if (attach(t, slot)) return -1;
            } else {
                detached_put(t, slot); /* _mark_detached */
                if (trim_detached(t)) return -1;
                if (find(t, hash) == NONE) slot = NONE; /* trimmed at once as the oldest */
            }
        }
        has_parent = 1;
        parent = hash;
        parent_block = slot;
    }
    return 0;
}

/* _remove_hashes */
static int remove_hashes(kvc_btree *t, const int64_t *hashes, size_t n_hashes, uint32_t medium) {
    uint32_t bit = UINT32_C(1) << medium;
    for (size_t i = 0; i < n_hashes; i++) {
        int64_t hash = hashes[i];
        uint32_t slot = find(t, hash);
        if (slot == NONE || !(B(t, slot)->media & bit)) {
            t->ignored++;
            continue;
        }
        block *b = B(t, slot);
        if (b->media & (b->media - 1)) { /* on another medium too */
            uint8_t before = b->tier;
            b->media &= ~bit;
            b->tier = own_tier(t, b);
            if (b->attached && b->tier != before && refresh_subtree(t, slot)) return -1;
            continue;
        }
        if (b->attached) {
            /* a copy of the children: detaching trims the oldest detached blocks, maybe these */
            size_t n_children = 0;
            for (uint32_t c = first_child(t, hash); c != NONE; c = B(t, c)->next_sib) {
                if (GROW(t, t->snapshot, t->snapshot_cap, n_children + 1)) return -1;
                t->snapshot[n_children++] = B(t, c)->hash;
            }
            for (size_t k = 0; k < n_children; k++) {
                uint32_t child = find(t, t->snapshot[k]);
                if (child != NONE && detach_subtree(t, child)) return -1;
            }
            if (B(t, slot)->n_anchors && withdraw_anchors(t, slot)) return -1;
        }
        forget(t, slot);
    }
    return 0;
}

static int cmp_touch(const void *a, const void *b) {
    uint64_t x = ((const touch *)a)->key, y = ((const touch *)b)->key;
    return x < y ? -1 : x > y;
}

/* _diff: the touched keys from what was announced to what the tree holds, ascending by key. */
static int diff(kvc_btree *t) {
    size_t n = t->n_touched;
    if (!n) return 0;
    if (n > 1) {
        qsort(t->touched, n, sizeof(touch), cmp_touch);
        size_t w = 0;
        for (size_t i = 0; i < n; i++) {
            if (w && t->touched[w - 1].key == t->touched[i].key) t->touched[w - 1] = t->touched[i];
            else t->touched[w++] = t->touched[i];
        }
        n = w;
    }
    t->n_touched = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t key = t->touched[i].key;
        uint32_t r = kmap_get(&t->by_key, key);
        uint8_t new_tier = 0, old = 0;
        if (r != NONE) {
            key_record *rec = &t->records[r];
            new_tier = rec->n[VRAM] ? VRAM : rec->n[DRAM] ? DRAM : 0;
            old = rec->registered;
        }
        if (new_tier == old) continue;
        key_record *rec = &t->records[r];
        uint8_t kind;
        if (!new_tier) {
            kind = KVC_BT_EVICTED;
            rec->registered = 0;
            t->registered--;
            record_release_if_empty(t, r);
        } else if (!old) {
            kind = KVC_BT_CACHED;
            rec->registered = new_tier;
            rec->seq = ++t->seq;
            t->registered++;
        } else {
            kind = KVC_BT_CHANGED;
            rec->registered = new_tier;
        }
        if (emit(t, kind, key, new_tier, t->touched[i].length)) return -1;
    }
    return 0;
}

static int cmp_seq(const void *a, const void *b) {
    uint64_t x = ((const key_record *const *)a)[0]->seq, y = ((const key_record *const *)b)[0]->seq;
    return x < y ? -1 : x > y;
}

/* registered records in announcement order, into t->stack as record indices */
static size_t registered_in_order(const kvc_btree *t, uint32_t *out) {
    size_t n = 0;
    for (size_t r = 0; r < t->rec_slots; r++) {
        const key_record *rec = &t->records[r];
        if (rec->registered && kmap_get(&t->by_key, rec->key) == r) out[n++] = (uint32_t)r;
    }
    /* sort indices by seq (insertion sort is too slow for big trees: sort pointers) */
    const key_record **ptrs = malloc((n ? n : 1) * sizeof(*ptrs));
    if (!ptrs) return (size_t)-1;
    for (size_t i = 0; i < n; i++) ptrs[i] = &t->records[out[i]];
    qsort(ptrs, n, sizeof(*ptrs), cmp_seq);
    for (size_t i = 0; i < n; i++) out[i] = (uint32_t)(ptrs[i] - t->records);
    free(ptrs);
    return n;
}

static int withdraw_all(kvc_btree *t) {
    uint32_t *order = malloc((t->registered ? t->registered : 1) * sizeof(uint32_t));
    if (!order) {
        t->oom = 1;
        return -1;
    }
    size_t n = registered_in_order(t, order);
    if (n == (size_t)-1) {
        free(order);
        t->oom = 1;
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        const key_record *rec = &t->records[order[i]];
        uint32_t length = (rec->n[1] || rec->n[2] || rec->n[3]) ? rec->length : 0;
        if (emit(t, KVC_BT_EVICTED, rec->key, 0, length)) {
            free(order);
            return -1;
        }
    }
    free(order);
    for (size_t s = 0; s < t->slots; s++) {
        if (t->blocks[s].live) block_release_memory(&t->blocks[s]);
    }
    t->slots = t->live = t->n_free = 0;
    t->rec_slots = t->n_free_recs = 0;
    t->registered = 0;
    kmap_clear(&t->by_hash);
    kmap_clear(&t->children);
    kmap_clear(&t->by_key);
    t->det_head = t->det_tail = NONE;
    t->detached = 0;
    t->n_touched = 0;
    return 0;
}

/* ------------------------------------------------------------------------------ API */

kvc_btree *kvc_btree_new(const uint32_t *lengths, size_t n_lengths, const uint8_t *salt, size_t salt_len,
                         uint64_t max_detached) {
    kvc_btree *t = calloc(1, sizeof(*t));
    if (!t) return NULL;
    t->lengths = malloc((n_lengths ? n_lengths : 1) * sizeof(uint32_t));
    if (!t->lengths) {
        free(t);
        return NULL;
    }
    if (n_lengths) memcpy(t->lengths, lengths, n_lengths * sizeof(uint32_t));
    t->n_lengths = n_lengths;
    kvc_sha256_init(&t->root, KVC_SHA256_AUTO);
    if (salt_len) kvc_sha256_update(&t->root, salt, salt_len);
    t->max_detached = max_detached;
    for (int i = 0; i < KVC_BT_MAX_MEDIA; i++) t->medium_tier[i] = UNINDEXED;
    t->det_head = t->det_tail = NONE;
    return t;
}

void kvc_btree_free(kvc_btree *t) {
    if (!t) return;
    for (size_t s = 0; s < t->slots; s++) {
        if (t->blocks[s].live) block_release_memory(&t->blocks[s]);
    }
    free(t->blocks);
    free(t->free_slots);
    kmap_free(&t->by_hash);
    kmap_free(&t->children);
    kmap_free(&t->by_key);
    free(t->records);
    free(t->free_recs);
    free(t->touched);
    free(t->events);
    free(t->notes);
    free(t->stack);
    free(t->snapshot);
    free(t->run_media);
    free(t->lengths);
    free(t);
}

void kvc_btree_set_medium_tier(kvc_btree *t, uint32_t medium, uint32_t tier) {
    if (medium < KVC_BT_MAX_MEDIA && tier >= VRAM && tier <= UNINDEXED) t->medium_tier[medium] = (uint8_t)tier;
}

static void begin(kvc_btree *t) {
    t->n_events = 0;
    t->n_notes = 0;
    t->n_touched = 0;
}

static int64_t finish(kvc_btree *t, int rc) {
    if (rc || t->oom) return -1;
    return (int64_t)t->n_events;
}

static uint32_t op_medium(const kvc_btree_op *op) {
    return (uint32_t)(op->flags >> KVC_BT_OP_MEDIUM_SHIFT) & 0xff;
}

/* every op well formed and its slices inside the columns (checked before anything applies) */
static int ops_valid(const kvc_btree_op *ops, size_t n, size_t n_hashes, size_t n_tokens) {
    size_t hash_at = 0, token_at = 0;
    for (size_t i = 0; i < n; i++) {
        const kvc_btree_op *op = &ops[i];
        int kind = (int)(op->flags & 3);
        if (!kind || op_medium(op) >= KVC_BT_MAX_MEDIA || op->n_hashes < 0 || op->n_tokens < 0) return 0;
        if ((uint64_t)op->n_hashes > n_hashes - hash_at || (uint64_t)op->n_tokens > n_tokens - token_at) return 0;
        if (kind == KVC_BT_OP_STORE && op->n_hashes && (op->size <= 0 || op->size > (int64_t)UINT32_MAX)) return 0;
        hash_at += (size_t)op->n_hashes;
        token_at += (size_t)op->n_tokens;
    }
    return 1;
}

/* every run of a known kind, its slices in order and inside the columns and `data`, its medium
 * index (when the caller gives them) a medium's */
static int runs_valid(const kvc_event_run *runs, size_t n, size_t n_hashes, size_t n_tokens, const uint8_t *media,
                      size_t data_len) {
    for (size_t i = 0; i < n; i++) {
        const kvc_event_run *run = &runs[i];
        if (run->kind == KVC_RUN_CLEARED) continue;
        if (run->kind != KVC_RUN_STORED && run->kind != KVC_RUN_REMOVED) return 0;
        if (media && media[i] >= KVC_BT_MAX_MEDIA) return 0;
        if (run->medium_off >= 0 && (uint64_t)run->medium_off + run->medium_len > data_len) return 0;
        if (run->hash_start > run->hash_end || run->hash_end > n_hashes) return 0;
        if (run->kind == KVC_RUN_STORED &&
            (run->token_start > run->token_end || run->token_end > n_tokens || !run->block_size))
            return 0;
    }
    return 1;
}

int64_t kvc_btree_apply_ops(kvc_btree *t, const kvc_btree_op *ops, size_t n, const int64_t *hashes,
                            size_t n_hashes, const uint32_t *tokens, size_t n_tokens, int diff_each) {
    begin(t);
    if (!ops_valid(ops, n, n_hashes, n_tokens)) return KVC_BT_BAD_INPUT;
    int rc = 0;
    size_t hash_at = 0, token_at = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        const kvc_btree_op *op = &ops[i];
        uint32_t medium = op_medium(op);
        size_t n_hashes = (size_t)op->n_hashes, n_tokens = (size_t)op->n_tokens;
        switch (op->flags & 3) {
        case KVC_BT_OP_STORE:
            rc = store_chain(t, hashes + hash_at, n_hashes, (op->flags & KVC_BT_OP_HAS_PARENT) != 0, op->parent,
                             tokens, token_at, token_at + n_tokens, (size_t)op->size,
                             (op->flags & KVC_BT_OP_LORA) != 0, medium);
            break;
        case KVC_BT_OP_REMOVE:
            rc = remove_hashes(t, hashes + hash_at, n_hashes, medium);
            break;
        case KVC_BT_OP_CLEAR:
            rc = diff(t);
            if (!rc) rc = withdraw_all(t);
            break;
        }
        hash_at += n_hashes;
        token_at += n_tokens;
        if (!rc && diff_each) rc = diff(t);
    }
    if (!rc) rc = diff(t);
    return finish(t, rc);
}

int kvc_btree_name_medium(kvc_btree *t, const uint8_t *raw, size_t len, int absent, uint32_t medium) {
    if (t->n_raw_media >= RAW_MEDIA || (!absent && len > RAW_MEDIUM_BYTES) || medium >= KVC_BT_MAX_MEDIA) return -1;
    raw_medium *m = &t->raw_media[t->n_raw_media++];
    m->absent = absent != 0;
    m->len = absent ? 0 : (uint32_t)len;
    m->medium = medium;
    if (!absent && len) memcpy(m->raw, raw, len);
    return 0;
}

/* run `run`'s medium index by its raw name in `data`, or -1 when not named */
static int64_t raw_medium_of(const kvc_btree *t, const kvc_event_run *run, const uint8_t *data, size_t data_len) {
    int absent = run->medium_off < 0;
    for (size_t k = 0; k < t->n_raw_media; k++) {
        const raw_medium *m = &t->raw_media[k];
        if (m->absent != absent) continue;
        if (absent) return m->medium;
        if (m->len == run->medium_len && (uint64_t)run->medium_off + run->medium_len <= data_len &&
            memcmp(m->raw, data + run->medium_off, m->len) == 0)
            return m->medium;
    }
    return -1;
}

int64_t kvc_btree_apply_runs(kvc_btree *t, const kvc_event_run *runs, size_t n, const int64_t *hashes,
                             size_t n_hashes, const uint32_t *tokens, size_t n_tokens, const uint8_t *media,
                             const uint8_t *data, size_t data_len, uint32_t page_size, uint8_t *refused,
                             int diff_each) {
    begin(t);
    if (!runs_valid(runs, n, n_hashes, n_tokens, media, data_len)) return KVC_BT_BAD_INPUT;
    if (!media) { /* every run's medium first: an unnamed one stops the call before anything applies */
        if (GROW(t, t->run_media, t->run_media_cap, n ? n : 1)) return -1;
        for (size_t i = 0; i < n; i++) {
            if (runs[i].kind == KVC_RUN_CLEARED) {
                t->run_media[i] = 0;
                continue;
            }
            int64_t medium = raw_medium_of(t, &runs[i], data, data_len);
            if (medium < 0) return -3 - (int64_t)i;
            t->run_media[i] = (uint8_t)medium;
        }
        media = t->run_media;
    }
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        const kvc_event_run *run = &runs[i];
        uint32_t medium = media[i];
        refused[i] = 0;
        int other_group = run->has_group && run->group_idx;
        if (run->kind == KVC_RUN_REMOVED && !other_group) {
            rc = remove_hashes(t, hashes + run->hash_start, run->hash_end - run->hash_start, medium);
        } else if (run->kind == KVC_RUN_STORED && !other_group && (!page_size || run->block_size == page_size)) {
            rc = store_chain(t, hashes + run->hash_start, run->hash_end - run->hash_start, run->has_parent,
                             run->parent, tokens, run->token_start, run->token_end, run->block_size,
                             run->has_lora_id || run->lora_name_off >= 0, medium);
        } else if (run->kind == KVC_RUN_CLEARED) {
            rc = diff(t);
            if (!rc) rc = withdraw_all(t);
        } else {
            refused[i] = 1;
        }
        if (!rc && diff_each) rc = diff(t);
    }
    if (!rc) rc = diff(t);
    return finish(t, rc);
}

int64_t kvc_btree_withdraw_all(kvc_btree *t) {
    begin(t);
    return finish(t, withdraw_all(t));
}

const kvc_btree_event *kvc_btree_events(const kvc_btree *t) { return t->events; }
size_t kvc_btree_note_count(const kvc_btree *t) { return t->n_notes; }
const kvc_btree_note *kvc_btree_notes(const kvc_btree *t) { return t->notes; }

void kvc_btree_get_stats(const kvc_btree *t, kvc_btree_stats *out) {
    out->blocks = t->live;
    out->detached = t->detached;
    out->dropped_blocks = t->dropped;
    out->ignored_removals = t->ignored;
    out->registered = t->registered;
}

int kvc_btree_block_state(const kvc_btree *t, int64_t hash) {
    uint32_t slot = find(t, hash);
    if (slot == NONE) return -1;
    return B(t, slot)->attached ? 1 : 0;
}

size_t kvc_btree_registered(const kvc_btree *t, uint64_t *keys, uint8_t *tiers, uint32_t *lengths, size_t cap) {
    size_t total = t->registered;
    if (cap < total) return total;
    uint32_t *order = malloc((total ? total : 1) * sizeof(uint32_t));
    if (!order) return (size_t)-1;
    size_t n = registered_in_order(t, order);
    if (n == (size_t)-1) {
        free(order);
        return n;
    }
    for (size_t i = 0; i < n; i++) {
        const key_record *rec = &t->records[order[i]];
        keys[i] = rec->key;
        tiers[i] = rec->registered;
        lengths[i] = (rec->n[1] || rec->n[2] || rec->n[3]) ? rec->length : 0;
    }
    free(order);
    return n;
}

size_t kvc_btree_detached(const kvc_btree *t, int64_t *hashes, size_t cap) {
    size_t n = 0;
    for (uint32_t s = t->det_head; s != NONE; s = t->blocks[s].det_next) {
        if (n < cap) hashes[n] = t->blocks[s].hash;
        n++;
    }
    return n;
}

size_t kvc_btree_slot_count(const kvc_btree *t) { return t->slots; }

int kvc_btree_block_at(const kvc_btree *t, size_t slot, kvc_btree_block_info *info, uint32_t *tokens,
                       size_t token_cap, uint32_t *anchor_lengths, uint64_t *anchor_keys, size_t anchor_cap) {
    if (slot >= t->slots || !t->blocks[slot].live) return 0;
    const block *b = &t->blocks[slot];
    info->hash = b->hash;
    info->parent = b->parent;
    info->sibling_seq = b->sibling_seq;
    info->detached_seq = b->detached_seq;
    info->start = b->start;
    info->n_tokens = b->n_tokens;
    info->media = b->media;
    info->n_anchors = b->n_anchors;
    info->has_parent = b->has_parent;
    info->lora = b->lora;
    info->tier = b->tier;
    info->path_tier = b->path_tier;
    info->attached = b->attached;
    info->detached = b->in_detached;
    const uint32_t *own = tokens_of(b);
    for (size_t i = 0; i < b->n_tokens && i < token_cap; i++) tokens[i] = own[i];
    for (size_t i = 0; i < b->n_anchors && i < anchor_cap; i++) {
        anchor_lengths[i] = b->anchors[i].length;
        anchor_keys[i] = b->anchors[i].key;
    }
    return 1;
}
