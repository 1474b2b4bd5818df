"""A prefill restarted under load: the sender's drain on close and fixed
listener ports (``pd_base_port``), with real `vllm serve` engines.

One prefill (kv_producer) and one decode (kv_consumer), pull-delay over
TCP, both with ``pd_base_port: B`` and no port key of their own (the
prefill's listeners at B+10.., the decode's at B..), behind the package's
proxy in the router-native flow (no ``--decode-kv``: the prefill parks each
save, the decode registers for it). Pull-delay because it is the mode where
a prefill holds the most for others: its request ends (and the proxy moves
on to the decode) with the KV parked in the sender's pool until the decode
registers and pulls it, so under load the prefill always owns KV its
decodes have not taken yet: what a restart would lose, and what the drain
is for.

The decode runs without prefix caching, so every hand-off loads the whole
prompt from the prefill (none is found in the decode's own cache), and the
reference tokens, computed by the decode alone first, leave nothing behind.

The run (one test):

1. reference tokens of a pool of prompts (300-1000 tokens) from the decode
   alone; the engines' listening ports read from /proc;
2. load: CLIENTS threads send requests through the proxy back to back
   (greedy, MAX_TOKENS tokens; one second's pause after a failure);
3. after WARM completed requests, the "orphan": the prefill leg of one more
   hand-off sent straight to the prefill, its decode leg held back, so its
   KV stays parked; then SIGTERM to the prefill's API server (what an
   orchestrator sends). The prefill runs with ``--shutdown-timeout`` and
   ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` above ``pd_drain_timeout``:
   with vLLM's defaults (0 and 5 s) its engine core, or its worker (where
   the connector drains) 9 s later, is killed and the drain never ends;
4. when its process group is gone, a new prefill on the same HTTP port with
   the same connector YAML; then the orphan's decode leg goes to the decode,
   which registers at the old register port, where the new prefill, which
   never had that KV, now listens; the load goes on until AFTER requests
   completed through the new prefill, then stops;
5. both engines are stepped until their pools are back.

Asserted: every completed request's tokens (the orphan's too) equal the
reference; every request in flight at the SIGTERM completed (but one sent in its last
second, whose prefill leg may come after it); a request may
fail only while the prefill was down or going down, at the prefill leg (its
id never reached the decode; with HTTP 5xx); the old prefill wrote one
``drain`` event and logged it: held by the orphan to ``pd_drain_timeout``
(not beyond it plus slack), then the orphan cancelled; vLLM killed nothing;
every decode load that failed (the orphan's, refused by the new prefill)
belongs to a request that completed with the reference tokens (vLLM
recomputed it); every request after the restart was loaded whole from the
new prefill, whose saves all ended ``done``; both pools are back; the new
prefill listens on exactly the old one's ports, those ``pd_base_port``
gives, and the decode registered with both at the same port. Figures go to
``RESULTS["prefill-restart"]``.

The proxy runs with ``--timeout PROXY_TIMEOUT_S``: vLLM's HTTP server goes on
taking requests while its engine shuts down, may never answer them, and
waits for their connections before it exits (seen: > 3 minutes, until the
proxy's default 600 s timeout would end them).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set

import pytest

from conftest import RESULTS
from harness import MAX_TOKENS, kv_config, pools_back, receiver_yaml, sender_yaml
from router_harness import Served, _Process, start, stop
from test_ops import STEP, Proxy, _until

MODE, CHANNEL = "pull-delay", "tcp"
#: ``pd_drain_timeout`` of the prefill: small, so the bound is visible.
DRAIN_S = 5
#: ``vllm serve --shutdown-timeout``: how long the API server lets its
#: engine core run after SIGTERM before killing it (0 by default: at once).
SHUTDOWN_S = DRAIN_S + 25
#: ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``: how long the engine core waits
#: for its worker process (where the connector drains) before SIGTERM and,
#: 4 s later, SIGKILL (5 s by default).
WORKER_SHUTDOWN_S = DRAIN_S + 15
#: Concurrent client threads.
CLIENTS = 3
#: Requests completed before the SIGTERM, and through the new prefill.
WARM, AFTER = 6, 8
#: Slack on the drain's bound (a loaded 2-core host).
SLACK_S = 10.0
#: The proxy's ``--timeout`` (per upstream request; 600 s by default). A
#: request the proxy sends to the prefill while it shuts down is accepted
#: by vLLM's HTTP server and may never be answered (its engine is gone),
#: and the server waits for that connection before it exits: the proxy
#: giving up is what lets it exit. A hand-off here takes a few seconds.
PROXY_TIMEOUT_S = 20

_rng = random.Random(3838)
#: Random tokens: no prompt shares a block with another or with STEP.
POOL = [[_rng.randrange(3, 512) for _ in range(n)] for n in (300, 347, 420, 512, 555, 640, 700, 768, 801, 900, 960, 1000)]

#: The pool prompt whose hand-off is split around the restart: its prefill
#: leg on the old prefill before the SIGTERM (no decode is told, so its KV
#: stays parked and holds the drain to its bound), its decode leg after the
#: new prefill is up, so the decode registers at the same port with a
#: prefill that never had that KV.
ORPHAN = 4

#: A rank's listeners under pd_base_port: base + 20 * rank + slot. A pull
#: mode TCP sender opens its done (10), register (11) and data (13)
#: listeners; a TCP receiver its init (0), alloc (1) and data (3).
SENDER_SLOTS = (10, 11, 13)
RECEIVER_SLOTS = (0, 1, 3)


# ------------------------------------------------------------------ helpers


class Serve(Served):
    """A `vllm serve` engine with extra command-line flags."""

    def __init__(self, name: str, model: Path, log_dir: Path, kv: Dict[str, Any], flags: Sequence[str] = (),
                 env: Optional[Dict[str, str]] = None, port: Optional[int] = None) -> None:
        self._flags = list(flags)
        super().__init__(name, model, log_dir, kv, env=env, port=port)

    def _spawn(self, cmd: Sequence[str], env: Dict[str, str]) -> None:
        super()._spawn(list(cmd) + self._flags, env)


class TimedProxy(Proxy):
    """The package's proxy with ``--timeout PROXY_TIMEOUT_S``."""

    def _spawn(self, cmd: Sequence[str], env: Dict[str, str]) -> None:
        super()._spawn(list(cmd) + ["--timeout", str(PROXY_TIMEOUT_S)], env)


def base_port() -> int:
    """A ``pd_base_port`` whose 20 ports are free (below the ephemeral range,
    above the ports harness.free_port hands out)."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        base = rng.randrange(30200, 32500, 20)
        try:
            for p in range(base, base + 20):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise RuntimeError("no free block of 20 ports")


def group(pgid: int) -> List[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            state, _ppid, pgrp = (d / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            out.append(int(d.name))
    return out


def listening(pgid: int) -> List[int]:
    """The TCP ports that processes of group ``pgid`` listen on (from
    /proc/<pid>/fd and /proc/net/tcp{,6})."""
    inodes: Set[str] = set()
    for pid in group(pgid):
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    ports: Set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def _metric(e: Served, name: str) -> float:
    try:
        return e.metric(name)
    except (OSError, AssertionError):
        return -1.0


@dataclass
class Call:
    """One client request through the proxy."""

    n: int
    prompt: int
    t0: float
    t1: float = 0.0
    status: int = 0
    tokens: List[int] = field(default_factory=list)
    #: The proxy's X-Request-Id: both legs' vLLM ids are cmpl-<it>-0-<8>.
    xrid: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200


def body(model: str, prompt: List[int], max_tokens: int, **extra: Any) -> Dict[str, Any]:
    """A greedy token-id completion request that answers token ids."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **extra}


def ask(url: str, req_body: Dict[str, Any], call: Call, xrid: Optional[str] = None) -> Dict[str, Any]:
    """POSTs ``req_body``; fills ``call`` (status, tokens, X-Request-Id,
    error, end time) and returns the JSON answer ({} on an error)."""
    headers = {"Content-Type": "application/json"}
    if xrid:
        headers["X-Request-Id"] = xrid
    req = urllib.request.Request(url, data=json.dumps(req_body).encode(), headers=headers)
    answer: Dict[str, Any] = {}
    try:
        with urllib.request.urlopen(req, timeout=180) as r:
            call.xrid = r.headers.get("X-Request-Id", "") or (xrid or "")
            answer = json.loads(r.read())
            call.tokens = list(answer["choices"][0]["token_ids"])
            call.status = int(r.status)
    except urllib.error.HTTPError as e:
        call.xrid = (e.headers.get("X-Request-Id", "") if e.headers else "") or (xrid or "")
        call.status = int(e.code)
        call.error = e.read()[:500].decode(errors="replace")
    except Exception as e:  # the proxy itself unreachable, a timeout
        call.status = -1
        call.error = f"{type(e).__name__}: {e}"
    finally:
        call.t1 = time.monotonic()
    return answer


class Load:
    """CLIENTS threads asking the proxy back to back until stopped."""

    def __init__(self, url: str, model: str) -> None:
        self.url = url
        self.model = model
        self.calls: List[Call] = []
        self._lock = threading.Lock()
        self._count = itertools.count()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True, name=f"load{i}") for i in range(CLIENTS)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in self._threads), "a client thread did not end"

    def snapshot(self) -> List[Call]:
        """The calls so far, in the order they were sent."""
        with self._lock:
            return sorted(self.calls, key=lambda c: c.n)

    def completed_since(self, t: float) -> int:
        with self._lock:
            return sum(1 for c in self.calls if c.ok and c.t0 >= t)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                n = next(self._count)
                call = Call(n, n % len(POOL), time.monotonic())
                self.calls.append(call)
            self._ask(call)
            if not call.ok:
                self._stop.wait(1.0)

    def _ask(self, call: Call) -> None:
        ask(f"{self.url}/v1/completions", body(self.model, POOL[call.prompt], MAX_TOKENS), call)


def _rid_of(req_id: str) -> str:
    """The proxy's X-Request-Id in a vLLM request id ``cmpl-<it>-0-<8>``."""
    assert req_id.startswith("cmpl-"), req_id
    return req_id[len("cmpl-"):].rsplit("-", 2)[0]


# -------------------------------------------------------------------- test


@dataclass
class Run:
    """The engines and the proxy; ``spawn_new`` starts the second prefill."""

    base: int
    decode: Served
    old: Served
    proxy: Proxy
    spawn_new: Callable[[], Served]
    procs: List[_Process]
    start_s: Dict[str, float] = field(default_factory=dict)


@pytest.fixture
def engines(model: Path, logdir: Path) -> Iterator[Run]:
    base = base_port()
    r = receiver_yaml(logdir / "restart-decode.yaml", CHANNEL, MODE, 0, 0, extra=[f"pd_base_port: {base}"])
    s = sender_yaml(logdir / "restart-prefill.yaml", CHANNEL, MODE, 0,
                    extra=[f"pd_base_port: {base}", f"pd_drain_timeout: {DRAIN_S}"])
    # Every listener port from pd_base_port: no port key of its own.
    for path, keys in ((r, ("pd_peer_init_port", "pd_peer_alloc_port")), (s, ("pd_pull_done_port",))):
        lines = [line for line in path.read_text().splitlines() if line.split(":")[0] not in keys]
        path.write_text("\n".join(lines) + "\n")
    decode = Serve("restart-decode", model, logdir, kv_config("kv_consumer", r), flags=["--no-enable-prefix-caching"])
    prefill_flags = ["--shutdown-timeout", str(SHUTDOWN_S)]
    prefill_env = {"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": str(WORKER_SHUTDOWN_S)}
    old = Serve("restart-prefill-old", model, logdir, kv_config("kv_producer", s), flags=prefill_flags,
                env=prefill_env)
    proxy = TimedProxy("restart-proxy", old, decode, logdir)

    def spawn_new() -> Served:
        new = Serve("restart-prefill-new", model, logdir, kv_config("kv_producer", s), flags=prefill_flags,
                    env=prefill_env, port=old.port)
        run.procs.append(new)
        return new

    run = Run(base, decode, old, proxy, spawn_new, [decode, old, proxy])
    try:
        run.start_s = start(run.procs)
        yield run
    finally:
        stop(run.procs)


def test_prefill_restart_under_load(engines: Run) -> None:
    run = engines
    decode, old, proxy = run.decode, run.old, run.proxy
    model = decode.model
    t_begin = time.monotonic()
    base = run.base
    want_sender = [base + s for s in SENDER_SLOTS]
    want_receiver = [base + s for s in RECEIVER_SLOTS]

    # 1. References: the decode alone (no hand-off, no prefix cache).
    refs = [decode.complete(p, MAX_TOKENS)["choices"][0]["token_ids"] for p in POOL]
    assert all(len(t) == MAX_TOKENS for t in refs)
    old_ports = [p for p in listening(old.proc.pid) if base <= p < base + 20]
    decode_ports = [p for p in listening(decode.proc.pid) if base <= p < base + 20]
    assert old_ports == want_sender, (old_ports, want_sender)
    assert decode_ports == want_receiver, (decode_ports, want_receiver)

    # 2. Load.
    load = Load(proxy.url, model)
    load.start()
    orphan_id = f"orphan-{base}"
    try:
        _until(f"{WARM} requests completed through the proxy", lambda: load.completed_since(0) >= WARM,
               lambda: None, timeout=180)
        # The orphan's prefill leg: its KV parked on the old prefill, and
        # no decode told of it until after the restart.
        orphan = Call(-1, ORPHAN, time.monotonic())
        params = ask(f"{old.url}/v1/completions",
                     body(model, POOL[ORPHAN], 1, kv_transfer_params={"do_remote_decode": True}), orphan,
                     xrid=orphan_id).get("kv_transfer_params")
        assert orphan.ok and isinstance(params, dict), (orphan, params)
        # 3. SIGTERM to the API server.
        in_flight = [c for c in load.snapshot() if not c.t1]
        t_term = time.monotonic()
        wall_term = time.time()
        os.kill(old.proc.pid, signal.SIGTERM)
        old.proc.wait(timeout=SHUTDOWN_S + PROXY_TIMEOUT_S + 60)
        t_exit = time.monotonic()
        _until("the old prefill's process group gone", lambda: not group(old.proc.pid), lambda: None, timeout=60)
        t_gone = time.monotonic()
        # 4. The new prefill: same HTTP port, same connector YAML.
        new = run.spawn_new()
        new.wait_healthy()
        t_up = time.monotonic()
        new_ports = [p for p in listening(new.proc.pid) if base <= p < base + 20]
        # The orphan's decode leg: the decode registers at the old
        # prefill's register port, where the new prefill now listens.
        late = Call(-2, ORPHAN, time.monotonic())
        ask(f"{decode.url}/v1/completions", body(model, POOL[ORPHAN], MAX_TOKENS, kv_transfer_params=params), late,
            xrid=orphan_id)
        _until(f"{AFTER} requests completed through the new prefill",
               lambda: load.completed_since(t_up) >= AFTER, lambda: None, timeout=180)
    finally:
        load.stop()
    t_load_end = time.monotonic()

    # 5. Pools back: both engines stepped (their connectors report what
    # ended, and their pools, when they step).
    def back() -> bool:
        d, p = decode.last_pools(), new.last_pools()
        return (set(d) == {"receiver"} and pools_back(d) and set(p) == {"sender"} and pools_back(p)
                and _metric(new, "vllm:ascend_pd_parked_saves") == 0)

    _until("both pools back", back, lambda: (decode.complete(STEP, 1), new.complete(STEP, 1)) and None,
           timeout=90)

    calls = load.snapshot()
    window = {"before": [c for c in calls if c.t0 < t_term],
              "during": [c for c in calls if t_term <= c.t0 < t_up],
              "after": [c for c in calls if c.t0 >= t_up]}

    # Tokens: every completed request equals its reference, the orphan too.
    for c in calls + [late]:
        if c.ok:
            assert c.tokens == refs[c.prompt], (c.n, c.prompt, len(POOL[c.prompt]), c.tokens, refs[c.prompt])
    assert late.ok and late.tokens == refs[ORPHAN], late
    # Every request in flight at the SIGTERM completed, but one sent in its
    # last second, whose prefill leg may have come after it.
    settled_before = [c for c in in_flight if c.t0 <= t_term - 1.0]
    assert all(c.ok for c in settled_before), [c for c in settled_before if not c.ok]

    # Failures: only while the prefill was down or going down, at the
    # prefill leg (the decode never saw the request).
    decode_events = decode.all_events()
    seen_at_decode = {_rid_of(ev["req_id"]) for ev in decode_events if "req_id" in ev}
    completed = {c.xrid for c in calls if c.ok} | {orphan_id}
    failed = [c for c in calls if not c.ok]
    for c in failed:
        assert t_term <= c.t1 and c.t0 < t_up, (c, t_term, t_up)
        assert c.xrid and c.xrid not in seen_at_decode, f"request {c.n} failed at the decode: {c}"
        assert c.status in (500, 502, 503, 504), c
    assert not [c for c in window["after"] if not c.ok]
    # Every request the decode saw is one that completed.
    assert seen_at_decode <= completed, seen_at_decode - completed

    # The drain of the old prefill: one event, logged; the orphan kept it
    # to its bound, then was cancelled.
    drains = old.events_of("drain")
    assert len(drains) == 1, (drains, old.tail())
    drain = {k: drains[0][k] for k in ("drained", "waited_ms", "saves_left", "parked_cancelled", "pulls_cancelled")}
    assert drain["drained"] == 0 and drain["parked_cancelled"] >= 1, drain
    assert DRAIN_S * 1000 <= drain["waited_ms"] <= DRAIN_S * 1000 + SLACK_S * 1000, drain
    drain_start = drains[0]["t"] - drain["waited_ms"] / 1000
    old_log = old.log_path.read_text(errors="replace").splitlines()
    drained_lines = [line for line in old_log if "sender drained" in line]
    assert drained_lines, "the old prefill did not log its drain"
    shutdown_lines = [line.split("] ", 1)[-1] for line in old_log if "[shutdown]" in line]
    assert not [line for line in shutdown_lines if "force killing" in line or "SIGKILL" in line], shutdown_lines

    # Decode loads: every one that failed belongs to a request that
    # completed with the reference tokens (vLLM recomputed it), the
    # orphan's among them; every request after the restart was loaded
    # whole from the new prefill.
    by_rid = {c.xrid: c for c in calls if c.xrid}
    by_rid[orphan_id] = late
    loads = [ev for ev in decode_events if ev.get("event") == "load"]
    failed_loads = []
    for ev in loads:
        if ev["status"] == "done":
            continue
        owner = by_rid.get(_rid_of(ev["req_id"]))
        assert owner is not None and owner.ok and owner.tokens == refs[owner.prompt], (ev, owner)
        failed_loads.append({"request": "orphan" if owner is late else owner.n, "status": ev["status"],
                             "message": str(ev.get("message"))[:300], "after_sigterm_s": round(ev["t"] - wall_term, 1)})
    assert [f for f in failed_loads if f["request"] == "orphan"], failed_loads
    done_by_rid = {_rid_of(ev["req_id"]): ev for ev in loads if ev["status"] == "done"}
    for c in window["after"]:
        loaded = done_by_rid.get(c.xrid)
        assert loaded is not None and loaded["tokens"] == len(POOL[c.prompt]), (c, loaded)
    # Loads of the old prefill's KV that ended after its drain began.
    during_drain = [ev for ev in loads if ev["status"] == "done" and ev["t"] >= drain_start
                    and by_rid.get(_rid_of(ev["req_id"])) in window["before"]]
    new_saves = new.events_of("save")
    assert len([ev for ev in new_saves if ev["status"] == "done" and ev.get("parked")]) >= len(window["after"])
    assert all(ev["status"] == "done" for ev in new_saves), new_saves
    new_registrations = (new.events_of("registrations") or [{}])[-1]
    # The decode registered with both prefills at the same register port.
    registers = [ev for ev in decode_events if ev.get("event") == "register"]
    reg_ports = sorted({p for ev in registers for p in ev["ports"]})
    assert reg_ports == [base + 11], reg_ports

    # Fixed ports: the new prefill's listeners are the old one's.
    assert new_ports == old_ports == want_sender, (new_ports, old_ports)

    def counts(cs: List[Call]) -> Dict[str, int]:
        return {"sent": len(cs), "completed": sum(c.ok for c in cs), "failed": sum(not c.ok for c in cs)}

    failures: Dict[str, Dict[str, float]] = {}
    examples: Dict[str, str] = {}
    for c in failed:
        if "unreachable" in c.error:
            kind = "prefill unreachable (proxy 502)"
        elif "did not answer in time" in c.error:
            kind = "sent to the prefill while it shut down, never answered (proxy 504)"
        elif "kv_transfer_params" in c.error:
            kind = "the shutting-down prefill answered without kv_transfer_params (proxy 502)"
        else:
            kind = f"the shutting-down prefill answered {c.status}"
        f = failures.setdefault(kind, {"count": 0, "max_s": 0.0})
        f["count"] += 1
        f["max_s"] = max(f["max_s"], round(c.t1 - c.t0, 1))
        examples.setdefault(kind, c.error[:300])
    RESULTS["prefill-restart"] = {
        "mode": MODE,
        "channel": CHANNEL,
        "flow": "router-native (ascend_pd.proxy without --decode-kv)",
        "pd_base_port": base,
        "pd_drain_timeout_s": DRAIN_S,
        "vllm_shutdown_timeout_s": SHUTDOWN_S,
        "vllm_worker_shutdown_timeout_s": WORKER_SHUTDOWN_S,
        "proxy_timeout_s": PROXY_TIMEOUT_S,
        "clients": CLIENTS,
        "prompt_lengths": [len(p) for p in POOL],
        "max_tokens": MAX_TOKENS,
        "requests": {k: counts(v) for k, v in window.items()} | {"total": counts(calls)},
        "in_flight_at_sigterm": {"count": len(in_flight), "completed": sum(c.ok for c in in_flight),
                                 "sent_in_its_last_second": len(in_flight) - len(settled_before)},
        "failures_by_kind": failures,
        "failure_examples": examples,
        "failed_at_decode": 0,
        "tokens_identical": True,
        "reference": "the decode alone (no hand-off, prefix caching off), before the load",
        "drain": drain,
        "drain_log": drained_lines[-1].split("] ", 1)[-1],
        "old_prefill_loads_done_during_drain": len(during_drain),
        "orphan": {"prompt_tokens": len(POOL[ORPHAN]), "kv_transfer_params": params,
                   "decode_leg_s": round(late.t1 - late.t0, 1), "tokens_identical": True},
        "vllm_shutdown_log": shutdown_lines,
        "old_prefill_http_waited_for_connections": any("Waiting for connections to close" in line
                                                       for line in old_log),
        "sigterm_to_exit_s": round(t_exit - t_term, 1),
        "sigterm_to_group_gone_s": round(t_gone - t_term, 1),
        "new_prefill_start_s": new.start_s,
        "downtime_s": round(t_up - t_term, 1),
        "decode_loads": {"done": sum(ev["status"] == "done" for ev in loads), "failed": failed_loads},
        "new_prefill_saves_done": sum(ev["status"] == "done" for ev in new_saves),
        "new_prefill_registrations": {k: v for k, v in new_registrations.items() if k not in ("pools", "t", "rank",
                                                                                            "event")},
        "requests_after_restart_loaded_whole": len(window["after"]),
        "ports": {"old_prefill": old_ports, "new_prefill": new_ports, "decode": decode_ports,
                  "decode_registered_at": reg_ports},
        "pools_end": {"decode": decode.last_pools(), "new_prefill": new.last_pools()},
        "engine_start_s": run.start_s,
        "test_wall_s": round(time.monotonic() - t_begin, 1),
        "load_wall_s": round(t_load_end - t_begin, 1),
    }
