/* kvc_arena.c -- edge views' memory on transparent huge pages (kvc_arena.h). */
#define _DEFAULT_SOURCE /* madvise */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kvc_arena.h"
#include "ludo_internal.h"

#define KVC_ARENA_UNIT 64u
#define KVC_ARENA_MAX_BLOCK ((size_t)256 << 10)
#define KVC_ARENA_CLASSES (KVC_ARENA_MAX_BLOCK / KVC_ARENA_UNIT)
#define KVC_ARENA_CHUNK ((size_t)32 << 20)
#define KVC_ARENA_HUGE_PAGE ((size_t)2 << 20)

typedef struct kvc_arena_chunk {
    struct kvc_arena_chunk *next;
    uint8_t *base, *end;
} kvc_arena_chunk;

static struct {
    pthread_mutex_t lock;
    int enabled;
    kvc_arena_chunk *chunks; /* every chunk: a block is the arena's if it lies in one */
    uint8_t *bump, *bump_end;
    void *free_list[KVC_ARENA_CLASSES + 1]; /* by size in 64-byte units; a freed block's first word links */
    kvc_arena_stats stats;
} arena = {PTHREAD_MUTEX_INITIALIZER, 0, NULL, NULL, NULL, {NULL}, {0, 0, 0, 0, 0}};

int kvc_arena_set_enabled(int enabled)
{
    pthread_mutex_lock(&arena.lock);
    int was = arena.enabled;
    arena.enabled = enabled != 0;
    pthread_mutex_unlock(&arena.lock);
    return was;
}

void kvc_arena_get_stats(kvc_arena_stats *out)
{
    pthread_mutex_lock(&arena.lock);
    *out = arena.stats;
    out->enabled = (uint64_t)arena.enabled;
    pthread_mutex_unlock(&arena.lock);
}

static int kvc_arena_owns(const void *p)
{
    for (const kvc_arena_chunk *c = arena.chunks; c; c = c->next)
        if ((const uint8_t *)p >= c->base && (const uint8_t *)p < c->end)
            return 1;
    return 0;
}

/* A new chunk to bump from (the old one's tail, less than a block, is left unused). */
static int kvc_arena_grow(void)
{
    kvc_arena_chunk *c = malloc(sizeof *c);
    void *base = NULL;
    if (!c || posix_memalign(&base, KVC_ARENA_HUGE_PAGE, KVC_ARENA_CHUNK) != 0) {
        free(c);
        return 0;
    }
#ifdef MADV_HUGEPAGE
    madvise(base, KVC_ARENA_CHUNK, MADV_HUGEPAGE); /* advice only: refused, the chunk has 4 KiB pages */
#endif
    c->base = base;
    c->end = c->base + KVC_ARENA_CHUNK;
    c->next = arena.chunks;
    arena.chunks = c;
    arena.bump = c->base;
    arena.bump_end = c->end;
    arena.stats.reserved += KVC_ARENA_CHUNK;
    arena.stats.chunks++;
    return 1;
}

void *kvc_arena_alloc(size_t bytes, int zero)
{
    size_t units = (bytes + KVC_ARENA_UNIT - 1) / KVC_ARENA_UNIT;
    if (units == 0)
        units = 1;
    pthread_mutex_lock(&arena.lock);
    if (!arena.enabled || units > KVC_ARENA_CLASSES) {
        pthread_mutex_unlock(&arena.lock);
        return kvc_alloc(bytes, zero);
    }
    size_t size = units * KVC_ARENA_UNIT;
    void *p = arena.free_list[units];
    if (p) {
        memcpy(&arena.free_list[units], p, sizeof(void *));
        arena.stats.kept -= size;
    } else {
        if ((size_t)(arena.bump_end - arena.bump) < size && !kvc_arena_grow()) {
            pthread_mutex_unlock(&arena.lock);
            return kvc_alloc(bytes, zero); /* no chunk to be had: the ordinary allocator */
        }
        p = arena.bump;
        arena.bump += size;
    }
    arena.stats.live += size;
    pthread_mutex_unlock(&arena.lock);
    if (zero)
        memset(p, 0, bytes);
    return p;
}

void kvc_arena_free(void *p, size_t bytes)
{
    if (!p)
        return;
    size_t units = (bytes + KVC_ARENA_UNIT - 1) / KVC_ARENA_UNIT;
    if (units == 0)
        units = 1;
    pthread_mutex_lock(&arena.lock);
    if (units > KVC_ARENA_CLASSES || !kvc_arena_owns(p)) {
        pthread_mutex_unlock(&arena.lock);
        free(p);
        return;
    }
    memcpy(p, &arena.free_list[units], sizeof(void *));
    arena.free_list[units] = p;
    arena.stats.live -= units * KVC_ARENA_UNIT;
    arena.stats.kept += units * KVC_ARENA_UNIT;
    pthread_mutex_unlock(&arena.lock);
}
