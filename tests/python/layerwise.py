"""A layer-wise save through the Python package: a sender and a receiver
in one process over tcp on loopback. Run by tests/examples.rs as
    python3 tests/python/layerwise.py INIT_PORT ALLOC_PORT
(ASCEND_PD_LIB set). Checks:
- each layer is written into the prefill cache just before it is handed
  over (save_layer), so a gather before the hand-over would ship zeros;
- the receiver's `available` is False before the last layer, True after
  the save is done; the load brings every byte of every layer;
- a save closed before its last layer fails naming that layer, is not
  available, and both pools return to full;
- save_layer refuses a layer beyond the model, one handed twice, and a
  request without an open layer-wise save.
Prints one line per check; exits non-zero on any failure."""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import numpy as np  # noqa: E402

import ascend_pd as apd  # noqa: E402

LAYERS, BLOCKS, BLOCK, HEADS, HEAD, CHUNK = 3, 16, 8, 2, 16, 16
TOKENS = 45  # 3 chunks, the last partial
failures = 0


def report(ok, what):
    global failures
    print(f"ok   {what}" if ok else f"FAIL {what}", file=sys.stdout if ok else sys.stderr)
    if not ok:
        failures += 1


def expect(what, exc_type, needle, fn):
    try:
        fn()
    except exc_type as e:
        report(needle in e.message, f"{what}: {e.message}")
        return
    except Exception as e:  # noqa: BLE001 - report the wrong kind
        report(False, f"{what}: {type(e).__name__}: {e}")
        return
    report(False, f"{what}: no exception")


def wait_for(what, fn, seconds=60.0):
    """Polls `fn` until it returns something truthy (bounded, not timed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.005)
    report(False, f"{what}: nothing within {seconds} s")
    return None


def pattern(layer, plane, tokens):
    """The bytes of `tokens` tokens of (layer, plane): distinct per position."""
    t = np.arange(tokens, dtype=np.uint32)[:, None, None]
    h = np.arange(HEADS, dtype=np.uint32)[None, :, None]
    e = np.arange(HEAD, dtype=np.uint32)[None, None, :]
    v = (t * 131 + h * 37 + e * 3 + layer * 1009 + plane * 503 + 1) % 30000
    return v.astype(np.float16)


def main():
    init_port, alloc_port = int(sys.argv[1]), int(sys.argv[2])
    geometry = (
        "pd_buffer_size: 1048576\npd_buffer_device: \"cpu\"\nchunk_size: 16\n"
        f"kv_num_layers: {LAYERS}\nkv_num_heads: {HEADS}\nkv_head_size: {HEAD}\nkv_dtype: \"float16\"\n"
    )
    rcfg = apd.Config.from_yaml(
        "enable_pd: True\nlocal_cpu: False\ntransfer_channel: \"tcp\"\npd_role: \"receiver\"\n"
        f"pd_peer_host: \"127.0.0.1\"\npd_peer_init_port: {init_port}\npd_peer_alloc_port: {alloc_port}\n"
        + geometry
    )
    scfg = apd.Config.from_yaml(
        "enable_pd: True\nlocal_cpu: False\ntransfer_channel: \"tcp\"\npd_role: \"sender\"\n"
        "pd_layerwise: True\npd_peer_host: \"127.0.0.1\"\npd_proxy_host: \"127.0.0.1\"\npd_proxy_port: 9\n"
        + geometry
    )
    receiver, sender = apd.Receiver(rcfg), apd.Sender(scfg)
    r_start, s_start = receiver.pool_stats(), sender.pool_stats()
    kw = dict(layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK, hidden=HEADS * HEAD)
    pre = [np.zeros((BLOCKS, BLOCK, HEADS, HEAD), np.float16) for _ in range(2 * LAYERS)]
    dec = [np.zeros((BLOCKS, BLOCK, HEADS, HEAD), np.float16) for _ in range(2 * LAYERS)]
    pcache, dcache = apd.KVCache(pre, **kw), apd.KVCache(dec, **kw)
    # Slots scattered over the blocks, different on each side.
    pslots = [((3 + t // BLOCK * 5) % BLOCKS) * BLOCK + t % BLOCK for t in range(TOKENS)]
    dslots = [((1 + t // BLOCK * 3) % BLOCKS) * BLOCK + t % BLOCK for t in range(TOKENS)]
    keys = [f"py-lw-a@{i}" for i in range(3)]
    peer = ("127.0.0.1", init_port, alloc_port)

    def write_layer(layer):
        for plane in range(2):
            flat = pre[2 * layer + plane].reshape(BLOCKS * BLOCK, HEADS, HEAD)
            flat[pslots] = pattern(layer, plane, TOKENS)

    expect("save_layer without an open save", apd.InvalidArgument, "no layer-wise save open", lambda: sender.save_layer("py-lw-a", 0))
    sender.open_layered_save("py-lw-a", keys, pcache, pslots, *peer, is_last_prefill=False)
    expect("layer beyond the model", apd.InvalidArgument, "kv_num_layers", lambda: sender.save_layer("py-lw-a", LAYERS))
    expect("a negative layer", apd.InvalidArgument, "layer is -1", lambda: sender.save_layer("py-lw-a", -1))
    for layer in range(LAYERS):
        write_layer(layer)
        sender.save_layer("py-lw-a", layer)
        if layer == 0:
            expect("layer 0 twice", apd.InvalidArgument, "already handed over", lambda: sender.save_layer("py-lw-a", 0))
        if layer < LAYERS - 1:
            report(not receiver.available(keys), f"not available after layer {layer} of {LAYERS}")
    report(sender.close_layered_save("py-lw-a") is None, "close after every layer: none missing")
    done = wait_for("save of py-lw-a", sender.poll)
    report(bool(done) and [(c.req_id, c.status) for c in done] == [("py-lw-a", "done")], f"layer-wise save done: {done}")
    report(receiver.available(keys), "available after the last layer")
    receiver.submit_load("py-lw-a", keys, dcache, dslots)
    loaded = wait_for("load of py-lw-a", receiver.poll)
    report(bool(loaded) and loaded[0].status == "done", f"load done: {loaded}")
    bad = 0
    for layer in range(LAYERS):
        for plane in range(2):
            got = dec[2 * layer + plane].reshape(BLOCKS * BLOCK, HEADS, HEAD)[dslots]
            bad += int(np.count_nonzero(got.view(np.uint16) != pattern(layer, plane, TOKENS).view(np.uint16)))
    report(bad == 0, f"every loaded element matches ({LAYERS * 2 * TOKENS * HEADS * HEAD} elements, {bad} differ)")

    # Closed before its last layer: fails, nothing loadable, pools back.
    bkeys = [f"py-lw-b@{i}" for i in range(3)]
    sender.open_layered_save("py-lw-b", bkeys, pcache, pslots, *peer, is_last_prefill=False)
    sender.save_layer("py-lw-b", 0)
    sender.save_layer("py-lw-b", 2)
    missing = sender.close_layered_save("py-lw-b")
    report(missing == 1, f"close before layer 1: missing layer {missing}")
    done = wait_for("save of py-lw-b", sender.poll)
    report(
        bool(done) and done[0].status == "failed" and "layer 1" in done[0].message,
        f"save closed early failed: {done}",
    )
    report(not receiver.available(bkeys), "a save closed early is not available")
    r_end = wait_for("receiver pool back", lambda: (lambda s: s if s == r_start else None)(receiver.pool_stats()))
    report(r_end is not None and r_end.free == r_end.total, f"receiver pool back to full: {receiver.pool_stats()}")
    s_end = wait_for("sender pool back", lambda: (lambda s: s if s == s_start else None)(sender.pool_stats()))
    report(s_end is not None and s_end.free == s_end.total, f"sender pool back to full: {sender.pool_stats()}")

    sender.close()
    receiver.close()
    pcache.close()
    dcache.close()
    if failures:
        print(f"{failures} check(s) failed", file=sys.stderr)
        sys.exit(1)
    print("layerwise: OK")


if __name__ == "__main__":
    main()
