/* Bad input through the C ABI: every call must fail with a status and a
 * message naming the argument, never crash. Run by tests/c_abi.rs as
 *   bad_input <init_port> <alloc_port>
 * (two free loopback ports for a real receiver). Exit 0 when every check
 * passed; each failed check prints one line to stderr. */
#include "ascend_pd.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;
static int log_calls = 0;
static int log_warnings = 0;

/* The call must return `want` and the last error must contain `needle`. */
static void expect(const char *what, int32_t got, int32_t want, const char *needle) {
    const char *msg = apd_last_error();
    if (got != want) {
        fprintf(stderr, "FAIL %s: status %d, want %d (message: %s)\n", what, got, want, msg);
        failures++;
        return;
    }
    if (needle && !strstr(msg, needle)) {
        fprintf(stderr, "FAIL %s: message \"%s\" does not name \"%s\"\n", what, msg, needle);
        failures++;
        return;
    }
    printf("ok   %s: %s\n", what, msg[0] ? msg : "(no message)");
}

static void on_log(int32_t level, const char *target, const char *message, void *user) {
    (void)target;
    (void)message;
    int *seen = (int *)user;
    ++*seen;
    log_calls++;
    if (level == 2) {
        log_warnings++;
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: bad_input <init_port> <alloc_port>\n");
        return 2;
    }
    int init_port = atoi(argv[1]);
    int alloc_port = atoi(argv[2]);

    if (apd_abi_version() != APD_ABI_VERSION) {
        fprintf(stderr, "FAIL abi version %u, header says %d\n", apd_abi_version(), APD_ABI_VERSION);
        failures++;
    }

    int seen = 0;
    expect("log level out of range", apd_set_log_callback(on_log, &seen, 9), APD_ERR_INVALID_ARGUMENT,
           "max_level");
    expect("log callback", apd_set_log_callback(on_log, &seen, 2), APD_OK, NULL);

    /* ---- configs */
    ApdConfig cfg = {0};
    expect("null yaml", apd_config_from_yaml(NULL, &cfg), APD_ERR_INVALID_ARGUMENT, "`yaml`");
    expect("null out_config", apd_config_from_yaml("pd_role: receiver", NULL), APD_ERR_INVALID_ARGUMENT,
           "`out_config`");
    expect("invalid config", apd_config_from_yaml("enable_pd: True\npd_role: bogus\n", &cfg), APD_ERR_CONFIG,
           "pd_role");
    expect("missing file", apd_config_from_file("/nonexistent/apd.yaml", &cfg), APD_ERR_CONFIG,
           "/nonexistent/apd.yaml");

    char yaml[1024];
    snprintf(yaml, sizeof yaml,
             "enable_pd: True\nlocal_cpu: False\ntransfer_channel: \"tcp\"\npd_role: \"receiver\"\n"
             "pd_peer_host: \"127.0.0.1\"\npd_peer_init_port: %d\npd_peer_alloc_port: %d\n"
             "pd_buffer_size: 1048576\npd_buffer_device: \"cpu\"\nchunk_size: 16\n"
             "kv_num_layers: 2\nkv_num_heads: 2\nkv_head_size: 16\nkv_dtype: \"float16\"\n"
             "a_key_nobody_knows: 1\n",
             init_port, alloc_port);
    int before = seen;
    expect("receiver config", apd_config_from_yaml(yaml, &cfg), APD_OK, NULL);
    if (seen == before || log_warnings == 0) {
        fprintf(stderr, "FAIL the unknown-key warning did not reach the log callback\n");
        failures++;
    } else {
        printf("ok   the unknown-key warning reached the log callback\n");
    }
    uint64_t chunk = 0;
    expect("chunk size", apd_config_chunk_size(cfg, &chunk), APD_OK, NULL);
    expect("chunk size null out", apd_config_chunk_size(cfg, NULL), APD_ERR_INVALID_ARGUMENT, "`out_tokens`");

    /* ---- KV caches: 2 layers x K/V, 8 blocks of 4 tokens, 32 float16 */
    enum { LAYERS = 2, BLOCKS = 8, BLOCK = 4, HIDDEN = 32 };
    size_t plane = (size_t)BLOCKS * BLOCK * HIDDEN * 2;
    unsigned char *mem = calloc(LAYERS * 2, plane);
    ApdKvTensor t[LAYERS * 2];
    for (int i = 0; i < LAYERS * 2; i++) {
        t[i].addr = (uint64_t)(uintptr_t)(mem + i * plane);
        t[i].bytes = plane;
    }
    ApdKvCacheDesc d = {APD_FMT_KV_2LTD, APD_DTYPE_FLOAT16, LAYERS, BLOCKS, BLOCK, HIDDEN,
                        APD_DEVICE_CPU, t, LAYERS * 2, NULL};
    ApdKvCache cache = {0};
    expect("null desc", apd_kv_cache_wrap(NULL, &cache), APD_ERR_INVALID_ARGUMENT, "`desc`");
    ApdKvCacheDesc bad = d;
    bad.tensors = NULL;
    expect("null tensors", apd_kv_cache_wrap(&bad, &cache), APD_ERR_INVALID_ARGUMENT, "`desc.tensors`");
    bad = d;
    bad.dtype = 42;
    expect("bad dtype", apd_kv_cache_wrap(&bad, &cache), APD_ERR_INVALID_ARGUMENT, "`desc.dtype`");
    bad = d;
    bad.fmt = 3;
    expect("bad fmt", apd_kv_cache_wrap(&bad, &cache), APD_ERR_INVALID_ARGUMENT, "`desc.fmt`");
    bad = d;
    bad.num_blocks = 0;
    expect("zero blocks", apd_kv_cache_wrap(&bad, &cache), APD_ERR_INVALID_ARGUMENT, "`desc.num_blocks`");
    bad = d;
    bad.device = -7;
    expect("bad device", apd_kv_cache_wrap(&bad, &cache), APD_ERR_INVALID_ARGUMENT, "`desc.device`");
    bad = d;
    bad.num_tensors = 3;
    expect("wrong tensor count", apd_kv_cache_wrap(&bad, &cache), APD_ERR_KV_CACHE, "3 tensor(s)");
    ApdKvTensor small[LAYERS * 2];
    memcpy(small, t, sizeof t);
    small[1].bytes = plane - 2;
    bad = d;
    bad.tensors = small;
    expect("tensor too small", apd_kv_cache_wrap(&bad, &cache), APD_ERR_KV_CACHE, "tensor 1 has");
    ApdKvTensor overlap[LAYERS * 2];
    memcpy(overlap, t, sizeof t);
    overlap[2].addr = t[1].addr + 64;
    bad = d;
    bad.tensors = overlap;
    expect("overlapping tensors", apd_kv_cache_wrap(&bad, &cache), APD_ERR_KV_CACHE, "overlap");
    ApdKvTensor nul[LAYERS * 2];
    memcpy(nul, t, sizeof t);
    nul[3].addr = 0;
    bad = d;
    bad.tensors = nul;
    expect("null tensor", apd_kv_cache_wrap(&bad, &cache), APD_ERR_KV_CACHE, "tensor 3 has a null address");
    expect("good cache", apd_kv_cache_wrap(&d, &cache), APD_OK, NULL);

    /* ---- strided caches: vLLM's CPU layout, one [BLOCKS, HEADS, BLOCK, 2 * HEAD]
     * tensor per layer; per (block, head) a cell of K's BLOCK x HEAD elements
     * stored transposed (element e of token t at e * BLOCK + t), then V's
     * token-major (at t * HEAD + e) */
    enum { HEADS = 2, HEAD = 16 };
    size_t region = (size_t)BLOCK * HEAD * 2; /* K's (or V's) part of a cell, in bytes */
    size_t layer_bytes = (size_t)BLOCKS * HEADS * 2 * region;
    unsigned char *layers_mem = calloc(LAYERS, layer_bytes);
    ApdKvTensor planes[LAYERS * 2];
    for (int l = 0; l < LAYERS; l++) {
        planes[2 * l].addr = (uint64_t)(uintptr_t)(layers_mem + l * layer_bytes);
        planes[2 * l].bytes = layer_bytes;
        planes[2 * l + 1].addr = planes[2 * l].addr + region;
        planes[2 * l + 1].bytes = layer_bytes - region;
    }
    ApdKvCacheDesc sd = d;
    sd.tensors = planes;
    sd.num_tensors = LAYERS * 2;
    /* {num_heads, head_size, block_stride, token_stride, head_stride, elem_stride} */
    ApdKvStrides st[2] = {
        {HEADS, HEAD, HEADS * 2 * region, 2, 2 * region, BLOCK * 2}, /* K: transposed */
        {HEADS, HEAD, HEADS * 2 * region, HEAD * 2, 2 * region, 0},  /* V: token-major */
    };
    ApdKvCache strided = {0};
    expect("strided: null strides", apd_kv_cache_wrap_strided(&sd, NULL, 2, &strided), APD_ERR_INVALID_ARGUMENT,
           "`strides`");
    expect("strided: no strides", apd_kv_cache_wrap_strided(&sd, st, 0, &strided), APD_ERR_INVALID_ARGUMENT,
           "`num_strides` is 0: pass 2 (K's strides, then V's) or 1 (shared by K and V)");
    expect("strided: three strides", apd_kv_cache_wrap_strided(&sd, st, 3, &strided), APD_ERR_INVALID_ARGUMENT,
           "`num_strides` is 3");
    expect("strided: null desc", apd_kv_cache_wrap_strided(NULL, st, 2, &strided), APD_ERR_INVALID_ARGUMENT,
           "`desc`");
    expect("strided: null out", apd_kv_cache_wrap_strided(&sd, st, 2, NULL), APD_ERR_INVALID_ARGUMENT,
           "`out_cache`");
    ApdKvStrides bst[2] = {st[0], st[1]};
    bst[1].num_heads = 0;
    expect("strided: zero heads", apd_kv_cache_wrap_strided(&sd, bst, 2, &strided), APD_ERR_INVALID_ARGUMENT,
           "`strides[1].num_heads`");
    bst[1] = st[1];
    bst[0].head_size = 8;
    expect("strided: heads do not make hidden", apd_kv_cache_wrap_strided(&sd, bst, 2, &strided),
           APD_ERR_INVALID_ARGUMENT, "`desc.hidden`");
    bst[0] = st[0];
    bst[1].token_stride = 3;
    expect("strided: unaligned stride", apd_kv_cache_wrap_strided(&sd, bst, 2, &strided), APD_ERR_KV_CACHE,
           "V plane: token_stride 3 is not a multiple of the 2-byte float16 element");
    bst[1] = st[1];
    bst[0].elem_stride = 4; /* K's element 1 of token 0 would be its element 0 of token 2 */
    expect("strided: K's elements alias", apd_kv_cache_wrap_strided(&sd, bst, 2, &strided), APD_ERR_KV_CACHE,
           "K plane: elem_stride 4 is smaller than the 8 bytes spanned by the dimensions of smaller stride "
           "(one element, token_stride): two elements of a plane would share bytes");
    bst[0] = st[0];
    bst[0].head_stride = region; /* K's head 1 would be V's head 0 */
    bst[1].head_stride = region;
    expect("strided: K and V share bytes", apd_kv_cache_wrap_strided(&sd, bst, 2, &strided), APD_ERR_KV_CACHE,
           "planes 0 (layer 0 K) and 1 (layer 0 V) overlap");
    ApdKvTensor short_planes[LAYERS * 2];
    memcpy(short_planes, planes, sizeof planes);
    short_planes[3].bytes = 8;
    ApdKvCacheDesc bsd = sd;
    bsd.tensors = short_planes;
    expect("strided: plane too small", apd_kv_cache_wrap_strided(&bsd, st, 2, &strided), APD_ERR_KV_CACHE,
           "plane 3 (layer 1 V) has 8 bytes");
    bsd = sd;
    bsd.num_tensors = LAYERS;
    expect("strided: one tensor per layer", apd_kv_cache_wrap_strided(&bsd, st, 2, &strided), APD_ERR_KV_CACHE,
           "2 plane(s) given: pass 4");
    expect("strided: good cache", apd_kv_cache_wrap_strided(&sd, st, 2, &strided), APD_OK, NULL);
    expect("strided: free", apd_kv_cache_free(strided), APD_OK, NULL);
    /* vLLM-Ascend's per-layer K and V as strides: one entry for both planes,
     * elem_stride 0 (contiguous). */
    ApdKvStrides ascend = {HEADS, HEAD, (uint64_t)BLOCK * HIDDEN * 2, HIDDEN * 2, HEAD * 2, 0};
    expect("strided: shared contiguous strides", apd_kv_cache_wrap_strided(&d, &ascend, 1, &strided), APD_OK,
           NULL);
    expect("strided: free shared", apd_kv_cache_free(strided), APD_OK, NULL);
    free(layers_mem);

    /* ---- handles */
    ApdSender not_a_sender = {cfg.id};
    int32_t state = -1;
    expect("config used as a sender", apd_sender_cancel(not_a_sender, "r", &state), APD_ERR_CLOSED,
           "is an ApdConfig, not an ApdSender");
    ApdSender null_sender = {0};
    expect("null handle", apd_sender_cancel(null_sender, "r", &state), APD_ERR_CLOSED, "null handle");
    ApdSender s = {0};
    expect("sender from a receiver config", apd_sender_start(cfg, 0, &s), APD_ERR_CONFIG, "`config` is a receiver config");

    ApdReceiver r = {0};
    expect("receiver start", apd_receiver_start(cfg, 0, &r), APD_OK, NULL);
    ApdPoolStats start;
    expect("pool stats", apd_receiver_pool_stats(r, &start), APD_OK, NULL);

    /* ---- a load with bad arguments: 20 tokens = 2 chunks of 16 */
    const char *keys[2] = {"req-a@0", "req-a@1"};
    int64_t slots[20];
    for (int i = 0; i < 20; i++) {
        slots[i] = i;
    }
    expect("null req_id", apd_receiver_submit_load(r, NULL, keys, 2, cache, slots, 20), APD_ERR_INVALID_ARGUMENT,
           "`req_id`");
    expect("empty req_id", apd_receiver_submit_load(r, "", keys, 2, cache, slots, 20), APD_ERR_INVALID_ARGUMENT,
           "`req_id`");
    char long_id[APD_REQ_ID_MAX + 8];
    memset(long_id, 'x', sizeof long_id - 1);
    long_id[sizeof long_id - 1] = 0;
    expect("req_id too long", apd_receiver_submit_load(r, long_id, keys, 2, cache, slots, 20),
           APD_ERR_INVALID_ARGUMENT, "APD_REQ_ID_MAX");
    expect("null keys", apd_receiver_submit_load(r, "req-a", NULL, 2, cache, slots, 20), APD_ERR_INVALID_ARGUMENT,
           "`keys`");
    const char *holey[2] = {"req-a@0", NULL};
    expect("null key", apd_receiver_submit_load(r, "req-a", holey, 2, cache, slots, 20), APD_ERR_INVALID_ARGUMENT,
           "`keys[1]`");
    const char *latin1[2] = {"req-a@0", "\xff\xfe"};
    expect("non-UTF-8 key", apd_receiver_submit_load(r, "req-a", latin1, 2, cache, slots, 20),
           APD_ERR_INVALID_ARGUMENT, "not UTF-8");
    expect("wrong key count", apd_receiver_submit_load(r, "req-a", keys, 1, cache, slots, 20),
           APD_ERR_INVALID_ARGUMENT, "`keys`");
    expect("null slot_mapping", apd_receiver_submit_load(r, "req-a", keys, 2, cache, NULL, 20),
           APD_ERR_INVALID_ARGUMENT, "`slot_mapping`");
    slots[17] = BLOCKS * BLOCK; /* one past the last slot */
    expect("slot beyond the cache", apd_receiver_submit_load(r, "req-a", keys, 2, cache, slots, 20),
           APD_ERR_INVALID_ARGUMENT, "slot_mapping");
    slots[17] = 17;
    ApdKvCache no_cache = {999999};
    expect("closed cache", apd_receiver_submit_load(r, "req-a", keys, 2, no_cache, slots, 20), APD_ERR_CLOSED,
           "ApdKvCache handle 999999");
    int32_t ready = -1;
    expect("available null ready", apd_receiver_available(r, keys, 2, NULL), APD_ERR_INVALID_ARGUMENT, "`ready`");
    expect("available", apd_receiver_available(r, keys, 2, &ready), APD_OK, NULL);
    if (ready != 0) {
        fprintf(stderr, "FAIL keys nobody sent are available\n");
        failures++;
    }
    /* The waits: bad arguments named, keys nobody sends time out (0), no load ends. */
    expect("wait_available null ready", apd_receiver_wait_available(r, keys, 2, 10, NULL),
           APD_ERR_INVALID_ARGUMENT, "`ready`");
    expect("wait_available no keys", apd_receiver_wait_available(r, keys, 0, 10, &ready),
           APD_ERR_INVALID_ARGUMENT, "keys");
    ready = -1;
    expect("wait_available", apd_receiver_wait_available(r, keys, 2, 20, &ready), APD_OK, NULL);
    if (ready != 0) {
        fprintf(stderr, "FAIL waiting for keys nobody sent said they are available\n");
        failures++;
    }
    int32_t ended = -1;
    expect("wait_ended null ended", apd_receiver_wait_ended(r, 10, NULL), APD_ERR_INVALID_ARGUMENT, "`ended`");
    expect("wait_ended", apd_receiver_wait_ended(r, 20, &ended), APD_OK, NULL);
    if (ended != 0) {
        fprintf(stderr, "FAIL wait_ended with no load said one ended\n");
        failures++;
    }
    uint64_t n = 99;
    ApdCompletion done[4];
    expect("poll null count", apd_receiver_poll(r, done, 4, NULL), APD_ERR_INVALID_ARGUMENT, "`count`");
    expect("poll null out", apd_receiver_poll(r, NULL, 4, &n), APD_ERR_INVALID_ARGUMENT, "`out`");
    expect("poll", apd_receiver_poll(r, done, 4, &n), APD_OK, NULL);
    if (n != 0) {
        fprintf(stderr, "FAIL %llu completions from nothing submitted\n", (unsigned long long)n);
        failures++;
    }
    expect("cancel unknown", apd_receiver_cancel(r, "req-z", keys, 2, &state), APD_OK, NULL);
    if (state != APD_CANCEL_UNKNOWN) {
        fprintf(stderr, "FAIL cancel of an unknown request gave state %d\n", state);
        failures++;
    }
    ApdPoolStats end;
    expect("pool stats again", apd_receiver_pool_stats(r, &end), APD_OK, NULL);
    if (memcmp(&start, &end, sizeof start) != 0 || end.free != end.total) {
        fprintf(stderr, "FAIL bad input changed the pool: %llu of %llu pages free\n",
                (unsigned long long)end.free, (unsigned long long)end.total);
        failures++;
    }

    /* ---- saves with bad peers (a push sender; nothing is ever sent) */
    ApdConfig scfg = {0};
    expect("sender config",
           apd_config_from_yaml("enable_pd: True\nlocal_cpu: False\ntransfer_channel: \"tcp\"\n"
                                "pd_role: \"sender\"\npd_peer_host: \"127.0.0.1\"\n"
                                "pd_proxy_host: \"127.0.0.1\"\npd_proxy_port: 9\n"
                                "pd_buffer_size: 1048576\npd_buffer_device: \"cpu\"\nchunk_size: 16\n"
                                "kv_num_layers: 2\nkv_num_heads: 2\nkv_head_size: 16\n"
                                "kv_dtype: \"float16\"\n",
                                &scfg),
           APD_OK, NULL);
    ApdSender snd = {0};
    expect("sender start", apd_sender_start(scfg, 0, &snd), APD_OK, NULL);
    ApdPeer peers[2] = {{"127.0.0.1", (uint16_t)init_port, (uint16_t)alloc_port},
                        {"127.0.0.2", (uint16_t)init_port, (uint16_t)alloc_port}};
    expect("save to no peers", apd_sender_submit_save_ranks(snd, "req-s", keys, 2, cache, slots, 20, peers, 0, 1),
           APD_ERR_INVALID_ARGUMENT, "`num_peers`");
    expect("save to null peers", apd_sender_submit_save_ranks(snd, "req-s", keys, 2, cache, slots, 20, NULL, 2, 1),
           APD_ERR_INVALID_ARGUMENT, "`peers`");
    expect("save to two hosts", apd_sender_submit_save_ranks(snd, "req-s", keys, 2, cache, slots, 20, peers, 2, 1),
           APD_ERR_INVALID_ARGUMENT, "`peers[1].host`");
    peers[1].host = "127.0.0.1";
    peers[1].alloc_port = 0;
    expect("save to a zero port", apd_sender_submit_save_ranks(snd, "req-s", keys, 2, cache, slots, 20, peers, 2, 1),
           APD_ERR_INVALID_ARGUMENT, "`peers[1]`");
    expect("save to a null peer", apd_sender_submit_save(snd, "req-s", keys, 2, cache, slots, 20, NULL, 1),
           APD_ERR_INVALID_ARGUMENT, "`peer`");
    peers[1].alloc_port = (uint16_t)alloc_port;
    slots[5] = -1; /* a padding slot: the save would ship a stale page's bytes */
    expect("save with a padding slot", apd_sender_submit_save(snd, "req-s", keys, 2, cache, slots, 20, &peers[0], 1),
           APD_ERR_INVALID_ARGUMENT, "token 5");
    slots[5] = 5;
    int32_t drained = -1;
    expect("drain without a time limit", apd_sender_drain(snd, UINT64_MAX, &drained), APD_OK, NULL);
    if (drained != 1) {
        fprintf(stderr, "FAIL drain(UINT64_MAX) with nothing pending says %d\n", drained);
        failures++;
    }
    ApdReqId released[4];
    n = 99;
    expect("poll released null count", apd_sender_poll_released(snd, released, 4, NULL), APD_ERR_INVALID_ARGUMENT,
           "`count`");
    expect("poll released null out", apd_sender_poll_released(snd, NULL, 4, &n), APD_ERR_INVALID_ARGUMENT, "`out`");
    expect("poll released from a config", apd_sender_poll_released(not_a_sender, released, 4, &n), APD_ERR_CLOSED,
           "is an ApdConfig, not an ApdSender");
    expect("poll released, nothing out", apd_sender_poll_released(snd, NULL, 0, &n), APD_OK, NULL);
    expect("poll released", apd_sender_poll_released(snd, released, 4, &n), APD_OK, NULL);
    if (n != 0) {
        fprintf(stderr, "FAIL %llu released saves from nothing submitted\n", (unsigned long long)n);
        failures++;
    }
    expect("sender close", apd_sender_close(snd), APD_OK, NULL);
    expect("poll released after close", apd_sender_poll_released(snd, released, 4, &n), APD_ERR_CLOSED,
           "ApdSender handle");
    expect("sender config free", apd_config_free(scfg), APD_OK, NULL);

    /* ---- closed handles */
    expect("receiver close", apd_receiver_close(r), APD_OK, NULL);
    expect("closed receiver", apd_receiver_available(r, keys, 2, &ready), APD_ERR_CLOSED, "closed");
    expect("closed receiver wait", apd_receiver_wait_ended(r, 10, &ended), APD_ERR_CLOSED, "closed");
    expect("closed twice", apd_receiver_close(r), APD_ERR_CLOSED, "ApdReceiver handle");
    expect("cache free", apd_kv_cache_free(cache), APD_OK, NULL);
    expect("cache freed twice", apd_kv_cache_free(cache), APD_ERR_CLOSED, "ApdKvCache handle");
    expect("config free", apd_config_free(cfg), APD_OK, NULL);
    expect("closed config", apd_receiver_start(cfg, 0, &r), APD_ERR_CLOSED, "ApdConfig handle");
    expect("log callback off", apd_set_log_callback(NULL, NULL, 0), APD_OK, NULL);
    free(mem);

    if (log_calls == 0) {
        fprintf(stderr, "FAIL the log callback was never called\n");
        failures++;
    }
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("all bad-input checks passed\n");
    return 0;
}
