"""An OpenAI-compatible proxy for disaggregated prefill/decode vLLM serving.

Run it as::

    python -m ascend_pd.proxy --port 8000 \\
        --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200

(or ``ascend-pd-proxy --port 8000 ...``: the command the package installs).
For each ``POST /v1/completions`` or ``POST /v1/chat/completions`` it picks
a decode instance and a prefill instance (round-robin, independently), asks
the prefill for one token (``max_tokens: 1``, not streamed) with
``kv_transfer_params = {"do_remote_decode": true}``, then sends the client's
original body to the decode with the ``kv_transfer_params`` the prefill
returned, unchanged, and hands the decode's answer back (streamed through as
it arrives when the client asked for ``"stream": true``). This is the
router-native flow (as with vLLM's NIXL connector): the prefill parks the KV
and its answer names where to register for it; the decode registers there
itself, so the proxy needs no ascend-pd ports.

The LMCache-style flow, where the prefill is told the decode's ascend-pd
receiver, is still supported: give one ``--decode-kv`` per ``--decode``, in
the same order::

    python -m ascend_pd.proxy --port 8000 \\
        --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --decode-kv 127.0.0.1/17300,17301/17400,17401

and the prefill's ``kv_transfer_params`` then also carry ``receiver_host``,
``receiver_init_port`` and ``receiver_alloc_port``. An upstream error
answer is passed through unchanged; an unreachable upstream gives 502.
``GET /health`` answers 200; ``GET /v1/models`` is forwarded to the first
decode.

This module needs aiohttp (the ``proxy`` extra, or ``pip install 'aiohttp>=3.9'``); nothing
else in :mod:`ascend_pd` imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit

_INSTALL_HINT = (
    "ascend_pd.proxy needs aiohttp, which is not installed; "
    "install it with: pip install 'aiohttp>=3.9' (what the package's proxy extra installs)"
)

try:
    import aiohttp
    from aiohttp import web
except ImportError as _import_error:  # pragma: no cover - exercised in a subprocess
    if __name__ == "__main__":
        raise SystemExit(f"error: {_import_error}\n{_INSTALL_HINT}") from None
    raise ImportError(_INSTALL_HINT) from _import_error

__all__ = [
    "DecodeTarget",
    "build_app",
    "build_parser",
    "main",
    "parse_args",
    "parse_decode_kv",
]

logger = logging.getLogger("ascend_pd.proxy")

#: The form ``--decode-kv`` takes, for error messages.
DECODE_KV_FORM = "HOST/INIT_PORTS/ALLOC_PORTS, e.g. 127.0.0.1/17300,17301/17400,17401"

JSONObject = Dict[str, Any]


@dataclass(frozen=True)
class DecodeTarget:
    """A decode instance: its OpenAI server and, optionally, its ascend-pd receiver.

    With ``host`` ``None`` (the default) the decode is reached through the
    router-native flow: the prefill is told only ``do_remote_decode`` and the
    decode registers with the prefill itself. With ``host`` set, the prefill
    is told this receiver (LMCache's flow); ``init_ports`` and ``alloc_ports``
    then hold one port per decode TP rank.
    """

    url: str
    host: Optional[str] = None
    init_ports: Tuple[int, ...] = ()
    alloc_ports: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.host is None:
            if self.init_ports or self.alloc_ports:
                raise ValueError(
                    f"decode {self.url!r}: receiver ports given without a receiver host"
                )
        elif not self.init_ports or len(self.init_ports) != len(self.alloc_ports):
            raise ValueError(
                f"decode {self.url!r}: {len(self.init_ports)} init port(s) and "
                f"{len(self.alloc_ports)} alloc port(s); give one of each per decode TP rank"
            )

    @property
    def router_native(self) -> bool:
        """True when the prefill is told no receiver (the decode registers itself)."""
        return self.host is None

    def kv_transfer_params(self) -> JSONObject:
        """What the prefill request's ``kv_transfer_params`` are for this decode."""
        if self.host is None:
            return {"do_remote_decode": True}
        return {
            "do_remote_decode": True,
            "receiver_host": self.host,
            "receiver_init_port": list(self.init_ports),
            "receiver_alloc_port": list(self.alloc_ports),
        }


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def _parse_ports(text: str, what: str, value: str) -> Tuple[int, ...]:
    ports: List[int] = []
    for item in text.split(","):
        item = item.strip()
        try:
            port = int(item, 10)
        except ValueError:
            raise ValueError(
                f"{value!r}: {what} port {item!r} is not a number; expected {DECODE_KV_FORM}"
            ) from None
        if not 1 <= port <= 65535:
            raise ValueError(
                f"{value!r}: {what} port {port} is out of range 1-65535; expected {DECODE_KV_FORM}"
            )
        ports.append(port)
    return tuple(ports)


def parse_decode_kv(value: str) -> Tuple[str, Tuple[int, ...], Tuple[int, ...]]:
    """Parse ``HOST/INIT_PORTS/ALLOC_PORTS`` (ports comma-separated per TP rank).

    Raises :class:`ValueError` naming the expected form.
    """
    parts = value.split("/")
    if len(parts) != 3:
        raise ValueError(f"{value!r}: expected {DECODE_KV_FORM}")
    host = parts[0].strip()
    if not host:
        raise ValueError(f"{value!r}: empty HOST; expected {DECODE_KV_FORM}")
    init_ports = _parse_ports(parts[1], "init", value)
    alloc_ports = _parse_ports(parts[2], "alloc", value)
    if len(init_ports) != len(alloc_ports):
        raise ValueError(
            f"{value!r}: {len(init_ports)} init port(s) but {len(alloc_ports)} alloc port(s); "
            f"give one of each per decode TP rank; expected {DECODE_KV_FORM}"
        )
    return host, init_ports, alloc_ports


def _decode_kv_arg(value: str) -> Tuple[str, Tuple[int, ...], Tuple[int, ...]]:
    try:
        return parse_decode_kv(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _url_arg(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(
            f"{value!r}: expected an http(s) URL, e.g. http://127.0.0.1:8100"
        )
    return value.rstrip("/")


def _positive_float(value: str) -> float:
    try:
        f = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a number of seconds") from None
    if not f > 0:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a positive number of seconds")
    return f


#: The command the package installs for :func:`main` ([project.scripts]).
_CONSOLE_SCRIPT = "ascend-pd-proxy"


def _prog() -> str:
    """How the proxy was started, for ``--help`` and errors: the installed
    command's name, else ``python -m ascend_pd.proxy``."""
    if sys.argv and os.path.basename(sys.argv[0]) == _CONSOLE_SCRIPT:
        return _CONSOLE_SCRIPT
    return "python -m ascend_pd.proxy"


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m ascend_pd.proxy`` (or ``ascend-pd-proxy``) argument parser."""
    p = argparse.ArgumentParser(
        prog=_prog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "OpenAI-compatible proxy for disaggregated prefill/decode vLLM serving\n"
            "with ascend-pd KV-cache transfer.\n\n"
            "Without --decode-kv (router-native flow) the prefill is sent\n"
            'kv_transfer_params {"do_remote_decode": true} and the decode the\n'
            "kv_transfer_params the prefill returned, unchanged; the decode registers\n"
            "with the prefill itself, so no ascend-pd ports are needed here. With one\n"
            "--decode-kv per --decode (LMCache's flow) the prefill is also told that\n"
            "decode's ascend-pd receiver."
        ),
        epilog=(
            "examples:\n"
            "  %(prog)s --port 8000 --prefill http://127.0.0.1:8100 \\\n"
            "      --decode http://127.0.0.1:8200\n"
            "  %(prog)s --port 8000 --prefill http://127.0.0.1:8100 \\\n"
            "      --decode http://127.0.0.1:8200 --decode-kv 127.0.0.1/17300,17301/17400,17401"
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default %(default)s)")
    p.add_argument(
        "--prefill",
        action="append",
        required=True,
        type=_url_arg,
        metavar="URL",
        help="a prefill instance's OpenAI server, e.g. http://127.0.0.1:8100 (repeatable)",
    )
    p.add_argument(
        "--decode",
        action="append",
        required=True,
        type=_url_arg,
        metavar="URL",
        help="a decode instance's OpenAI server, e.g. http://127.0.0.1:8200 (repeatable)",
    )
    p.add_argument(
        "--decode-kv",
        action="append",
        default=[],
        type=_decode_kv_arg,
        metavar="HOST/INIT_PORTS/ALLOC_PORTS",
        help=(
            "optional: the ascend-pd receiver of a decode instance, for LMCache's flow; "
            "if given, give one per --decode in the same order; ports comma-separated "
            "per decode TP rank, e.g. 127.0.0.1/17300,17301/17400,17401. Without it the "
            "router-native flow is used (the decode registers with the prefill itself)"
        ),
    )
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=600.0,
        metavar="S",
        help="total seconds allowed per upstream request (default %(default)s)",
    )
    p.add_argument(
        "--prefill-timeout",
        type=_positive_float,
        default=None,
        metavar="S",
        help=(
            "seconds allowed for the prefill leg alone (default: --timeout). A prefill "
            "that is shutting down may accept a request and never answer it; a short "
            "bound fails that request fast instead of holding the client (and keeping "
            "the stopping prefill's HTTP server alive) for the whole --timeout"
        ),
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default %(default)s)",
    )
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line; adds ``decodes``: a list of :class:`DecodeTarget`.

    Without ``--decode-kv`` every decode is router-native (``host`` ``None``);
    with it, there must be exactly one per ``--decode``.
    Exits through ``argparse`` (status 2) on a bad command line.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    kvs: List[Tuple[str, Tuple[int, ...], Tuple[int, ...]]] = args.decode_kv
    decode_urls: List[str] = args.decode
    if kvs and len(kvs) != len(decode_urls):
        parser.error(
            f"argument --decode-kv: give exactly one --decode-kv per --decode, in the same "
            f"order, or none at all for the router-native flow (got {len(decode_urls)} "
            f"--decode and {len(kvs)} --decode-kv); expected {DECODE_KV_FORM}"
        )
    if not 0 <= args.port <= 65535:
        parser.error(f"argument --port: {args.port} is out of range 0-65535")
    if kvs:
        args.decodes = [
            DecodeTarget(url=url, host=host, init_ports=init, alloc_ports=alloc)
            for url, (host, init, alloc) in zip(decode_urls, kvs)
        ]
    else:
        args.decodes = [DecodeTarget(url=url) for url in decode_urls]
    return args


# --------------------------------------------------------------------------
# The proxy
# --------------------------------------------------------------------------


@dataclass
class _Outcome:
    """What a request ended with, for its log line."""

    status: Optional[int] = None


class _UpstreamFailed(Exception):
    """An upstream could not be reached or did not answer in time."""

    def __init__(self, response: web.Response) -> None:
        super().__init__()
        self.response = response


def _error(status: int, message: str, request_id: Optional[str] = None) -> web.Response:
    """An OpenAI-style JSON error."""
    body = {"error": {"message": message, "type": "proxy_error", "code": status}}
    headers = {"X-Request-Id": request_id} if request_id else None
    return web.json_response(body, status=status, headers=headers)


def _passthrough(resp: aiohttp.ClientResponse, body: bytes, request_id: Optional[str]) -> web.Response:
    """A response copying an upstream's status, body and content type."""
    headers: Dict[str, str] = {}
    content_type = resp.headers.get("Content-Type")
    if content_type is not None:
        headers["Content-Type"] = content_type
    if request_id:
        headers["X-Request-Id"] = request_id
    return web.Response(status=resp.status, reason=resp.reason, body=body, headers=headers)


def _unreachable(role: str, url: str, exc: BaseException, request_id: Optional[str]) -> _UpstreamFailed:
    if isinstance(exc, asyncio.TimeoutError):
        return _UpstreamFailed(
            _error(504, f"{role} {url} did not answer in time", request_id)
        )
    detail = str(exc) or type(exc).__name__
    return _UpstreamFailed(_error(502, f"{role} {url} unreachable: {detail}", request_id))


class _Proxy:
    def __init__(
        self,
        prefills: Sequence[str],
        decodes: Sequence[DecodeTarget],
        timeout: float,
        prefill_timeout: Optional[float] = None,
    ) -> None:
        if not prefills:
            raise ValueError("at least one prefill URL is required")
        if not decodes:
            raise ValueError("at least one decode target is required")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.prefills = [u.rstrip("/") for u in prefills]
        self.decodes = list(decodes)
        self.timeout = timeout
        if prefill_timeout is not None and not prefill_timeout > 0:
            raise ValueError(f"prefill_timeout must be positive, got {prefill_timeout}")
        self.prefill_timeout = aiohttp.ClientTimeout(total=min(prefill_timeout or timeout, timeout))
        self._next_prefill = itertools.count()
        self._next_decode = itertools.count()
        self._session: Optional[aiohttp.ClientSession] = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the proxy's client session is not open (app not started)")
        return self._session

    async def session_ctx(self, app: web.Application) -> AsyncIterator[None]:
        # limit=0: no cap on concurrent upstream connections, so long
        # streaming requests never queue behind each other.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            connector=aiohttp.TCPConnector(limit=0),
        )
        try:
            yield
        finally:
            await self._session.close()
            self._session = None

    def _pick_decode(self) -> DecodeTarget:
        return self.decodes[next(self._next_decode) % len(self.decodes)]

    def _pick_prefill(self) -> str:
        return self.prefills[next(self._next_prefill) % len(self.prefills)]

    @staticmethod
    def _upstream_headers(request: web.Request, request_id: str) -> Dict[str, str]:
        headers = {"X-Request-Id": request_id}
        auth = request.headers.get("Authorization")
        if auth is not None:
            headers["Authorization"] = auth
        return headers

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        decode = self.decodes[0]
        request_id = str(uuid.uuid4())
        headers = self._upstream_headers(request, request_id)
        try:
            async with self.session.get(decode.url + "/v1/models", headers=headers) as resp:
                body = await resp.read()
                return _passthrough(resp, body, request_id)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return _unreachable("decode", decode.url, e, request_id).response

    async def _prefill(
        self,
        prefill: str,
        path: str,
        body: JSONObject,
        decode: DecodeTarget,
        chat: bool,
        headers: Dict[str, str],
        request_id: str,
    ) -> JSONObject:
        """Run the prefill; the ``kv_transfer_params`` it returns.

        Raises :class:`_UpstreamFailed` carrying the answer for the client.
        """
        req = dict(body)
        req["max_tokens"] = 1
        if chat and "max_completion_tokens" in req:
            req["max_completion_tokens"] = 1
        req["stream"] = False
        req.pop("stream_options", None)
        req["kv_transfer_params"] = decode.kv_transfer_params()
        try:
            async with self.session.post(
                prefill + path, json=req, headers=headers, timeout=self.prefill_timeout
            ) as resp:
                raw = await resp.read()
                if not 200 <= resp.status < 300:
                    raise _UpstreamFailed(_passthrough(resp, raw, request_id))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise _unreachable("prefill", prefill, e, request_id) from e
        try:
            answer = json.loads(raw)
        except ValueError:
            raise _UpstreamFailed(
                _error(502, f"prefill {prefill} answered with invalid JSON", request_id)
            ) from None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(params, dict):
            raise _UpstreamFailed(
                _error(
                    502,
                    f"prefill {prefill} returned no kv_transfer_params "
                    "(is it running with the ascend-pd KV connector as a producer?)",
                    request_id,
                )
            )
        return params

    async def generate(self, request: web.Request) -> web.StreamResponse:
        start = time.perf_counter()
        request_id = str(uuid.uuid4())
        chat = request.path.endswith("/chat/completions")
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not valid JSON", request_id)
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", request_id)

        decode = self._pick_decode()
        prefill = self._pick_prefill()
        headers = self._upstream_headers(request, request_id)
        prefill_ms: Optional[float] = None
        outcome = _Outcome()

        def log() -> None:
            logger.info(
                "%s %s id=%s prefill=%s decode=%s status=%s prefill_ms=%s total_ms=%.1f",
                request.method,
                request.path,
                request_id,
                prefill,
                decode.url,
                outcome.status if outcome.status is not None else "-",
                f"{prefill_ms:.1f}" if prefill_ms is not None else "-",
                (time.perf_counter() - start) * 1000.0,
            )

        try:
            try:
                params = await self._prefill(
                    prefill, request.path, body, decode, chat, headers, request_id
                )
            except _UpstreamFailed as f:
                outcome.status = f.response.status
                return f.response
            finally:
                prefill_ms = (time.perf_counter() - start) * 1000.0

            dreq = dict(body)
            dreq["kv_transfer_params"] = params
            stream = bool(body.get("stream"))
            try:
                return await self._decode(
                    request, decode, dreq, stream, headers, request_id, outcome
                )
            except _UpstreamFailed as f:
                outcome.status = f.response.status
                return f.response
        finally:
            log()

    async def _decode(
        self,
        request: web.Request,
        decode: DecodeTarget,
        body: JSONObject,
        stream: bool,
        headers: Dict[str, str],
        request_id: str,
        outcome: _Outcome,
    ) -> web.StreamResponse:
        url = decode.url + request.path
        try:
            async with self.session.post(url, json=body, headers=headers) as resp:
                outcome.status = resp.status
                if not stream or not 200 <= resp.status < 300:
                    raw = await resp.read()
                    return _passthrough(resp, raw, request_id)
                out = web.StreamResponse(status=resp.status, reason=resp.reason)
                content_type = resp.headers.get("Content-Type")
                if content_type is not None:
                    out.headers["Content-Type"] = content_type
                out.headers["Cache-Control"] = "no-cache"
                out.headers["X-Request-Id"] = request_id
                await out.prepare(request)
                try:
                    async for chunk in resp.content.iter_any():
                        await out.write(chunk)
                except ConnectionResetError:
                    logger.info("id=%s: the client went away while streaming", request_id)
                    return out
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    # The status line is already sent: all that can be done is
                    # ending the stream early.
                    logger.warning(
                        "id=%s: decode %s failed while streaming: %s",
                        request_id,
                        decode.url,
                        str(e) or type(e).__name__,
                    )
                    return out
                try:
                    await out.write_eof()
                except ConnectionResetError:
                    pass
                return out
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise _unreachable("decode", decode.url, e, request_id) from e


_PROXY_KEY = web.AppKey("ascend_pd_proxy", _Proxy)


def build_app(
    prefills: Sequence[str],
    decodes: Sequence[DecodeTarget],
    timeout: float = 600.0,
    prefill_timeout: Optional[float] = None,
) -> web.Application:
    """The proxy as an :class:`aiohttp.web.Application`.

    ``prefills`` are the prefill instances' base URLs (``http://host:port``),
    ``decodes`` the decode instances (each router-native, or with its
    ascend-pd receiver: see :class:`DecodeTarget`), and
    ``timeout`` the total seconds allowed per upstream request,
    ``prefill_timeout`` those allowed for the prefill leg (default
    ``timeout``). The client session to the upstreams opens when the app
    starts and closes on cleanup.
    """
    proxy = _Proxy(prefills, decodes, timeout, prefill_timeout)
    app = web.Application()
    app[_PROXY_KEY] = proxy
    app.cleanup_ctx.append(proxy.session_ctx)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_post("/v1/completions", proxy.generate)
    app.router.add_post("/v1/chat/completions", proxy.generate)
    return app


def _describe(d: DecodeTarget) -> str:
    if d.host is None:
        return f"{d.url} (router-native)"
    return (
        f"{d.url} (kv {d.host}/{','.join(map(str, d.init_ports))}/"
        f"{','.join(map(str, d.alloc_ports))})"
    )


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m ascend_pd.proxy`` and the ``ascend-pd-proxy`` command
    (``argv``: the arguments, default ``sys.argv[1:]``)."""
    args = parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    decodes: List[DecodeTarget] = args.decodes
    app = build_app(args.prefill, decodes, args.timeout, args.prefill_timeout)
    logger.info(
        "listening on http://%s:%d; prefill %s; decode %s",
        args.host,
        args.port,
        ", ".join(args.prefill),
        ", ".join(_describe(d) for d in decodes),
    )
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
