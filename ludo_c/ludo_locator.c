/* ludo_locator.c -- Othello locator kept acyclic by tree walks; see ludo_locator.h. */
#include <stdlib.h>

#include "ludo_locator.h"

static inline uint32_t word_of(const kvc_locator *L, uint32_t cell)
{
    return cell < L->ma ? cell >> 6 : L->wa + ((cell - L->ma) >> 6);
}

static inline unsigned cell_bit(const kvc_locator *L, uint32_t cell)
{
    uint32_t off = cell < L->ma ? cell : cell - L->ma;
    return (unsigned)(L->words[word_of(L, cell)] >> (off & 63)) & 1u;
}

static inline void cell_flip(kvc_locator *L, uint32_t cell)
{
    uint32_t off = cell < L->ma ? cell : cell - L->ma;
    L->words[word_of(L, cell)] ^= UINT64_C(1) << (off & 63);
}

static int grow_u32(uint32_t **p, size_t *cap, size_t need)
{
    if (need <= *cap)
        return KVC_OK;
    size_t c = *cap ? *cap : 256;
    while (c < need)
        c *= 2;
    uint32_t *q = realloc(*p, c * sizeof *q);
    if (!q)
        return KVC_ERR_NOMEM;
    *p = q;
    *cap = c;
    return KVC_OK;
}

static int walk_push(struct kvc_walk *w, uint32_t node, uint32_t from)
{
    if (w->sp == w->cap) {
        size_t c1 = w->cap, c2 = w->cap;
        if (grow_u32(&w->node, &c1, w->sp + 1) != KVC_OK || grow_u32(&w->from, &c2, w->sp + 1) != KVC_OK)
            return KVC_ERR_NOMEM;
        w->cap = c1 < c2 ? c1 : c2;
    }
    w->node[w->sp] = node;
    w->from[w->sp++] = from;
    return KVC_OK;
}

/* One step of a walk: visit the next cell. Returns 1 if it is `target`, 0 otherwise, or NOMEM. */
static int walk_step(kvc_locator *L, struct kvc_walk *w, uint32_t skip, uint32_t target)
{
    w->sp--;
    uint32_t x = w->node[w->sp], from = w->from[w->sp];
    if (x == target)
        return 1;
    if (grow_u32(&w->comp, &w->comp_cap, w->comp_n + 1) != KVC_OK)
        return KVC_ERR_NOMEM;
    w->comp[w->comp_n++] = x;
    for (uint32_t h = L->head[x]; h != KVC_NO_EDGE; h = L->half[h].next) {
        uint32_t e = h >> 1;
        if (e == from || e == skip)
            continue;
        uint32_t y = L->half[h ^ 1u].node;
        __builtin_prefetch(&L->head[y]); /* visited a step later: let the miss overlap */
        if (walk_push(w, y, e) != KVC_OK)
            return KVC_ERR_NOMEM;
    }
    return 0;
}

/* Walk the trees of cells u and v (not crossing edge `skip`) in lockstep until one is exhausted,
 * so the cost is about twice the smaller tree. Returns the index (0 = u, 1 = v) of the walk that
 * covered its whole tree, KVC_LOC_CYCLE + 1 if u and v are in the same tree, or NOMEM. */
static int walk_smaller(kvc_locator *L, uint32_t u, uint32_t v, uint32_t skip)
{
    struct kvc_walk *w = L->walk;
    w[0].sp = w[1].sp = w[0].comp_n = w[1].comp_n = 0;
    if (skip == KVC_NO_EDGE) { /* a new edge: a lone cell on either side settles it at once */
        for (int s = 0; s < 2; s++) {
            uint32_t x = s ? v : u;
            if (L->head[x] == KVC_NO_EDGE) {
                if (grow_u32(&w[s].comp, &w[s].comp_cap, 1) != KVC_OK)
                    return KVC_ERR_NOMEM;
                w[s].comp[w[s].comp_n++] = x;
                return s;
            }
        }
    }
    if (walk_push(&w[0], u, KVC_NO_EDGE) != KVC_OK || walk_push(&w[1], v, KVC_NO_EDGE) != KVC_OK)
        return KVC_ERR_NOMEM;
    for (;;) {
        for (int s = 0; s < 2; s++) {
            int r = walk_step(L, &w[s], skip, s ? u : v);
            if (r < 0)
                return r;
            if (r == 1)
                return KVC_LOC_CYCLE + 1;
            if (w[s].sp == 0) /* tree done: often a lone cell, and the other side is never read */
                return s;
        }
    }
}

static int flip_comp(kvc_locator *L, const struct kvc_walk *w)
{
    if (grow_u32(&L->touched, &L->touched_cap, L->touched_n + w->comp_n) != KVC_OK)
        return KVC_ERR_NOMEM;
    for (size_t i = 0; i < w->comp_n; i++) {
        cell_flip(L, w->comp[i]);
        L->touched[L->touched_n++] = word_of(L, w->comp[i]);
    }
    return KVC_OK;
}

static void link_edge(kvc_locator *L, uint32_t e, uint32_t u, uint32_t v)
{
    L->half[2 * e].node = u;
    L->half[2 * e + 1].node = v;
    L->half[2 * e].next = L->head[u];
    L->head[u] = 2 * e;
    L->half[2 * e + 1].next = L->head[v];
    L->head[v] = 2 * e + 1;
}

void kvc_locator_free(kvc_locator *L)
{
    free(L->words);
    free(L->head);
    free(L->half);
    for (int i = 0; i < 2; i++) {
        free(L->walk[i].node);
        free(L->walk[i].from);
        free(L->walk[i].comp);
    }
    free(L->touched);
    memset(L, 0, sizeof *L);
}

static uint32_t uf_find(uint32_t *parent, uint32_t x)
{
    while (parent[x] != x) {
        parent[x] = parent[parent[x]];
        x = parent[x];
    }
    return x;
}

int kvc_locator_build(kvc_locator *L, uint32_t ma, uint32_t mb, uint64_t seed,
                      kvc_bucket *bk, uint32_t nb, uint64_t bucket_seed)
{
    memset(L, 0, sizeof *L);
    size_t slots = (size_t)nb * 4u, cells = (size_t)ma + mb;
    uint32_t *parent = kvc_alloc(cells * sizeof *parent, 0);
    if (!parent)
        return KVC_ERR_NOMEM;
    for (size_t i = 0; i < cells; i++)
        parent[i] = (uint32_t)i;
    for (size_t i = 0; i < slots; i++) { /* pass 1: is the key graph a forest under this seed? */
        if (bk[i >> 2].key[i & 3] == UINT64_MAX)
            continue;
        uint32_t a, b;
        kvc_cells(bk[i >> 2].key[i & 3], seed, ma, mb, &a, &b);
        uint32_t ru = uf_find(parent, a), rv = uf_find(parent, ma + b);
        if (ru == rv) {
            free(parent);
            return KVC_LOC_CYCLE;
        }
        parent[ru] = rv;
    }
    L->ma = ma;
    L->mb = mb;
    L->wa = kvc_words_for(ma);
    L->wb = kvc_words_for(mb);
    L->seed = seed;
    L->ecap = (uint32_t)slots;
    L->words = kvc_alloc(((size_t)L->wa + L->wb) * sizeof *L->words, 1);
    L->head = kvc_alloc(cells * sizeof *L->head, 0);
    L->half = kvc_alloc(2 * slots * sizeof *L->half, 0);
    uint8_t *ebit = kvc_alloc(slots, 0);
    if (!L->words || !L->head || !L->half || !ebit) {
        free(parent);
        free(ebit);
        kvc_locator_free(L);
        return KVC_ERR_NOMEM;
    }
    for (size_t i = 0; i < cells; i++)
        L->head[i] = KVC_NO_EDGE;
    uint32_t e = 0;
    for (size_t i = 0; i < slots; i++) { /* pass 2: link edges */
        if (bk[i >> 2].key[i & 3] == UINT64_MAX) {
            bk[i >> 2].edge[i & 3] = KVC_NO_EDGE;
            continue;
        }
        uint32_t a, b, b0, b1;
        kvc_cells(bk[i >> 2].key[i & 3], seed, ma, mb, &a, &b);
        kvc_buckets(bk[i >> 2].key[i & 3], bucket_seed, nb, &b0, &b1);
        link_edge(L, e, a, ma + b);
        ebit[e] = (uint8_t)(i / 4 == b1);
        bk[i >> 2].edge[i & 3] = e++;
    }
    L->efree = KVC_NO_EDGE;
    for (uint32_t f = L->ecap; f > e; f--) { /* free list of unused edge ids */
        L->half[2 * (f - 1)].next = L->efree;
        L->efree = f - 1;
    }
    /* pass 3: give every tree's cells values so each edge reads its bit (root cells stay 0) */
    uint8_t *seen = (uint8_t *)parent;
    memset(seen, 0, cells);
    int rc = KVC_OK;
    for (size_t r = 0; r < cells && rc == KVC_OK; r++) {
        if (seen[r] || L->head[r] == KVC_NO_EDGE)
            continue;
        struct kvc_walk *w = &L->walk[0];
        w->sp = 0;
        seen[r] = 1;
        if ((rc = walk_push(w, (uint32_t)r, KVC_NO_EDGE)) != KVC_OK)
            break;
        while (w->sp && rc == KVC_OK) {
            uint32_t x = w->node[--w->sp];
            unsigned bx = cell_bit(L, x);
            for (uint32_t h = L->head[x]; h != KVC_NO_EDGE; h = L->half[h].next) {
                uint32_t y = L->half[h ^ 1u].node;
                if (seen[y])
                    continue;
                seen[y] = 1;
                if (bx ^ ebit[h >> 1])
                    cell_flip(L, y);
                if ((rc = walk_push(w, y, KVC_NO_EDGE)) != KVC_OK)
                    break;
            }
        }
    }
    free(parent);
    free(ebit);
    if (rc != KVC_OK) {
        kvc_locator_free(L);
        return rc;
    }
    return KVC_OK;
}

int kvc_locator_add(kvc_locator *L, uint64_t key, unsigned bit, uint32_t *edge_out)
{
    uint32_t a, b;
    kvc_cells(key, L->seed, L->ma, L->mb, &a, &b);
    uint32_t u = a, v = L->ma + b;
    int r = walk_smaller(L, u, v, KVC_NO_EDGE);
    if (r < 0)
        return r;
    if (r == KVC_LOC_CYCLE + 1)
        return KVC_LOC_CYCLE;
    if ((cell_bit(L, u) ^ cell_bit(L, v)) != bit) {
        /* the two trees are not linked yet: flipping the smaller one moves no other key's bit */
        int rc = flip_comp(L, &L->walk[r]);
        if (rc != KVC_OK)
            return rc;
    }
    uint32_t e = L->efree;
    L->efree = L->half[2 * e].next;
    link_edge(L, e, u, v);
    *edge_out = e;
    return KVC_OK;
}

int kvc_locator_flip(kvc_locator *L, uint32_t e)
{
    /* without edge e its tree splits in two; flipping either side inverts only e's bit */
    int r = walk_smaller(L, L->half[2 * e].node, L->half[2 * e + 1].node, e);
    if (r < 0)
        return r;
    return flip_comp(L, &L->walk[r]);
}

static void unlink_half(kvc_locator *L, uint32_t h)
{
    uint32_t *link = &L->head[L->half[h].node];
    while (*link != h)
        link = &L->half[*link].next;
    *link = L->half[h].next;
}

void kvc_locator_remove(kvc_locator *L, uint32_t e)
{
    unlink_half(L, 2 * e);
    unlink_half(L, 2 * e + 1);
    L->half[2 * e].next = L->efree;
    L->efree = e;
}

uint64_t kvc_locator_memory_bytes(const kvc_locator *L)
{
    return 8u * ((uint64_t)L->wa + L->wb) + 4u * ((uint64_t)L->ma + L->mb) + 16u * (uint64_t)L->ecap +
           4u * (2u * (L->walk[0].cap + L->walk[1].cap) + L->walk[0].comp_cap + L->walk[1].comp_cap + L->touched_cap);
}
