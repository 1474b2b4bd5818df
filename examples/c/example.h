/* Shared by the example prefill and decode workers: the geometry, the
 * request plan, the slot mappings and the byte pattern both sides agree
 * on (see examples/README.md). */
#ifndef APD_EXAMPLE_H
#define APD_EXAMPLE_H

#include "ascend_pd.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum {
    LAYERS = 2,
    PLANES = 2, /* K and V */
    NUM_BLOCKS = 64,
    BLOCK_SIZE = 16,
    HIDDEN = 32,                 /* 2 kv heads x head size 16 */
    TOKEN_BYTES = HIDDEN * 2,    /* float16 */
    CHUNK = 16,                  /* chunk_size */
    REQUESTS = 5,
    MAX_KEYS = 4,
    TENSOR_BYTES = NUM_BLOCKS * BLOCK_SIZE * TOKEN_BYTES,
};

static const int TOKENS[REQUESTS] = {40, 16, 33, 50, 20};

static int failures = 0;

#define FAIL(...)                         \
    do {                                  \
        fprintf(stderr, "FAIL ");         \
        fprintf(stderr, __VA_ARGS__);     \
        fprintf(stderr, "\n");            \
        failures++;                       \
    } while (0)

/* Exits with the library's message if a call failed. */
#define CHECK(call)                                                              \
    do {                                                                         \
        int32_t st_ = (call);                                                    \
        if (st_ != APD_OK) {                                                     \
            fprintf(stderr, "FAIL %s: status %d: %s\n", #call, st_, apd_last_error()); \
            exit(1);                                                             \
        }                                                                        \
    } while (0)

static inline int num_keys(int q) { return (TOKENS[q] + CHUNK - 1) / CHUNK; }

/* Keys of request q: "ex-req-<q>@<i>"; `store` holds the strings. */
static inline void request_keys(int q, char store[MAX_KEYS][32], const char *keys[MAX_KEYS]) {
    for (int i = 0; i < num_keys(q); i++) {
        snprintf(store[i], 32, "ex-req-%d@%d", q, i);
        keys[i] = store[i];
    }
}

static inline int64_t prefill_slot(int q, int t) {
    return (int64_t)(((q * 5 + t / BLOCK_SIZE) % NUM_BLOCKS) * BLOCK_SIZE + t % BLOCK_SIZE);
}

static inline int64_t decode_slot(int q, int t) {
    return (int64_t)(((q * 7 + 3 + t / BLOCK_SIZE) % NUM_BLOCKS) * BLOCK_SIZE + t % BLOCK_SIZE);
}

static inline uint8_t pattern(int q, int layer, int plane, int t, int b) {
    return (uint8_t)((q * 131 + layer * 31 + plane * 17 + t * 7 + b) & 0xff);
}

/* A zeroed host KV cache in vLLM's layout: one [blocks, block_size, heads,
 * head_size] tensor per layer and plane, wrapped for the library. */
static inline ApdKvCache make_cache(uint8_t *tensors[LAYERS * PLANES]) {
    ApdKvTensor t[LAYERS * PLANES];
    for (int i = 0; i < LAYERS * PLANES; i++) {
        tensors[i] = calloc(1, TENSOR_BYTES);
        t[i].addr = (uint64_t)(uintptr_t)tensors[i];
        t[i].bytes = TENSOR_BYTES;
    }
    ApdKvCacheDesc d = {APD_FMT_KV_2LTD, APD_DTYPE_FLOAT16, LAYERS, NUM_BLOCKS, BLOCK_SIZE, HIDDEN,
                        APD_DEVICE_CPU, t, LAYERS * PLANES, NULL};
    ApdKvCache cache;
    CHECK(apd_kv_cache_wrap(&d, &cache));
    return cache;
}

static inline void on_log(int32_t level, const char *target, const char *message, void *user) {
    (void)target;
    printf("%s log: %d %s\n", (const char *)user, level, message);
    fflush(stdout);
}

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static inline void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static inline int same_pools(const ApdPoolStats *a, const ApdPoolStats *b) {
    return a->total == b->total && a->free == b->free && a->allocated == b->allocated &&
           a->pinned == b->pinned && a->quarantined == b->quarantined;
}

#endif
