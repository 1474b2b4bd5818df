"""KV identity and the vLLM contract, with real engines.

Two disaggregated pairs (push over tcp, pull-delay over tcp with a short
pull lease), each started once and run through every case, and one
colocated engine for the reference tokens; every engine serves LoRA. Each
case compares every decode's greedy tokens with the colocated engine's
for the same prompt and adapter, and checks both pools back at the end.

- LoRA: the same prompt without an adapter and under two adapters (and a
  shared system prompt under different adapters), every prefill answered
  before any decode runs, so all their KV sits on the decode side at once
  (the decodes then run one at a time, like the reference: vLLM's CPU LoRA
  gives a request without an adapter batch-dependent tokens when it shares
  a batch with adapter requests, connector or not).
  Before chunk keys named the adapter, the receiver took the second
  request's KV as "already sent" and the decode loaded the first's.
  A decode request whose adapter differs from its prefill's is refused
  (reported as a failed load, recomputed), not loaded.
- The decode's own prefix cache holds part of the prompt, not on a chunk
  boundary: only the rest moves.
- A decode request aborted before its load started (the prefill's save
  held back, then let go: its chunks are refused, nothing waits for
  pd_resident_ttl), and one aborted after its load ran but before vLLM
  was told.
- A load that starts after its pull lease ended fails (lease expired) while
  the other loads of the same decode complete; the failed one is
  recomputed.
- The prefill is killed while its saves are in flight.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import pytest

import make_model
from conftest import RESULTS
from harness import (
    Engine,
    Lora,
    address,
    external,
    free_port,
    kv_config,
    receiver_yaml,
    sender_yaml,
    settle,
)

_rng = random.Random(4321)


def _toks(n: int) -> List[int]:
    return [_rng.randrange(3, 512) for _ in range(n)]


SYSTEM = _toks(300)
X = SYSTEM + _toks(90)
Y = SYSTEM + _toks(160)
PARTIAL = _toks(700)
ABORT_WAITING = [_toks(300)]
ABORT_RUNNING = [_toks(600), _toks(450)]
LATE = [_toks(350), _toks(420), _toks(500), _toks(280)]
KILL = [_toks(640), _toks(520), _toks(380)]
#: Router-native flow: prompts, and one whose first 600 tokens the decode
#: computes itself first.
ROUTER = [_toks(640), _toks(300), _toks(450)]
HELD = _toks(700)
#: Router-native faults: a prompt no decode asks for, one a forged
#: registration tries to divert, one whose prefill dies after answering.
ORPHAN, FORGED, KILLED = _toks(500), _toks(420), _toks(380)
#: The LoRA batch: (prompt, adapter name or None).
LORA_BATCH: List[Tuple[List[int], Optional[str]]] = [
    (X, None), (X, "a1"), (X, "a2"), (Y, "a1"), (Y, None), (Y, "a2"),
]

#: Everything the colocated engine computes, by case: (prompt, adapter).
CASES: Dict[str, List[Tuple[List[int], Optional[str]]]] = {
    "lora": LORA_BATCH,
    "partial": [(PARTIAL, None)],
    "abort_waiting": [(p, None) for p in ABORT_WAITING],
    "abort_running": [(p, None) for p in ABORT_RUNNING],
    "late": [(p, None) for p in LATE],
    "kill": [(p, None) for p in KILL],
    "router": [(p, None) for p in ROUTER],
    "held": [(HELD, None)],
    "router_faults": [(FORGED, None), (KILLED, None)],
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Lora]:
    d = tmp_path_factory.mktemp("adapters")
    return {
        name: (name, i + 1, str(make_model.make_lora(d / name, seed=10 + i)))
        for i, name in enumerate(("a1", "a2"))
    }


def _loras(names: Sequence[Optional[str]], adapters: Dict[str, Lora]) -> List[Optional[Lora]]:
    return [adapters[n] if n else None for n in names]


@pytest.fixture(scope="module")
def reference(model: Path, logdir: Path, adapters: Dict[str, Lora]) -> Dict[str, List[List[int]]]:
    """The colocated engine's tokens for every case."""
    e = Engine("colocated-lora", model, logdir, lora=True)
    try:
        e.wait_ready()
        out = {}
        for case, items in CASES.items():
            if case == "lora":
                # One at a time: vLLM's CPU LoRA gives a request without an
                # adapter other tokens (even another first token) when it
                # shares a batch with adapter requests, depending on the
                # batch (seen with no connector at all).
                got = [e.generate([p], loras=_loras([a], adapters))[0] for p, a in items]
            else:
                got = e.generate([p for p, _ in items], loras=_loras([a for _, a in items], adapters))
            out[case] = [o["tokens"] for o in got]
    finally:
        e.stop()
    # The adapters change the model's output (else the LoRA case proves nothing).
    x = out["lora"][:3]
    assert x[0] != x[1] and x[0] != x[2] and x[1] != x[2], x
    return out


class Pair:
    """A prefill and a decode engine (FaultConnector on both), started once."""

    def __init__(self, name: str, mode: str, model: Path, logdir: Path, lease_s: float = 60.0,
                 decode_env: Optional[Dict[str, str]] = None, load_timeout_s: float = 30.0,
                 both: Sequence[str] = (), sender: Sequence[str] = ()) -> None:
        self.name = name
        self.init, self.alloc, done = free_port(), free_port(), free_port()
        ry = receiver_yaml(logdir / f"{name}-receiver.yaml", "tcp", mode, self.init, self.alloc, lease_s=lease_s,
                           extra=both)
        sy = sender_yaml(logdir / f"{name}-sender.yaml", "tcp", mode, done, lease_s=lease_s,
                         extra=[*both, *sender])
        self.hold_saves = logdir / f"{name}-hold-saves.flag"
        self.hold_done = logdir / f"{name}-hold-done.flag"
        fault = dict(connector="FaultConnector", module="fault_connector")
        self.decode = Engine(f"{name}-decode", model, logdir,
                             kv_config("kv_consumer", ry, load_timeout_s=load_timeout_s, **fault),
                             env={"APD_TEST_HOLD_DONE": str(self.hold_done), **(decode_env or {})}, lora=True)
        self.prefill = Engine(f"{name}-prefill", model, logdir, kv_config("kv_producer", sy, **fault),
                              env={"APD_TEST_HOLD_SAVES": str(self.hold_saves)}, lora=True)
        self.decode.wait_ready()
        self.prefill.wait_ready()

    def handoff(self, prompts: Sequence[List[int]], loras: Optional[Sequence[Optional[Lora]]] = None,
                ids: Optional[Sequence[str]] = None, router: bool = False) -> List[Dict[str, Any]]:
        """Runs the prompts on the prefill; their kv_transfer_params.
        ``router``: as vllm-router sends them (no receiver named)."""
        ask = {"do_remote_decode": True} if router else address(self.init, self.alloc)
        outs = self.prefill.generate(prompts, [dict(ask) for _ in prompts], max_tokens=1,
                                     loras=loras, ids=[f"{i}-p" for i in ids] if ids else None)
        params = [o["kv_transfer_params"] for o in outs]
        for p in params:
            assert p and p.get("do_remote_prefill") and "ascend_pd" in p, p
        return params

    def loads(self, ids: Sequence[str]) -> Dict[str, Dict[str, Any]]:
        """The decode's last load event of each request (by client id)."""
        out: Dict[str, Dict[str, Any]] = {}
        for ev in self.decode.events_of("load"):
            if external(ev["req_id"]) in ids:
                out[external(ev["req_id"])] = ev
        return out

    def settle(self) -> Dict[str, Any]:
        return settle([self.decode, self.prefill], ["receiver", "sender"])

    def stop(self) -> None:
        for f in (self.hold_saves, self.hold_done):
            f.unlink(missing_ok=True)
        self.prefill.stop()
        self.decode.stop()


#: The push pair authenticates (a deployment secret on both sides) and
#: frees parked KV no decode registered for after PARK_S.
PARK_S = 20.0


@pytest.fixture(scope="module")
def push_pair(model: Path, logdir: Path, reference: Dict[str, Any]) -> Iterator[Pair]:
    secret = logdir / "push-secret"
    secret.write_bytes(random.Random(36).randbytes(32))
    secret.chmod(0o600)
    p = Pair("id-push", "push", model, logdir, both=[f"pd_auth_secret_file: {secret}"],
             sender=[f"pd_park_timeout: {PARK_S}"])
    try:
        yield p
    finally:
        p.stop()


#: Pull-delay pair: a 10 s pull lease; loads of requests named "late-..."
#: start 14 s after their KV is here.
LEASE_S, LATE_S = 10.0, 14.0


@pytest.fixture(scope="module")
def delay_pair(model: Path, logdir: Path, reference: Dict[str, Any]) -> Iterator[Pair]:
    p = Pair("id-delay", "pull-delay", model, logdir, lease_s=LEASE_S, load_timeout_s=40.0,
             decode_env={"APD_TEST_LATE_LOADS": f"late-={LATE_S}"})
    try:
        yield p
    finally:
        p.stop()


def _lora_case(pair: Pair, reference: Dict[str, Any], adapters: Dict[str, Lora], tag: str) -> Dict[str, Any]:
    prompts = [p for p, _ in LORA_BATCH]
    loras = _loras([a for _, a in LORA_BATCH], adapters)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    # Every prefill answers before any decode runs: all their KV is on the
    # decode side at once. One at a time, like the reference (see
    # `reference`): batched with adapter requests, vLLM's CPU LoRA computes
    # another KV for a request without an adapter.
    params = [pair.handoff([p], [lr], [i])[0] for p, lr, i in zip(prompts, loras, ids)]
    keys = [tuple(p["ascend_pd"]["keys"]) for p in params]
    assert len({keys[0][0], keys[1][0], keys[2][0]}) == 3, "adapters did not change the keys"
    assert keys[0][0] == keys[4][0] and keys[1][0] == keys[3][0], "the shared system prompt lost its sharing"
    # Decoded one at a time, as the reference was (see `reference`).
    outs = [pair.decode.generate([p], [kv], loras=[lr], ids=[i])[0]
            for p, kv, lr, i in zip(prompts, params, loras, ids)]
    for i, (o, want) in enumerate(zip(outs, reference["lora"])):
        assert o["tokens"] == want, f"{tag} {i} (adapter {LORA_BATCH[i][1]}): {o['tokens']} != {want}"
    loads = pair.loads(ids)
    assert sorted(loads) == sorted(ids), loads
    assert all(ev["status"] == "done" and ev["tokens"] > 0 for ev in loads.values()), loads
    # The adapter mix-up a router could make: the prefill ran X under a1,
    # the decode request has no adapter. Refused and recomputed, never
    # loaded: its tokens are the no-adapter ones.
    mix = pair.handoff([X], _loras(["a1"], adapters), [f"{tag}-mix"])
    out = pair.decode.generate([X], mix, ids=[f"{tag}-mix"])
    assert out[0]["tokens"] == reference["lora"][0], "a decode loaded KV computed under another adapter"
    ev = pair.loads([f"{tag}-mix"])[f"{tag}-mix"]
    assert ev["status"] == "refused" and "(the LoRA adapter differs)" in ev["message"], ev
    pools = pair.settle()
    return {"requests": len(prompts), "tokens_identical": True,
            "tokens_loaded_remotely": sum(ev["tokens"] for ev in loads.values()),
            "mixup_refused": ev["message"][:160], "pools_after": pools}


def test_lora_push(push_pair: Pair, reference: Dict[str, Any], adapters: Dict[str, Lora]) -> None:
    RESULTS["lora-push"] = _lora_case(push_pair, reference, adapters, "lp")


def test_lora_pull_delay(delay_pair: Pair, reference: Dict[str, Any], adapters: Dict[str, Lora]) -> None:
    RESULTS["lora-pull-delay"] = _lora_case(delay_pair, reference, adapters, "ld")


def test_partial_prefix_hit_not_on_a_chunk_boundary(push_pair: Pair, reference: Dict[str, Any]) -> None:
    """The decode computed the prompt's first 400 tokens itself (vLLM's
    cache holds 384 of them: three 128-token blocks, half a 256-token
    chunk): only tokens 384.. are loaded."""
    pair = push_pair
    pair.decode.generate([PARTIAL[:400]], max_tokens=1)
    params = pair.handoff([PARTIAL], ids=["partial"])
    out = pair.decode.generate([PARTIAL], params, ids=["partial"])
    assert out[0]["tokens"] == reference["partial"][0]
    ev = pair.loads(["partial"])["partial"]
    assert ev["status"] == "done" and ev["tokens"] == len(PARTIAL) - 384, ev
    RESULTS["partial-prefix"] = {"prompt": len(PARTIAL), "held_by_decode": 384, "loaded": ev["tokens"],
                                 "tokens_identical": True, "pools_after": pair.settle()}


def test_decode_aborted_before_its_load_started(push_pair: Pair, reference: Dict[str, Any]) -> None:
    """The prefill answered but holds its save; the decode request waits for
    the KV and is aborted. When the prefill then sends, the decode's
    receiver refuses those chunks (the abort named the prefill's save):
    both pools are back without waiting for pd_resident_ttl, and the same
    prompt then runs through the pair with the colocated tokens."""
    pair = push_pair
    pair.hold_saves.write_text("1")
    queued_s: Optional[float] = None
    try:
        params = pair.handoff(ABORT_WAITING, ids=["abortw"])
        pair.decode.submit(ABORT_WAITING, params, ids=["abortw"])
        # Aborted once its load waits in the worker. Full CI runs showed the
        # decode's worker not taking the load for 60 s, until the prefill
        # sent (an open stall, see the closing note): then the abort comes
        # after 20 s, and what must still hold is below (nothing leaks, the
        # rerun is right); the results record which case ran.
        t0 = time.monotonic()
        while not [e for e in pair.decode.events_of("load_queued") if external(e["req_id"]) == "abortw"]:
            if time.monotonic() > t0 + 20:
                break
            time.sleep(0.1)
        else:
            queued_s = round(time.monotonic() - t0, 2)
        pair.decode.abort(["abortw"])
        if queued_s is not None:
            # The decode's worker dropped the load (and told its receiver)
            # before the prefill sends anything.
            deadline = time.monotonic() + 30
            while pair.loads(["abortw"]).get("abortw", {}).get("status") != "cancelled":
                assert time.monotonic() < deadline, pair.decode.events_of("load")
                time.sleep(0.1)
            assert not [e for e in pair.decode.events_of("load_start") if external(e["req_id"]) == "abortw"]
    finally:
        pair.hold_saves.unlink()
    out = pair.decode.wait(["abortw"], timeout=120)
    # (In the stalled case the KV may land before the engine takes the abort.)
    assert out[0]["aborted"] or queued_s is None, out
    # The prefill now sends; step it until its save ended.
    deadline = time.monotonic() + 60
    while not (saves := [e for e in pair.prefill.events_of("save") if external(e["req_id"]) == "abortw-p"]):
        assert time.monotonic() < deadline, "the held save never ended"
        pair.prefill.generate([[5]], max_tokens=1)
        time.sleep(0.2)
    assert saves[-1]["status"] == "done", saves
    t0 = time.monotonic()
    pools = pair.settle()
    freed_s = round(time.monotonic() - t0, 1)
    params = pair.handoff(ABORT_WAITING, ids=["abortw2"])
    out = pair.decode.generate(ABORT_WAITING, params, ids=["abortw2"])
    assert out[0]["tokens"] == reference["abort_waiting"][0]
    RESULTS["abort-before-load"] = {"load_queued_before_abort_s": queued_s, "pools_back_after_s": freed_s, "late_save_status": saves[-1]["status"],
                                    "rerun_tokens_identical": True, "pools_after": pools}


def test_decode_aborted_after_its_load_started(push_pair: Pair, reference: Dict[str, Any]) -> None:
    """The loads ran (their events are written) but vLLM is not told yet when
    the requests are aborted: their blocks stay the load's until it is
    reported; afterwards the pools are back and the prompts run again with
    the colocated tokens."""
    pair = push_pair
    ids = ["abortr-0", "abortr-1"]
    params = pair.handoff(ABORT_RUNNING, ids=ids)
    pair.hold_done.write_text("1")
    try:
        pair.decode.submit(ABORT_RUNNING, params, ids=ids)
        deadline = time.monotonic() + 60
        while len(pair.loads(ids)) < len(ids):
            assert time.monotonic() < deadline, pair.decode.events_of("load")
            time.sleep(0.1)
        pair.decode.abort(ids)
    finally:
        pair.hold_done.unlink()
    outs = pair.decode.wait(ids, timeout=60)
    assert all(o["aborted"] for o in outs), outs
    loads = pair.loads(ids)
    pools = pair.settle()
    params = pair.handoff(ABORT_RUNNING, ids=[f"{i}-again" for i in ids])
    outs = pair.decode.generate(ABORT_RUNNING, params, ids=[f"{i}-again" for i in ids])
    for o, want in zip(outs, reference["abort_running"]):
        assert o["tokens"] == want
    RESULTS["abort-after-load-started"] = {"load_status_at_abort": {k: v["status"] for k, v in loads.items()},
                                           "rerun_tokens_identical": True, "pools_after": pools}


def test_a_load_after_its_lease_fails_and_the_others_complete(delay_pair: Pair, reference: Dict[str, Any]) -> None:
    """Four pull-delay loads into the same decode; one starts after its
    10 s lease ended. It fails (the library never reads after the lease)
    and is recomputed; the other three load; every request's tokens equal
    the colocated run's; both pools come back."""
    pair = delay_pair
    ids = ["late-0", "ok-1", "ok-2", "ok-3"]
    params = pair.handoff(LATE, ids=ids)
    outs = pair.decode.generate(LATE, params, ids=ids, timeout=300)
    for i, (o, want) in enumerate(zip(outs, reference["late"])):
        assert o["tokens"] == want, f"{ids[i]}: {o['tokens']} != {want}"
    loads = pair.loads(ids)
    assert loads["late-0"]["status"] not in ("done",), loads["late-0"]
    assert all(loads[i]["status"] == "done" for i in ids[1:]), loads
    RESULTS["lease-outlived"] = {"late": {k: loads["late-0"][k] for k in ("status", "message")},
                                 "others_done": 3, "tokens_identical": True, "pools_after": pair.settle()}


def _router_case(pair: Pair, reference: Dict[str, Any], tag: str) -> Dict[str, Any]:
    """The flow vllm-router drives: the prefill is asked with only
    do_remote_decode, parks the KV and names where it takes registrations;
    the decode, given the params unchanged, registers and loads."""
    ids = [f"{tag}-{i}" for i in range(len(ROUTER))]
    params = pair.handoff(ROUTER, ids=ids, router=True)
    for p in params:
        reg = p["ascend_pd"].get("register")
        assert reg and reg["host"] and reg["ports"], p
    outs = pair.decode.generate(ROUTER, params, ids=ids)
    for o, want in zip(outs, reference["router"]):
        assert o["tokens"] == want
    loads = pair.loads(ids)
    assert all(loads[i]["status"] == "done" and loads[i]["tokens"] == len(p) for i, p in zip(ids, ROUTER)), loads
    registered = {external(e["req_id"]) for e in pair.decode.events_of("register")}
    assert set(ids) <= registered, registered
    # A transfer the prefill does not know: the decode fails the load at
    # once (recomputes) instead of waiting for load_timeout_s.
    bogus = json.loads(json.dumps(params[0]))
    bogus["ascend_pd"]["save_id"] = f"nobody-{tag}"
    t0 = time.monotonic()
    out = pair.decode.generate([ROUTER[0]], [bogus], ids=[f"{tag}-bogus"])
    bogus_s = round(time.monotonic() - t0, 2)
    assert out[0]["tokens"] == reference["router"][0]
    bev = pair.loads([f"{tag}-bogus"])[f"{tag}-bogus"]
    assert bev["status"] == "failed" and "knows no transfer" in bev["message"], bev
    # The decode's own prefix cache holds the first 512 tokens (4 blocks):
    # the prefill sends only the chunks after them.
    pair.decode.generate([HELD[:600]], max_tokens=1)

    def skipped() -> int:
        ends = [e for e in pair.prefill.events_of("save") if e.get("parked") and "registrations" in e]
        return max((e["registrations"]["chunks_skipped"] for e in ends), default=0)

    skipped_before = skipped()
    held = pair.handoff([HELD], ids=[f"{tag}-held"], router=True)
    out = pair.decode.generate([HELD], held, ids=[f"{tag}-held"])
    # The prefill's own counters: the two chunks the decode holds were
    # never sent.
    deadline = time.monotonic() + 30
    while not [e for e in pair.prefill.events_of("save") if external(e["req_id"]) == f"{tag}-held-p"]:
        assert time.monotonic() < deadline, "the prefill never reported the held case's save"
        pair.prefill.generate([[5]], max_tokens=1)
        time.sleep(0.2)
    assert skipped() - skipped_before == 2, (skipped_before, skipped())
    assert out[0]["tokens"] == reference["held"][0]
    ev = pair.loads([f"{tag}-held"])[f"{tag}-held"]
    reg = [e for e in pair.decode.events_of("register") if external(e["req_id"]) == f"{tag}-held"]
    assert reg and reg[-1]["held_tokens"] == 512, reg
    assert ev["status"] == "done" and ev["tokens"] == len(HELD) - 512, ev
    pools = pair.settle()
    return {"prompts": len(ROUTER), "tokens_identical": True,
            "tokens_loaded_remotely": sum(loads[i]["tokens"] for i in ids),
            "unknown_transfer_failed_after_s": bogus_s, "unknown_transfer_message": bev["message"][:160],
            "held_by_decode": 512, "held_case_loaded": ev["tokens"],
            "prefill_chunks_not_sent": skipped() - skipped_before, "pools_after": pools}


def test_router_flow_push(push_pair: Pair, reference: Dict[str, Any]) -> None:
    RESULTS["router-flow-push"] = _router_case(push_pair, reference, "rp")


def test_router_flow_pull_delay(delay_pair: Pair, reference: Dict[str, Any]) -> None:
    RESULTS["router-flow-pull-delay"] = _router_case(delay_pair, reference, "rd")


def test_prefill_killed_while_its_saves_are_in_flight(delay_pair: Pair, reference: Dict[str, Any]) -> None:
    """The prefill answers three requests with their saves held back, the
    decode requests arrive, then the saves are let go and the prefill is
    killed as soon as the first of them reached the decode (its load
    started), the others in flight (or after 30 s if none arrived, which
    the results record): whatever each load met (done, or failed), every
    decode's tokens equal the colocated run's and the decode's pool is
    back."""
    pair = delay_pair
    ids = [f"kill-{i}" for i in range(len(KILL))]
    pair.hold_saves.write_text("1")
    params = pair.handoff(KILL, ids=ids)
    pair.decode.submit(KILL, params, ids=ids)
    pair.hold_saves.unlink()
    t0 = time.monotonic()
    pair.prefill.submit([[5]], max_tokens=1)
    deadline = t0 + 30
    while not [e for e in pair.decode.events_of("load_start") if external(e["req_id"]).startswith("kill-")]:
        if time.monotonic() > deadline:
            break  # killed before any save arrived: the loads time out
        time.sleep(0.005)
    first_arrival_s = round(time.monotonic() - t0, 2) if time.monotonic() <= deadline else None
    pair.prefill.kill()
    outs = pair.decode.wait(ids, timeout=300)
    for i, (o, want) in enumerate(zip(outs, reference["kill"])):
        assert o["tokens"] == want, f"{ids[i]}: {o['tokens']} != {want}"
    loads = pair.loads(ids)
    pools = settle([pair.decode], ["receiver"])
    RESULTS["prefill-killed-mid-transfer"] = {
        "first_save_reached_decode_after_s": first_arrival_s,
        "loads": {k: {"status": v["status"], "message": (v.get("message") or "")[:120]} for k, v in loads.items()},
        "tokens_identical": True, "decode_pools_after": pools,
    }


def _mp(v: Any) -> bytes:
    """A msgpack encoding of str, small int, list and dict (the test's own:
    the vLLM venv has no msgpack)."""
    if isinstance(v, str):
        b = v.encode()
        return (bytes([0xA0 | len(b)]) if len(b) < 32 else bytes([0xD9, len(b)])) + b
    if isinstance(v, int):
        return bytes([v]) if 0 <= v < 128 else bytes([0xCD]) + v.to_bytes(2, "big")
    if isinstance(v, list):
        return bytes([0x90 | len(v)]) + b"".join(_mp(x) for x in v)
    assert isinstance(v, dict)
    return bytes([0x80 | len(v)]) + b"".join(_mp(k) + _mp(x) for k, x in v.items())


def _registrations(engine: Engine) -> Dict[str, int]:
    """The prefill's latest registration counters (steps it so its worker
    writes them)."""
    engine.generate([[5]], max_tokens=1)
    evs = engine.events_of("registrations")
    return {k: int(v) for k, v in evs[-1].items() if isinstance(v, int)} if evs else {}


def test_router_flow_faults_push(push_pair: Pair, reference: Dict[str, Any]) -> None:
    """Router-native faults with a deployment secret: a prefill whose decode
    never comes frees the parked KV after pd_park_timeout; a registration
    not sealed with the secret is dropped unanswered and counted, and the
    real decode still gets the KV; a prefill killed after it answered makes
    the decode's registration fail (no answer), reported as a load error and
    recomputed. Runs last on this pair: its prefill is gone after it."""
    import zmq

    pair = push_pair
    # A decode that never comes.
    pair.handoff([ORPHAN], ids=["orphan"], router=True)
    t0 = time.monotonic()
    while not (ends := [e for e in pair.prefill.events_of("save") if external(e["req_id"]) == "orphan-p"]):
        assert time.monotonic() < t0 + PARK_S + 90, "the parked save never ended"
        pair.prefill.generate([[5]], max_tokens=1)
        time.sleep(0.5)
    freed_s = round(time.monotonic() - t0, 1)
    assert ends[-1]["status"] == "failed" and "pd_park_timeout" in ends[-1]["message"], ends[-1]
    assert ends[-1]["registrations"]["expired"] >= 1, ends[-1]
    pools = pair.settle()
    # A forged registration: the real message, not sealed with the secret.
    params = pair.handoff([FORGED], ids=["forged"], router=True)
    ours = params[0]["ascend_pd"]
    before = _registrations(pair.prefill).get("dropped", 0)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{ours['register']['host']}:{ours['register']['ports'][0]}")
    sock.send(_mp({"type": "RegisterDecode", "transfer_id": ours["save_id"], "receiver_host": "127.0.0.1",
                   "receiver_init_port": [9], "receiver_alloc_port": [10], "held_tokens": 0}))
    with pytest.raises(zmq.Again):
        sock.recv()
    sock.close()
    ctx.term()
    out = pair.decode.generate([FORGED], params, ids=["forged"])
    assert out[0]["tokens"] == reference["router_faults"][0]
    fev = pair.loads(["forged"])["forged"]
    assert fev["status"] == "done" and fev["tokens"] == len(FORGED), fev
    deadline = time.monotonic() + 30
    while _registrations(pair.prefill).get("dropped", 0) <= before:
        assert time.monotonic() < deadline, "the forged registration was not counted"
        time.sleep(0.2)
    # The prefill dies after it answered.
    params = pair.handoff([KILLED], ids=["killed"], router=True)
    pair.prefill.kill()
    t0 = time.monotonic()
    out = pair.decode.generate([KILLED], params, ids=["killed"])
    killed_s = round(time.monotonic() - t0, 1)
    assert out[0]["tokens"] == reference["router_faults"][1]
    ev = pair.loads(["killed"])["killed"]
    assert ev["status"] == "failed" and "no answer" in ev["message"], ev
    decode_pools = settle([pair.decode], ["receiver"])
    RESULTS["router-flow-faults"] = {
        "orphan_freed_after_s": freed_s, "orphan_message": ends[-1]["message"][:160], "pools_after_orphan": pools,
        "forged_registration": "dropped unanswered, counted; the real decode loaded", "forged_loaded": fev["tokens"],
        "killed_prefill_decode_answered_after_s": killed_s, "killed_message": ev["message"][:160],
        "tokens_identical": True, "decode_pools_after": decode_pools,
    }
