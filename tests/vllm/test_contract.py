"""The connector's contract with vLLM, without engines: KV identity (what
a chunk key names), the hand-off check, the skip count vLLM grants,
aborts, preemption and pinned blocks, loud failures, geometry.

vLLM's own objects are used where the connector reads them (``Request``,
``LoRARequest``, ``MultiModalFeatureSpec``, ``BlockPool``); the scheduler
output and the block lists are plain stand-ins with the fields read.
Each test names what it proves; each fails on the connector before KV
identity was added (keys of token ids only, the skip count taken as
"everything after the local hit", saves waited for on preemption).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from safetensors.torch import save_file

from ascend_pd import Config, Receiver
from ascend_pd.vllm import settings
from ascend_pd.vllm.identity import ModelIdentity, adapter_identity, files_fingerprint
from ascend_pd.vllm.layout import LayoutError, check_geometry, describe
from ascend_pd.vllm.metadata import (
    AscendPDConnectorMetadata,
    AscendPDWorkerMetadata,
    LoadSpec,
    ReceiverAddress,
    SaveSpec,
    parse_handoff,
)
from ascend_pd.vllm.scheduler import ConnectorScheduler
from ascend_pd.vllm.stats import TransferStats
from ascend_pd.vllm.worker import ConnectorWorker
from harness import free_port

from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.request import Request, RequestStatus

BS = 16  # vLLM block size in these tests
CHUNK = 32  # ascend-pd chunk size


def _yaml(tmp: Path, role: str, extra: str = "") -> settings.ConnectorSettings:
    p = tmp / f"{role}.yaml"
    p.write_text(f"enable_pd: true\ntransfer_channel: tcp\npd_role: {role}\npd_buffer_device: cpu\n"
                 f"pd_buffer_size: {8 << 20}\nchunk_size: {CHUNK}\npd_peer_host: 127.0.0.1\n" + extra)
    kv_role = {"sender": "kv_producer", "receiver": "kv_consumer", "both": "kv_both"}[role]
    return settings.load(kv_role, {"config": str(p)})


IDENTITY = ModelIdentity((("weights", "w1"), ("config", "c1"), ("dtype", "float32"),
                          ("kv_cache_dtype", "auto"), ("quantization", "None"),
                          ("geometry", "4 layers x 2 KV heads x 64"), ("chunk_size", str(CHUNK)),
                          ("key_format", "2")))


def _request(rid: str, tokens: Sequence[int], params: Optional[Dict[str, Any]] = None,
             lora: Optional[LoRARequest] = None, salt: Optional[str] = None,
             mm: Sequence[Tuple[str, int, int]] = (), embeds: Any = None) -> Request:
    sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params} if params is not None else None)
    feats = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                   mm_position=PlaceholderRange(offset=off, length=n)) for ident, off, n in mm]
    return Request(rid, list(tokens) if embeds is None else None, sp, None, lora_request=lora,
                   cache_salt=salt, mm_features=feats or None, prompt_embeds=embeds)


class _Blocks:
    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = list(ids)

    def get_block_ids(self) -> Tuple[List[int]]:
        return (self.ids,)


def _step(new: Sequence[Tuple[str, int, int]] = (), preempted: Sequence[str] = ()) -> Any:
    """A scheduler output: ``new`` holds (req_id, computed, scheduled)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={r: s for r, _, s in new},
        preempted_req_ids=set(preempted),
    )


def _adapter(d: Path, seed: int) -> Path:
    """A small LoRA adapter's files (config and weights) in ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    g = torch.Generator().manual_seed(seed)
    save_file({"a": torch.randn(4, 256, generator=g), "b": torch.randn(256, 4, generator=g)},
              str(d / "adapter_model.safetensors"))
    return d


# --------------------------------------------------------------- identity

def _keys(s: ConnectorScheduler, req: Request) -> Tuple[str, ...]:
    return s.request_keys(req, None)


def test_keys_name_the_adapter_the_salt_the_images_and_the_embeddings(tmp_path: Path) -> None:
    """Same tokens, other KV: a LoRA adapter, another adapter, a cache_salt,
    an image (and the same image elsewhere), prompt embeddings — each gives
    other keys for every chunk; the same inputs give the same keys."""
    s = ConnectorScheduler(_yaml(tmp_path, "receiver"), IDENTITY, BS)
    toks = list(range(3, 3 + 70))  # 2 full chunks and a partial one
    a1, a2 = _adapter(tmp_path / "a1", 1), _adapter(tmp_path / "a2", 2)
    base = _keys(s, _request("r0", toks))
    assert len(base) == 3 and base == _keys(s, _request("r1", toks))
    variants = {
        "lora": _keys(s, _request("r2", toks, lora=LoRARequest("ad", 1, str(a1)))),
        "other lora": _keys(s, _request("r3", toks, lora=LoRARequest("ad2", 2, str(a2)))),
        "salt": _keys(s, _request("r4", toks, salt="tenant-a")),
        "other salt": _keys(s, _request("r5", toks, salt="tenant-b")),
        "image": _keys(s, _request("r6", toks, mm=[("img-1", 5, 10)])),
        "other image": _keys(s, _request("r7", toks, mm=[("img-2", 5, 10)])),
        "image moved": _keys(s, _request("r8", toks, mm=[("img-1", 6, 10)])),
        "embeds": _keys(s, _request("r9", toks, embeds=torch.ones(70, 8))),
        "other embeds": _keys(s, _request("r10", toks, embeds=torch.full((70, 8), 2.0))),
    }
    for name, keys in variants.items():
        assert all(k != b for k, b in zip(keys, base)), name
    seen = {k for keys in variants.values() for k in keys}
    assert len(seen) == 3 * len(variants), "two variants share a key"
    # The same adapter content under another path: the same keys (a decode
    # on another host). Reloaded in place with other weights: other keys.
    copy = _adapter(tmp_path / "copy", 1)
    assert _keys(s, _request("r11", toks, lora=LoRARequest("ad", 7, str(copy)))) == variants["lora"]
    _adapter(a1, 3)
    assert _keys(s, _request("r12", toks, lora=LoRARequest("ad", 1, str(a1)))) != variants["lora"]


def test_the_partial_last_chunk_is_keyed_with_its_inputs(tmp_path: Path) -> None:
    """An image in the partial tail (which vLLM does not hash: it hashes full
    blocks only) changes the last key and only it."""
    s = ConnectorScheduler(_yaml(tmp_path, "receiver"), IDENTITY, BS)
    toks = list(range(3, 3 + 70))
    plain = _keys(s, _request("a", toks))
    tail = _keys(s, _request("b", toks, mm=[("img-9", 66, 4)]))
    assert plain[:2] == tail[:2] and plain[2] != tail[2]


def test_model_identity_parts_name_weights_config_and_dtype(tmp_path: Path) -> None:
    """A fine-tune of the same shapes (same file names and sizes) has another
    weights fingerprint; copies of the same files agree; the identity's
    differences name the part."""
    def model(d: Path, seed: int) -> Path:
        d.mkdir()
        (d / "config.json").write_text('{"num_hidden_layers": 4}')
        g = torch.Generator().manual_seed(seed)
        save_file({"w": torch.randn(512, 512, generator=g)}, str(d / "model.safetensors"))
        return d

    a, b, c = model(tmp_path / "a", 1), model(tmp_path / "b", 2), model(tmp_path / "c", 1)
    assert files_fingerprint(str(a)) == files_fingerprint(str(c)) != files_fingerprint(str(b))
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size
    # One weight changed in the middle of the file (a fine-tune of one
    # layer): the whole content is hashed, not samples of it.
    d = model(tmp_path / "d", 1)
    raw = bytearray((d / "model.safetensors").read_bytes())
    raw[len(raw) // 2 + 1] ^= 0x01
    (d / "model.safetensors").write_bytes(bytes(raw))
    assert files_fingerprint(str(d)) != files_fingerprint(str(a))
    other = dict(IDENTITY.as_dict(), weights="w2", kv_cache_dtype="fp8")
    diffs = IDENTITY.differences(other)
    assert [d.split(":")[0] for d in diffs] == ["kv_cache_dtype", "weights"], diffs
    assert adapter_identity("x", str(a)) != adapter_identity("x", str(b))


# ----------------------------------------------------------------- decode

def _handoff(prefill: ConnectorScheduler, req: Request, n: int, identity: Optional[Dict[str, str]] = None,
             nonce: Optional[str] = None) -> Dict[str, Any]:
    from ascend_pd.vllm.keys import input_digests
    from ascend_pd.vllm.metadata import prefill_params

    ki, _ = prefill.key_inputs(req, nonce)
    return prefill_params(n, prefill.request_keys(req, nonce), identity or IDENTITY.as_dict(), "push",
                          req.request_id, nonce, input_digests(ki))


def test_a_decode_refuses_kv_another_request_computed(tmp_path: Path) -> None:
    """The prefill ran the prompt with a LoRA adapter, the decode request
    has none (or another model's identity): the load is refused and reported
    as failed at once, naming why, and the prefill's keys are freed."""
    pre = ConnectorScheduler(_yaml(tmp_path, "sender"), IDENTITY, BS)
    dec = ConnectorScheduler(_yaml(tmp_path, "receiver"), IDENTITY, BS)
    toks = list(range(3, 3 + 40))
    lora = LoRARequest("ad", 1, str(_adapter(tmp_path / "ad", 1)))
    params = _handoff(pre, _request("p", toks, lora=lora), len(toks))
    req = _request("d", toks, params=params)  # no adapter
    assert dec.get_num_new_matched_tokens(req, 0) == (40, True)
    dec.update_state_after_alloc(req, _Blocks([4, 5, 6]), 40)
    (spec,) = dec.build_connector_meta(_step()).loads
    assert spec.error is not None and spec.cause == "inputs" and "(the LoRA adapter differs)" in spec.error
    assert spec.keys == () and spec.sent_keys == tuple(params["ascend_pd"]["keys"])
    assert spec.block_ids == (4, 5, 6)
    assert dec.counters.handoffs_refused == {"inputs": 1}
    # The same request with the adapter loads.
    params = _handoff(pre, _request("p2", toks, lora=lora), len(toks))
    ok = _request("d2", toks, params=params, lora=lora)
    dec.get_num_new_matched_tokens(ok, 0)
    dec.update_state_after_alloc(ok, _Blocks([1, 2, 3]), 40)
    (spec,) = dec.build_connector_meta(_step()).loads
    assert spec.error is None and spec.keys == tuple(params["ascend_pd"]["keys"])
    # Another salt: named as what differs.
    params = _handoff(pre, _request("ps", toks, salt="tenant-a"), len(toks))
    salted = _request("ds", toks, params=params, salt="tenant-b")
    dec.get_num_new_matched_tokens(salted, 0)
    dec.update_state_after_alloc(salted, _Blocks([13, 14, 15]), 40)
    (spec,) = dec.build_connector_meta(_step()).loads
    assert "(cache_salt differs)" in (spec.error or ""), spec.error
    # Another model's KV.
    params = _handoff(pre, _request("p3", toks), len(toks), identity=dict(IDENTITY.as_dict(), weights="w2"))
    bad = _request("d3", toks, params=params)
    dec.get_num_new_matched_tokens(bad, 0)
    dec.update_state_after_alloc(bad, _Blocks([7, 8, 9]), 40)
    (spec,) = dec.build_connector_meta(_step()).loads
    assert spec.cause == "model" and "weights: 'w2' != 'w1'" in (spec.error or "")
    # Params of an older connector: refused by version, keys unknown.
    old = {"do_remote_prefill": True, "ascend_pd": {"v": 1, "num_tokens": 40, "model_tag": "x"}}
    req = _request("d4", toks, params=old)
    dec.get_num_new_matched_tokens(req, 0)
    dec.update_state_after_alloc(req, _Blocks([10, 11, 12]), 40)
    (spec,) = dec.build_connector_meta(_step()).loads
    assert spec.cause == "version" and "same ascend-pd release" in (spec.error or "")


def test_unhashable_inputs_get_keys_of_their_own(tmp_path: Path) -> None:
    """An image vLLM gave no content hash: the prefill keys the request with
    a nonce it returns; the decode, given the params, computes the same
    keys; no other request (same tokens, same missing hash) shares them."""
    pre = ConnectorScheduler(_yaml(tmp_path, "sender"), IDENTITY, BS)
    dec = ConnectorScheduler(_yaml(tmp_path, "receiver"), IDENTITY, BS)
    toks = list(range(3, 3 + 40))
    req = _request("p", toks, mm=[("", 0, 8)])
    req.mm_features[0].identifier = None
    pre._saves["p"] = SimpleNamespace(request=req, to=ReceiverAddress("h", (1,), (2,)), shipped=False,
                                      keys=(), nonce=None, inputs={})
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BS)
    pre.block_pool = pool
    blocks = [b.block_id for b in pool.get_new_blocks(3)]
    pre.kv_cache_manager = SimpleNamespace(get_block_ids=lambda r: (blocks,))
    (save,) = pre.build_connector_meta(_step([("p", 0, 40)])).saves
    nonce = pre._saves["p"].nonce
    assert nonce and save.keys == pre.request_keys(req, nonce) != pre.request_keys(req, "other")
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = pre.request_finished(req, [0, 1, 2])
    assert params is not None and params["ascend_pd"]["nonce"] == nonce
    d = _request("d", toks, params=params, mm=[("", 0, 8)])
    d.mm_features[0].identifier = None
    dec.get_num_new_matched_tokens(d, 0)
    dec.update_state_after_alloc(d, _Blocks([3, 4, 5]), 40)
    (spec,) = dec.build_connector_meta(_step()).loads
    assert spec.error is None and spec.keys == save.keys


def test_the_load_writes_exactly_the_tokens_vllm_counts_as_loaded(tmp_path: Path) -> None:
    """vLLM may grant fewer external tokens than offered (its prefix-replay
    path trims a hit to a block boundary): the load writes tokens
    [local, local + granted) and nothing else."""
    pre = ConnectorScheduler(_yaml(tmp_path, "sender"), IDENTITY, BS)
    dec = ConnectorScheduler(_yaml(tmp_path, "receiver"), IDENTITY, BS)
    toks = list(range(3, 3 + 70))
    req = _request("d", toks, params=_handoff(pre, _request("p", toks), 70))
    # The decode's own cache holds one block; 54 tokens offered.
    assert dec.get_num_new_matched_tokens(req, 16) == (54, True)
    # vLLM grants 48 (to a block boundary): tokens [16, 64).
    dec.update_state_after_alloc(req, _Blocks([9, 1, 2, 3, 4]), 48)
    (spec,) = dec.build_connector_meta(_step()).loads
    written = [t for t, slot in enumerate(spec.slots) if slot >= 0]
    assert written == list(range(16, 64)), (written[:3], written[-3:])
    assert spec.slots[16] == 1 * BS and spec.slots[63] == 3 * BS + 15
    assert spec.block_ids == (1, 2, 3)


def test_a_decode_request_that_ends_before_its_load_frees_the_prefills_keys(tmp_path: Path) -> None:
    """Aborted while waiting to be scheduled, or while its load waits for
    the keys: what the prefill pushed for it is freed at once (drops and
    cancels in the next step's orders), not after pd_resident_ttl."""
    pre = ConnectorScheduler(_yaml(tmp_path, "sender"), IDENTITY, BS)
    dec = ConnectorScheduler(_yaml(tmp_path, "receiver"), IDENTITY, BS)
    toks = list(range(3, 3 + 40))
    params = _handoff(pre, _request("p", toks), 40)
    waiting = _request("w", toks, params=params)
    waiting.status = RequestStatus.FINISHED_ABORTED
    assert dec.request_finished(waiting, []) == (False, None)
    assert dec.has_pending_work()
    meta = dec.build_connector_meta(_step())
    # Named by the prefill's save id: the receiver also refuses that save's
    # chunks if they arrive later.
    assert meta.drops == [("p", tuple(params["ascend_pd"]["keys"]))]
    # Offered but not yet allocated, then aborted.
    offered = _request("o", toks, params=_handoff(pre, _request("p2", toks), 40))
    dec.get_num_new_matched_tokens(offered, 0)
    offered.status = RequestStatus.FINISHED_ABORTED
    dec.request_finished(offered, [])
    assert [r for r, _ in dec.build_connector_meta(_step()).drops] == ["p2"]
    # Planned (its load waits for the keys): cancelled, blocks kept until
    # the worker reports it.
    planned = _request("l", toks, params=_handoff(pre, _request("p3", toks), 40))
    dec.get_num_new_matched_tokens(planned, 0)
    dec.update_state_after_alloc(planned, _Blocks([1, 2, 3]), 40)
    dec.build_connector_meta(_step())
    planned.status = RequestStatus.FINISHED_ABORTED
    assert dec.request_finished(planned, [1, 2, 3]) == (True, None)
    assert [r for r, _ in dec.build_connector_meta(_step()).cancels] == ["l"]


# ---------------------------------------------------------------- prefill

def test_save_blocks_stay_pinned_when_vllm_frees_the_request(tmp_path: Path) -> None:
    """The blocks a save reads are pinned in vLLM's own BlockPool: when vLLM
    frees the request's blocks (it ended or was aborted here; a preemption
    frees them the same way, through the same pool) they do not go back to
    the free queue until every TP rank reported the save released them. An aborted request's save is cancelled and returns no hand-off.
    The engine keeps stepping (has_pending_work) while anything is pinned."""
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=BS)
    pre = ConnectorScheduler(_yaml(tmp_path, "sender"), IDENTITY, BS, num_workers=2)
    pre.block_pool = pool
    blocks = {r: pool.get_new_blocks(3) for r in ("a", "b")}
    pre.kv_cache_manager = SimpleNamespace(get_block_ids=lambda r: ([b.block_id for b in blocks[r]],))
    to = {"do_remote_decode": True, "receiver_host": "h", "receiver_init_port": [1], "receiver_alloc_port": [2]}
    reqs = {r: _request(r, list(range(3, 43)), params=dict(to)) for r in ("a", "b")}
    for r in reqs.values():
        pre.update_state_after_alloc(r, _Blocks([]), 0)
    meta = pre.build_connector_meta(_step([("a", 0, 40), ("b", 0, 40)]))
    assert [s.req_id for s in meta.saves] == ["a", "b"]
    free_before = pool.get_num_free_blocks()
    # "a" finishes normally; "b" is aborted. vLLM drops its own references.
    reqs["a"].status = RequestStatus.FINISHED_LENGTH_CAPPED
    reqs["b"].status = RequestStatus.FINISHED_ABORTED
    done, params = pre.request_finished(reqs["a"], [])
    assert done is False and params is not None and params["ascend_pd"]["keys"] == list(meta.saves[0].keys)
    assert pre.request_finished(reqs["b"], []) == (False, None)
    for r in ("a", "b"):
        pool.free_blocks(blocks[r])
    assert pool.get_num_free_blocks() == free_before, "pinned blocks went back to the free queue"
    assert pre.build_connector_meta(_step()).cancel_saves == ["b"]
    assert pre.has_pending_work() and pre.pinned_requests == {"a", "b"}
    # One rank released "a": still pinned; the second: freed.
    pre.update_connector_output(None, AscendPDWorkerMetadata({"a": 1}).released)
    assert pool.get_num_free_blocks() == free_before
    both = AscendPDWorkerMetadata({"a": 1}).aggregate(AscendPDWorkerMetadata({"b": 1}))
    both.aggregate(AscendPDWorkerMetadata({"b": 1}))
    pre.update_connector_output(None, both.released)
    assert pool.get_num_free_blocks() == free_before + 6
    assert not pre.has_pending_work()


def _pair_worker(tmp_path: Path, monkeypatch: Any) -> Tuple[ConnectorWorker, Receiver, int, int, List[Any]]:
    from ascend_pd.vllm.worker import ENV_EVENTS

    monkeypatch.setenv(ENV_EVENTS, str(tmp_path / "events.jsonl"))
    init, alloc = free_port(), free_port()
    common = (f"enable_pd: true\ntransfer_channel: tcp\npd_buffer_device: cpu\npd_buffer_size: {8 << 20}\n"
              f"chunk_size: {CHUNK}\npd_peer_host: 127.0.0.1\nkv_num_layers: 2\nkv_num_heads: 2\n"
              "kv_head_size: 8\nkv_dtype: float32\n")
    rx = Receiver(Config.from_yaml(common + f"pd_role: receiver\npd_peer_init_port: {init}\n"
                                   f"pd_peer_alloc_port: {alloc}\n"))
    worker = ConnectorWorker(_yaml(tmp_path, "sender"), settings.ModelShape(2, 2, 8, "float32", False, 1, 0, "m"))
    caches = [tuple(torch.randn(8, BS, 2, 8) for _ in range(2)) for _ in range(2)]
    worker.start(describe(caches, "ASCEND", 2, 8, False))
    return worker, rx, init, alloc, [caches]


def test_preemption_never_waits_and_an_aborted_save_is_cancelled(tmp_path: Path, monkeypatch: Any) -> None:
    """handle_preemptions returns at once even with a save running (the
    blocks are pinned, nothing to wait for); a save cancelled before it
    started is released at once; every save's release is reported to the
    scheduler exactly once, then the pools are whole."""
    worker, rx, init, alloc, _keep = _pair_worker(tmp_path, monkeypatch)
    try:
        to = ReceiverAddress("127.0.0.1", (init,), (alloc,))
        slots = tuple(range(40))
        meta = AscendPDConnectorMetadata(saves=[SaveSpec("a", ("a" * 32, "b" * 32), slots, to),
                                                SaveSpec("b", ("c" * 32, "d" * 32), slots, to)])
        worker.wait_for_save(meta)
        t0 = time.monotonic()
        worker.handle_preemptions(AscendPDConnectorMetadata(preempted=["a", "b"]))
        assert time.monotonic() - t0 < 1.0
        # "b" aborted: cancelled (running or queued, either way released once).
        worker.start_load_kv(AscendPDConnectorMetadata(cancel_saves=["b"]))
        released: Dict[str, int] = {}
        deadline = time.monotonic() + 30
        while set(released) != {"a", "b"}:
            assert time.monotonic() < deadline, released
            for r, n in worker.take_released().items():
                released[r] = released.get(r, 0) + n
            time.sleep(0.01)
        assert released == {"a": 1, "b": 1}
        deadline = time.monotonic() + 30
        while worker.state.running_saves:
            assert time.monotonic() < deadline
            worker.get_finished(set())
            time.sleep(0.01)
        assert worker.take_released() == {}
        deadline = time.monotonic() + 10
        while True:
            ps = worker.pool_stats()["sender"]
            if ps["free"] == ps["total"] and ps["pinned"] == 0:
                break
            assert time.monotonic() < deadline, ps
            time.sleep(0.01)
    finally:
        worker.close()
        rx.close()


def test_a_refused_handoff_fails_at_once_and_is_counted_by_cause(tmp_path: Path) -> None:
    """A load the scheduler refused is reported failed in the same step (not
    after load_timeout_s): its request among failed_recving and
    finished_recving, its blocks among the load errors, its cause in the
    stats."""
    init, alloc = free_port(), free_port()
    worker = ConnectorWorker(_yaml(tmp_path, "receiver", f"pd_peer_init_port: {init}\npd_peer_alloc_port: {alloc}\n"),
                             settings.ModelShape(2, 2, 8, "float32", False, 1, 0, "m"))
    caches = [tuple(torch.zeros(8, BS, 2, 8) for _ in range(2)) for _ in range(2)]
    worker.start(describe(caches, "ASCEND", 2, 8, False))
    try:
        spec = LoadSpec("r", (), (), (3, 4), error="the prefill's KV is of another model", cause="model",
                        sent_keys=("e" * 32,))
        worker.start_load_kv(AscendPDConnectorMetadata(loads=[spec]))
        _, recving = worker.get_finished(set())
        assert recving == {"r"}
        assert worker.take_failed_recving() == {"r"} and worker.take_load_errors() == {3, 4}
        stats = worker.stats.take()
        assert stats is not None and stats.failures_by_cause("load") == {"model": 1}
        assert stats.reduce()["load_failed_model"] == 1
    finally:
        worker.close()


def test_stats_count_failures_by_cause_and_aggregate() -> None:
    a, b = TransferStats(), TransferStats()
    a.record_failure("load", "timeout")
    b.record_failure("load", "timeout")
    b.record_failure("load", "inputs")
    a.aggregate(b)
    assert a.failures_by_cause("load") == {"timeout": 2, "inputs": 1} and a.data["load_failures"] == 3


# --------------------------------------------------------------- geometry

def test_geometry_read_from_the_tensors_is_checked_against_the_config() -> None:
    caches = [tuple(torch.zeros(8, BS, 2, 8) for _ in range(2)) for _ in range(3)]
    lay = describe(caches, "ASCEND", 2, 8, False)
    check_geometry(lay, 3, 2, 8, BS, "float32")
    with pytest.raises(LayoutError) as e:
        check_geometry(lay, 4, 4, 8, 128, "bfloat16")
    msg = str(e.value)
    for part in ("layers: the tensors have 3, the config 4", "KV heads per rank: the tensors have 2, the config 4",
                 "block size: the tensors have 16, the config 128", "dtype: the tensors have float32"):
        assert part in msg, msg


def test_pipeline_parallel_and_hybrid_kv_groups_are_refused_by_name() -> None:
    from ascend_pd import ConfigError
    from ascend_pd.vllm.connector import _check_supported

    cfg = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=2))
    with pytest.raises(ConfigError, match="pipeline_parallel_size is 2"):
        _check_supported(cfg, None)
    cfg.parallel_config.pipeline_parallel_size = 1
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        setattr(cfg.parallel_config, name, 2)
        with pytest.raises(ConfigError, match=f"{name} is 2"):
            _check_supported(cfg, None)
        setattr(cfg.parallel_config, name, 1)
    with pytest.raises(ConfigError, match="2 KV cache groups"):
        _check_supported(cfg, SimpleNamespace(kv_cache_groups=[1, 2]))
    _check_supported(cfg, SimpleNamespace(kv_cache_groups=[1]))


def test_handoff_params_are_parsed_strictly() -> None:
    assert parse_handoff({"do_remote_decode": True}) is None
    assert parse_handoff({"do_remote_prefill": True, "other": {}}) is None
    from ascend_pd.vllm.metadata import HandOffError

    with pytest.raises(HandOffError, match="malformed"):
        parse_handoff({"do_remote_prefill": True, "ascend_pd": {"v": 2, "num_tokens": 40, "keys": ["x"]}})


def test_a_step_that_runs_nothing_is_idle_and_a_holding_prefill_paces_it(tmp_path: Path) -> None:
    """vLLM keeps an idle prefill stepping while a save pins blocks: such a
    step (no token, no order) is marked idle, and a sender's worker with no
    load of its own pauses it (no busy loop of empty steps burning the core
    other engines' workers run on); a step with work, or a decode waiting
    for a load, never pauses."""
    from ascend_pd.vllm.metadata import AscendPDConnectorMetadata
    from ascend_pd.vllm.worker import IDLE_PACE_S, ConnectorWorker

    dec = ConnectorScheduler(_yaml(tmp_path, "receiver"), IDENTITY, BS)
    empty = _step()
    empty.total_num_scheduled_tokens = 0
    assert dec.build_connector_meta(empty).idle
    busy = _step([("r", 0, 16)])
    busy.total_num_scheduled_tokens = 16
    assert not dec.build_connector_meta(busy).idle
    # A cancelled save is an order: the step that carries it is not idle.
    pre = ConnectorScheduler(_yaml(tmp_path, "sender"), IDENTITY, BS)
    pre._cancel_saves.append("gone")
    assert not pre.build_connector_meta(empty).idle

    def worker(sender: bool, loads: Dict[str, Any]) -> Any:
        return SimpleNamespace(sender=object() if sender else None,
                               state=SimpleNamespace(waiting_loads=loads, running_loads={}))

    idle = AscendPDConnectorMetadata(idle=True)
    assert ConnectorWorker.idle_pace_s(worker(True, {}), idle) == IDLE_PACE_S
    assert ConnectorWorker.idle_pace_s(worker(True, {}), AscendPDConnectorMetadata()) == 0.0
    assert ConnectorWorker.idle_pace_s(worker(False, {}), idle) == 0.0
    assert ConnectorWorker.idle_pace_s(worker(True, {"d": object()}), idle) == 0.0
