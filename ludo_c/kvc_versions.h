/*
 * kvc_versions.h -- the simulator's shared edge views: one copy of each table version, shared
 * by every simulated edge at it.
 *
 * Without loss every edge applies the same blobs of a shard in the same order; edges differ only
 * by their delay from the shard. A set keeps, for each (shard, group) table, the versions some
 * edge is at (version k: after the table's k-th blob), each shared by the edges at it, and the
 * blobs between them; an edge's position on a shard is worked out when it reads (a batch
 * published at t has reached edge e once t + delay(s, e) <= now). kvc_vs_prepare brings the
 * tables a prompt's lookup reads to the reading edge's position and writes the versions into the
 * edge's pointer array (the lookup's kvc_view *[shards * groups]), so no other table is touched.
 * kvcompassd/sim/shared_views.py is the Python face and tells the whole policy; this file is its
 * hot path (no Python per table read, moved or made).
 *
 * Views in a set are its own: made by copy, snapshot or in place from another version, freed when
 * no edge is at them. Not thread-safe. Errors are the Ludo codes (ludo.h). KVC_ERR_ARG for a call
 * out of order or out of range, and kvc_vs_publish's refusal of a blob whose header is not a Ludo
 * blob's, change nothing. KVC_ERR_NOMEM, or a blob's own error while a version is made (a blob
 * kvc_view_apply refuses), can leave a table part-way through a move: the set is then good only
 * to be freed (the simulator stops on either).
 */
#ifndef KVC_VERSIONS_H
#define KVC_VERSIONS_H

#include <stddef.h>
#include <stdint.h>

#include "ludo.h"

/* CDEF-BEGIN */

typedef struct kvc_vs kvc_vs;

/* A set for `shards` x `groups` tables read by `edges` edges; every delay 0. */
int kvc_vs_new(kvc_vs **out, uint32_t shards, uint32_t groups, uint32_t edges);
void kvc_vs_free(kvc_vs *vs);

/* Edge e's pointer array (shards * groups slots, slot s * groups + g), kept current by every
 * call that moves one of its tables; and which groups its lookup reads at each query length
 * (offsets[i]..offsets[i + 1] into groups, n_lengths + 1 offsets). Both are copied or borrowed
 * as said: the pointer array is borrowed and must outlive the set's use of it. */
int kvc_vs_bind_edge(kvc_vs *vs, uint32_t edge, kvc_view **pointers, const uint32_t *offsets,
                     uint32_t n_lengths, const uint32_t *groups);

/* Seconds from shard s publishing to edge e having the batch. */
int kvc_vs_set_delay(kvc_vs *vs, uint32_t shard, uint32_t edge, double seconds);

/* The shard's initial state at batch seq base_seq: group's version 0, from a snapshot blob, for
 * every edge. Call once per (shard, group) before the shard's first batch. */
int kvc_vs_install(kvc_vs *vs, uint32_t shard, uint32_t group, int64_t base_seq, const uint8_t *blob,
                   size_t len);

/* Shard s published batch seq at `now` (the next seq after the last, else KVC_ERR_ARG), carrying
 * n blobs for groups[i] (copied). */
int kvc_vs_publish(kvc_vs *vs, uint32_t shard, int64_t seq, double now, uint32_t n, const uint32_t *groups,
                   const uint8_t *const *blobs, const size_t *lens);

/* The seq of the last batch of shard s that edge e has by `now` (and remembered as its position). */
int64_t kvc_vs_position(kvc_vs *vs, uint32_t edge, uint32_t shard, double now);

/* Bring the tables edge e's lookup reads for these query keys (keys[i] at query length i, on
 * shard keys[i] % shards) to its positions at `now`. */
int kvc_vs_prepare(kvc_vs *vs, uint32_t edge, const uint64_t *keys, uint32_t n_keys, double now);

/* Every table of edge e to its position at `now`. */
int kvc_vs_advance(kvc_vs *vs, uint32_t edge, double now);

/* Free the versions no edge needs by `now`: every edge behind what the most delayed edge has by
 * then moves to that version, together (one version per table). */
int kvc_vs_compact(kvc_vs *vs, double now);

/* Edge e's current version of (shard, group), NULL if not installed; valid until the next call
 * that moves or frees versions. */
const kvc_view *kvc_vs_view(const kvc_vs *vs, uint32_t edge, uint32_t shard, uint32_t group);

/* The remembered position of edge e on shard s (kvc_vs_position's last answer, or base_seq). */
int64_t kvc_vs_edge_seq(const kvc_vs *vs, uint32_t edge, uint32_t shard);

/* For inspection: edge e's version of (shard, group) (-1 if none); the table's live versions
 * and the edges at each, in the order they were made (up to cap of them; returns how many there
 * are); the version an edge at batch seq reads (-1 if none). */
int64_t kvc_vs_edge_version(const kvc_vs *vs, uint32_t edge, uint32_t shard, uint32_t group);
uint32_t kvc_vs_table_versions(const kvc_vs *vs, uint32_t shard, uint32_t group, int64_t *versions,
                               int64_t *refs, uint32_t cap);
int64_t kvc_vs_version_at(const kvc_vs *vs, uint32_t shard, uint32_t group, int64_t seq);

/* Table versions held; bytes of their views. */
uint64_t kvc_vs_live_versions(const kvc_vs *vs);
uint64_t kvc_vs_memory_bytes(const kvc_vs *vs);

/* CDEF-END */

#endif /* KVC_VERSIONS_H */
