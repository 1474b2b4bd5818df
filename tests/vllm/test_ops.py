"""Operability (issue 37): the connector's metrics on vLLM's own
``/metrics``, and ``kv_role: kv_both`` with real engines.

Two `vllm serve` engines, A and B, both ``kv_both`` (each a sender and a
receiver from one YAML, pull-delay over TCP), and two of the package's
proxies: A->B in the router-native flow (the proxy names no receiver: A
parks each save, B registers for it) and B->A in LMCache's flow (the proxy
tells B A's receiver ports). The traffic, run once for the module:

1. reference tokens: SET_AB computed by B alone, SET_BA by A alone (plain
   requests, no hand-off); then both prefix caches are reset, so neither
   engine holds what it is to load;
2. SET_AB through the A->B proxy: A prefills, B loads the KV and decodes;
3. SET_BA through the B->A proxy: the same two engines, roles reversed;
4. both engines stepped (1-token requests, no hand-off) until their
   connector's pool gauges say every page is free again.

``/metrics`` of each engine is scraped after 2 and after 4.
test_metrics_on_vllms_endpoint checks the ``vllm:ascend_pd_*`` series there
(names, vLLM's ``model_name``/``engine`` labels, counts and bytes that
match the traffic exactly, histograms, pool gauges);
test_kv_both_engines_swap_roles checks the tokens against the references,
that every prompt's KV was loaded whole from the other engine, and the
pools. test_stats_aggregate_like_vllm runs without engines: how the stats
add up over TP workers and over intervals.
"""

from __future__ import annotations

import functools
import math
import os
import random
import re
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest

import make_model
from conftest import RESULTS
from harness import CHUNK, MAX_TOKENS, free_port, kv_config, pools_back, receiver_yaml
from router_harness import Served, _get, _Process, post, start, stop

MODE, CHANNEL = "pull-delay", "tcp"

_rng = random.Random(3737)


def _toks(n: int) -> List[int]:
    return [_rng.randrange(3, 512) for _ in range(n)]


#: Random tokens: no prompt shares a block with another or with the steps.
#: Under a block, under a chunk, over one, and several chunks.
SET_AB = [_toks(n) for n in (100, 300, 700, 1000)]
SET_BA = [_toks(n) for n in (200, 513, 800, 999)]
#: What a step request asks (no hand-off: nothing is saved or loaded).
STEP = [5, 6, 7]

#: KV bytes per token of make_model's model: K and V planes, every layer,
#: every KV head, float32.
TOKEN_BYTES = (2 * int(make_model.CONFIG["num_hidden_layers"]) * int(make_model.CONFIG["num_key_value_heads"])
               * int(make_model.CONFIG["head_dim"]) * 4)


# ------------------------------------------------------------------ scraping

Sample = Tuple[str, Dict[str, str], float]
_LINE = re.compile(r"^([^\s{]+)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(e: Served) -> List[Sample]:
    """Every sample of ``e``'s ``/metrics`` (Prometheus text format)."""
    status, body = _get(f"{e.url}/metrics")
    assert status == 200, f"{e.name} /metrics answered {status}"
    out: List[Sample] = []
    for line in body.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        assert m is not None, f"{e.name} /metrics: unparsable line {line!r}"
        out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def value(samples: List[Sample], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for n, ls, v in samples if n == name and all(ls.get(k) == x for k, x in labels.items()))


def ours(samples: List[Sample]) -> Dict[str, float]:
    """The ``vllm:ascend_pd_*`` samples, as ``name{label=value,...}: value``
    (vLLM's labels left out; ``_created`` and buckets dropped)."""
    out: Dict[str, float] = {}
    for n, ls, v in samples:
        if not n.startswith("vllm:ascend_pd_") or n.endswith("_created") or n.endswith("_bucket"):
            continue
        extra = ",".join(f"{k}={x}" for k, x in sorted(ls.items()) if k not in ("model_name", "engine"))
        out[f"{n}{{{extra}}}" if extra else n] = v
    return out


# ------------------------------------------------------------------ engines


class Proxy(_Process):
    """``python -m ascend_pd.proxy`` over one prefill and one decode;
    ``decode_kv`` (LMCache's flow) names the decode's receiver."""

    def __init__(self, name: str, prefill: Served, decode: Served, log_dir: Path,
                 decode_kv: Optional[str] = None) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        cmd = [sys.executable, "-m", "ascend_pd.proxy", "--port", str(self.port),
               "--prefill", prefill.url, "--decode", decode.url]
        if decode_kv is not None:
            cmd += ["--decode-kv", decode_kv]
        env = dict(os.environ)
        extra = [p for p in (os.environ.get("APD_EXTRA_PYTHONPATH"), env.get("PYTHONPATH")) if p]
        if extra:
            env["PYTHONPATH"] = os.pathsep.join(extra)
        self._spawn(cmd, env)


def both_yaml(path: Path, init: int, alloc: int, done: int) -> Path:
    """An ascend-pd YAML for ``kv_both``: the receiver keys of
    harness.receiver_yaml, the sender's done port, ``pd_role: both``."""
    receiver_yaml(path, CHANNEL, MODE, init, alloc, extra=[f"pd_pull_done_port: {done}"])
    text = path.read_text()
    assert "pd_role: receiver\n" in text
    path.write_text(text.replace("pd_role: receiver\n", "pd_role: both\n"))
    return path


def _kv_both(yaml_path: Path) -> Dict[str, Any]:
    cfg = kv_config("kv_both", yaml_path)
    cfg["kv_load_failure_policy"] = "recompute"
    return cfg


def _reset_prefix_cache(e: Served) -> None:
    """Empties ``e``'s prefix cache (vLLM's dev endpoint); retried while a
    save still pins blocks (the reset refuses then), stepping the engine."""
    deadline = time.monotonic() + 60
    while True:
        req = urllib.request.Request(f"{e.url}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read().decode()
        if '"success":true' in body.replace(" ", ""):
            return
        assert time.monotonic() < deadline, f"{e.name}: prefix cache not reset: {body}"
        e.complete(STEP, 1)
        time.sleep(0.2)


def _until(what: str, done: Callable[[], bool], step: Callable[[], None], timeout: float = 90.0) -> None:
    """Steps the engines until ``done()`` (the connector's workers report
    what ended, and their counters, when their engine steps)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        step()
        time.sleep(0.2)


class Pair:
    """The two kv_both engines, the proxies, and what the traffic answered."""

    def __init__(self, model: Path, logdir: Path) -> None:
        self.model = str(model)
        self.ports = {n: (free_port(), free_port(), free_port()) for n in ("a", "b")}
        dev = {"VLLM_SERVER_DEV_MODE": "1"}
        self.a = Served("ops-a", model, logdir, _kv_both(both_yaml(logdir / "ops-a.yaml", *self.ports["a"])),
                        env=dev)
        self.b = Served("ops-b", model, logdir, _kv_both(both_yaml(logdir / "ops-b.yaml", *self.ports["b"])),
                        env=dev)
        init_a, alloc_a, _ = self.ports["a"]
        self.ab = Proxy("ops-proxy-ab", self.a, self.b, logdir)
        self.ba = Proxy("ops-proxy-ba", self.b, self.a, logdir, decode_kv=f"127.0.0.1/{init_a}/{alloc_a}")
        self.procs: List[_Process] = [self.a, self.b, self.ab, self.ba]
        self.start_s: Dict[str, float] = {}
        self.refs: Dict[str, List[List[int]]] = {}
        self.outs: Dict[str, List[List[int]]] = {}
        #: /metrics of each engine: "before", "after_ab", "end".
        self.scrapes: Dict[str, Dict[str, List[Sample]]] = {}
        self.traffic_s = 0.0

    def engines(self) -> List[Served]:
        return [self.a, self.b]

    def step(self) -> None:
        for e in self.engines():
            e.complete(STEP, 1)

    def scrape_all(self, when: str) -> Dict[str, List[Sample]]:
        self.scrapes[when] = {e.name: scrape(e) for e in self.engines()}
        return self.scrapes[when]

    def tokens(self, url: str, prompts: List[List[int]]) -> List[List[int]]:
        out = []
        for p in prompts:
            r = post(f"{url}/v1/completions", self.a.body(p, MAX_TOKENS))
            out.append(list(r["choices"][0]["token_ids"]))
        return out

    def counted(self, prefill: Served, decode: Served, n: int, parked: bool) -> bool:
        """Whether ``/metrics`` counts ``n`` saves on ``prefill`` (and their
        registrations if ``parked``) and ``n`` loads on ``decode``."""
        p, d = scrape(prefill), scrape(decode)
        return (value(p, "vllm:ascend_pd_saves_total") >= n and value(d, "vllm:ascend_pd_loads_total") >= n
                and (not parked or value(p, "vllm:ascend_pd_registrations_total", outcome="attached") >= n))

    def run(self) -> None:
        t0 = time.monotonic()
        self.scrape_all("before")
        # 1. References, each computed by the engine that will load it later.
        self.refs["ab"] = self.tokens(self.b.url, SET_AB)
        self.refs["ba"] = self.tokens(self.a.url, SET_BA)
        for e in self.engines():
            _reset_prefix_cache(e)
        # 2. A prefills, B decodes (router-native: A parks, B registers).
        self.outs["ab"] = self.tokens(self.ab.url, SET_AB)
        _until("A's saves and B's loads of SET_AB counted on /metrics",
               lambda: self.counted(self.a, self.b, len(SET_AB), parked=True), self.step)
        self.scrape_all("after_ab")
        # 3. Roles reversed (LMCache flow: B is told A's receiver).
        self.outs["ba"] = self.tokens(self.ba.url, SET_BA)
        _until("B's saves and A's loads of SET_BA counted on /metrics",
               lambda: self.counted(self.b, self.a, len(SET_BA), parked=False), self.step)
        # 4. Every page free again, as the gauges and the events say.
        _until("both engines' pools back (gauges and events)", self.settled, self.step)
        self.scrape_all("end")
        self.traffic_s = round(time.monotonic() - t0, 1)

    def settled(self) -> bool:
        for e in self.engines():
            s = scrape(e)
            for pool in ("sender", "receiver"):
                pages = value(s, "vllm:ascend_pd_pool_pages", pool=pool)
                if not (pages > 0 and value(s, "vllm:ascend_pd_pool_free_pages", pool=pool) == pages
                        and value(s, "vllm:ascend_pd_pool_pinned_pages", pool=pool) == 0
                        and value(s, "vllm:ascend_pd_pool_quarantined_pages", pool=pool) == 0):
                    return False
            if value(s, "vllm:ascend_pd_parked_saves") != 0:
                return False
            if not pools_back(e.last_pools()) or set(e.last_pools()) != {"sender", "receiver"}:
                return False
        return True

    def stop(self) -> None:
        stop(self.procs)


@pytest.fixture(scope="module")
def pair(model: Path, logdir: Path) -> Iterator[Pair]:
    p = Pair(model, logdir)
    try:
        p.start_s = start(p.procs)
        p.run()
        yield p
    finally:
        p.stop()


# -------------------------------------------------------------------- tests

#: Every series the connector exports (counters with ``_total``, histograms
#: by their ``_count``).
SERIES = [
    "vllm:ascend_pd_saves_total", "vllm:ascend_pd_save_bytes_total", "vllm:ascend_pd_save_failures_total",
    "vllm:ascend_pd_saves_cancelled_total", "vllm:ascend_pd_loads_total", "vllm:ascend_pd_load_bytes_total",
    "vllm:ascend_pd_load_tokens_total", "vllm:ascend_pd_load_failures_total", "vllm:ascend_pd_chunks_dropped_total",
    "vllm:ascend_pd_saves_parked_total", "vllm:ascend_pd_parked_expired_total",
    "vllm:ascend_pd_registrations_total", "vllm:ascend_pd_registered_chunks_total",
    "vllm:ascend_pd_save_seconds_count", "vllm:ascend_pd_load_seconds_count",
    "vllm:ascend_pd_load_wait_seconds_count", "vllm:ascend_pd_pool_pages", "vllm:ascend_pd_pool_free_pages", "vllm:ascend_pd_pool_pinned_pages",
    "vllm:ascend_pd_pool_quarantined_pages", "vllm:ascend_pd_parked_saves",
]


def _direction(prefill: List[Sample], decode: List[Sample], prompts: List[List[int]],
               parked: bool) -> Dict[str, Any]:
    """Checks one direction's counters (prefill's saves, decode's loads) and
    returns them."""
    n, tokens = len(prompts), sum(map(len, prompts))
    got = {
        "prefill_saves": value(prefill, "vllm:ascend_pd_saves_total"),
        "prefill_save_bytes": value(prefill, "vllm:ascend_pd_save_bytes_total"),
        "prefill_save_seconds_count": value(prefill, "vllm:ascend_pd_save_seconds_count"),
        "prefill_save_seconds_sum": value(prefill, "vllm:ascend_pd_save_seconds_sum"),
        "prefill_saves_parked": value(prefill, "vllm:ascend_pd_saves_parked_total"),
        "prefill_registrations_attached": value(prefill, "vllm:ascend_pd_registrations_total", outcome="attached"),
        "prefill_chunks_sent": value(prefill, "vllm:ascend_pd_registered_chunks_total", outcome="sent"),
        "decode_loads": value(decode, "vllm:ascend_pd_loads_total"),
        "decode_load_bytes": value(decode, "vllm:ascend_pd_load_bytes_total"),
        "decode_load_tokens": value(decode, "vllm:ascend_pd_load_tokens_total"),
        "decode_load_seconds_count": value(decode, "vllm:ascend_pd_load_seconds_count"),
        "decode_load_seconds_sum": value(decode, "vllm:ascend_pd_load_seconds_sum"),
        "decode_load_wait_seconds_count": value(decode, "vllm:ascend_pd_load_wait_seconds_count"),
    }
    # TP 1: one save per request on the prefill, one load on the decode,
    # each the whole prompt (the decode held none of it).
    assert got["prefill_saves"] == n and got["decode_loads"] == n, got
    assert got["prefill_save_bytes"] == tokens * TOKEN_BYTES, got
    assert got["decode_load_bytes"] == tokens * TOKEN_BYTES and got["decode_load_tokens"] == tokens, got
    assert got["prefill_save_seconds_count"] == n and got["prefill_save_seconds_sum"] > 0, got
    assert got["decode_load_seconds_count"] == n and got["decode_load_seconds_sum"] > 0, got
    # Every load waited for its KV once (the wait may round to 0 s).
    assert got["decode_load_wait_seconds_count"] == n, got
    if parked:
        chunks = sum(math.ceil(len(p) / CHUNK) for p in prompts)
        assert got["prefill_saves_parked"] == n and got["prefill_registrations_attached"] == n, got
        assert got["prefill_chunks_sent"] == chunks, (got, chunks)
    else:
        assert got["prefill_saves_parked"] == 0 and got["prefill_registrations_attached"] == 0, got
    return got


def test_metrics_on_vllms_endpoint(pair: Pair) -> None:
    """The connector's series are on each engine's own ``/metrics`` with
    vLLM's labels, and they count exactly what the traffic did."""
    a, b = pair.a.name, pair.b.name
    before, mid, end = pair.scrapes["before"], pair.scrapes["after_ab"], pair.scrapes["end"]
    for name, samples in end.items():
        mine = [(n, ls) for n, ls, _ in samples if n.startswith("vllm:ascend_pd_")]
        names = {n for n, _ in mine}
        missing = [s for s in SERIES if s not in names]
        assert not missing, f"{name} /metrics lacks {missing}"
        # vLLM's own labels, as on its vllm:* series.
        wrong = [(n, ls) for n, ls in mine if ls.get("model_name") != pair.model or ls.get("engine") != "0"]
        assert not wrong, wrong[:5]
        assert {ls.get("pool") for n, ls in mine if n == "vllm:ascend_pd_pool_pages"} == {"sender", "receiver"}
        # Nothing failed, nothing was cancelled or dropped.
        for s in ("vllm:ascend_pd_save_failures_total", "vllm:ascend_pd_load_failures_total",
                  "vllm:ascend_pd_saves_cancelled_total", "vllm:ascend_pd_chunks_dropped_total",
                  "vllm:ascend_pd_parked_expired_total"):
            assert value(samples, s) == 0, (name, s, ours(samples))
        for outcome in ("refused", "dropped", "malformed"):
            assert value(samples, "vllm:ascend_pd_registrations_total", outcome=outcome) == 0, (name, outcome)
    # The counters exist from the start, at zero; the gauges come with the
    # first step that moved KV.
    for name, samples in before.items():
        assert value(samples, "vllm:ascend_pd_saves_total") == 0 and value(
            samples, "vllm:ascend_pd_loads_total") == 0, ours(samples)
        assert any(n == "vllm:ascend_pd_load_failures_total" and ls.get("cause") == "timeout"
                   for n, ls, _ in samples), f"{name}: the known failure causes are not there at 0"

    # A -> B (router-native): after it, and unchanged by B -> A.
    ab = _direction(mid[a], mid[b], SET_AB, parked=True)
    assert value(mid[a], "vllm:ascend_pd_loads_total") == 0 and value(mid[b], "vllm:ascend_pd_saves_total") == 0
    # B -> A (LMCache flow): the end counters, less A -> B's.
    ba = _direction(end[b], end[a], SET_BA, parked=False)
    assert value(end[a], "vllm:ascend_pd_saves_total") == len(SET_AB)
    assert value(end[b], "vllm:ascend_pd_loads_total") == len(SET_AB)

    # Pool gauges: every page free again, and the size the events report.
    pools: Dict[str, Dict[str, Dict[str, float]]] = {}
    for e in pair.engines():
        s = end[e.name]
        events = e.last_pools()
        pools[e.name] = {}
        for pool in ("sender", "receiver"):
            g = {state: value(s, f"vllm:ascend_pd_pool_{state}pages", pool=pool)
                 for state in ("", "free_", "pinned_", "quarantined_")}
            pools[e.name][pool] = g
            assert g[""] == events[pool]["total"] > 0 and g["free_"] == g[""], (e.name, pool, g, events)
            assert g["pinned_"] == 0 and g["quarantined_"] == 0, (e.name, pool, g)
        assert value(s, "vllm:ascend_pd_parked_saves") == 0
    RESULTS["metrics"] = {
        "engines": "two vllm serve, kv_both (A prefills for B, then B for A)",
        "mode": MODE,
        "channel": CHANNEL,
        "labels": {"model_name": pair.model, "engine": "0"},
        "a_to_b_router_native": ab,
        "b_to_a_lmcache_flow": ba,
        "pool_gauges_end": pools,
        "series_end": {name: ours(samples) for name, samples in end.items()},
        "engine_start_s": pair.start_s,
        "traffic_wall_s": pair.traffic_s,
    }


def _events(e: Served, kind: str) -> List[Dict[str, Any]]:
    return e.events_of(kind)


def test_kv_both_engines_swap_roles(pair: Pair) -> None:
    """Two kv_both engines, each prefilling for the other: the decodes'
    tokens equal the reference computed by an engine alone, every prompt's
    KV was loaded whole from the other engine (one save there, one load
    here, each ``done``), and every pool is back."""
    for key, prompts in (("ab", SET_AB), ("ba", SET_BA)):
        for i, (got, want) in enumerate(zip(pair.outs[key], pair.refs[key])):
            assert len(want) == MAX_TOKENS
            assert got == want, f"{key} prompt {i} ({len(prompts[i])} tokens): {got} != {want}"
    a, b = pair.a, pair.b
    # The loads each engine ran: exactly the prompts the other prefilled.
    for decode, prompts in ((b, SET_AB), (a, SET_BA)):
        loads = sorted((ev["status"], ev["tokens"]) for ev in _events(decode, "load"))
        assert loads == sorted(("done", len(p)) for p in prompts), (decode.name, loads)
    for prefill, prompts, parked in ((a, SET_AB, True), (b, SET_BA, False)):
        saves = sorted((ev["status"], ev["tokens"], ev.get("parked")) for ev in _events(prefill, "save"))
        assert saves == sorted(("done", len(p), parked) for p in prompts), (prefill.name, saves)
    registered = _events(b, "register")
    assert len(registered) == len(SET_AB), registered
    # One YAML for both roles: the receiver is not handed the sender's keys.
    for e in pair.engines():
        ignored = [l for l in e.log_path.read_text(errors="replace").splitlines() if "ignored on a receiver" in l]
        assert not ignored, (e.name, ignored)
    pools = {e.name: e.last_pools() for e in pair.engines()}
    for name, p in pools.items():
        assert set(p) == {"sender", "receiver"} and pools_back(p), (name, p)
    RESULTS["kv-both"] = {
        "mode": MODE,
        "channel": CHANNEL,
        "a_to_b": {"flow": "router-native (A parks, B registers)", "prompt_lengths": [len(p) for p in SET_AB]},
        "b_to_a": {"flow": "LMCache (B is told A's receiver)", "prompt_lengths": [len(p) for p in SET_BA]},
        "tokens_identical": True,
        "reference": "each set computed by the engine that later loads it, alone, before its prefix cache was reset",
        "tokens_loaded_remotely": {"b_from_a": sum(map(len, SET_AB)), "a_from_b": sum(map(len, SET_BA))},
        "pools_after": pools,
    }


def test_stats_aggregate_like_vllm() -> None:
    """Without engines: vLLM sums the TP workers' stats of one step and
    accumulates steps over its log interval with ``aggregate``; counters
    and per-operation seconds add up, a rank's pool pages are its latest
    value (never summed over steps), different ranks' add up; the
    Prometheus side sums the latest value of every rank, even of a rank
    that did not report this step."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from ascend_pd.vllm.stats import AscendPDPromMetrics, TransferStats

    def pool(free: int, pinned: int = 0) -> Dict[str, Dict[str, int]]:
        return {"receiver": {"total": 10, "free": free, "allocated": 10 - free, "pinned": pinned,
                             "quarantined": 0}}

    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = AscendPDPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"]})
    r0, r1 = TransferStats(), TransferStats()
    # Step 1: both ranks load, ranks hold 3 and 2 pages.
    r0.record("load", 4096, 0.010, tokens=1)
    r1.record("load", 4096, 0.030, tokens=1)
    r0.sample(0, pool(7, pinned=3))
    r1.sample(1, pool(8, pinned=2))
    s0, s1 = r0.take(), r1.take()
    assert s0 is not None and s1 is not None
    step1 = s0.aggregate(s1)
    prom.observe(step1.data)
    # Step 2: rank 0 alone, its pages back; rank 1 unchanged sends nothing.
    r0.sample(0, pool(10))
    r1.sample(1, pool(8, pinned=2))
    assert r1.take() is None
    step2 = r0.take()
    assert step2 is not None
    prom.observe(step2.data)
    # The log interval: both steps, as vLLM's logger accumulates them.
    interval = TransferStats(step1.data).aggregate(TransferStats(step2.data))
    r = interval.reduce()
    assert r["loads"] == 2 and r["load_tokens"] == 2 and r["load_ms_avg"] == 20.0, r
    assert r["receiver_pages_free"] == 18 and r["receiver_pages_pinned"] == 2, r
    text = generate_latest(reg).decode()

    def metric(line_start: str) -> float:
        got = [float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(line_start)]
        assert len(got) == 1, (line_start, got)
        return got[0]

    lv = 'engine="0",model_name="m"'
    assert metric(f"vllm:ascend_pd_loads_total{{{lv}}}") == 2
    assert metric(f"vllm:ascend_pd_load_bytes_total{{{lv}}}") == 8192
    assert metric(f"vllm:ascend_pd_load_seconds_count{{{lv}}}") == 2
    assert metric('vllm:ascend_pd_load_seconds_bucket{engine="0",le="0.01",model_name="m"}') == 1
    assert metric(f'vllm:ascend_pd_pool_free_pages{{{lv},pool="receiver"}}') == 18
    assert metric(f'vllm:ascend_pd_pool_pinned_pages{{{lv},pool="receiver"}}') == 2
    assert metric(f'vllm:ascend_pd_pool_pages{{{lv},pool="receiver"}}') == 20
    # Failures by cause, and registration counters as increases.
    r0.record_failure("load", "timeout")
    r0.sample(0, pool(10), {"parked": 2, "attached": 1, "parked_now": 1, "chunks_sent": 3})
    r0.sample(0, pool(10), {"parked": 3, "attached": 3, "parked_now": 0, "chunks_sent": 7})
    step3 = r0.take()
    assert step3 is not None
    prom.observe(step3.data)
    text = generate_latest(reg).decode()
    assert metric(f'vllm:ascend_pd_load_failures_total{{cause="timeout",{lv}}}') == 1
    assert metric(f'vllm:ascend_pd_saves_parked_total{{{lv}}}') == 3
    assert metric(f'vllm:ascend_pd_registrations_total{{{lv},outcome="attached"}}') == 3
    assert metric(f'vllm:ascend_pd_registered_chunks_total{{{lv},outcome="sent"}}') == 7
    assert metric(f"vllm:ascend_pd_parked_saves{{{lv}}}") == 0
