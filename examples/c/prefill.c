/* A prefill worker in C: writes five requests' KV into its own cache,
 * saves them to the decode worker without blocking, cancels one after its
 * save, and checks that every page came back to its pool.
 *   prefill CONFIG_YAML RECEIVER_HOST RECEIVER_INIT_PORT RECEIVER_ALLOC_PORT */
#define _POSIX_C_SOURCE 200809L
#include "example.h"

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: prefill CONFIG_YAML RECEIVER_HOST RECEIVER_INIT_PORT RECEIVER_ALLOC_PORT\n");
        return 2;
    }
    CHECK(apd_set_log_callback(on_log, "prefill", 2));
    ApdConfig cfg;
    CHECK(apd_config_from_file(argv[1], &cfg));
    uint64_t chunk = 0;
    CHECK(apd_config_chunk_size(cfg, &chunk));
    if (chunk != CHUNK) {
        fprintf(stderr, "FAIL the config's chunk_size is %llu, the example needs %d\n",
                (unsigned long long)chunk, CHUNK);
        return 1;
    }
    ApdSender sender;
    CHECK(apd_sender_start(cfg, 0, &sender));
    ApdPoolStats start;
    CHECK(apd_sender_pool_stats(sender, &start));

    /* The engine's cache, filled as a prefill would. */
    uint8_t *tensors[LAYERS * PLANES];
    ApdKvCache cache = make_cache(tensors);
    for (int q = 0; q < REQUESTS; q++) {
        for (int t = 0; t < TOKENS[q]; t++) {
            int64_t slot = prefill_slot(q, t);
            for (int l = 0; l < LAYERS; l++) {
                for (int p = 0; p < PLANES; p++) {
                    for (int b = 0; b < TOKEN_BYTES; b++) {
                        tensors[l * PLANES + p][slot * TOKEN_BYTES + b] = pattern(q, l, p, t, b);
                    }
                }
            }
        }
    }

    ApdPeer peer = {argv[2], (uint16_t)atoi(argv[3]), (uint16_t)atoi(argv[4])};
    for (int q = 0; q < REQUESTS; q++) {
        char store[MAX_KEYS][32];
        const char *keys[MAX_KEYS];
        request_keys(q, store, keys);
        int64_t slots[64];
        for (int t = 0; t < TOKENS[q]; t++) {
            slots[t] = prefill_slot(q, t);
        }
        char id[16];
        snprintf(id, sizeof id, "req-%d", q);
        CHECK(apd_sender_submit_save(sender, id, keys, (uint64_t)num_keys(q), cache, slots,
                                     (uint64_t)TOKENS[q], &peer, 1));
    }
    printf("prefill: 5 saves submitted\n");

    /* The step loop: poll, never block on the network. */
    int finished = 0;
    double deadline = now_s() + 60;
    while (finished < REQUESTS && now_s() < deadline) {
        ApdCompletion done[REQUESTS];
        uint64_t n = 0;
        CHECK(apd_sender_poll(sender, done, REQUESTS, &n));
        for (uint64_t i = 0; i < n; i++) {
            finished++;
            if (done[i].status != APD_REQ_DONE) {
                FAIL("save of %s ended with status %d: %s", done[i].req_id, done[i].status, done[i].message);
            } else {
                printf("prefill: save of %s done\n", done[i].req_id);
            }
        }
        sleep_ms(2);
    }
    if (finished < REQUESTS) {
        FAIL("only %d of %d saves finished in 60 s", finished, REQUESTS);
    }

    /* The client of req-2 went away after its prefill: the decode side drops its KV. */
    int32_t state = -1;
    CHECK(apd_sender_cancel(sender, "req-2", &state));
    if (state != APD_CANCEL_ALREADY_ENDED) {
        FAIL("cancel of req-2 after its save gave state %d", state);
    }

    /* Pull modes: wait for every PullDoneSignal, so every pinned page is free. */
    int32_t drained = 0;
    CHECK(apd_sender_drain(sender, 30000, &drained));
    if (!drained) {
        FAIL("pulls still pending after 30 s");
    }
    ApdPoolStats end;
    double until = now_s() + 10;
    do {
        CHECK(apd_sender_pool_stats(sender, &end));
    } while (!same_pools(&start, &end) && now_s() < until && (sleep_ms(10), 1));
    if (!same_pools(&start, &end) || end.free != end.total) {
        FAIL("the pools did not return to their start: %llu of %llu pages free, %llu pinned, %llu quarantined",
             (unsigned long long)end.free, (unsigned long long)end.total, (unsigned long long)end.pinned,
             (unsigned long long)end.quarantined);
    }

    CHECK(apd_sender_close(sender));
    CHECK(apd_kv_cache_free(cache));
    CHECK(apd_config_free(cfg));
    for (int i = 0; i < LAYERS * PLANES; i++) {
        free(tensors[i]);
    }
    if (failures) {
        fprintf(stderr, "prefill: %d check(s) failed\n", failures);
        return 1;
    }
    printf("prefill: OK 5 saves, 1 cancelled after save, pools back at start (%llu pages free)\n",
           (unsigned long long)end.free);
    return 0;
}
