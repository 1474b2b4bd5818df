"""Engines, configs and prompts for the vLLM end-to-end tests."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
ENGINE = HERE / "engine.py"

#: Tokens per ascend-pd chunk in the tests (vLLM's CPU block size is 128).
CHUNK = 256
#: Decode tokens compared per prompt.
MAX_TOKENS = 12

_used_ports: set = set()

#: A LoRA adapter as the engine driver takes it: (name, int id, path).
Lora = Tuple[str, int, str]


def free_port() -> int:
    """A free loopback port below the ephemeral range, never twice per run."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(1000):
        p = rng.randrange(20000, 30000)
        if p in _used_ports or p + 100 in _used_ports:
            continue
        try:
            for q in (p, p + 100):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
        except OSError:
            continue
        _used_ports.update((p, p + 100))
        return p
    raise RuntimeError("no free port")


def prompts() -> List[List[int]]:
    """Awkward lengths: 1 token, under a block, a block, under/at/over a
    chunk, whole chunks, several chunks, and two sharing a long prefix."""
    rng = random.Random(1234)

    def toks(n: int) -> List[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    out = [toks(n) for n in (1, 7, 100, 128, 255, 256, 257, 512, 700, 1000)]
    shared = toks(600)
    out.append(shared)
    out.append(shared[:520] + toks(90))
    return out


def receiver_yaml(path: Path, channel: str, mode: str, init_port: int, alloc_port: int,
                  lease_s: float = 60.0, extra: Sequence[str] = ()) -> Path:
    lines = [
        "enable_pd: true",
        f"transfer_channel: {channel}",
        "pd_role: receiver",
        "pd_buffer_device: cpu",
        f"pd_buffer_size: {64 << 20}",
        f"chunk_size: {CHUNK}",
        "pd_peer_host: 127.0.0.1",
        f"pd_peer_init_port: {init_port}",
        f"pd_peer_alloc_port: {alloc_port}",
        f"pd_pull_pending_ttl: {lease_s}",
        *extra,
    ]
    lines += _mode_lines(mode)
    path.write_text("\n".join(lines) + "\n")
    return path


def sender_yaml(path: Path, channel: str, mode: str, done_port: int, layerwise: bool = False,
                lease_s: float = 60.0, extra: Sequence[str] = ()) -> Path:
    lines = [
        "enable_pd: true",
        f"transfer_channel: {channel}",
        "pd_role: sender",
        "pd_buffer_device: cpu",
        f"pd_buffer_size: {64 << 20}",
        f"chunk_size: {CHUNK}",
        "pd_peer_host: 127.0.0.1",
        f"pd_pull_pending_ttl: {lease_s}",
        *extra,
    ]
    if mode != "push":
        lines.append(f"pd_pull_done_port: {done_port}")
    if layerwise:
        lines.append("pd_layerwise: True")
    lines += _mode_lines(mode)
    path.write_text("\n".join(lines) + "\n")
    return path


def _mode_lines(mode: str) -> List[str]:
    return {
        "push": [],
        "pull-eager": ["pd_pull_mode: true"],
        "pull-delay": ["pd_pull_mode: true", "pd_delay_pull: true"],
    }[mode]


def kv_config(role: str, yaml_path: Path, connector: str = "AscendPDConnector",
              module: str = "ascend_pd.vllm", **extra: Any) -> Dict[str, Any]:
    cfg: Dict[str, Any] = {
        "kv_connector": connector,
        "kv_connector_module_path": module,
        "kv_role": role,
        "kv_connector_extra_config": {"config": str(yaml_path), **extra},
    }
    if role == "kv_consumer":
        cfg["kv_load_failure_policy"] = "recompute"
    return cfg


class Engine:
    """An engine process (tests/vllm/engine.py) and its pipes."""

    def __init__(self, name: str, model: Path, log_dir: Path, kv: Optional[Dict[str, Any]] = None,
                 env: Optional[Dict[str, str]] = None, prefix_caching: bool = True, lora: bool = False) -> None:
        self.name = name
        self.events = log_dir / f"{name}-events.jsonl"
        self.log_path = log_dir / f"{name}.log"
        cmd = [sys.executable, str(ENGINE), "--model", str(model)]
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        if not prefix_caching:
            cmd.append("--no-prefix-caching")
        if lora:
            cmd.append("--lora")
        e = dict(os.environ)
        e["VLLM_CPU_KVCACHE_SPACE"] = "1"
        e["ASCEND_PD_VLLM_EVENTS"] = str(self.events)
        e["PYTHONPATH"] = os.pathsep.join([str(HERE)] + [p for p in [os.environ.get("APD_EXTRA_PYTHONPATH")] if p] + [p for p in [e.get("PYTHONPATH")] if p])
        e.update(env or {})
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=e, start_new_session=True)

    def wait_ready(self, timeout: float = 600.0) -> None:
        self._read(timeout)

    def _read(self, timeout: float) -> Dict[str, Any]:
        assert self.proc.stdout is not None
        box: List[str] = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        t.start()
        t.join(timeout)
        if not box or not box[0]:
            raise AssertionError(f"engine {self.name} gave no answer in {timeout}s; its log:\n{self.tail()}")
        return json.loads(box[0])

    def _send(self, cmd: Dict[str, Any], timeout: float) -> Dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    @staticmethod
    def _requests(prompts: Sequence[List[int]], params: Optional[Sequence[Optional[Dict[str, Any]]]],
                  max_tokens: int, loras: Optional[Sequence[Optional[Lora]]],
                  ids: Optional[Sequence[str]]) -> Dict[str, Any]:
        return {"prompts": list(prompts), "params": list(params) if params else None, "max_tokens": max_tokens,
                "loras": [list(l) if l else None for l in loras] if loras else None,
                "ids": list(ids) if ids else None}

    def generate(self, prompts: Sequence[List[int]], params: Optional[Sequence[Optional[Dict[str, Any]]]] = None,
                 max_tokens: int = MAX_TOKENS, timeout: float = 600.0,
                 loras: Optional[Sequence[Optional[Lora]]] = None,
                 ids: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
        """Runs the prompts concurrently; their outputs in prompt order."""
        cmd = self._requests(prompts, params, max_tokens, loras, ids)
        out: List[Dict[str, Any]] = self._send(cmd, timeout)["outputs"]
        return out

    def submit(self, prompts: Sequence[List[int]], params: Optional[Sequence[Optional[Dict[str, Any]]]] = None,
               max_tokens: int = MAX_TOKENS, loras: Optional[Sequence[Optional[Lora]]] = None,
               ids: Optional[Sequence[str]] = None) -> List[str]:
        """Starts the prompts; their request ids."""
        got: List[str] = self._send({"submit": self._requests(prompts, params, max_tokens, loras, ids)}, 60)[
            "submitted"]
        return got

    def abort(self, ids: Sequence[str]) -> None:
        self._send({"abort": list(ids)}, 60)

    def wait(self, ids: Sequence[str], timeout: float = 600.0) -> List[Dict[str, Any]]:
        out: List[Dict[str, Any]] = self._send({"wait": list(ids), "timeout": timeout}, timeout + 30)["outputs"]
        return out

    def events_of(self, kind: str) -> List[Dict[str, Any]]:
        if not self.events.exists():
            return []
        out = []
        for line in self.events.read_text().splitlines():
            ev = json.loads(line)
            if ev.get("event") == kind:
                out.append(ev)
        return out

    def last_pools(self) -> Dict[str, Any]:
        """The pool counters of the worker's latest event (every event
        carries them; of two at the same time, the later written)."""
        if not self.events.exists():
            return {}
        evs = [json.loads(line) for line in self.events.read_text().splitlines()]
        evs = [e for e in evs if "pools" in e]
        if not evs:
            return {}
        best = max(range(len(evs)), key=lambda i: (evs[i]["t"], i))
        return dict(evs[best]["pools"])

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except Exception:
                pass
        self.kill()
        self._log.close()


def pools_back(pools: Dict[str, Any]) -> bool:
    """Every pool of a rank has all its pages free, none pinned or quarantined."""
    return bool(pools) and all(
        p["free"] == p["total"] and p["pinned"] == 0 and p["quarantined"] == 0 for p in pools.values()
    )


def address(init: int, alloc: int) -> Dict[str, Any]:
    return {
        "do_remote_decode": True,
        "receiver_host": "127.0.0.1",
        "receiver_init_port": [init],
        "receiver_alloc_port": [alloc],
    }


def settle(engines: List[Engine], roles: List[str], timeout: float = 60.0) -> Dict[str, Any]:
    """Steps the engines (a 1-token request each) until their pools are all
    free again; returns the last pool counters seen."""
    deadline = time.monotonic() + timeout
    last: Dict[str, Any] = {}
    while True:
        last = {e.name: e.last_pools() for e in engines}
        if all(pools_back(last[e.name]) and set(last[e.name]) == {r} for e, r in zip(engines, roles)):
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"pools not back at their start after {timeout}s: {last}")
        time.sleep(0.5)
        for e in engines:
            e.generate([[5]], max_tokens=1)


def external(req_id: str) -> str:
    """The id a client gave a request (vLLM appends ``-`` and 8 characters inside)."""
    return req_id.rsplit("-", 1)[0]
