/*
 * kvc_kvevents.h -- one C pass over an engine's KV-event payload (kvcompassd.engine.kvevents).
 *
 * SGLang and vLLM publish each batch as msgpack [ts, events, dp_rank], events as maps tagged
 * with "type", one event per block. kvc_kvevents_scan reads such a payload and writes the
 * events as *runs*, exactly as the Python decoder's coalescing (PayloadDecoder(coalesce=True),
 * kvevents._decode_coalesced) builds them: chained BlockStored events of one block size,
 * medium, LoRA and group (each one's parent the previous one's last block, whose blocks were
 * all full) as one run; BlockRemoved events of one medium and group as one run; each
 * AllBlocksCleared as its own run. Block hashes and token ids land in two flat arrays; a run
 * names its slices of them. No Python object is built per event or per block.
 *
 * The scan takes only the shapes the Python fast path takes (signed int64 hashes, token ids in
 * [0, 2^32), a positive block size, null-or-int lora_id, null-or-string medium and lora_name,
 * null-or-[0, 2^32) group_idx, valid UTF-8 everywhere, the payload consumed exactly). Anything
 * else -- the map form of a batch, positional events, byte hashes, uint64 hashes above 2^63,
 * EAGLE token pairs, ext types, malformed msgpack, an unknown event type -- answers
 * KVC_KVEVENTS_FALLBACK and writes nothing the caller may use: the caller decodes the payload
 * in Python, which accepts what the engines may also send and names every error.
 *
 * Everything between CDEF-BEGIN and CDEF-END is also fed to cffi's cdef: plain declarations only.
 */
#ifndef KVC_KVEVENTS_H
#define KVC_KVEVENTS_H

#include <stddef.h>
#include <stdint.h>

/* CDEF-BEGIN */

enum kvc_kvevents_answer {
    KVC_KVEVENTS_FALLBACK = -1  /* not a payload of the fast path's shapes: decode it in Python */
};

enum kvc_run_kind {
    KVC_RUN_STORED = 1,
    KVC_RUN_REMOVED = 2,
    KVC_RUN_CLEARED = 3
};

typedef struct {
    uint8_t kind;           /* KVC_RUN_STORED, KVC_RUN_REMOVED or KVC_RUN_CLEARED */
    uint8_t has_parent;     /* stored: parent_block_hash was an int (else null or absent) */
    uint8_t has_lora_id;    /* stored: lora_id was an int */
    uint8_t has_group;      /* stored, removed: group_idx was an int */
    uint32_t block_size;    /* stored */
    uint32_t group_idx;     /* when has_group */
    int64_t parent;         /* when has_parent: the run's first block's parent */
    int64_t lora_id;        /* when has_lora_id */
    uint32_t hash_start;    /* stored, removed: hashes_out[hash_start:hash_end] */
    uint32_t hash_end;
    uint32_t token_start;   /* stored: tokens_out[token_start:token_end] */
    uint32_t token_end;
    int64_t medium_off;     /* -1: null or absent; else the UTF-8 string payload[off:off+len] */
    uint32_t medium_len;
    int64_t lora_name_off;  /* stored: as medium_off */
    uint32_t lora_name_len;
} kvc_event_run;

/* Scan ``payload`` (``len`` bytes). On success returns the number of runs written to
 * ``runs_out`` (at most ``runs_cap``), with the batch's timestamp in ``*ts_out`` and its
 * dp_rank in ``*dp_rank_out`` (``*has_dp_rank_out`` 0 when null or absent); hashes and tokens
 * go to ``hashes_out`` / ``tokens_out`` (at most ``hashes_cap`` / ``tokens_cap``: a payload
 * holds at most ``len`` of each, every one taking at least a byte). Returns
 * KVC_KVEVENTS_FALLBACK for anything outside the fast path's shapes, or when a capacity is
 * exceeded; then nothing written is meaningful. Never reads outside payload[0:len]. */
int64_t kvc_kvevents_scan(const uint8_t *payload, size_t len, kvc_event_run *runs_out, size_t runs_cap,
                          int64_t *hashes_out, size_t hashes_cap, uint32_t *tokens_out, size_t tokens_cap,
                          double *ts_out, int64_t *dp_rank_out, int *has_dp_rank_out);

/* CDEF-END */

#endif /* KVC_KVEVENTS_H */
