"""The connector's pieces without engines: settings, keys, slots, the
hand-off's validation, and the KV layouts against the kernel that writes
them (vLLM's own CPU attention op) moved through the library."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, List

import pytest
import torch

from ascend_pd import Config, ConfigError, KVCache, Receiver, Sender
from ascend_pd.vllm import settings
from ascend_pd.vllm.keys import chunk_keys, model_tag
from ascend_pd.vllm.layout import LayoutError, describe
from ascend_pd.vllm.scheduler import receiver_address, slots_for
from harness import free_port


def _yaml(tmp: Path, text: str) -> str:
    p = tmp / "c.yaml"
    p.write_text(text)
    return str(p)


def test_roles_must_agree_and_errors_name_the_key(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "pd_role: receiver\ntransfer_channel: tcp\n")
    s = settings.load("kv_consumer", {"config": path})
    assert s.pd_role == "receiver" and s.mode == "push"
    with pytest.raises(ConfigError, match="pd_role is 'receiver' but kv_role is 'kv_producer'"):
        settings.load("kv_producer", {"config": path})
    with pytest.raises(ConfigError, match='no "config"'):
        settings.load("kv_producer", {})
    with pytest.raises(ConfigError, match="unknown key"):
        settings.load("kv_consumer", {"config": path, "confg": 1})
    with pytest.raises(ConfigError, match="cannot be read"):
        settings.load("kv_consumer", {"config": str(tmp_path / "missing.yaml")})
    # load_wait_ms: 20 ms unless set, 0 turns the in-step wait off, the rest is refused by name.
    assert s.load_wait_s == 0.02
    assert settings.load("kv_consumer", {"config": path, "load_wait_ms": 0}).load_wait_s == 0.0
    assert settings.load("kv_consumer", {"config": path, "load_wait_ms": 5}).load_wait_s == 0.005
    for bad in (-1, 1001, "20", True):
        with pytest.raises(ConfigError, match="load_wait_ms is .*: pass milliseconds from 0"):
            settings.load("kv_consumer", {"config": path, "load_wait_ms": bad})


def test_a_model_key_contradicting_vllm_is_named(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "pd_role: sender\nkv_num_layers: 32\nkv_dtype: float32\n")
    s = settings.load("kv_producer", {"config": path})
    shape = settings.ModelShape(4, 2, 64, "float32", False, 1, 0, "m")
    with pytest.raises(ConfigError, match="kv_num_layers is 32 in the YAML but vLLM's model has 4"):
        settings.check_model_keys(s, shape)
    ok = settings.load("kv_producer", {"config": _yaml(
        tmp_path, "enable_pd: true\npd_role: sender\nkv_num_layers: 4\npd_buffer_device: cpu\n"
        "pd_buffer_size: 1048576\npd_peer_host: 127.0.0.1\n")})
    settings.check_model_keys(ok, shape)
    # The library accepts what the connector generates.
    Config.from_yaml(ok.role_yaml("sender", shape)).close()


def test_kv_both_starts_from_one_yaml_as_sender_and_receiver(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "enable_pd: true\npd_role: both\ntransfer_channel: tcp\npd_buffer_device: cpu\n"
                 "pd_buffer_size: 1048576\npd_peer_host: 127.0.0.1\npd_peer_init_port: 17300\n"
                 "pd_peer_alloc_port: 17400\n")
    s = settings.load("kv_both", {"config": path})
    shape = settings.ModelShape(4, 2, 64, "float32", False, 1, 0, "m")
    for role in ("sender", "receiver"):
        Config.from_yaml(s.role_yaml(role, shape)).close()


def test_keys_are_prefix_chained_and_content_derived() -> None:
    tag = model_tag("m", 4, 2, 64, "float32", False, 4)
    a = chunk_keys(tag, list(range(10)), 4)
    b = chunk_keys(tag, list(range(8)) + [99, 98, 97], 4)
    assert len(a) == 3 and len(b) == 3
    assert a[:2] == b[:2] and a[2] != b[2]
    # A different first chunk changes every later key (chained).
    c = chunk_keys(tag, [5] + list(range(1, 10)), 4)
    assert all(x != y for x, y in zip(a, c))
    # Another model: other keys.
    assert chunk_keys(model_tag("other", 4, 2, 64, "float32", False, 4), list(range(10)), 4)[0] != a[0]


def test_slots_follow_the_block_table_and_skip_what_is_held() -> None:
    assert slots_for([5, 2], 4, 6) == (20, 21, 22, 23, 8, 9)
    assert slots_for([5, 2], 4, 6, skip=4) == (-1, -1, -1, -1, 8, 9)
    with pytest.raises(ValueError, match="need 3 blocks"):
        slots_for([5, 2], 4, 9)


def test_the_receiver_address_is_checked() -> None:
    a = receiver_address({"receiver_host": "h", "receiver_init_port": [1, 2], "receiver_alloc_port": [3, 4]})
    assert a.init_ports == (1, 2) and a.alloc_ports == (3, 4)
    with pytest.raises(ValueError, match="receiver_host"):
        receiver_address({"receiver_init_port": [1], "receiver_alloc_port": [2]})
    with pytest.raises(ValueError, match="one of each per decode TP rank"):
        receiver_address({"receiver_host": "h", "receiver_init_port": [1, 2], "receiver_alloc_port": [3]})
    with pytest.raises(ValueError, match="1 to 65535"):
        receiver_address({"receiver_host": "h", "receiver_init_port": [0], "receiver_alloc_port": [3]})


def test_unknown_layouts_are_refused_by_name() -> None:
    with pytest.raises(LayoutError, match="not a layout ascend-pd knows"):
        describe([torch.zeros(4, 4, 4)], "FOO", 2, 2, False)
    with pytest.raises(LayoutError, match="'amx' kernel"):
        describe([torch.zeros(2, 2, 32, 128)], "CPU_ATTN", 2, 64, False, isa="amx")


def test_stacked_and_permuted_and_mla_layouts_read_their_strides() -> None:
    es = 4
    # Stacked [2, num_blocks, block_size, heads, head] (NHD).
    t = torch.zeros(2, 8, 16, 2, 64)
    lay = describe([t, torch.zeros_like(t)], "FLASH_ATTN", 2, 64, False)
    assert lay.planes[1][0] - lay.planes[0][0] == 8 * 16 * 2 * 64 * es
    assert lay.strides == ((16 * 128 * es, 128 * es, 64 * es, es),) * 2
    # The same logical shape with heads outside tokens (HND) is read, not assumed.
    hnd = torch.zeros(2, 8, 2, 16, 64).permute(0, 1, 3, 2, 4)
    lay = describe([hnd], "FLASH_ATTN", 2, 64, False)
    assert lay.strides[0] == (2 * 16 * 64 * es, 64 * es, 16 * 64 * es, es)
    # MLA: one latent plane per layer.
    lay = describe([torch.zeros(8, 16, 576)], "MLA", 1, 576, True)
    assert lay.fmt == "mla" and len(lay.planes) == 1 and lay.num_heads == 1 and lay.head_size == 576


# ------------------------------------------------------- layouts, for real

NB, H, BS, HS, L = 6, 2, 128, 64, 3


def _wrap(caches: List[Any], backend: str) -> KVCache:
    lay = describe(caches, backend, H, HS, False, isa="vec")
    return KVCache(list(lay.planes), fmt="kv", dtype=lay.dtype, layers=lay.layers, num_blocks=lay.num_blocks,
                   block_size=lay.block_size, hidden=lay.hidden, strides=list(lay.strides),
                   num_heads=lay.num_heads, head_size=lay.head_size)


def _pair(channel: str) -> Any:
    init, alloc = free_port(), free_port()
    common = (f"enable_pd: true\ntransfer_channel: {channel}\npd_buffer_device: cpu\npd_buffer_size: {32 << 20}\n"
              f"chunk_size: 256\npd_peer_host: 127.0.0.1\nkv_num_layers: {L}\nkv_num_heads: {H}\n"
              f"kv_head_size: {HS}\nkv_dtype: float32\n")
    rx = Receiver(Config.from_yaml(common + f"pd_role: receiver\npd_peer_init_port: {init}\npd_peer_alloc_port: {alloc}\n"))
    tx = Sender(Config.from_yaml(common + "pd_role: sender\npd_proxy_host: 127.0.0.1\npd_proxy_port: 1\n"))
    return rx, tx, init, alloc


def _until_ended(worker: Any, req_id: str) -> None:
    """Steps a connector worker until its save of ``req_id`` ended."""
    deadline = time.monotonic() + 30
    while req_id in worker.state.running_saves:
        assert time.monotonic() < deadline, f"the save of {req_id} did not end"
        worker.get_finished(set())
        time.sleep(0.005)


def _wait(poll: Any) -> Any:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = poll()
        if got:
            return got
        time.sleep(0.005)
    raise AssertionError("no completion in 30 s")


@pytest.mark.parametrize("channel", ["shm", "tcp"])
def test_cpu_attention_cache_written_by_vllms_kernel_lands_in_a_vllm_ascend_cache(channel: str) -> None:
    """K and V written by vLLM's own CPU kernel (whose block interior keeps K
    transposed) are saved from that cache and loaded into vLLM-Ascend's
    (K, V) layout: every element lands where vLLM-Ascend reads it."""
    import vllm._custom_ops as ops

    n = 300
    g = torch.Generator().manual_seed(3)
    keys = [torch.randn(n, H, HS, generator=g) for _ in range(L)]
    vals = [torch.randn(n, H, HS, generator=g) for _ in range(L)]
    src_blocks, dst_blocks = [4, 1, 3], [0, 5, 2]
    src_slots = torch.tensor([src_blocks[t // BS] * BS + t % BS for t in range(n)])
    cpu = []
    for layer in range(L):
        t = torch.zeros(NB, H, BS, 2 * HS)
        kc, vc = t.view(NB, H, 2 * BS, HS).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys[layer], vals[layer], kc, vc, src_slots, "vec")
        cpu.append(t)
    ascend = [(torch.full((NB, BS, H, HS), 7.0), torch.full((NB, BS, H, HS), 7.0)) for _ in range(L)]
    rx, tx, init, alloc = _pair(channel)
    try:
        src, dst = _wrap(cpu, "CPU_ATTN"), _wrap(ascend, "ASCEND")
        ks = ["a", "b"]
        tx.submit_save("r", ks, src, src_slots.tolist(), "127.0.0.1", init, alloc, is_last_prefill=False)
        assert [c.status for c in _wait(tx.poll)] == ["done"]
        deadline = time.monotonic() + 30
        while not rx.available(ks):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        rx.submit_load("r", ks, dst, [dst_blocks[t // BS] * BS + t % BS for t in range(n)])
        assert [c.status for c in _wait(rx.poll)] == ["done"]
        for layer in range(L):
            k, v = ascend[layer]
            for t in range(n):
                b, o = dst_blocks[t // BS], t % BS
                assert torch.equal(k[b, o], keys[layer][t]), (layer, t)
                assert torch.equal(v[b, o], vals[layer][t]), (layer, t)
            # Nothing outside the request's slots was written.
            touched = torch.zeros(NB, BS, dtype=torch.bool)
            for t in range(n):
                touched[dst_blocks[t // BS], t % BS] = True
            assert bool((k[~touched] == 7.0).all()) and bool((v[~touched] == 7.0).all())
        deadline = time.monotonic() + 10
        while not (rx.pool_stats().free == rx.pool_stats().total and tx.pool_stats().free == tx.pool_stats().total):
            assert time.monotonic() < deadline, (rx.pool_stats(), tx.pool_stats())
            time.sleep(0.01)
    finally:
        tx.close()
        rx.close()


def test_a_permuted_stacked_cache_lands_in_the_cpu_backends_cache() -> None:
    """From a GPU-style stacked cache with heads outside tokens (HND, read
    off its strides) into the CPU backend's cache (K transposed): every
    element lands where vLLM's CPU kernel reads it."""
    n = 200
    g = torch.Generator().manual_seed(5)
    src_blocks, dst_blocks = [2, 5], [1, 3]
    stacked = [torch.randn(2, NB, H, BS, HS, generator=g).permute(0, 1, 3, 2, 4) for _ in range(L)]
    cpu = [torch.full((NB, H, BS, 2 * HS), 7.0) for _ in range(L)]
    rx, tx, init, alloc = _pair("shm")
    try:
        lay = describe(stacked, "FLASH_ATTN", H, HS, False)
        src = KVCache(list(lay.planes), fmt="kv", dtype=lay.dtype, layers=lay.layers, num_blocks=lay.num_blocks,
                      block_size=lay.block_size, hidden=lay.hidden, strides=list(lay.strides),
                      num_heads=lay.num_heads, head_size=lay.head_size)
        dst = _wrap(cpu, "CPU_ATTN")
        ks = ["x"]
        tx.submit_save("s", ks, src, [src_blocks[t // BS] * BS + t % BS for t in range(n)],
                       "127.0.0.1", init, alloc, is_last_prefill=False)
        assert [c.status for c in _wait(tx.poll)] == ["done"]
        while not rx.available(ks):
            time.sleep(0.005)
        rx.submit_load("s", ks, dst, [dst_blocks[t // BS] * BS + t % BS for t in range(n)])
        assert [c.status for c in _wait(rx.poll)] == ["done"]
        for layer in range(L):
            cell = cpu[layer].view(NB, H, 2 * BS * HS)
            for t in range(n):
                sb, db, o = src_blocks[t // BS], dst_blocks[t // BS], t % BS
                for h in range(H):
                    k_want = stacked[layer][0, sb, o, h]
                    v_want = stacked[layer][1, sb, o, h]
                    k_got = cell[db, h, : BS * HS].view(HS, BS)[:, o]  # K transposed
                    v_got = cell[db, h, BS * HS :].view(BS, HS)[o]
                    assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want), (layer, t, h)
    finally:
        tx.close()
        rx.close()


def test_connector_stats_add_up_and_reduce_for_vllms_logger() -> None:
    from ascend_pd.vllm.stats import TransferStats

    a = TransferStats()
    assert a.is_empty() and a.take() is None
    a.record("load", 2 << 20, 0.010, tokens=300)
    a.record("save", 1 << 20, 0.004)
    a.record_failure("load", "timeout")
    b = TransferStats(a.take().data)  # type: ignore[union-attr]
    assert a.is_empty()  # take() resets the interval
    b.aggregate(TransferStats({"loads": 1, "load_bytes": 2 << 20, "load_s": 0.030, "load_tokens": 100}))
    r = b.reduce()
    assert r["loads"] == 2 and r["load_tokens"] == 400 and r["load_failures"] == 1
    assert r["load_MiB"] == 4.0 and r["load_ms_avg"] == 20.0
    assert r["saves"] == 1 and r["save_MiB"] == 1.0 and r["save_ms_avg"] == 4.0


def test_a_layerwise_worker_hands_each_layer_as_vllm_writes_it(tmp_path: Path, monkeypatch: Any) -> None:
    """With pd_layerwise the worker opens the step's saves at its first
    save_kv_layer, hands layer i at each call (by the wrapped caches' order)
    and only closes them in wait_for_save: the receiver holds nothing before
    the last layer, every byte after; a layer vLLM did not report during
    the forward pass is handed over at wait_for_save (the forward is over,
    every layer is written), so that save still lands whole. Events say the
    saves were layer-wise."""
    from ascend_pd.vllm.metadata import AscendPDConnectorMetadata, ReceiverAddress, SaveSpec
    from ascend_pd.vllm.worker import ENV_EVENTS, ConnectorWorker
    import json

    events = tmp_path / "events.jsonl"
    monkeypatch.setenv(ENV_EVENTS, str(events))
    rx, _unused, init, alloc = _pair("tcp")
    _unused.close()
    path = _yaml(tmp_path, "enable_pd: true\ntransfer_channel: tcp\npd_buffer_device: cpu\n"
                 f"pd_buffer_size: {32 << 20}\nchunk_size: 256\npd_peer_host: 127.0.0.1\n"
                 "pd_role: sender\npd_layerwise: True\n")
    s = settings.load("kv_producer", {"config": path})
    assert s.layerwise
    worker = ConnectorWorker(s, settings.ModelShape(L, H, HS, "float32", False, 1, 0, "m"))
    cpu = [torch.zeros(NB, H, BS, 2 * HS) for _ in range(L)]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    worker.layer_index = {n: i for i, n in enumerate(names)}
    worker.start(describe(cpu, "CPU_ATTN", H, HS, False, isa="vec"))
    dst = [(torch.zeros(NB, BS, H, HS), torch.zeros(NB, BS, H, HS)) for _ in range(L)]
    try:
        assert worker.layerwise
        n = 300
        src_blocks, dst_blocks = [4, 1, 3], [0, 5, 2]
        slots = tuple(src_blocks[t // BS] * BS + t % BS for t in range(n))
        to = ReceiverAddress("127.0.0.1", (init,), (alloc,))
        ks = ("lw-a", "lw-b")
        meta = AscendPDConnectorMetadata(saves=[SaveSpec("r", ks, slots, to)])
        g = torch.Generator().manual_seed(11)
        keys = [torch.randn(n, H, HS, generator=g) for _ in range(L)]
        vals = [torch.randn(n, H, HS, generator=g) for _ in range(L)]
        import vllm._custom_ops as ops

        for layer in range(L):
            # vLLM's CPU kernel writes the layer, then the layer is saved.
            kc, vc = cpu[layer].view(NB, H, 2 * BS, HS).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(keys[layer], vals[layer], kc, vc, torch.tensor(slots), "vec")
            worker.save_kv_layer(names[layer], meta)
            assert "r" in worker.state.layered
            assert not rx.available(list(ks)), layer
        worker.wait_for_save(meta)
        assert not worker.state.layered and "r" in worker.state.running_saves
        assert _wait(worker.take_released) == {"r": 1}
        _until_ended(worker, "r")
        assert rx.available(list(ks))
        dst_cache = _wrap(dst, "ASCEND")
        rx.submit_load("r", list(ks), dst_cache, [dst_blocks[t // BS] * BS + t % BS for t in range(n)])
        assert [c.status for c in _wait(rx.poll)] == ["done"]
        for layer in range(L):
            k, v = dst[layer]
            for t in range(n):
                b, o = dst_blocks[t // BS], t % BS
                assert torch.equal(k[b, o], keys[layer][t]) and torch.equal(v[b, o], vals[layer][t]), (layer, t)

        # A step whose forward did not report layer 1: it is handed over at
        # wait_for_save, and the request lands whole.
        meta2 = AscendPDConnectorMetadata(saves=[SaveSpec("r2", ("lw-c", "lw-d"), slots, to)])
        worker.save_kv_layer(names[0], meta2)
        worker.save_kv_layer(names[2], meta2)
        assert not rx.available(["lw-c", "lw-d"])
        worker.wait_for_save(meta2)
        assert _wait(worker.take_released) == {"r2": 1}
        _until_ended(worker, "r2")
        saves = [e for e in map(json.loads, events.read_text().splitlines()) if e["event"] == "save"]
        assert [(e["req_id"], e["status"], e["layerwise"]) for e in saves] == [
            ("r", "done", True), ("r2", "done", True)], saves
        assert rx.available(["lw-c", "lw-d"])
        for d in dst:
            d[0].zero_()
            d[1].zero_()
        rx.submit_load("r2", ["lw-c", "lw-d"], dst_cache, [dst_blocks[t // BS] * BS + t % BS for t in range(n)])
        assert [c.status for c in _wait(rx.poll)] == ["done"]
        k, v = dst[1]
        assert all(torch.equal(k[dst_blocks[t // BS], t % BS], keys[1][t]) for t in range(n))
        assert all(torch.equal(v[dst_blocks[t // BS], t % BS], vals[1][t]) for t in range(n))
        deadline = time.monotonic() + 10
        while not (rx.pool_stats().free == rx.pool_stats().total
                   and worker.pool_stats()["sender"]["free"] == worker.pool_stats()["sender"]["total"]):
            assert time.monotonic() < deadline, (rx.pool_stats(), worker.pool_stats())
            time.sleep(0.01)
        dst_cache.close()
    finally:
        worker.close()
        rx.close()


def test_the_drain_on_shutdown_fits_inside_vllms_worker_grace(monkeypatch: Any, caplog: Any) -> None:
    """vLLM kills a worker VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS after asking
    it to stop: a longer pd_drain_timeout is cut to end a second before,
    and an API server that kills its engine at once is warned about."""
    from types import SimpleNamespace

    import vllm.envs as envs

    from ascend_pd.vllm import compat

    # vLLM before the setting (0.23) waits a fixed 4 s.
    configurable = getattr(envs, "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", None) is not None
    monkeypatch.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "5")
    with caplog.at_level("WARNING"):
        got = compat.drain_bound(SimpleNamespace(shutdown_timeout=0), 20.0)
    assert got == (4.0 if configurable else 3.0)
    text = caplog.text
    assert f"cut to {got:.1f} s" in text
    assert ("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS" in text) == configurable
    assert "--shutdown-timeout 0" in text
    caplog.clear()
    monkeypatch.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "30")
    with caplog.at_level("WARNING"):
        want = 20.0 if configurable else 3.0
        assert compat.drain_bound(SimpleNamespace(shutdown_timeout=40), 20.0) == want
    assert (caplog.text == "") == configurable


def test_a_decode_step_with_nothing_to_run_waits_for_its_load_and_reports_it_in_that_step(tmp_path: Path) -> None:
    """load_wait_ms: a decode step that runs no tokens and holds a load
    whose KV is not there yet waits in step_finished, woken by the
    library when the KV lands and again when its copy ends, and reports
    the request loaded in that same step, every byte in place; a step that
    runs tokens, or one with load_wait_ms 0, returns at once; the pools
    are full again."""
    import threading

    import vllm._custom_ops as ops
    from ascend_pd.vllm.metadata import AscendPDConnectorMetadata, LoadSpec
    from ascend_pd.vllm.worker import ConnectorWorker

    n = 300
    g = torch.Generator().manual_seed(5)
    keys = [torch.randn(n, H, HS, generator=g) for _ in range(L)]
    vals = [torch.randn(n, H, HS, generator=g) for _ in range(L)]
    src_blocks, dst_blocks = [2, 4, 0], [5, 1, 3]
    src_slots = [src_blocks[t // BS] * BS + t % BS for t in range(n)]
    dst_slots = tuple(dst_blocks[t // BS] * BS + t % BS for t in range(n))
    cpu = []
    for layer in range(L):
        t = torch.zeros(NB, H, BS, 2 * HS)
        kc, vc = t.view(NB, H, 2 * BS, HS).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys[layer], vals[layer], kc, vc, torch.tensor(src_slots), "vec")
        cpu.append(t)
    dst = [torch.zeros(NB, H, BS, 2 * HS) for _ in range(L)]
    _rx, tx, init, alloc = _pair("tcp")
    _rx.close()  # its ports go to the worker's receiver
    shape = settings.ModelShape(L, H, HS, "float32", False, 1, 0, "m")
    common = (f"enable_pd: true\ntransfer_channel: tcp\npd_buffer_device: cpu\npd_buffer_size: {32 << 20}\n"
              "chunk_size: 256\npd_peer_host: 127.0.0.1\n")
    path = _yaml(tmp_path, common + f"pd_role: receiver\npd_peer_init_port: {init}\npd_peer_alloc_port: {alloc}\n")
    worker = ConnectorWorker(settings.load("kv_consumer", {"config": path}), shape)
    worker.start(describe(dst, "CPU_ATTN", H, HS, False, isa="vec"))
    src = _wrap(cpu, "CPU_ATTN")
    start = worker.pool_stats()
    rx = worker.receiver
    assert rx is not None
    waits: List[str] = []
    real_available, real_ended = rx.wait_available, rx.wait_ended

    def spy_available(k: Any, timeout_s: float) -> bool:
        waits.append("available")
        return bool(real_available(k, timeout_s))

    def spy_ended(timeout_s: float) -> bool:
        waits.append("ended")
        return bool(real_ended(timeout_s))

    rx.wait_available, rx.wait_ended = spy_available, spy_ended  # type: ignore[method-assign]
    try:
        ks = ("w-a", "w-b")
        load = LoadSpec("r", ks, dst_slots, tuple(dst_blocks), sent_keys=ks)
        worker.start_load_kv(AscendPDConnectorMetadata(loads=[load], no_tokens=True))
        # A step that runs tokens has work of its own: it does not wait.
        assert worker.step_finished(set(), AscendPDConnectorMetadata(no_tokens=False)) == (None, None)
        assert waits == [] and "r" in worker.state.waiting_loads
        # load_wait_ms 0: not even an idle step waits.
        worker.settings = settings.load("kv_consumer", {"config": path, "load_wait_ms": 0})
        assert worker.step_finished(set(), AscendPDConnectorMetadata(no_tokens=True)) == (None, None)
        assert waits == [] and "r" in worker.state.waiting_loads
        # The prefill sends 0.3 s into a step with nothing to run (the wait
        # budget raised to cover it): that step returns the request loaded,
        # having waited for the KV, then for its copy.
        worker.settings = settings.load("kv_consumer", {"config": path, "load_wait_ms": 1000})
        sender = threading.Timer(0.3, lambda: tx.submit_save("s", list(ks), src, src_slots, "127.0.0.1", init,
                                                              alloc, is_last_prefill=False))
        sender.start()
        t0 = time.monotonic()
        got = worker.step_finished(set(), AscendPDConnectorMetadata(no_tokens=True))
        waited = time.monotonic() - t0
        sender.join()
        assert got == (None, {"r"}), got
        assert waited >= 0.25 and waits[0] == "available" and "ended" in waits, (waited, waits)
        assert not worker.state.waiting_loads and not worker.state.running_loads
        for layer in range(L):
            kc, vc = dst[layer].view(NB, H, 2 * BS, HS).chunk(2, dim=2)
            skc, svc = cpu[layer].view(NB, H, 2 * BS, HS).chunk(2, dim=2)
            for s_b, d_b in zip(src_blocks, dst_blocks):
                assert torch.equal(kc[d_b], skc[s_b]) and torch.equal(vc[d_b], svc[s_b]), (layer, s_b)
        assert [c.status for c in _wait(tx.poll)] == ["done"]
        deadline = time.monotonic() + 10
        while not (worker.pool_stats() == start and tx.pool_stats().free == tx.pool_stats().total):
            assert time.monotonic() < deadline, (worker.pool_stats(), start, tx.pool_stats())
            time.sleep(0.01)
    finally:
        src.close()
        worker.close()
        tx.close()
