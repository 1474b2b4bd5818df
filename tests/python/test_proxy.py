"""Tests of ``python -m ascend_pd.proxy`` (plain pytest, loopback only).

Fake prefill and decode OpenAI servers run in-process with aiohttp on
ephemeral ports, together with the proxy app; each test runs its own event
loop through ``asyncio.run``.

Run from the repository root: ``PYTHONPATH=python python3 -m pytest -q tests/python/test_proxy.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, List, Optional, Tuple

import pytest

# aiohttp is the proxy's one dependency: a test run without it fails here
# (install it with `pip install 'aiohttp>=3.9'`, the proxy extra), it never skips.
import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402
from multidict import CIMultiDict  # noqa: E402

PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"
try:  # the installed package, else this checkout's source
    import ascend_pd  # noqa: F401
except ImportError:
    sys.path.insert(0, str(PYTHON_DIR))

from ascend_pd import proxy  # noqa: E402
from ascend_pd.proxy import DecodeTarget, build_app  # noqa: E402

SSE_CHUNKS = [f'data: {{"choices": [{{"text": "tok{i}"}}]}}\n\n' for i in range(5)] + [
    "data: [DONE]\n\n"
]


@dataclass
class Seen:
    path: str
    body: Any
    headers: "CIMultiDict[str]"


@dataclass
class Fake:
    """A fake upstream vLLM OpenAI server."""

    name: str
    role: str  # "prefill" or "decode"
    seen: List[Seen] = field(default_factory=list)
    url: str = ""
    # Prefill: answer this (status, body, content-type) instead of success.
    fail: Optional[Tuple[int, bytes, str]] = None
    # Decode streaming: set after the first chunk; the rest waits for it.
    first_chunk_sent: Optional[asyncio.Event] = None
    continue_stream: Optional[asyncio.Event] = None

    # Prefill: answer in the router-native shape (the KV parked, the
    # registration point named) instead of an opaque LMCache-style one.
    native: bool = False

    def kv_params(self) -> Dict[str, Any]:
        if self.native:
            return {
                "do_remote_prefill": True,
                "ascend_pd": {
                    "v": 1,
                    "num_tokens": 3,
                    "keys": ["k0"],
                    "save_id": f"save-{self.name}",
                    "register": {"host": "10.8.8.8", "ports": [7101, 7102]},
                    "nested": {"from": self.name, "list": [1, 2]},
                },
            }
        return {
            "do_remote_prefill": True,
            "remote_engine_id": f"engine-{self.name}",
            "remote_block_ids": [3, 1, 4],
            "remote_host": "10.9.9.9",
            "remote_port": 7777,
            "nested": {"from": self.name, "list": [1, 2]},
        }

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(Seen(request.path, body, CIMultiDict(request.headers)))
        if self.role == "prefill":
            if self.fail is not None:
                status, raw, ctype = self.fail
                return web.Response(status=status, body=raw, headers={"Content-Type": ctype})
            return web.json_response(
                {
                    "id": f"cmpl-{self.name}",
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                    "kv_transfer_params": self.kv_params(),
                }
            )
        if body.get("stream"):
            out = web.StreamResponse(status=200)
            out.headers["Content-Type"] = "text/event-stream; charset=utf-8"
            await out.prepare(request)
            for i, chunk in enumerate(SSE_CHUNKS):
                await out.write(chunk.encode())
                if i == 0 and self.first_chunk_sent is not None and self.continue_stream is not None:
                    self.first_chunk_sent.set()
                    await asyncio.wait_for(self.continue_stream.wait(), 5)
                await asyncio.sleep(0.02)
            await out.write_eof()
            return out
        return web.json_response(
            {"id": f"cmpl-{self.name}", "served_by": self.name, "choices": [{"text": "hello"}]},
            status=200,
        )

    async def models(self, request: web.Request) -> web.Response:
        self.seen.append(Seen(request.path, None, CIMultiDict(request.headers)))
        return web.json_response({"object": "list", "data": [{"id": f"model-{self.name}"}]})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        return app


async def _serve(app: web.Application) -> Tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


def _target(url: str, i: int, ranks: int = 2) -> DecodeTarget:
    return DecodeTarget(
        url=url,
        host=f"127.0.0.{10 + i}",
        init_ports=tuple(17300 + 10 * i + r for r in range(ranks)),
        alloc_ports=tuple(17400 + 10 * i + r for r in range(ranks)),
    )


@dataclass
class Env:
    prefills: List[Fake]
    decodes: List[Fake]
    targets: List[DecodeTarget]
    proxy_url: str
    client: aiohttp.ClientSession


@asynccontextmanager
async def environment(
    n_prefill: int = 1,
    n_decode: int = 1,
    extra_decodes: Optional[List[DecodeTarget]] = None,
    router_native: bool = False,
) -> AsyncIterator[Env]:
    """Fake upstreams and the proxy; ``router_native``: the decodes are given
    without receivers (no ``--decode-kv``) and the prefills answer with
    router-native params."""
    runners: List[web.AppRunner] = []
    try:
        prefills = [Fake(f"p{i}", "prefill", native=router_native) for i in range(n_prefill)]
        decodes = [Fake(f"d{i}", "decode") for i in range(n_decode)]
        for f in prefills + decodes:
            runner, f.url = await _serve(f.app())
            runners.append(runner)
        if router_native:
            targets = [DecodeTarget(url=d.url) for d in decodes]
        else:
            targets = [_target(d.url, i) for i, d in enumerate(decodes)]
        targets += list(extra_decodes or [])
        runner, proxy_url = await _serve(build_app([p.url for p in prefills], targets, timeout=10))
        runners.append(runner)
        async with aiohttp.ClientSession() as client:
            yield Env(prefills, decodes, targets, proxy_url, client)
    finally:
        for r in reversed(runners):
            await r.cleanup()


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    async def with_timeout() -> None:
        await asyncio.wait_for(coro_fn(), 20)

    asyncio.run(with_timeout())


def expected_prefill_kv(t: DecodeTarget) -> Dict[str, Any]:
    return {
        "do_remote_decode": True,
        "receiver_host": t.host,
        "receiver_init_port": list(t.init_ports),
        "receiver_alloc_port": list(t.alloc_ports),
    }


# ---------------------------------------------------------------------------


def test_completion_flow() -> None:
    async def body() -> None:
        async with environment() as env:
            req = {
                "model": "m",
                "prompt": "hello world",
                "max_tokens": 64,
                "temperature": 0.0,
                "stream": False,
            }
            async with env.client.post(
                env.proxy_url + "/v1/completions",
                json=req,
                headers={"Authorization": "Bearer sekrit"},
            ) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("application/json")
                got = await resp.json()
            assert got["served_by"] == "d0"

            (p,) = env.prefills[0].seen
            assert p.path == "/v1/completions"
            assert p.body["max_tokens"] == 1
            assert p.body["stream"] is False
            assert p.body["prompt"] == "hello world"
            assert p.body["temperature"] == 0.0
            assert p.body["kv_transfer_params"] == expected_prefill_kv(env.targets[0])
            assert p.body["kv_transfer_params"]["receiver_init_port"] == [17300, 17301]
            assert p.body["kv_transfer_params"]["receiver_alloc_port"] == [17400, 17401]

            (d,) = env.decodes[0].seen
            assert d.path == "/v1/completions"
            assert d.body == {**req, "kv_transfer_params": env.prefills[0].kv_params()}

            for seen in (p, d):
                assert seen.headers["Authorization"] == "Bearer sekrit"
                uuid.UUID(seen.headers["X-Request-Id"])
            assert p.headers["X-Request-Id"] == d.headers["X-Request-Id"]

    run(body)


def test_single_rank_ports_are_lists_and_stream_options_dropped() -> None:
    async def body() -> None:
        one_rank = DecodeTarget(url="", host="h", init_ports=(1,), alloc_ports=(2,))
        assert one_rank.kv_transfer_params() == {
            "do_remote_decode": True,
            "receiver_host": "h",
            "receiver_init_port": [1],
            "receiver_alloc_port": [2],
        }
        async with environment() as env:
            req = {
                "model": "m",
                "prompt": "p",
                "stream": True,
                "stream_options": {"include_usage": True},
                "kv_transfer_params": {"client": "junk"},
            }
            async with env.client.post(env.proxy_url + "/v1/completions", json=req) as resp:
                assert resp.status == 200
                await resp.read()
            (p,) = env.prefills[0].seen
            assert p.body["stream"] is False
            assert "stream_options" not in p.body
            assert p.body["max_tokens"] == 1
            assert p.body["kv_transfer_params"] == expected_prefill_kv(env.targets[0])
            (d,) = env.decodes[0].seen
            assert d.body == {**req, "kv_transfer_params": env.prefills[0].kv_params()}
            assert "Authorization" not in p.headers

    run(body)


def test_round_robin() -> None:
    async def body() -> None:
        async with environment(n_prefill=2, n_decode=2) as env:
            for i in range(4):
                req = {"model": "m", "prompt": f"req{i}", "max_tokens": 8}
                async with env.client.post(env.proxy_url + "/v1/completions", json=req) as resp:
                    assert resp.status == 200
                    assert (await resp.json())["served_by"] == f"d{i % 2}"

            for k in range(2):
                prompts = [s.body["prompt"] for s in env.prefills[k].seen]
                assert prompts == [f"req{k}", f"req{k + 2}"]
                dprompts = [s.body["prompt"] for s in env.decodes[k].seen]
                assert dprompts == [f"req{k}", f"req{k + 2}"]

            # Each prefill was told the receiver of the decode that got the request.
            for k in range(2):
                for s in env.prefills[k].seen:
                    i = int(s.body["prompt"][3:])
                    assert s.body["kv_transfer_params"] == expected_prefill_kv(env.targets[i % 2])
            assert env.targets[0].host != env.targets[1].host
            # Each decode got the kv_transfer_params of the prefill that served it.
            for k in range(2):
                for s in env.decodes[k].seen:
                    i = int(s.body["prompt"][3:])
                    assert s.body["kv_transfer_params"] == env.prefills[i % 2].kv_params()

    run(body)


def test_streaming_passthrough() -> None:
    async def body() -> None:
        async with environment() as env:
            dec = env.decodes[0]
            dec.first_chunk_sent = asyncio.Event()
            dec.continue_stream = asyncio.Event()
            req = {"model": "m", "prompt": "stream me", "max_tokens": 16, "stream": True}
            async with env.client.post(env.proxy_url + "/v1/completions", json=req) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
                # The first chunk must reach the client while the decode is
                # still holding the rest back: nothing is buffered.
                first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
                assert first.decode() == SSE_CHUNKS[0]
                dec.continue_stream.set()
                rest = await resp.content.read()
            text = first.decode() + rest.decode()
            assert text == "".join(SSE_CHUNKS)
            assert text.endswith("data: [DONE]\n\n")
            (d,) = dec.seen
            assert d.body["stream"] is True
            assert d.body["kv_transfer_params"] == env.prefills[0].kv_params()

    run(body)


def test_streaming_all_chunks_in_order() -> None:
    async def body() -> None:
        async with environment() as env:
            req = {"model": "m", "prompt": "p", "stream": True}
            events: List[str] = []
            async with env.client.post(env.proxy_url + "/v1/completions", json=req) as resp:
                assert resp.status == 200
                async for line in resp.content:
                    if line.strip():
                        events.append(line.decode().strip())
            assert events == [c.strip() for c in SSE_CHUNKS]
            assert events[-1] == "data: [DONE]"

    run(body)


def test_chat_completions() -> None:
    async def body() -> None:
        async with environment() as env:
            req = {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 50,
                "max_tokens": 50,
            }
            async with env.client.post(env.proxy_url + "/v1/chat/completions", json=req) as resp:
                assert resp.status == 200
                assert (await resp.json())["served_by"] == "d0"
            (p,) = env.prefills[0].seen
            assert p.path == "/v1/chat/completions"
            assert p.body["max_tokens"] == 1
            assert p.body["max_completion_tokens"] == 1
            assert p.body["stream"] is False
            assert p.body["messages"] == req["messages"]
            assert p.body["kv_transfer_params"] == expected_prefill_kv(env.targets[0])
            (d,) = env.decodes[0].seen
            assert d.path == "/v1/chat/completions"
            assert d.body == {**req, "kv_transfer_params": env.prefills[0].kv_params()}

            # max_completion_tokens is not added when the client did not send it.
            req2 = {"model": "m", "messages": [{"role": "user", "content": "yo"}]}
            async with env.client.post(env.proxy_url + "/v1/chat/completions", json=req2) as resp:
                assert resp.status == 200
            p2 = env.prefills[0].seen[1]
            assert "max_completion_tokens" not in p2.body
            assert p2.body["max_tokens"] == 1

    run(body)


def test_prefill_error_passed_through() -> None:
    async def body() -> None:
        async with environment() as env:
            err = json.dumps(
                {"object": "error", "message": "This model's maximum context length is 8", "code": 400}
            ).encode()
            env.prefills[0].fail = (400, err, "application/json")
            async with env.client.post(
                env.proxy_url + "/v1/completions", json={"model": "m", "prompt": "p"}
            ) as resp:
                assert resp.status == 400
                assert resp.headers["Content-Type"] == "application/json"
                assert await resp.read() == err
            assert env.decodes[0].seen == []

            env.prefills[0].fail = (422, b"unprocessable thing", "text/plain; charset=utf-8")
            async with env.client.post(
                env.proxy_url + "/v1/completions", json={"model": "m", "prompt": "p"}
            ) as resp:
                assert resp.status == 422
                assert resp.headers["Content-Type"] == "text/plain; charset=utf-8"
                assert await resp.read() == b"unprocessable thing"
            assert env.decodes[0].seen == []

    run(body)


def test_unreachable_decode_gives_502() -> None:
    async def body() -> None:
        # A bound socket that never listens: connections to it are refused.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            dead_url = f"http://127.0.0.1:{s.getsockname()[1]}"
            dead = DecodeTarget(url=dead_url, host="127.0.0.99", init_ports=(1,), alloc_ports=(2,))
            async with environment(n_decode=0, extra_decodes=[dead]) as env:
                async with env.client.post(
                    env.proxy_url + "/v1/completions", json={"model": "m", "prompt": "p"}
                ) as resp:
                    assert resp.status == 502
                    got = await resp.json()
                assert dead_url in got["error"]["message"]
                assert "decode" in got["error"]["message"]
                # The prefill ran first, told about the dead decode's receiver.
                (p,) = env.prefills[0].seen
                assert p.body["kv_transfer_params"]["receiver_host"] == "127.0.0.99"

    run(body)


def test_unreachable_prefill_gives_502() -> None:
    async def body() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            dead_url = f"http://127.0.0.1:{s.getsockname()[1]}"
            async with environment() as env:
                runner, url = await _serve(build_app([dead_url], env.targets, timeout=5))
                try:
                    async with env.client.post(
                        url + "/v1/completions", json={"model": "m", "prompt": "p"}
                    ) as resp:
                        assert resp.status == 502
                        got = await resp.json()
                    assert dead_url in got["error"]["message"]
                    assert "prefill" in got["error"]["message"]
                    assert env.decodes[0].seen == []
                finally:
                    await runner.cleanup()

    run(body)


def test_a_prefill_that_never_answers_fails_at_the_prefill_timeout() -> None:
    """A prefill shutting down may take a request and never answer: with
    --prefill-timeout the client gets a 504 naming the prefill then, not at
    the whole --timeout, and the decode is never asked."""

    async def body() -> None:
        release = asyncio.Event()

        async def hang(request: web.Request) -> web.Response:
            await release.wait()
            return web.json_response({})

        silent = web.Application()
        silent.router.add_post("/v1/completions", hang)
        async with environment() as env:
            srunner, silent_url = await _serve(silent)
            runner, url = await _serve(
                build_app([silent_url], env.targets, timeout=15, prefill_timeout=0.5)
            )
            try:
                started = asyncio.get_running_loop().time()
                async with env.client.post(
                    url + "/v1/completions", json={"model": "m", "prompt": "p"}
                ) as resp:
                    assert resp.status == 504
                    got = await resp.json()
                # Well before the 15 s total (not a speed bound: 0.5 s vs 15 s).
                assert asyncio.get_running_loop().time() - started < 10
                assert silent_url in got["error"]["message"]
                assert env.decodes[0].seen == []
            finally:
                release.set()
                await runner.cleanup()
                await srunner.cleanup()

    run(body)
    args = proxy.parse_args(GOOD + ["--prefill-timeout", "20"])
    assert args.prefill_timeout == 20.0
    assert proxy.parse_args(GOOD).prefill_timeout is None


def test_health_models_and_bad_body() -> None:
    async def body() -> None:
        async with environment(n_decode=2) as env:
            async with env.client.get(env.proxy_url + "/health") as resp:
                assert resp.status == 200
            for _ in range(2):
                async with env.client.get(
                    env.proxy_url + "/v1/models", headers={"Authorization": "Bearer k"}
                ) as resp:
                    assert resp.status == 200
                    assert (await resp.json())["data"][0]["id"] == "model-d0"
            assert len(env.decodes[0].seen) == 2
            assert env.decodes[0].seen[0].headers["Authorization"] == "Bearer k"
            assert env.decodes[1].seen == []
            async with env.client.post(
                env.proxy_url + "/v1/completions",
                data=b"{not json",
                headers={"Content-Type": "application/json"},
            ) as resp:
                assert resp.status == 400
            async with env.client.post(env.proxy_url + "/v1/completions", json=[1, 2]) as resp:
                assert resp.status == 400
            assert env.prefills[0].seen == []

    run(body)


def test_logs_one_line_per_request(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with environment() as env:
            async with env.client.post(
                env.proxy_url + "/v1/completions", json={"model": "m", "prompt": "p"}
            ) as resp:
                assert resp.status == 200

    with caplog.at_level("INFO", logger="ascend_pd.proxy"):
        run(body)
    lines = [r.getMessage() for r in caplog.records if r.name == "ascend_pd.proxy"]
    assert len(lines) == 1, lines
    (line,) = lines
    assert "prefill=http://127.0.0.1:" in line
    assert "decode=http://127.0.0.1:" in line
    assert "status=200" in line
    assert "prefill_ms=" in line and "total_ms=" in line


# ---------------------------------------------------------------------------
# The router-native flow: no --decode-kv, no ports anywhere

ROUTER_NATIVE_PREFILL_KV = {"do_remote_decode": True}


def test_router_native_target() -> None:
    t = DecodeTarget("http://d:1")
    assert t.host is None and t.init_ports == () and t.alloc_ports == ()
    assert t.router_native
    assert t.kv_transfer_params() == ROUTER_NATIVE_PREFILL_KV
    # A fresh dict each time: a caller changing one cannot change the next.
    t.kv_transfer_params()["x"] = 1
    assert t.kv_transfer_params() == ROUTER_NATIVE_PREFILL_KV
    assert not _target("http://d:1", 0).router_native
    with pytest.raises(ValueError, match="without a receiver host"):
        DecodeTarget("http://d:1", None, (1,), (2,))
    with pytest.raises(ValueError, match="per decode TP rank"):
        DecodeTarget("http://d:1", "h", (1, 2), (3,))
    with pytest.raises(ValueError, match="per decode TP rank"):
        DecodeTarget("http://d:1", "h")


def test_router_native_completion_flow() -> None:
    async def body() -> None:
        async with environment(router_native=True) as env:
            req = {
                "model": "m",
                "prompt": "hello world",
                "max_tokens": 64,
                "temperature": 0.0,
                "stream": False,
                # Whatever the client sent is replaced on the prefill leg.
                "kv_transfer_params": {"client": "junk", "receiver_host": "x"},
            }
            async with env.client.post(
                env.proxy_url + "/v1/completions",
                json=req,
                headers={"Authorization": "Bearer sekrit"},
            ) as resp:
                assert resp.status == 200
                got = await resp.json()
            assert got["served_by"] == "d0"

            (p,) = env.prefills[0].seen
            assert p.path == "/v1/completions"
            assert p.body["kv_transfer_params"] == {"do_remote_decode": True}
            assert p.body == {
                **req,
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": {"do_remote_decode": True},
            }
            assert "receiver" not in json.dumps(p.body)

            (d,) = env.decodes[0].seen
            assert d.path == "/v1/completions"
            # The prefill's answer, unchanged, and nothing else added.
            assert d.body == {**req, "kv_transfer_params": env.prefills[0].kv_params()}
            assert d.body["kv_transfer_params"]["ascend_pd"]["register"] == {
                "host": "10.8.8.8",
                "ports": [7101, 7102],
            }
            for seen in (p, d):
                assert seen.headers["Authorization"] == "Bearer sekrit"
            assert p.headers["X-Request-Id"] == d.headers["X-Request-Id"]

    run(body)


def test_router_native_streaming() -> None:
    async def body() -> None:
        async with environment(router_native=True) as env:
            dec = env.decodes[0]
            dec.first_chunk_sent = asyncio.Event()
            dec.continue_stream = asyncio.Event()
            req = {
                "model": "m",
                "prompt": "stream me",
                "max_tokens": 16,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with env.client.post(env.proxy_url + "/v1/completions", json=req) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
                first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
                assert first.decode() == SSE_CHUNKS[0]
                dec.continue_stream.set()
                rest = await resp.content.read()
            assert first.decode() + rest.decode() == "".join(SSE_CHUNKS)
            (p,) = env.prefills[0].seen
            assert p.body["stream"] is False
            assert "stream_options" not in p.body
            assert p.body["max_tokens"] == 1
            assert p.body["kv_transfer_params"] == {"do_remote_decode": True}
            (d,) = dec.seen
            assert d.body == {**req, "kv_transfer_params": env.prefills[0].kv_params()}

    run(body)


def test_router_native_round_robin_and_chat() -> None:
    async def body() -> None:
        async with environment(n_prefill=2, n_decode=2, router_native=True) as env:
            for i in range(4):
                req = {"model": "m", "prompt": f"req{i}", "max_tokens": 8}
                async with env.client.post(env.proxy_url + "/v1/completions", json=req) as resp:
                    assert resp.status == 200
                    assert (await resp.json())["served_by"] == f"d{i % 2}"
            for k in range(2):
                for s in env.prefills[k].seen:
                    assert s.body["kv_transfer_params"] == {"do_remote_decode": True}
                # Each decode got the params of the prefill that served it.
                for s in env.decodes[k].seen:
                    i = int(s.body["prompt"][3:])
                    assert s.body["kv_transfer_params"] == env.prefills[i % 2].kv_params()
            assert env.prefills[0].kv_params() != env.prefills[1].kv_params()

            chat = {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 50,
            }
            async with env.client.post(env.proxy_url + "/v1/chat/completions", json=chat) as resp:
                assert resp.status == 200
            p = env.prefills[0].seen[-1]
            assert p.path == "/v1/chat/completions"
            assert p.body["max_completion_tokens"] == 1
            assert p.body["kv_transfer_params"] == {"do_remote_decode": True}
            d = env.decodes[0].seen[-1]
            assert d.path == "/v1/chat/completions"
            assert d.body == {**chat, "kv_transfer_params": env.prefills[0].kv_params()}

    run(body)


def test_router_native_prefill_without_params_gives_502() -> None:
    async def body() -> None:
        async with environment(router_native=True) as env:
            # A prefill not running the connector as a producer answers
            # without kv_transfer_params: the decode is never asked.
            env.prefills[0].fail = (200, b'{"choices": []}', "application/json")
            async with env.client.post(
                env.proxy_url + "/v1/completions", json={"model": "m", "prompt": "p"}
            ) as resp:
                assert resp.status == 502
                got = await resp.json()
            assert "kv_transfer_params" in got["error"]["message"]
            assert env.prefills[0].seen[0].body["kv_transfer_params"] == {"do_remote_decode": True}
            assert env.decodes[0].seen == []

    run(body)


def test_router_native_through_the_command_line() -> None:
    """``python -m ascend_pd.proxy`` without ``--decode-kv``, in a subprocess."""

    async def body() -> None:
        runners: List[web.AppRunner] = []
        pre = Fake("p0", "prefill", native=True)
        dec = Fake("d0", "decode")
        for f in (pre, dec):
            runner, f.url = await _serve(f.app())
            runners.append(runner)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ)
        env["PYTHONPATH"] = str(PYTHON_DIR) + os.pathsep + env.get("PYTHONPATH", "")
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ascend_pd.proxy", "--port", str(port),
            "--prefill", pre.url, "--decode", dec.url, "--log-level", "INFO",
            env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as client:
                for _ in range(150):
                    try:
                        async with client.get(url + "/health") as resp:
                            if resp.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    assert child.returncode is None, "the proxy exited"
                    await asyncio.sleep(0.05)
                req = {"model": "m", "prompt": "p", "stream": True}
                async with client.post(url + "/v1/completions", json=req) as resp:
                    assert resp.status == 200
                    assert (await resp.read()).decode() == "".join(SSE_CHUNKS)
        finally:
            child.terminate()
            out, _ = await child.communicate()
            for r in reversed(runners):
                await r.cleanup()
        (p,) = pre.seen
        assert p.body["kv_transfer_params"] == {"do_remote_decode": True}
        (d,) = dec.seen
        assert d.body == {**req, "kv_transfer_params": pre.kv_params()}
        assert f"{dec.url} (router-native)" in out.decode(), out.decode()

    run(body)


# ---------------------------------------------------------------------------
# Command line


GOOD = ["--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"]


def test_cli_parses() -> None:
    args = proxy.parse_args(
        [
            "--port",
            "9000",
            "--prefill",
            "http://p1:1/",
            "--prefill",
            "http://p2:2",
            "--decode",
            "http://d1:1",
            "--decode-kv",
            "10.0.0.1/17300,17301/17400,17401",
            "--decode",
            "http://d2:2",
            "--decode-kv",
            "10.0.0.2/7300/7400",
            "--timeout",
            "30",
        ]
    )
    assert args.host == "127.0.0.1"
    assert args.port == 9000
    assert args.prefill == ["http://p1:1", "http://p2:2"]
    assert args.timeout == 30.0
    assert args.decodes == [
        DecodeTarget("http://d1:1", "10.0.0.1", (17300, 17301), (17400, 17401)),
        DecodeTarget("http://d2:2", "10.0.0.2", (7300,), (7400,)),
    ]
    defaults = proxy.parse_args(GOOD + ["--decode-kv", "h/1/2"])
    assert defaults.port == 8000 and defaults.timeout == 600.0


def test_cli_without_decode_kv_is_router_native() -> None:
    args = proxy.parse_args(GOOD)
    assert args.decodes == [DecodeTarget("http://127.0.0.1:8200")]
    assert args.decodes[0].host is None
    assert args.decodes[0].kv_transfer_params() == {"do_remote_decode": True}
    args = proxy.parse_args(
        ["--prefill", "http://p:1", "--decode", "http://d1:1/", "--decode", "http://d2:2"]
    )
    assert args.decodes == [DecodeTarget("http://d1:1"), DecodeTarget("http://d2:2")]
    assert all(d.router_native for d in args.decodes)
    assert args.decode_kv == []


def test_cli_help_shows_the_router_native_form(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        proxy.parse_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert '{"do_remote_decode": true}' in out
    assert "router-native" in out
    # The first example names no ports.
    examples = out.split("examples:", 1)[1].strip().splitlines()
    assert "--decode http://127.0.0.1:8200" in examples[1]
    assert "--decode-kv" not in examples[0] + examples[1]


@pytest.mark.parametrize(
    "extra",
    [
        ["--decode-kv", "h/1/2", "--decode-kv", "h/3/4"],  # one too many
        ["--decode", "http://127.0.0.1:8201", "--decode-kv", "h/1/2"],  # one too few
        ["--decode-kv", "127.0.0.1/17300"],  # two parts
        ["--decode-kv", "127.0.0.1/17300/17400/1"],  # four parts
        ["--decode-kv", "127.0.0.1/abc/17400"],  # not a port
        ["--decode-kv", "127.0.0.1/17300,/17400"],  # empty port
        ["--decode-kv", "127.0.0.1/70000/17400"],  # out of range
        ["--decode-kv", "/17300/17400"],  # no host
        ["--decode-kv", "h/1,2/3"],  # rank count mismatch
    ],
)
def test_cli_bad_decode_kv(extra: List[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        proxy.parse_args(GOOD + extra)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--decode-kv" in err
    assert "HOST/INIT_PORTS/ALLOC_PORTS" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--decode", "http://d:1", "--decode-kv", "h/1/2"],  # no --prefill
        ["--prefill", "http://p:1"],  # no --decode
        ["--prefill", "p:1", "--decode", "http://d:1", "--decode-kv", "h/1/2"],  # not a URL
    ],
)
def test_cli_other_errors(argv: List[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        proxy.parse_args(argv)
    assert exc.value.code == 2
    capsys.readouterr()


# ---------------------------------------------------------------------------
# Without aiohttp

_BLOCK_AIOHTTP = "import sys; sys.modules['aiohttp'] = None; "


def _python(code: str) -> "subprocess.CompletedProcess[str]":
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PYTHON_DIR) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )


def test_package_imports_without_aiohttp() -> None:
    r = _python(_BLOCK_AIOHTTP + "import ascend_pd; assert 'aiohttp' not in [m for m in sys.modules if sys.modules[m] is not None]")
    assert r.returncode == 0, r.stderr


def test_main_without_aiohttp_names_what_to_install() -> None:
    r = _python(
        _BLOCK_AIOHTTP
        + "import runpy; runpy.run_module('ascend_pd.proxy', run_name='__main__', alter_sys=True)"
    )
    assert r.returncode != 0
    assert "pip install 'aiohttp>=3.9'" in r.stderr
    assert "Traceback" not in r.stderr
    r = _python(_BLOCK_AIOHTTP + "import ascend_pd.proxy")
    assert r.returncode != 0
    assert "pip install 'aiohttp>=3.9'" in r.stderr
