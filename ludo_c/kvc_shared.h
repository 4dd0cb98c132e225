/*
 * kvc_shared.h -- a view in shared memory: one writer process keeps a view's arrays in a buffer
 * it shares (an "image"), reader processes map the same buffer and look keys up in it with the
 * ordinary kvc_view functions, and a sequence lock tells a reader that a write overlapped its read.
 *
 * Image: a header followed by the view's arrays (locator words, packed seeds, values, fingerprints
 * and an overflow map of fixed capacity), every section 64-byte aligned, native byte order (the
 * image never leaves the host). kvc_view_attach builds a kvc_view whose arrays ARE the image's, so
 * kvc_view_lookup*, kvc_lookup_plan and kvc_forward_decide read it as they read a private view.
 *
 * Writing: kvc_view_image_apply applies a record blob to an attached view in place. It never
 * reallocates: when the overflow map has no room left for the records it returns KVC_ERR_FULL and
 * changes nothing; the writer then writes a new image with more room (kvc_view_image_write from the
 * attached view) and switches readers over to it. Snapshots (a rebuilt or grown table) always make
 * a new image. Readers must bracket their reads with kvc_seq_read_begin / kvc_seq_read_valid on a
 * counter the writer bumps around every in-place write (kvc_seq_write_begin / _end): a read that
 * overlapped a write is repeated. A torn read may return garbage values but never reads outside
 * the image (every index is derived from the image's fixed geometry).
 *
 * Everything between CDEF-BEGIN and CDEF-END is also fed to cffi's cdef: plain declarations only.
 */
#ifndef KVC_SHARED_H
#define KVC_SHARED_H

#include <stddef.h>
#include <stdint.h>

#include "ludo.h"

/* CDEF-BEGIN */

/* Bytes an image of `view` takes with room for `overflow_room` more overflow-map buckets. */
size_t kvc_view_image_size(const kvc_view *view, uint64_t overflow_room);
/* Write the image into buf (len must be kvc_view_image_size(view, overflow_room), else KVC_ERR_ARG).
 * `view` may be a private or an attached view. */
int kvc_view_image_write(const kvc_view *view, uint8_t *buf, size_t len, uint64_t overflow_room);
/* A view over an image (validated: magic, sizes, sections inside len). The buffer must outlive the
 * view, and the view must be released with kvc_view_detach, never kvc_view_free nor kvc_view_apply.
 * A reader may attach a read-only mapping: only kvc_view_image_apply writes through the view. */
int kvc_view_attach(kvc_view **out, const uint8_t *buf, size_t len);
void kvc_view_detach(kvc_view *view);
/* Apply a record blob to an attached view in place (the writer's; bracket with the seqlock).
 * KVC_ERR_ARG for a snapshot blob (make a new image), KVC_ERR_FULL when the overflow map lacks
 * room (write a bigger image); every other code as kvc_view_apply's. Nothing changes on error. */
int kvc_view_image_apply(kvc_view *view, const uint8_t *blob, size_t len);
/* Overflow-map room left before kvc_view_image_apply would answer KVC_ERR_FULL. */
uint64_t kvc_view_overflow_room(const kvc_view *view);

/* Sequence lock over a 64-bit counter in shared memory (8-byte aligned). */
uint64_t kvc_seq_read_begin(const uint64_t *seq);          /* odd: a write is in progress */
int kvc_seq_read_valid(const uint64_t *seq, uint64_t start); /* 1: start was even and nothing was written since */
void kvc_seq_write_begin(uint64_t *seq);
void kvc_seq_write_end(uint64_t *seq);

/* CDEF-END */

#endif /* KVC_SHARED_H */
