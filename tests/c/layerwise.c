/* A layer-wise save through the C ABI, a prefill sender and a decode
 * receiver in one process over tcp on loopback. Run by tests/c_abi.rs as
 *   layerwise <init_port> <alloc_port> <pull_done_port>
 * (free loopback ports). Checks:
 * - the error paths of the layer-wise calls (no open save, bad layer,
 *   a layer twice, a host cache with save_layer_after, a null stream,
 *   close twice, open on a pull sender);
 * - a save whose layers are written into the cache one at a time, each
 *   just before it is handed over: not available at the receiver before
 *   the last layer, available after; loaded and every byte verified;
 * - a save closed before its last layer: fails naming the layer, nothing
 *   loadable, both pools back to where they started.
 * Exit 0 when every check passed; each failure prints a line to stderr. */
#define _POSIX_C_SOURCE 200809L
#include "example.h"

/* The call must return `want` and the last error must contain `needle`. */
static void expect(const char *what, int32_t got, int32_t want, const char *needle) {
    const char *msg = apd_last_error();
    if (got != want) {
        FAIL("%s: status %d, want %d (message: %s)", what, got, want, msg);
        return;
    }
    if (needle && !strstr(msg, needle)) {
        FAIL("%s: message \"%s\" does not name \"%s\"", what, msg, needle);
        return;
    }
    printf("ok   %s: %s\n", what, msg[0] ? msg : "(no message)");
}

/* Polls the sender until `id`'s save ends (60 s at most); its record in `out`. */
static int wait_save(ApdSender s, const char *id, ApdCompletion *out) {
    double deadline = now_s() + 60;
    while (now_s() < deadline) {
        uint64_t n = 0;
        CHECK(apd_sender_poll(s, out, 1, &n));
        if (n == 1) {
            if (strcmp(out->req_id, id) != 0) {
                FAIL("poll reported %s, waiting for %s", out->req_id, id);
                return 0;
            }
            return 1;
        }
        sleep_ms(2);
    }
    FAIL("the save of %s did not end in 60 s", id);
    return 0;
}

static int pools_back(ApdPoolStats (*stats)(void *), void *h, const ApdPoolStats *start) {
    double until = now_s() + 30;
    ApdPoolStats now = stats(h);
    while (!same_pools(start, &now) && now_s() < until) {
        sleep_ms(10);
        now = stats(h);
    }
    return same_pools(start, &now) && now.free == now.total;
}

static ApdPoolStats sender_stats(void *h) {
    ApdPoolStats s;
    CHECK(apd_sender_pool_stats(*(ApdSender *)h, &s));
    return s;
}

static ApdPoolStats receiver_stats(void *h) {
    ApdPoolStats s;
    CHECK(apd_receiver_pool_stats(*(ApdReceiver *)h, &s));
    return s;
}

static const char *GEOMETRY = "pd_buffer_size: 1048576\npd_buffer_device: \"cpu\"\nchunk_size: 16\n"
                              "kv_num_layers: 2\nkv_num_heads: 2\nkv_head_size: 16\nkv_dtype: \"float16\"\n";

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: layerwise <init_port> <alloc_port> <pull_done_port>\n");
        return 2;
    }
    int init_port = atoi(argv[1]);
    int alloc_port = atoi(argv[2]);
    int done_port = atoi(argv[3]);
    CHECK(apd_set_log_callback(on_log, "layerwise", 2));

    char yaml[2048];
    snprintf(yaml, sizeof yaml,
             "enable_pd: True\nlocal_cpu: False\ntransfer_channel: \"tcp\"\npd_role: \"receiver\"\n"
             "pd_peer_host: \"127.0.0.1\"\npd_peer_init_port: %d\npd_peer_alloc_port: %d\n%s",
             init_port, alloc_port, GEOMETRY);
    ApdConfig rcfg;
    CHECK(apd_config_from_yaml(yaml, &rcfg));
    ApdReceiver r;
    CHECK(apd_receiver_start(rcfg, 0, &r));
    snprintf(yaml, sizeof yaml,
             "enable_pd: True\nlocal_cpu: False\ntransfer_channel: \"tcp\"\npd_role: \"sender\"\n"
             "pd_layerwise: True\npd_peer_host: \"127.0.0.1\"\npd_proxy_host: \"127.0.0.1\"\n"
             "pd_proxy_port: 9\n%s",
             GEOMETRY);
    ApdConfig scfg;
    CHECK(apd_config_from_yaml(yaml, &scfg));
    ApdSender s;
    CHECK(apd_sender_start(scfg, 0, &s));
    ApdPoolStats s_start = sender_stats(&s), r_start = receiver_stats(&r);

    uint8_t *pre[LAYERS * PLANES], *dec[LAYERS * PLANES];
    ApdKvCache pcache = make_cache(pre), dcache = make_cache(dec);
    ApdPeer peer = {"127.0.0.1", (uint16_t)init_port, (uint16_t)alloc_port};

    /* Request 0 of the example plan: 40 tokens, 3 chunks. */
    const int q = 0;
    char store[MAX_KEYS][32];
    const char *keys[MAX_KEYS];
    request_keys(q, store, keys);
    uint64_t nk = (uint64_t)num_keys(q), nt = (uint64_t)TOKENS[q];
    int64_t pslots[64], dslots[64];
    for (int t = 0; t < TOKENS[q]; t++) {
        pslots[t] = prefill_slot(q, t);
        dslots[t] = decode_slot(q, t);
    }

    /* ---- error paths */
    expect("save_layer without an open save", apd_sender_save_layer(s, "lw-a", 0), APD_ERR_INVALID_ARGUMENT,
           "no layer-wise save open");
    expect("close without an open save", apd_sender_close_layered_save(s, "lw-a", NULL), APD_ERR_INVALID_ARGUMENT,
           "no layer-wise save open");
    expect("save_layer null req_id", apd_sender_save_layer(s, NULL, 0), APD_ERR_INVALID_ARGUMENT, "`req_id`");
    expect("open with a null peer", apd_sender_open_layered_save(s, "lw-a", keys, nk, pcache, pslots, nt, NULL, 0),
           APD_ERR_INVALID_ARGUMENT, "`peer`");
    expect("open with wrong keys", apd_sender_open_layered_save(s, "lw-a", keys, nk - 1, pcache, pslots, nt, &peer, 0),
           APD_ERR_INVALID_ARGUMENT, "`keys`");
    expect("open ranks with no peers",
           apd_sender_open_layered_save_ranks(s, "lw-a", keys, nk, pcache, pslots, nt, &peer, 0, 0),
           APD_ERR_INVALID_ARGUMENT, "`num_peers`");

    /* ---- a layer-wise save, each layer written just before it is handed over */
    expect("open", apd_sender_open_layered_save(s, "lw-a", keys, nk, pcache, pslots, nt, &peer, 0), APD_OK, NULL);
    expect("open twice", apd_sender_open_layered_save(s, "lw-a", keys, nk, pcache, pslots, nt, &peer, 0),
           APD_ERR_INVALID_ARGUMENT, "already has a layer-wise save open");
    expect("layer beyond the model", apd_sender_save_layer(s, "lw-a", LAYERS), APD_ERR_INVALID_ARGUMENT,
           "kv_num_layers");
    expect("save_layer_after on a host cache", apd_sender_save_layer_after(s, "lw-a", 0, (void *)&peer),
           APD_ERR_INVALID_ARGUMENT, "NPU");
    expect("save_layer_after with a null stream", apd_sender_save_layer_after(s, "lw-a", 0, NULL),
           APD_ERR_INVALID_ARGUMENT, "`stream`");
    for (int l = 0; l < LAYERS; l++) {
        for (int t = 0; t < TOKENS[q]; t++) {
            for (int p = 0; p < PLANES; p++) {
                for (int b = 0; b < TOKEN_BYTES; b++) {
                    pre[l * PLANES + p][pslots[t] * TOKEN_BYTES + b] = pattern(q, l, p, t, b);
                }
            }
        }
        expect("save layer", apd_sender_save_layer(s, "lw-a", (uint64_t)l), APD_OK, NULL);
        if (l == 0) {
            expect("layer 0 twice", apd_sender_save_layer(s, "lw-a", 0), APD_ERR_INVALID_ARGUMENT,
                   "already handed over");
            int32_t ready = -1;
            CHECK(apd_receiver_available(r, keys, nk, &ready));
            if (ready != 0) {
                FAIL("the request is available at the receiver before its last layer was handed over");
            } else {
                printf("ok   not available before the last layer\n");
            }
        }
    }
    int64_t missing = 42;
    expect("close", apd_sender_close_layered_save(s, "lw-a", &missing), APD_OK, NULL);
    if (missing != -1) {
        FAIL("close after every layer says layer %lld is missing", (long long)missing);
    }
    expect("close twice", apd_sender_close_layered_save(s, "lw-a", &missing), APD_ERR_INVALID_ARGUMENT,
           "no layer-wise save open");
    ApdCompletion c;
    if (wait_save(s, "lw-a", &c) && c.status != APD_REQ_DONE) {
        FAIL("layer-wise save ended with status %d: %s", c.status, c.message);
    }
    int32_t ready = 0;
    CHECK(apd_receiver_available(r, keys, nk, &ready));
    if (ready != 1) {
        FAIL("the request is not available after its save was done");
    } else {
        printf("ok   available after the last layer\n");
    }
    CHECK(apd_receiver_submit_load(r, "lw-a", keys, nk, dcache, dslots, nt));
    double deadline = now_s() + 60;
    uint64_t n = 0;
    while (n == 0 && now_s() < deadline) {
        CHECK(apd_receiver_poll(r, &c, 1, &n));
        if (n == 0) {
            sleep_ms(2);
        }
    }
    if (n != 1 || c.status != APD_REQ_DONE) {
        FAIL("load of lw-a: %llu record(s), status %d: %s", (unsigned long long)n, c.status, c.message);
    }
    long bad = 0, checked = 0;
    for (int l = 0; l < LAYERS; l++) {
        for (int p = 0; p < PLANES; p++) {
            for (int t = 0; t < TOKENS[q]; t++) {
                for (int b = 0; b < TOKEN_BYTES; b++) {
                    checked++;
                    if (dec[l * PLANES + p][dslots[t] * TOKEN_BYTES + b] != pattern(q, l, p, t, b)) {
                        bad++;
                    }
                }
            }
        }
    }
    if (bad) {
        FAIL("%ld of %ld loaded bytes differ from what the prefill wrote", bad, checked);
    } else {
        printf("ok   %ld loaded bytes match, every layer\n", checked);
    }

    /* ---- closed before the last layer: fails, nothing loadable, pools back */
    const char *bkeys[MAX_KEYS] = {"lw-b@0", "lw-b@1", "lw-b@2"};
    expect("open b", apd_sender_open_layered_save(s, "lw-b", bkeys, nk, pcache, pslots, nt, &peer, 0), APD_OK, NULL);
    expect("save b layer 0", apd_sender_save_layer(s, "lw-b", 0), APD_OK, NULL);
    missing = -7;
    expect("close b early", apd_sender_close_layered_save(s, "lw-b", &missing), APD_OK, NULL);
    if (missing != 1) {
        FAIL("close before layer 1 says the missing layer is %lld", (long long)missing);
    }
    if (wait_save(s, "lw-b", &c)) {
        if (c.status != APD_REQ_FAILED || !strstr(c.message, "layer 1")) {
            FAIL("save closed early ended with status %d: %s", c.status, c.message);
        } else {
            printf("ok   save closed early failed: %s\n", c.message);
        }
    }
    CHECK(apd_receiver_available(r, bkeys, nk, &ready));
    if (ready != 0) {
        FAIL("a save closed before its last layer is available at the receiver");
    }
    expect("save_layer after the save ended", apd_sender_save_layer(s, "lw-b", 1), APD_ERR_INVALID_ARGUMENT,
           "no layer-wise save open");
    if (!pools_back(sender_stats, &s, &s_start)) {
        FAIL("the sender's pool did not return to its start");
    } else {
        printf("ok   sender pool back to full\n");
    }
    if (!pools_back(receiver_stats, &r, &r_start)) {
        FAIL("the receiver's pool did not return to its start");
    } else {
        printf("ok   receiver pool back to full\n");
    }

    /* ---- a pull sender refuses a layer-wise save */
    snprintf(yaml, sizeof yaml,
             "enable_pd: True\nlocal_cpu: False\ntransfer_channel: \"tcp\"\npd_role: \"sender\"\n"
             "pd_pull_mode: True\npd_pull_done_port: %d\npd_peer_host: \"127.0.0.1\"\n"
             "pd_proxy_host: \"127.0.0.1\"\npd_proxy_port: 9\n%s",
             done_port, GEOMETRY);
    ApdConfig pcfg;
    CHECK(apd_config_from_yaml(yaml, &pcfg));
    ApdSender ps;
    CHECK(apd_sender_start(pcfg, 0, &ps));
    expect("open on a pull sender", apd_sender_open_layered_save(ps, "lw-c", keys, nk, pcache, pslots, nt, &peer, 0),
           APD_ERR_INVALID_ARGUMENT, "push mode");
    CHECK(apd_sender_close(ps));
    CHECK(apd_config_free(pcfg));

    CHECK(apd_sender_close(s));
    expect("save_layer on a closed sender", apd_sender_save_layer(s, "lw-a", 0), APD_ERR_CLOSED, "ApdSender");
    CHECK(apd_receiver_close(r));
    CHECK(apd_kv_cache_free(pcache));
    CHECK(apd_kv_cache_free(dcache));
    CHECK(apd_config_free(scfg));
    CHECK(apd_config_free(rcfg));
    for (int i = 0; i < LAYERS * PLANES; i++) {
        free(pre[i]);
        free(dec[i]);
    }
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("all layer-wise checks passed\n");
    return 0;
}
