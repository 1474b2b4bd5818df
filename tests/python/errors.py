"""Bad input through the Python package: each failure raises the
AscendPdError subclass of its status with the library's message, which
names the argument. Run by tests/examples.rs as
    python3 tests/python/errors.py INIT_PORT ALLOC_PORT
(ASCEND_PD_LIB set); prints one line per check and exits non-zero on any
failure."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import numpy as np  # noqa: E402

import ascend_pd as apd  # noqa: E402

failures = 0


def expect(what, exc_type, needle, fn):
    global failures
    try:
        fn()
    except exc_type as e:
        if needle in e.message:
            print(f"ok   {what}: {type(e).__name__}: {e.message}")
        else:
            print(f"FAIL {what}: {e.message!r} does not name {needle!r}", file=sys.stderr)
            failures += 1
        return
    except Exception as e:  # noqa: BLE001 - report the wrong kind
        print(f"FAIL {what}: {type(e).__name__}: {e}", file=sys.stderr)
        failures += 1
        return
    print(f"FAIL {what}: no exception", file=sys.stderr)
    failures += 1


def report(ok, what):
    global failures
    print(f"ok   {what}" if ok else f"FAIL {what}", file=sys.stdout if ok else sys.stderr)
    if not ok:
        failures += 1


class _FakeDevice:
    def __init__(self, type_: str, index: int) -> None:
        self.type = type_
        self.index = index

    def __repr__(self) -> str:
        return f"device(type='{self.type}', index={self.index})"


class _FakeNpuTensor:
    """What KVCache reads of a torch_npu tensor."""

    dtype = "torch.float16"

    def __init__(self, addr: int, numel: int, device: str = "npu") -> None:
        self._addr, self._numel = addr, numel
        self.device = _FakeDevice(device, 0)

    def data_ptr(self) -> int:
        return self._addr

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return 2

    def is_contiguous(self) -> bool:
        return True


def main():
    init_port, alloc_port = int(sys.argv[1]), int(sys.argv[2])
    expect("invalid config", apd.ConfigError, "pd_role", lambda: apd.Config.from_yaml("enable_pd: True\npd_role: bogus\n"))
    yaml = (
        "enable_pd: True\nlocal_cpu: False\ntransfer_channel: \"tcp\"\npd_role: \"receiver\"\n"
        f"pd_peer_host: \"127.0.0.1\"\npd_peer_init_port: {init_port}\npd_peer_alloc_port: {alloc_port}\n"
        "pd_buffer_size: 1048576\npd_buffer_device: \"cpu\"\nchunk_size: 16\n"
        "kv_num_layers: 2\nkv_num_heads: 2\nkv_head_size: 16\nkv_dtype: \"float16\"\n"
    )
    cfg = apd.Config.from_yaml(yaml)
    expect("sender from a receiver config", apd.ConfigError, "`config` is a receiver config", lambda: apd.Sender(cfg))
    tensors = [np.zeros((8, 4, 2, 16), np.float16) for _ in range(4)]
    geometry = dict(layers=2, num_blocks=8, block_size=4, hidden=32)
    expect(
        "tensor too small",
        apd.KVCacheError,
        "tensor 1 has",
        lambda: apd.KVCache([tensors[0], tensors[1][:4], tensors[2], tensors[3]], **geometry),
    )
    expect("wrong tensor count", apd.KVCacheError, "3 tensor(s)", lambda: apd.KVCache(tensors[:3], **geometry))
    cache = apd.KVCache(tensors, **geometry)
    # torch_npu tensors (their interface, faked: no NPU here). The default
    # device used to be the host, whatever the tensors: the first save then
    # took host memcpys from device addresses and crashed the process.
    npu = [_FakeNpuTensor(0x10000 + i * 0x10000, 8 * 4 * 32) for i in range(4)]
    expect(
        "NPU tensors wrapped as host memory",
        apd.InvalidArgument,
        "device=-1 (host memory) but tensors[0] is on NPU 0",
        lambda: apd.KVCache(npu, **geometry, device=-1),
    )
    expect(
        "host and NPU tensors in one cache",
        apd.InvalidArgument,
        "tensors[0] is on host memory but tensors[1] on NPU 0",
        lambda: apd.KVCache([tensors[0]] + npu[1:], **geometry),
    )
    expect(
        "NPU tensors on another NPU than given",
        apd.InvalidArgument,
        "device=1 (NPU 1) but tensors[0] is on NPU 0",
        lambda: apd.KVCache(npu, **geometry, device=1),
    )
    expect(
        "CUDA tensors",
        apd.InvalidArgument,
        "host memory and Ascend NPUs",
        lambda: apd.KVCache([_FakeNpuTensor(0x10000, 8, "cuda")] * 4, **geometry),
    )
    # Left out, the device is the tensors': NPU 0, which the library then
    # wraps as device memory (here, without an NPU runtime, it refuses by
    # name rather than taking the addresses as host memory).
    try:
        wrapped = apd.KVCache(npu, **geometry)
        ok = wrapped.device == 0
        detail = f"device {wrapped.device}"
        wrapped.close()
    except apd.AscendPdError as e:
        ok = "host" not in e.message.split(":")[0]
        detail = e.message
    report(ok, f"NPU tensors, device inferred: {detail}")
    # A strided cache: vLLM's CPU layout, one [blocks, heads, block_size,
    # 2 * head_size] tensor per layer; per (block, head) a cell of K's
    # elements transposed (e * block_size + t), then V's token-major.
    layer_tensors = [np.zeros((8, 2, 4, 2 * 16), np.float16) for _ in range(2)]
    region = 4 * 16 * 2  # K's (or V's) part of a (block, head) cell, in bytes
    planes = []
    for t in layer_tensors:
        base = t.__array_interface__["data"][0]
        planes += [(base, t.nbytes), (base + region, t.nbytes - region)]
    k_strides = (2 * 2 * region, 2, 2 * region, 4 * 2)  # block, token, head, element
    v_strides = (2 * 2 * region, 16 * 2, 2 * region)  # a head's elements contiguous
    cpu = dict(geometry, dtype="float16", strides=[k_strides, v_strides], num_heads=2)
    strided = apd.KVCache(planes, **cpu)
    want = ([(512, 2, 256, 8), (512, 32, 256, 2)], 2, 16)
    if (strided.strides, strided.num_heads, strided.head_size) != want:
        print(f"FAIL strided cache geometry {strided.strides!r}", file=sys.stderr)
        failures_add()
    else:
        print("ok   strided cache wrapped: vLLM's CPU layout, K and V strides")
    strided.close()
    # vLLM-Ascend's per-layer K and V as one 3-tuple shared by both planes.
    shared = apd.KVCache(tensors, **dict(geometry, strides=(4 * 32 * 2, 32 * 2, 16 * 2), head_size=16))
    if shared.strides != [(256, 64, 32, 2)] * 2:
        print(f"FAIL shared strides {shared.strides!r}", file=sys.stderr)
        failures_add()
    else:
        print("ok   strided cache wrapped: one 3-tuple shared by K and V")
    shared.close()
    shifted = [planes[0], (planes[0][0] + 2, planes[1][1]), planes[2], planes[3]]
    expect("strided: K and V share bytes", apd.KVCacheError, "overlap", lambda: apd.KVCache(shifted, **cpu))
    expect(
        "strided: K's elements alias",
        apd.KVCacheError,
        "K plane: elem_stride 4 is smaller than the 8 bytes spanned by the dimensions of smaller "
        "stride (one element, token_stride)",
        lambda: apd.KVCache(planes, **dict(cpu, strides=[(512, 2, 256, 4), v_strides])),
    )
    expect(
        "strided: unaligned stride",
        apd.KVCacheError,
        "V plane: token_stride 3 is not a multiple",
        lambda: apd.KVCache(planes, **dict(cpu, strides=[k_strides, (512, 3, 256)])),
    )
    expect(
        "strided: no head count",
        apd.InvalidArgument,
        "num_heads=",
        lambda: apd.KVCache(planes, **dict(cpu, num_heads=None)),
    )
    expect(
        "strided: not three or four strides",
        apd.InvalidArgument,
        "(block_stride, token_stride, head_stride)",
        lambda: apd.KVCache(planes, **dict(cpu, strides=(512, 32))),
    )
    expect(
        "strided: one entry per plane",
        apd.InvalidArgument,
        "strides has 3 entries: pass one per plane of a layer (2: K's, then V's)",
        lambda: apd.KVCache(planes, **dict(cpu, strides=[k_strides, v_strides, v_strides])),
    )
    receiver = apd.Receiver(cfg)
    start = receiver.pool_stats()
    keys = ["py-a@0", "py-a@1"]
    slots = list(range(20))
    expect("wrong key count", apd.InvalidArgument, "`keys`", lambda: receiver.submit_load("py-a", keys[:1], cache, slots))
    expect(
        "slot beyond the cache",
        apd.InvalidArgument,
        "slot_mapping",
        lambda: receiver.submit_load("py-a", keys, cache, slots[:17] + [32] + slots[18:]),
    )
    expect("empty req_id", apd.InvalidArgument, "`req_id`", lambda: receiver.submit_load("", keys, cache, slots))
    if receiver.available(keys):
        print("FAIL keys nobody sent are available", file=sys.stderr)
        failures_add()
    if receiver.pool_stats() != start:
        print("FAIL bad input changed the pool", file=sys.stderr)
        failures_add()
    # Ports are checked before anything is queued: one number 1 to 65535
    # each, or equally long lists (one per decode rank).
    scfg = apd.Config.from_yaml(
        yaml.replace('pd_role: "receiver"', 'pd_role: "sender"') + 'pd_proxy_host: "127.0.0.1"\npd_proxy_port: 9\n'
    )
    sender = apd.Sender(scfg)
    for what, exc_type, ports, needle in [
        ("port out of range", ValueError, (70000, alloc_port), "1 to 65535"),
        ("not a port", TypeError, ("x", alloc_port), "pass a port number"),
        ("a list and a port", TypeError, ([init_port], alloc_port), "both be lists"),
        ("lists of two lengths", ValueError, ([init_port, 1], [alloc_port]), "one of each per decode rank"),
        ("a zero port in a list", ValueError, ([init_port, 0], [alloc_port, 1]), "init_port[1] is 0"),
    ]:
        try:
            sender.submit_save("py-s", keys, cache, slots, "127.0.0.1", *ports)
        except exc_type as e:
            if needle in str(e):
                print(f"ok   {what}: {type(e).__name__}: {e}")
            else:
                print(f"FAIL {what}: {str(e)!r} does not name {needle!r}", file=sys.stderr)
                failures_add()
        except Exception as e:  # noqa: BLE001 - report the wrong kind
            print(f"FAIL {what}: {type(e).__name__}: {e}", file=sys.stderr)
            failures_add()
        else:
            print(f"FAIL {what}: no exception", file=sys.stderr)
            failures_add()
    if sender.poll():
        print("FAIL a refused save was queued", file=sys.stderr)
        failures_add()
    if sender.poll_released():
        print("FAIL a refused save was reported as released", file=sys.stderr)
        failures_add()
    expect(
        "save with a padding slot",
        apd.InvalidArgument,
        "token 5",
        lambda: sender.submit_save("py-s", keys, cache, slots[:5] + [-1] + slots[6:], "127.0.0.1", init_port, alloc_port),
    )
    expect("drain NaN", apd.InvalidArgument, "timeout_s", lambda: sender.drain(float("nan")))
    report(sender.drain(float("inf")), "drain(inf) with nothing pending returns True")
    sender.close()
    expect("poll_released on a closed sender", apd.ClosedHandle, "closed", sender.poll_released)
    scfg.close()
    # TP rank 1 sends to decode rank 1: a one-entry port list has no port for it.
    scfg = apd.Config.from_yaml(
        yaml.replace('pd_role: "receiver"', 'pd_role: "sender"')
        + 'pd_proxy_host: "127.0.0.1"\npd_proxy_port: 9\ntp_size: 2\n'
    )
    sender = apd.Sender(scfg, rank=1)
    expect(
        "a port list without the decode rank",
        apd.InvalidArgument,
        "decode rank 1",
        lambda: sender.submit_save("py-s", keys, cache, slots, "127.0.0.1", [init_port], [alloc_port]),
    )
    sender.close()
    scfg.close()
    receiver.close()
    expect("closed receiver", apd.ClosedHandle, "closed", lambda: receiver.available(keys))
    cache.close()
    cfg.close()
    if failures:
        print(f"{failures} check(s) failed", file=sys.stderr)
        sys.exit(1)
    print("all python bad-input checks passed")


def failures_add():
    global failures
    failures += 1


if __name__ == "__main__":
    main()
