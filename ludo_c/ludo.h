/*
 * ludo.h -- a Ludo hashing table (Shi & Qian, SIGMETRICS 2020) for kvcompassd.
 *
 * Two halves:
 *   kvc_table  the maintenance side: stores full 63-bit keys next to their values, so `get` is
 *              exact; the single writer of a shard. Every mutation appends update records that
 *              carry the ABSOLUTE new state of what it touched (bucket seed + 4 slot values
 *              [+ fingerprints], 64-bit locator words), so applying a record twice is harmless.
 *   kvc_view   the keyless edge side: built from a snapshot, kept identical by applying record
 *              blobs; answers lookup(key) in about three memory reads.
 *
 * Records and snapshots are plain little-endian bytes ("blobs") with a 72-byte header (magic,
 * format version, kind, table id, epoch, geometry, hash seeds, payload length, CRC-32). A view
 * validates a whole blob before changing anything, so a rejected blob leaves it untouched.
 *
 * There is no global mutable state: any number of tables and views may live side by side. None of
 * the functions is thread-safe on the same object; different objects may be used concurrently.
 *
 * Everything between CDEF-BEGIN and CDEF-END is also fed to cffi's cdef: plain declarations only.
 */
#ifndef KVC_LUDO_H
#define KVC_LUDO_H

#include <stddef.h>
#include <stdint.h>

/* CDEF-BEGIN */

/* Result codes: 0 is success, negatives are errors. Lookups of presence return 1/0. */
enum kvc_status {
    KVC_OK = 0,
    KVC_ERR_NOMEM = -1,        /* an allocation failed; the object is unchanged */
    KVC_ERR_KEY_RANGE = -2,    /* key >= 2^63 */
    KVC_ERR_VALUE_RANGE = -3,  /* value is 0 or wider than the table's value bits */
    KVC_ERR_PRESENT = -4,      /* insert of a key that is already present */
    KVC_ERR_ABSENT = -5,       /* update/remove of a key that is not present */
    KVC_ERR_ARG = -6,          /* bad creation parameter or output buffer size */
    KVC_ERR_TRUNCATED = -7,    /* blob shorter than its header or its declared length */
    KVC_ERR_MAGIC = -8,        /* blob does not start with the Ludo magic */
    KVC_ERR_VERSION = -9,      /* unknown format version or blob kind */
    KVC_ERR_CHECKSUM = -10,    /* CRC-32 mismatch: the blob was corrupted */
    KVC_ERR_FOREIGN = -11,     /* blob belongs to another table (table id differs) */
    KVC_ERR_EPOCH = -12,       /* records for another epoch, or a snapshot older than the view */
    KVC_ERR_GEOMETRY = -13,    /* header geometry impossible or not the view's */
    KVC_ERR_MALFORMED = -14,   /* payload fields out of range (index, fingerprint, length) */
    KVC_ERR_FULL = -15         /* the table cannot grow any further (2^31 buckets) */
};

/* Blob kinds (header field). */
enum kvc_blob_kind {
    KVC_BLOB_SNAPSHOT = 1,
    KVC_BLOB_RECORDS = 2
};

typedef struct kvc_table kvc_table;
typedef struct kvc_view kvc_view;

/* ---- maintenance table ---------------------------------------------------------------- */

/* Create a table sized for `capacity` entries at `max_load` occupancy (buckets =
 * ceil(capacity / (4 * max_load))). value_bits is 32 or 64; fingerprint_bits 0..16 (0 = paper);
 * max_load in (0, 0.98]; `seed` is also the table id carried in every blob (give each table its
 * own). Returns KVC_OK and sets *out, or KVC_ERR_ARG / KVC_ERR_NOMEM. */
int kvc_table_new(kvc_table **out, uint64_t capacity, unsigned value_bits,
                  unsigned fingerprint_bits, double max_load, uint64_t seed);

/* Free a table (NULL is allowed). */
void kvc_table_free(kvc_table *table);

/* Insert a new key. Errors: KEY_RANGE, VALUE_RANGE (0 or too wide), PRESENT, NOMEM, FULL.
 * May grow the table (new epoch; the next take yields a snapshot). */
int kvc_table_insert(kvc_table *table, uint64_t key, uint64_t value);

/* Replace the value of a present key. Errors: KEY_RANGE, VALUE_RANGE, ABSENT, NOMEM. */
int kvc_table_update(kvc_table *table, uint64_t key, uint64_t value);

/* Remove a present key. Errors: KEY_RANGE, ABSENT, NOMEM. */
int kvc_table_remove(kvc_table *table, uint64_t key);

/* Exact lookup: returns 1 and sets *value_out if present, 0 if absent, KEY_RANGE if key >= 2^63. */
int kvc_table_get(const kvc_table *table, uint64_t key, uint64_t *value_out);

/* Batch forms: apply in order, stop at the first failing element. *done is set to the number of
 * elements applied; the return value is KVC_OK or the failing element's error. */
int kvc_table_insert_many(kvc_table *table, const uint64_t *keys, const uint64_t *values,
                          size_t n, size_t *done);
int kvc_table_update_many(kvc_table *table, const uint64_t *keys, const uint64_t *values,
                          size_t n, size_t *done);
int kvc_table_remove_many(kvc_table *table, const uint64_t *keys, size_t n, size_t *done);

/* Outcome of one edit of kvc_table_edit_fields. */
enum kvc_edit_status {
    KVC_EDIT_CHANGED = 0,   /* the field changed (the key was inserted, updated or removed) */
    KVC_EDIT_UNCHANGED = 1, /* the field already held the new value */
    KVC_EDIT_REFUSED = 2    /* the op needs a non-zero field and the field was 0 */
};

/* Batch field edits, e.g. one worker's index events on one table in one call: for each i in
 * order, the `width`-bit field at bit `shift` of keys[i]'s value (0 for an absent key) becomes
 * op_field[ops[i]], unless op_needs_held[ops[i]] is set and the field is 0 (refused). An absent
 * key is inserted; a value whose bits all become 0 is removed. status_out[i] is a
 * kvc_edit_status. Returns KVC_OK, KVC_ERR_ARG (width not in 1..8, shift + width beyond the
 * value bits, an op_field wider than width, or an op >= n_ops), KVC_ERR_KEY_RANGE, or a table
 * error (NOMEM, FULL); *done is the number of elements finished before the error. */
int kvc_table_edit_fields(kvc_table *table, const uint64_t *keys, const uint8_t *ops, size_t n,
                          const uint8_t *op_field, const uint8_t *op_needs_held, unsigned n_ops,
                          unsigned shift, unsigned width, uint8_t *status_out, size_t *done);

/* kvc_table_edit_fields of one report on a table and on the tables that take part of it, in one
 * call: a maintenance shard's full table of one region group and the same group's table of each
 * of its region streams (kvcompassd.core.streams), each stream taking the events of the lengths
 * its region reads.
 *   full          takes every event; status_out[i] is its kvc_edit_status for event i.
 *   streams       [n_streams] the stream tables, each with full's value bits (not checked: a
 *                 narrower one refuses a value it cannot hold as a table error, part-way).
 *   lengths       [n] each event's length; event i goes to the streams of row r: the index of
 *                 lengths[i] among known[0..n_known) (ascending and distinct, which is not
 *                 checked: any order still routes each event to some row), or n_known if it is
 *                 none of them (a length no stream reads; a length every stream takes, such as
 *                 "unknown", is a known one whose row names them all).
 *   row_start     [n_known + 2], row_streams: row r's streams are row_streams[row_start[r] ..
 *                 row_start[r + 1]), ascending stream indices below n_streams.
 *   changed_out   [n_streams + 1] fields changed: [0] in full, [1 + j] in streams[j].
 * Events go in order, each to full and then to its streams, so every table's state and pending
 * records are those kvc_table_edit_fields of its own events alone would leave. Returns KVC_OK;
 * KVC_ERR_ARG (a NULL table, width not in 1..8, shift + width beyond full's value bits, an
 * op_field wider than width, an op >= n_ops, a row an event uses not ascending or naming a
 * stream >= n_streams) or KVC_ERR_KEY_RANGE, both found before any table changes; or a table
 * error (NOMEM, FULL) with *failed the table (0: full, 1 + j: streams[j]) and *done the events
 * finished before it (changed_out counts what changed up to there). */
int kvc_tables_edit_routed(kvc_table *full, kvc_table *const *streams, size_t n_streams,
                           const uint64_t *keys, const uint8_t *ops, const uint32_t *lengths, size_t n,
                           const uint32_t *known, size_t n_known,
                           const uint32_t *row_start, const uint32_t *row_streams,
                           const uint8_t *op_field, const uint8_t *op_needs_held, unsigned n_ops,
                           unsigned shift, unsigned width,
                           uint8_t *status_out, uint64_t *changed_out, size_t *failed, size_t *done);

/* Field edits of several workers' events on several tables in one call, e.g. what a maintenance
 * shard received from many workers between two flushes: for each i in order, event i edits the
 * `width`-bit field at bit (places[i] & 0xff) of keys[i]'s value in tables[places[i] >> 8] as
 * kvc_table_edit_fields of that one event on that table would (op_field, op_needs_held and
 * status_out[i] as there). Every table sees its own events in the given order, so its state and
 * pending records are those of kvc_table_edit_fields of each worker's run of events in turn.
 * Returns KVC_OK; KVC_ERR_ARG (a table index >= n_tables, a NULL table, width not in 1..8, a
 * shift + width beyond that table's value bits, an op_field wider than width, an op >= n_ops) or
 * KVC_ERR_KEY_RANGE, both found before any table changes; or a table error (NOMEM, FULL), with
 * *done the events finished before it. */
int kvc_tables_edit_fields_each(kvc_table *const *tables, size_t n_tables, const uint32_t *places,
                                const uint64_t *keys, const uint8_t *ops, size_t n,
                                const uint8_t *op_field, const uint8_t *op_needs_held, unsigned n_ops,
                                unsigned width, uint8_t *status_out, size_t *done);

/* Batch exact lookup: values_out[i] = value or 0, found_out[i] = 1/0 (0 for keys >= 2^63). */
void kvc_table_get_many(const kvc_table *table, const uint64_t *keys, size_t n,
                        uint64_t *values_out, uint8_t *found_out);

/* Number of keys stored. */
uint64_t kvc_table_size(const kvc_table *table);

/* Current epoch (starts at 1; +1 on every grow or locator reseed). */
uint64_t kvc_table_epoch(const kvc_table *table);

/* Number of slots (4 x buckets). */
uint64_t kvc_table_slots(const kvc_table *table);

/* Bytes allocated by the table, everything included. */
uint64_t kvc_table_memory_bytes(const kvc_table *table);

/* Number of buckets whose slot seed does not fit in the view's 5 bits (go to its overflow map). */
uint64_t kvc_table_overflow_buckets(const kvc_table *table);

/* Size in bytes of a snapshot blob of the current state. */
size_t kvc_table_snapshot_size(const kvc_table *table);

/* Write a snapshot blob of the current state into buf (len must equal kvc_table_snapshot_size). */
int kvc_table_snapshot_write(const kvc_table *table, uint8_t *buf, size_t len);

/* 1 if the table was rebuilt (grow or locator reseed) since the last kvc_table_clear_pending:
 * pending records are then meaningless and a snapshot must be shipped instead. */
int kvc_table_needs_snapshot(const kvc_table *table);

/* Size of the record blob that kvc_table_records_drain would write now (0 = nothing pending). */
size_t kvc_table_records_size(const kvc_table *table);

/* Write all pending records as one blob into buf (len must equal kvc_table_records_size) and
 * forget them. */
int kvc_table_records_drain(kvc_table *table, uint8_t *buf, size_t len);

/* Copy up to `cap` (key, value) pairs of the table into keys_out/values_out (slot order);
 * returns how many were written (kvc_table_size of them when cap is large enough). */
size_t kvc_table_export(const kvc_table *table, uint64_t *keys_out, uint64_t *values_out, size_t cap);

/* Forget pending records and the needs-snapshot flag (call after shipping a snapshot). */
void kvc_table_clear_pending(kvc_table *table);

/* ---- keyless view ---------------------------------------------------------------------- */

/* Build a view from a snapshot blob. Returns KVC_OK and sets *out, or a blob error code. */
int kvc_view_new(kvc_view **out, const uint8_t *blob, size_t len);

/* Free a view (NULL is allowed). */
void kvc_view_free(kvc_view *view);

/* A new view in the same state as ``src`` (an exact copy of its arrays: the same answers as
 * kvc_view_new on src's snapshot, without writing and parsing one). KVC_OK or KVC_ERR_NOMEM. */
int kvc_view_copy(kvc_view **out, const kvc_view *src);

/* Apply a record blob (same table, same epoch) or a snapshot blob (same table, epoch not older).
 * The whole blob is validated first; on any error the view is unchanged. */
int kvc_view_apply(kvc_view *view, const uint8_t *blob, size_t len);

/* Apply one update batch: blobs[i] (lens[i] bytes) to views[i], for i < n, in one call. Every
 * blob's header, checksum and table id are checked before any view changes. When every blob is a
 * record blob and no view is named twice, the rest of each (epoch, geometry, payload) is checked
 * too before anything is written, so a refused batch changes nothing. Otherwise (a snapshot among
 * them, a view named twice) they are then applied one after the other as kvc_view_apply would,
 * and the blobs before a refused one stay applied (records carry absolute state: harmless).
 * Returns KVC_OK, or the first refused blob's error with *failed set to its index; KVC_ERR_ARG
 * for a NULL view or pointer. */
int kvc_views_apply_batch(kvc_view *const *views, const uint8_t *const *blobs, const size_t *lens,
                          size_t n, size_t *failed);

/* Value stored for key; 0 for an empty slot, a fingerprint mismatch, or key >= 2^63. A key never
 * inserted may return a non-zero value (a false hit) unless fingerprints reject it. */
uint64_t kvc_view_lookup(const kvc_view *view, uint64_t key);

/* Batch lookup with software prefetching across the batch; values_out[i] as kvc_view_lookup. */
void kvc_view_lookup_many(const kvc_view *view, const uint64_t *keys, size_t n,
                          uint64_t *values_out);
/* kvc_view_lookup of keys[i] in views[i] (NULL: 0) for i < n, the reads overlapped as in
 * kvc_view_lookup_many. */
void kvc_view_lookup_multi(const kvc_view *const *views, const uint64_t *keys, size_t n, uint64_t *out);
/* kvc_view_lookup_multi, each view's header also fetched ahead: for reads spread over many views. */
void kvc_view_lookup_spread(const kvc_view *const *views, const uint64_t *keys, size_t n, uint64_t *out);

/* Epoch, table id, geometry and accounting of the view. */
uint64_t kvc_view_epoch(const kvc_view *view);
uint64_t kvc_view_table_id(const kvc_view *view);
uint64_t kvc_view_slots(const kvc_view *view);
unsigned kvc_view_value_bits(const kvc_view *view);
unsigned kvc_view_fingerprint_bits(const kvc_view *view);
/* Entries the table held when the view's snapshot was taken (records do not carry counts). */
uint64_t kvc_view_snapshot_entries(const kvc_view *view);
/* Buckets currently in the overflow map, and the map's capacity (it grows as needed). */
uint64_t kvc_view_overflow_count(const kvc_view *view);
uint64_t kvc_view_overflow_capacity(const kvc_view *view);
/* Bytes allocated by the view, everything included (struct, arrays, overflow map). */
uint64_t kvc_view_memory_bytes(const kvc_view *view);

/* A snapshot blob of the view's current state, in the table's snapshot format, so a peer can
 * build an identical view from it (an edge bootstrapping from another edge). Size first, then
 * write into a buffer of exactly that size (KVC_ERR_ARG otherwise). */
size_t kvc_view_snapshot_size(const kvc_view *view);
int kvc_view_snapshot_write(const kvc_view *view, uint8_t *buf, size_t len);

/* ---- blobs ------------------------------------------------------------------------------ */

/* Read a blob's header without the checksum: sets kind, table id and epoch. Returns KVC_OK or a
 * header error (TRUNCATED, MAGIC, VERSION). Use for routing; kvc_view_apply validates fully. */
int kvc_blob_peek(const uint8_t *blob, size_t len, unsigned *kind, uint64_t *table_id,
                  uint64_t *epoch);

/* ---- benchmark helpers (read the monotonic clock; not used by the index itself) ------------ */

/* Run n single operations (op 1 = insert, 2 = update, 3 = remove) one at a time; after each one
 * drain its records (or a snapshot after a rebuild) into `view` so it stays in sync, and store the
 * elapsed nanoseconds of op + sync in ns_out[i]. values may be NULL for remove. Returns KVC_OK or
 * the first error (ns_out filled up to it). */
int kvc_bench_table_ops(kvc_table *table, kvc_view *view, int op, const uint64_t *keys,
                        const uint64_t *values, size_t n, uint64_t *ns_out);

/* Time n single kvc_view_lookup calls; ns_out[i] = elapsed ns, sink receives the XOR of values. */
void kvc_bench_view_lookups(const kvc_view *view, const uint64_t *keys, size_t n,
                            uint64_t *ns_out, uint64_t *sink);

/* ---- the edge's per-request plan (ludo_plan.c) ---------------------------------------------- */

/* One edge lookup over every (shard, region group) view, in one call.
 *   views         [shards * groups]: views[s * groups + g] is group g's view of shard s, NULL where
 *                 the shard has no state yet (reads as a miss). A key is read on shard key % shards.
 *   keys          the prompt's keys, one per query length that fits the prompt (n_keys of them).
 *   level_lengths [groups * max_levels]: each group's lengths toward its region, ascending, 0 pads.
 *   level_keys    [groups * max_levels]: index into `keys` of each such length, -1 at the pads; a
 *                 group stops at the first index that is -1 or >= n_keys (the prompt is shorter).
 *   worker_group, worker_shift [workers]: each worker's group and its 2-bit field's bit shift.
 *   consistency   1: a worker's match is its unbroken run of hits from the shortest level (a hit
 *                 above a miss is a keyless-view false hit); a group's reads stop once every
 *                 field has missed. 0: the longest level with a hit (the paper's plain rule).
 *   values_out    [groups * max_levels] scratch, left holding the values read (0 = not read).
 *   matched_out   [workers]: the matched length, 0 = none; tier_out [workers]: the field there.
 * Returns KVC_OK, or KVC_ERR_ARG (no shard, a worker naming no group, a bad shift; the outputs
 * are then unspecified). */
int kvc_lookup_plan(const kvc_view *const *views, size_t shards, size_t groups,
                    const uint64_t *keys, size_t n_keys,
                    const int64_t *level_lengths, const int32_t *level_keys, size_t max_levels,
                    const int32_t *worker_group, const uint8_t *worker_shift, size_t workers,
                    int consistency, uint64_t *values_out,
                    int64_t *matched_out, uint8_t *tier_out);

/* Ablation flags of kvc_score_joint (set = the feature is on). */
enum kvc_score_flags {
    KVC_SCORE_LOAD_AWARE = 1,
    KVC_SCORE_TIER_AWARE = 2,
    KVC_SCORE_CROSS_REGION = 4
};

/* The joint score of every worker (paper section 3.4), bit-identical to JointScorer's numpy path:
 *   s_r = WAN_r + Tq_r + c_r * L + min(b_r * m_r, L) * (gamma * [t_r = DRAM] - c_r),
 *   c_r = beta_r * (1 + lam),  lam = min(lambda_max, min_r Tq_r / tau)   (0 without load awareness)
 * Without cross-region reuse the effective match is scaled by local_factor and remote_penalty is
 * added. eligible may be NULL (all eligible); an ineligible worker scores +inf. Writes scores_out
 * [n] and *lam_out; returns the index of the first minimum (the first NaN if any), -1 if n == 0. */
int64_t kvc_score_joint(size_t n, double prompt_len,
                        const double *wan, const double *beta, const double *queue,
                        const double *belief, const int64_t *matched, const uint8_t *tier,
                        const double *local_factor, const double *remote_penalty,
                        const uint8_t *eligible, double gamma, double lambda_max, double tau,
                        unsigned flags, double *scores_out, double *lam_out);

/* What the hot-prefix detector needs to know of a decision, as KVC_MISS_* bits:
 *   LOCAL_HOLDER  some local worker (local[i] != 0) has matched[i] > 0;
 *   LOST_TO_LOAD  there are local holders, the winner `chosen` is not one of them, and each would
 *                 have won with the winner's queue term: scores[i] - queue[i] + queue[chosen] <
 *                 scores[chosen] (evaluated in that order);
 *   REMOTE_WORTH  some remote worker's match reaches floors[i] (its region's first length).
 * Returns 0 if chosen >= n. */
enum kvc_miss_flags {
    KVC_MISS_LOCAL_HOLDER = 1,
    KVC_MISS_LOST_TO_LOAD = 2,
    KVC_MISS_REMOTE_WORTH = 4
};
unsigned kvc_miss_summary(size_t n, const int64_t *matched, const uint8_t *local,
                          const int64_t *floors, const double *scores, const double *queue,
                          size_t chosen);

/* CDEF-END */

#endif /* KVC_LUDO_H */
