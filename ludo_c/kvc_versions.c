/*
 * kvc_versions.c -- the simulator's shared edge views (see kvc_versions.h).
 *
 * The rules are shared_views.py's, step for step (the simulator's decisions must not change with
 * the language): a version is made only when an edge moves to it -- in place from the highest
 * version below it that no edge is at any more, else as a copy of it, or from a snapshot blob in
 * between; when every edge at the version below already has the new batch by now, that version
 * moves on in place with all of them instead of a copy for one. Versions below every edge's are
 * freed, with their blobs. A table's live versions stay in the order they were made (compaction
 * breaks ties on it).
 */
#include "kvc_versions.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t k;       /* version number: after the table's k-th blob */
    kvc_view *view;
    int64_t refs;    /* edges at it */
} vs_version;

typedef struct {
    uint8_t *data;      /* a copy of the blob */
    size_t len;
    int snapshot;       /* a snapshot blob (the table grew or was rebuilt) */
} vs_blob;

typedef struct {
    int installed;
    vs_version *live;
    uint32_t n_live, cap_live;
    int64_t *at;        /* [edges]: the version each edge is at */
    int64_t latest;
    int64_t blob_base;  /* blob[i] turns version blob_base + i into blob_base + i + 1 */
    vs_blob *blob;
    uint64_t cap_blob;
    int64_t *seqs;      /* seqs[k - 1]: the shard's batch that made version k */
    uint64_t cap_seqs;
} vs_table;

typedef struct {
    int installed;
    int64_t base_seq;   /* the seq of the snapshot the edges started from */
    double *times;      /* publish time of each batch since */
    uint64_t n_times, cap_times;
} vs_shard;

typedef struct {
    kvc_view **ptrs;
    uint32_t *offsets;
    uint32_t *groups;
    uint32_t n_lengths;
} vs_edge;

struct kvc_vs {
    uint32_t shards, groups, edges;
    vs_table *tables;   /* [shards * groups] */
    vs_shard *shard;    /* [shards] */
    vs_edge *edge;      /* [edges] */
    double *delay;      /* [shards * edges] */
    int64_t *edge_seq;  /* [edges * shards] */
    int64_t *pos_cache; /* [shards]: positions worked out in this prepare call */
    uint64_t *pos_stamp;
    uint64_t stamp;
    uint8_t *snapshot;  /* kvc_vs_publish's scratch: blob i is a snapshot (read once, when checked) */
    uint64_t cap_snapshot;
};

static int grow(void **p, uint64_t *cap, uint64_t need, size_t elem) {
    if (need <= *cap) return KVC_OK;
    uint64_t n = *cap ? *cap : 4;
    while (n < need) n *= 2;
    void *q = realloc(*p, (size_t)n * elem);
    if (!q) return KVC_ERR_NOMEM;
    *p = q;
    *cap = n;
    return KVC_OK;
}

int kvc_vs_new(kvc_vs **out, uint32_t shards, uint32_t groups, uint32_t edges) {
    *out = NULL;
    if (shards == 0 || groups == 0 || (uint64_t)shards * groups > (1u << 30) || (uint64_t)shards * edges > (1u << 30))
        return KVC_ERR_ARG;
    kvc_vs *vs = calloc(1, sizeof *vs);
    if (!vs) return KVC_ERR_NOMEM;
    vs->shards = shards, vs->groups = groups, vs->edges = edges;
    vs->tables = calloc((size_t)shards * groups, sizeof *vs->tables);
    vs->shard = calloc(shards, sizeof *vs->shard);
    vs->edge = calloc(edges ? edges : 1, sizeof *vs->edge);
    vs->delay = calloc((size_t)shards * (edges ? edges : 1), sizeof *vs->delay);
    vs->edge_seq = calloc((size_t)shards * (edges ? edges : 1), sizeof *vs->edge_seq);
    vs->pos_cache = calloc(shards, sizeof *vs->pos_cache);
    vs->pos_stamp = calloc(shards, sizeof *vs->pos_stamp);
    if (!vs->tables || !vs->shard || !vs->edge || !vs->delay || !vs->edge_seq || !vs->pos_cache || !vs->pos_stamp) {
        kvc_vs_free(vs);
        return KVC_ERR_NOMEM;
    }
    *out = vs;
    return KVC_OK;
}

static void free_table(vs_table *t) {
    for (uint32_t i = 0; i < t->n_live; i++) {
        int shared = 0;  /* (never two entries on one view between calls; be safe anyway) */
        for (uint32_t j = 0; j < i; j++) shared |= t->live[j].view == t->live[i].view;
        if (!shared) kvc_view_free(t->live[i].view);
    }
    for (int64_t i = 0; i < t->latest - t->blob_base; i++) free(t->blob[i].data);
    free(t->live), free(t->at), free(t->blob), free(t->seqs);
}

void kvc_vs_free(kvc_vs *vs) {
    if (!vs) return;
    if (vs->tables)
        for (uint64_t i = 0; i < (uint64_t)vs->shards * vs->groups; i++) free_table(&vs->tables[i]);
    if (vs->shard)
        for (uint32_t s = 0; s < vs->shards; s++) free(vs->shard[s].times);
    if (vs->edge)
        for (uint32_t e = 0; e < vs->edges; e++) free(vs->edge[e].offsets), free(vs->edge[e].groups);
    free(vs->tables), free(vs->shard), free(vs->edge), free(vs->delay), free(vs->edge_seq);
    free(vs->pos_cache), free(vs->pos_stamp), free(vs->snapshot);
    free(vs);
}

int kvc_vs_bind_edge(kvc_vs *vs, uint32_t e, kvc_view **pointers, const uint32_t *offsets, uint32_t n_lengths,
                     const uint32_t *groups) {
    if (e >= vs->edges || !pointers || offsets[0] != 0) return KVC_ERR_ARG;
    for (uint32_t i = 0; i < n_lengths; i++)
        if (offsets[i + 1] < offsets[i]) return KVC_ERR_ARG;
    uint32_t n = offsets[n_lengths];
    for (uint32_t i = 0; i < n; i++)
        if (groups[i] >= vs->groups) return KVC_ERR_ARG;
    uint32_t *o = malloc(((size_t)n_lengths + 1) * sizeof *o), *g = malloc((n ? n : 1) * sizeof *g);
    if (!o || !g) {
        free(o), free(g);
        return KVC_ERR_NOMEM;
    }
    memcpy(o, offsets, ((size_t)n_lengths + 1) * sizeof *o);
    memcpy(g, groups, (size_t)n * sizeof *g);
    vs_edge *ed = &vs->edge[e];
    free(ed->offsets), free(ed->groups);
    ed->ptrs = pointers, ed->offsets = o, ed->groups = g, ed->n_lengths = n_lengths;
    for (uint32_t s = 0; s < vs->shards; s++)
        for (uint32_t gr = 0; gr < vs->groups; gr++) {
            vs_table *t = &vs->tables[(size_t)s * vs->groups + gr];
            if (!t->installed) continue;
            for (uint32_t i = 0; i < t->n_live; i++)
                if (t->live[i].k == t->at[e]) pointers[(size_t)s * vs->groups + gr] = t->live[i].view;
        }
    return KVC_OK;
}

int kvc_vs_set_delay(kvc_vs *vs, uint32_t s, uint32_t e, double seconds) {
    if (s >= vs->shards || e >= vs->edges || !(seconds >= 0.0)) return KVC_ERR_ARG;
    vs->delay[(size_t)s * vs->edges + e] = seconds;
    return KVC_OK;
}

static void set_pointer(kvc_vs *vs, uint32_t e, uint32_t s, uint32_t g, kvc_view *view) {
    kvc_view **p = vs->edge[e].ptrs;
    if (p) p[(size_t)s * vs->groups + g] = view;
}

static int add_live(vs_table *t, int64_t k, kvc_view *view, int64_t refs) {
    uint64_t cap = t->cap_live;
    int rc = grow((void **)&t->live, &cap, (uint64_t)t->n_live + 1, sizeof *t->live);
    if (rc != KVC_OK) return rc;
    t->cap_live = (uint32_t)cap;
    t->live[t->n_live++] = (vs_version){k, view, refs};
    return KVC_OK;
}

static void remove_live(vs_table *t, uint32_t i) {
    memmove(&t->live[i], &t->live[i + 1], (size_t)(t->n_live - i - 1) * sizeof *t->live);
    t->n_live--;
}

static int find_live(const vs_table *t, int64_t k) {
    for (uint32_t i = 0; i < t->n_live; i++)
        if (t->live[i].k == k) return (int)i;
    return -1;
}

int kvc_vs_install(kvc_vs *vs, uint32_t s, uint32_t g, int64_t base_seq, const uint8_t *blob, size_t len) {
    if (s >= vs->shards || g >= vs->groups) return KVC_ERR_ARG;
    vs_shard *sh = &vs->shard[s];
    vs_table *t = &vs->tables[(size_t)s * vs->groups + g];
    if (t->installed || sh->n_times || (sh->installed && sh->base_seq != base_seq)) return KVC_ERR_ARG;
    t->at = calloc(vs->edges ? vs->edges : 1, sizeof *t->at);
    if (!t->at) return KVC_ERR_NOMEM;
    kvc_view *view;
    int rc = kvc_view_new(&view, blob, len);
    if (rc == KVC_OK && (rc = add_live(t, 0, view, vs->edges)) != KVC_OK) kvc_view_free(view);
    if (rc != KVC_OK) {
        free(t->at);
        t->at = NULL;
        return rc;
    }
    t->installed = 1;
    sh->installed = 1;
    sh->base_seq = base_seq;
    for (uint32_t e = 0; e < vs->edges; e++) {
        vs->edge_seq[(size_t)e * vs->shards + s] = base_seq;
        set_pointer(vs, e, s, g, view);
    }
    return KVC_OK;
}

int kvc_vs_publish(kvc_vs *vs, uint32_t s, int64_t seq, double now, uint32_t n, const uint32_t *groups,
                   const uint8_t *const *blobs, const size_t *lens) {
    if (s >= vs->shards) return KVC_ERR_ARG;
    vs_shard *sh = &vs->shard[s];
    if (!sh->installed || seq != sh->base_seq + (int64_t)sh->n_times + 1) return KVC_ERR_ARG;
    int rc = grow((void **)&vs->snapshot, &vs->cap_snapshot, n ? n : 1, 1);
    if (rc != KVC_OK) return rc;
    for (uint32_t i = 0; i < n; i++) {  /* all checked before anything changes */
        if (groups[i] >= vs->groups || !vs->tables[(size_t)s * vs->groups + groups[i]].installed) return KVC_ERR_ARG;
        unsigned kind;
        uint64_t table_id, epoch;
        if ((rc = kvc_blob_peek(blobs[i], lens[i], &kind, &table_id, &epoch)) != KVC_OK) return rc;
        vs->snapshot[i] = kind == KVC_BLOB_SNAPSHOT;
    }
    if ((rc = grow((void **)&sh->times, &sh->cap_times, sh->n_times + 1, sizeof *sh->times)) != KVC_OK) return rc;
    for (uint32_t i = 0; i < n; i++) {
        vs_table *t = &vs->tables[(size_t)s * vs->groups + groups[i]];
        uint64_t held = (uint64_t)(t->latest - t->blob_base);
        if ((rc = grow((void **)&t->blob, &t->cap_blob, held + 1, sizeof *t->blob)) != KVC_OK) return rc;
        if ((rc = grow((void **)&t->seqs, &t->cap_seqs, (uint64_t)t->latest + 1, sizeof *t->seqs)) != KVC_OK) return rc;
        uint8_t *copy = malloc(lens[i] ? lens[i] : 1);
        if (!copy) return KVC_ERR_NOMEM;
        memcpy(copy, blobs[i], lens[i]);
        t->blob[held] = (vs_blob){copy, lens[i], vs->snapshot[i]};
        t->seqs[t->latest] = seq;
        t->latest++;
    }
    sh->times[sh->n_times++] = now;
    return KVC_OK;
}

static int64_t position(kvc_vs *vs, uint32_t e, uint32_t s, double now) {
    const vs_shard *sh = &vs->shard[s];
    const double *times = sh->times;
    uint64_t n = sh->n_times, lo = 0, hi = n;
    double d = vs->delay[(size_t)s * vs->edges + e], x = now - d;
    while (lo < hi) {  /* bisect_right(times, now - d) */
        uint64_t mid = (lo + hi) / 2;
        if (x < times[mid]) hi = mid;
        else lo = mid + 1;
    }
    uint64_t i = lo;  /* then exactly the sum the per-edge delivery events were due at */
    while (i < n && times[i] + d <= now) i++;
    while (i > 0 && times[i - 1] + d > now) i--;
    int64_t seq = sh->base_seq + (int64_t)i;
    vs->edge_seq[(size_t)e * vs->shards + s] = seq;
    return seq;
}

int64_t kvc_vs_position(kvc_vs *vs, uint32_t e, uint32_t s, double now) {
    if (e >= vs->edges || s >= vs->shards) return -1;
    return position(vs, e, s, now);
}

static int64_t version_at(const vs_table *t, int64_t seq) {  /* bisect_right(seqs, seq) */
    int64_t lo = 0, hi = t->latest;
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (seq < t->seqs[mid]) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

static const vs_blob *blob_to(const vs_table *t, int64_t v) {  /* the blob that makes version v */
    return &t->blob[v - 1 - t->blob_base];
}

static int apply_blobs(vs_table *t, kvc_view *view, int64_t from, int64_t to) {  /* versions from+1..to */
    for (int64_t v = from + 1; v <= to; v++) {
        int rc = kvc_view_apply(view, blob_to(t, v)->data, blob_to(t, v)->len);
        if (rc != KVC_OK) return rc;
    }
    return KVC_OK;
}

static int64_t snapshot_between(const vs_table *t, int64_t base, int64_t k) {  /* highest v in base+1..k, or 0 */
    for (int64_t v = k; v > base; v--)
        if (blob_to(t, v)->snapshot) return v;
    return 0;
}

/* Live version i moved on in place to version k: 1, or 0 (untouched) when a snapshot blob lies
 * between (a new table: version k is made instead), or a blob's error. */
static int advance_in_place(vs_table *t, int i, int64_t k) {
    if (snapshot_between(t, t->live[i].k, k)) return 0;
    int rc = apply_blobs(t, t->live[i].view, t->live[i].k, k);
    return rc != KVC_OK ? rc : 1;
}

static int64_t lowest_live(const vs_table *t) {
    int64_t lowest = INT64_MAX;
    for (uint32_t i = 0; i < t->n_live; i++)
        if (t->live[i].k < lowest) lowest = t->live[i].k;
    return lowest;
}

/* Version k (not live yet) from the highest live version below it; *out its view. */
static int make(vs_table *t, int64_t k, kvc_view **out) {
    int ib = -1;
    for (uint32_t i = 0; i < t->n_live; i++)
        if (t->live[i].k < k && (ib < 0 || t->live[i].k > t->live[ib].k)) ib = (int)i;
    if (ib < 0) return KVC_ERR_ARG;
    int64_t base = t->live[ib].k, snap = snapshot_between(t, base, k), start = snap ? snap : base;
    kvc_view *view;
    int rc = KVC_OK;
    if (snap) {
        rc = kvc_view_new(&view, blob_to(t, snap)->data, blob_to(t, snap)->len);
    } else if (t->live[ib].refs == 0) {
        view = t->live[ib].view;  /* no edge is at it any more: move it on in place */
        remove_live(t, (uint32_t)ib);
    } else {
        rc = kvc_view_copy(&view, t->live[ib].view);
    }
    if (rc != KVC_OK) return rc;
    if ((rc = apply_blobs(t, view, start, k)) != KVC_OK) {
        kvc_view_free(view);
        return rc;
    }
    *out = view;
    return KVC_OK;
}

/* Free the versions no edge is at, and the blobs below every edge's version. */
static void collect(vs_table *t) {
    for (uint32_t i = 0; i < t->n_live;) {
        if (t->live[i].refs != 0) {
            i++;
            continue;
        }
        kvc_view *view = t->live[i].view;
        remove_live(t, i);
        int shared = 0;  /* (compaction's version moved on in place: its view is the new one's) */
        for (uint32_t j = 0; j < t->n_live; j++) shared |= t->live[j].view == view;
        if (!shared) kvc_view_free(view);
    }
    if (!t->n_live) return;
    int64_t lowest = lowest_live(t);
    if (lowest > t->blob_base) {
        int64_t cut = lowest - t->blob_base, held = t->latest - t->blob_base;
        for (int64_t i = 0; i < cut; i++) free(t->blob[i].data);
        memmove(t->blob, t->blob + cut, (size_t)(held - cut) * sizeof *t->blob);
        t->blob_base = lowest;
    }
}

/* Version j moved on in place to version k with every edge at it, when each of them has the
 * batch that made version k by now (and no snapshot blob lies between): 1 if so, 0 if not. */
static int carry(kvc_vs *vs, uint32_t s, vs_table *t, int ij, int64_t k, double now) {
    const vs_shard *sh = &vs->shard[s];
    int64_t j = t->live[ij].k;
    double due = sh->times[t->seqs[k - 1] - sh->base_seq - 1];
    const double *delay = &vs->delay[(size_t)s * vs->edges];
    for (uint32_t x = 0; x < vs->edges; x++)
        if (t->at[x] == j && due + delay[x] > now) return 0;
    int rc = advance_in_place(t, ij, k);
    if (rc != 1) return rc;
    vs_version moved = t->live[ij];
    remove_live(t, (uint32_t)ij);
    moved.k = k;
    t->live[t->n_live++] = moved;  /* (the slot just freed) */
    for (uint32_t x = 0; x < vs->edges; x++)
        if (t->at[x] == j) t->at[x] = k;
    collect(t);
    return 1;
}

static int move(kvc_vs *vs, uint32_t e, uint32_t s, uint32_t g, vs_table *t, int64_t k, double now) {
    int64_t j = t->at[e];
    int ij = find_live(t, j), ik = find_live(t, k);
    if (ij < 0) return KVC_ERR_ARG;
    if (ik < 0 && t->live[ij].refs > 1) {
        int rc = carry(vs, s, t, ij, k, now);
        if (rc != 0) return rc < 0 ? rc : KVC_OK;
    }
    t->live[ij].refs--;
    kvc_view *view;
    if (ik < 0) {
        int rc = make(t, k, &view);
        if (rc == KVC_OK && (rc = add_live(t, k, view, 1)) != KVC_OK) kvc_view_free(view);
        if (rc != KVC_OK) {
            if ((ij = find_live(t, j)) >= 0) t->live[ij].refs++;
            return rc;
        }
    } else {
        t->live[ik].refs++;
        view = t->live[ik].view;
    }
    t->at[e] = k;
    set_pointer(vs, e, s, g, view);
    ij = find_live(t, j);
    if (ij < 0 || t->live[ij].refs == 0) collect(t);  /* j is nobody's now (or was moved on in place) */
    return KVC_OK;
}

int kvc_vs_prepare(kvc_vs *vs, uint32_t e, const uint64_t *keys, uint32_t n_keys, double now) {
    if (e >= vs->edges) return KVC_ERR_ARG;
    const vs_edge *ed = &vs->edge[e];
    if (n_keys > ed->n_lengths) return KVC_ERR_ARG;
    uint64_t stamp = ++vs->stamp;
    for (uint32_t i = 0; i < n_keys; i++) {
        uint32_t s = (uint32_t)(keys[i] % vs->shards);
        vs_table *row = &vs->tables[(size_t)s * vs->groups];
        for (uint32_t gi = ed->offsets[i]; gi < ed->offsets[i + 1]; gi++) {
            uint32_t g = ed->groups[gi];
            vs_table *t = &row[g];
            if (!t->installed) return KVC_ERR_ARG;
            int64_t cur = t->at[e];
            if (cur == t->latest) continue;
            if (vs->pos_stamp[s] != stamp) {
                vs->pos_stamp[s] = stamp;
                vs->pos_cache[s] = position(vs, e, s, now);
            }
            int64_t k = version_at(t, vs->pos_cache[s]);
            if (k != cur) {
                int rc = move(vs, e, s, g, t, k, now);
                if (rc != KVC_OK) return rc;
            }
        }
    }
    return KVC_OK;
}

int kvc_vs_advance(kvc_vs *vs, uint32_t e, double now) {
    if (e >= vs->edges) return KVC_ERR_ARG;
    for (uint32_t s = 0; s < vs->shards; s++) {
        int64_t pos = position(vs, e, s, now);
        for (uint32_t g = 0; g < vs->groups; g++) {
            vs_table *t = &vs->tables[(size_t)s * vs->groups + g];
            if (!t->installed || t->at[e] == t->latest) continue;
            int64_t k = version_at(t, pos);
            if (k != t->at[e]) {
                int rc = move(vs, e, s, g, t, k, now);
                if (rc != KVC_OK) return rc;
            }
        }
    }
    return KVC_OK;
}

int kvc_vs_compact(kvc_vs *vs, double now) {
    for (uint32_t s = 0; s < vs->shards; s++) {
        if (!vs->shard[s].n_times || !vs->edges) continue;
        int64_t low = INT64_MAX;
        for (uint32_t e = 0; e < vs->edges; e++) {
            int64_t p = position(vs, e, s, now);
            if (p < low) low = p;
        }
        for (uint32_t g = 0; g < vs->groups; g++) {
            vs_table *t = &vs->tables[(size_t)s * vs->groups + g];
            if (!t->installed) continue;
            int64_t k = version_at(t, low);
            if (lowest_live(t) >= k) continue;  /* nobody is behind it */
            int64_t behind = 0, kept = -1;
            for (uint32_t e = 0; e < vs->edges; e++) behind += t->at[e] < k;
            int ik = find_live(t, k);
            kvc_view *view;
            if (ik < 0) {
                /* Most lagging edges sit together at the version the last sweep moved them to:
                 * that version's view moves on in place (the one most edges are at, the first
                 * made on a tie), and only the others are pointed at it. */
                int ib = -1;
                for (uint32_t i = 0; i < t->n_live; i++)
                    if (t->live[i].k < k && (ib < 0 || t->live[i].refs > t->live[ib].refs)) ib = (int)i;
                int rc = advance_in_place(t, ib, k);
                if (rc < 0) return rc;
                if (rc == 1) {
                    view = t->live[ib].view;
                    kept = t->live[ib].k;
                } else if ((rc = make(t, k, &view)) != KVC_OK) {
                    return rc;
                }
                if ((rc = add_live(t, k, view, 0)) != KVC_OK) {
                    if (kept < 0) kvc_view_free(view);
                    return rc;
                }
                ik = (int)t->n_live - 1;
            } else {
                view = t->live[ik].view;
            }
            t->live[ik].refs += behind;
            for (uint32_t e = 0; e < vs->edges; e++) {
                int64_t j = t->at[e];
                if (j >= k) continue;
                t->live[find_live(t, j)].refs--;
                t->at[e] = k;
                if (j != kept) set_pointer(vs, e, s, g, view);
            }
            collect(t);  /* (frees version kept's entry: its view is version k's now) */
        }
    }
    return KVC_OK;
}

const kvc_view *kvc_vs_view(const kvc_vs *vs, uint32_t e, uint32_t s, uint32_t g) {
    if (e >= vs->edges || s >= vs->shards || g >= vs->groups) return NULL;
    const vs_table *t = &vs->tables[(size_t)s * vs->groups + g];
    if (!t->installed) return NULL;
    int i = find_live(t, t->at[e]);
    return i < 0 ? NULL : t->live[i].view;
}

int64_t kvc_vs_edge_seq(const kvc_vs *vs, uint32_t e, uint32_t s) {
    if (e >= vs->edges || s >= vs->shards) return -1;
    return vs->edge_seq[(size_t)e * vs->shards + s];
}

uint64_t kvc_vs_live_versions(const kvc_vs *vs) {
    uint64_t n = 0;
    for (uint64_t i = 0; i < (uint64_t)vs->shards * vs->groups; i++) n += vs->tables[i].n_live;
    return n;
}

uint64_t kvc_vs_memory_bytes(const kvc_vs *vs) {
    uint64_t n = 0;
    for (uint64_t i = 0; i < (uint64_t)vs->shards * vs->groups; i++)
        for (uint32_t j = 0; j < vs->tables[i].n_live; j++) n += kvc_view_memory_bytes(vs->tables[i].live[j].view);
    return n;
}

int64_t kvc_vs_edge_version(const kvc_vs *vs, uint32_t e, uint32_t s, uint32_t g) {
    if (e >= vs->edges || s >= vs->shards || g >= vs->groups) return -1;
    const vs_table *t = &vs->tables[(size_t)s * vs->groups + g];
    return t->installed ? t->at[e] : -1;
}

uint32_t kvc_vs_table_versions(const kvc_vs *vs, uint32_t s, uint32_t g, int64_t *versions, int64_t *refs,
                               uint32_t cap) {
    if (s >= vs->shards || g >= vs->groups) return 0;
    const vs_table *t = &vs->tables[(size_t)s * vs->groups + g];
    for (uint32_t i = 0; i < t->n_live && i < cap; i++) versions[i] = t->live[i].k, refs[i] = t->live[i].refs;
    return t->n_live;
}

int64_t kvc_vs_version_at(const kvc_vs *vs, uint32_t s, uint32_t g, int64_t seq) {
    if (s >= vs->shards || g >= vs->groups) return -1;
    const vs_table *t = &vs->tables[(size_t)s * vs->groups + g];
    return t->installed ? version_at(t, seq) : -1;
}
