/* A decode worker in C: waits for each request's KV, loads it into its
 * own cache without blocking, cancels one request, verifies every byte,
 * and checks that every page came back to its pool.
 *   decode CONFIG_YAML      (stdin: closed by the launcher once the prefill is done) */
#define _POSIX_C_SOURCE 200809L
#include "example.h"

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: decode CONFIG_YAML\n");
        return 2;
    }
    CHECK(apd_set_log_callback(on_log, "decode", 2));
    ApdConfig cfg;
    CHECK(apd_config_from_file(argv[1], &cfg));
    ApdReceiver receiver;
    CHECK(apd_receiver_start(cfg, 0, &receiver));
    ApdPoolStats start;
    CHECK(apd_receiver_pool_stats(receiver, &start));
    printf("decode: ready\n");
    fflush(stdout);

    uint8_t *tensors[LAYERS * PLANES];
    ApdKvCache cache = make_cache(tensors);
    /* Which slots hold a loaded request's token (for the stray-write check). */
    static int owner[NUM_BLOCKS * BLOCK_SIZE];
    memset(owner, -1, sizeof owner);

    const int order[4] = {0, 1, 3, 4};
    int loaded = 0;
    for (int k = 0; k < 4; k++) {
        int q = order[k];
        char store[MAX_KEYS][32];
        const char *keys[MAX_KEYS];
        request_keys(q, store, keys);
        char id[16];
        snprintf(id, sizeof id, "req-%d", q);
        int32_t ready = 0;
        double deadline = now_s() + 60;
        while (!ready && now_s() < deadline) {
            CHECK(apd_receiver_available(receiver, keys, (uint64_t)num_keys(q), &ready));
            if (!ready) {
                sleep_ms(5);
            }
        }
        if (!ready) {
            FAIL("%s never became available", id);
            continue;
        }
        if (q == 4) {
            /* The scheduler aborted req-4: drop its KV here (its sender's pins come back). */
            int32_t state = -1;
            CHECK(apd_receiver_cancel(receiver, id, keys, (uint64_t)num_keys(q), &state));
            printf("decode: %s cancelled (state %d)\n", id, state);
            continue;
        }
        int64_t slots[64];
        for (int t = 0; t < TOKENS[q]; t++) {
            slots[t] = decode_slot(q, t);
        }
        CHECK(apd_receiver_submit_load(receiver, id, keys, (uint64_t)num_keys(q), cache, slots,
                                       (uint64_t)TOKENS[q]));
        int finished = 0;
        deadline = now_s() + 60;
        while (!finished && now_s() < deadline) {
            ApdCompletion done[1];
            uint64_t n = 0;
            CHECK(apd_receiver_poll(receiver, done, 1, &n));
            if (n == 1) {
                finished = 1;
                if (done[0].status != APD_REQ_DONE || strcmp(done[0].req_id, id) != 0) {
                    FAIL("load of %s ended with status %d: %s", done[0].req_id, done[0].status, done[0].message);
                } else {
                    loaded++;
                    for (int t = 0; t < TOKENS[q]; t++) {
                        owner[slots[t]] = q * 1000 + t;
                    }
                }
            } else {
                sleep_ms(2);
            }
        }
        if (!finished) {
            FAIL("load of %s did not finish in 60 s", id);
        }
    }

    /* Every byte: the pattern at a loaded request's slots, zero elsewhere. */
    uint64_t checked = 0, wrong = 0;
    for (int l = 0; l < LAYERS; l++) {
        for (int p = 0; p < PLANES; p++) {
            const uint8_t *tensor = tensors[l * PLANES + p];
            for (int slot = 0; slot < NUM_BLOCKS * BLOCK_SIZE; slot++) {
                for (int b = 0; b < TOKEN_BYTES; b++) {
                    uint8_t want = 0;
                    if (owner[slot] >= 0) {
                        want = pattern(owner[slot] / 1000, l, p, owner[slot] % 1000, b);
                    }
                    if (tensor[(size_t)slot * TOKEN_BYTES + b] != want) {
                        if (wrong++ < 5) {
                            FAIL("layer %d plane %d slot %d byte %d: %u, want %u", l, p, slot, b,
                                 tensor[(size_t)slot * TOKEN_BYTES + b], want);
                        }
                    }
                    checked++;
                }
            }
        }
    }
    if (wrong) {
        FAIL("%llu of %llu cache bytes wrong", (unsigned long long)wrong, (unsigned long long)checked);
    }

    /* Stay up until the prefill is done (it needs us for its PullDoneSignals). */
    char buf[256];
    while (fread(buf, 1, sizeof buf, stdin) > 0) {
    }
    ApdPoolStats end;
    double until = now_s() + 20;
    do {
        CHECK(apd_receiver_pool_stats(receiver, &end));
    } while (!(same_pools(&start, &end) && end.free == end.total) && now_s() < until && (sleep_ms(10), 1));
    if (!same_pools(&start, &end) || end.free != end.total) {
        FAIL("the pools did not return to their start: %llu of %llu pages free, %llu pinned, %llu quarantined",
             (unsigned long long)end.free, (unsigned long long)end.total, (unsigned long long)end.pinned,
             (unsigned long long)end.quarantined);
    }
    CHECK(apd_receiver_close(receiver));
    CHECK(apd_kv_cache_free(cache));
    CHECK(apd_config_free(cfg));
    for (int i = 0; i < LAYERS * PLANES; i++) {
        free(tensors[i]);
    }
    if (failures) {
        fprintf(stderr, "decode: %d check(s) failed\n", failures);
        return 1;
    }
    printf("decode: OK %d loads verified (%llu bytes checked), 1 cancelled here, 1 cancelled by the prefill\n",
           loaded, (unsigned long long)checked);
    return 0;
}
