"""ascend-pd under vLLM's own PD router (issue 36: router-native PD).

`vllm-router --vllm-pd-disaggregation --kv-connector nixl` in front of
`vllm serve` engines (vLLM's CPU build, the local tiny GQA Llama), over
loopback, with the connector configured only through its YAML: the router
knows nothing of ascend-pd. For each request it sends the prefill the
client's body with ``max_tokens: 1``, ``stream: false`` and
``kv_transfer_params: {"do_remote_decode": true, <nixl fields all null>}``,
then the decode the client's body plus the prefill answer's
``kv_transfer_params``, copied unchanged. Both legs carry the same
``X-Request-Id``, so the prefill's and the decode's vLLM request ids are
both ``cmpl-<that id>-0-<8 characters>``, and the client's answer id is
``cmpl-<that id>``.

Engine sets, each started for its own tests and stopped after them: one
prefill (kv_producer) and one decode (kv_consumer) per mode (push,
pull-eager, pull-delay, layer-wise push), and two prefills with one decode
(round robin). A colocated `vllm serve` (no connector) gives the reference
tokens and time to first token.

Per set, through the router, greedy token-id prompts of 300 to 1000 tokens
(none sharing a block with another), one set non-streamed and one streamed
(SSE): the tokens must equal the colocated engine's; the decode must have
loaded every prompt's KV from the prefill that computed it (its connector's
``load`` event ``done`` with the whole prompt), that prefill must have
saved it once (``save`` event ``done``), and every pool must be back at its
start afterwards. The layer-wise set checks that ``pd_layerwise`` does not
break the flow: a prefill learns its decode only after it answered, so it
parks its saves and sends them whole (the results count both).

Each set's streamed time to first token through the router, and the
colocated engine's, go to ``APD_VLLM_RESULTS`` under the set's key, each
streamed request asked after the engines were idle for ``IDLE_S`` (see
router_harness on timing).
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence

import pytest

from conftest import RESULTS
from harness import CHUNK, MAX_TOKENS, external, free_port, kv_config, pools_back, receiver_yaml, sender_yaml
from router_harness import IDLE_S, Router, Served, Streamed, post, router_bin, start, stop, stream

_rng = random.Random(3636)


def _toks(n: int) -> List[int]:
    return [_rng.randrange(3, 512) for _ in range(n)]


#: Asked non-streamed, then STREAMED streamed; random tokens, so no two
#: prompts share a 128-token block and every prompt is new to every engine.
NON_STREAMED = [_toks(n) for n in (300, 517, 768, 1000)]
STREAMED = [_toks(n) for n in (333, 640, 901, 1000)]
#: One short request per prefill before the measured ones (first-request costs).
WARM_UP = [[11 + i] * 16 for i in range(2)]


class SetSpec(NamedTuple):
    key: str
    mode: str
    channel: str
    layerwise: bool
    prefills: int


SETS = [
    SetSpec("router-push", "push", "shm", False, 1),
    SetSpec("router-pull-eager", "pull-eager", "tcp", False, 1),
    SetSpec("router-pull-delay", "pull-delay", "shm", False, 1),
    SetSpec("router-push-layerwise", "push", "tcp", True, 1),
    # Both prefills must reach the one decode: push, so each prefill has to
    # find the decode's receiver without the router naming it.
    SetSpec("router-2p1d", "push", "tcp", False, 2),
]


class Answer(NamedTuple):
    prompt: List[int]
    response_id: str
    tokens: List[int]
    #: Streamed: seconds to the first chunk with a token; non-streamed: the whole request.
    seconds: float
    streamed: bool


def _nonstreamed(url: str, body: Dict[str, Any], prompt: List[int]) -> Answer:
    t0 = time.monotonic()
    r = post(f"{url}/v1/completions", {**body, "prompt": prompt})
    took = time.monotonic() - t0
    return Answer(prompt, str(r["id"]), list(r["choices"][0]["token_ids"]), took, False)


def _streamed(url: str, body: Dict[str, Any], prompt: List[int]) -> Answer:
    s: Streamed = stream(f"{url}/v1/completions", {**body, "prompt": prompt})
    return Answer(prompt, s.response_id, s.tokens, s.ttft_s, True)


def _traffic(url: str, body: Dict[str, Any], warm_ups: int) -> List[Answer]:
    """Warm-up requests, then NON_STREAMED back to back, then STREAMED one
    at a time, each after the engines were idle for IDLE_S: a request that
    follows another at once mostly measures vLLM's second of polling after
    a step on a 2-CPU host (router_harness), not the request."""
    for p in WARM_UP[:warm_ups]:
        post(f"{url}/v1/completions", {**body, "prompt": p, "max_tokens": 2})
    out = [_nonstreamed(url, body, p) for p in NON_STREAMED]
    for p in STREAMED:
        time.sleep(IDLE_S)
        out.append(_streamed(url, body, p))
    return out


def _ms(xs: Sequence[float]) -> List[float]:
    return [round(1000 * x, 1) for x in xs]


@pytest.fixture(scope="module")
def colocated(model: Path, logdir: Path) -> Dict[str, Any]:
    """The reference: the same requests to a `vllm serve` without a connector."""
    e = Served("router-colocated", model, logdir)
    try:
        start_s = start([e])
        answers = _traffic(e.url, e.body([], MAX_TOKENS), warm_ups=1)
    finally:
        stop([e])
    for a in answers:
        assert len(a.tokens) == MAX_TOKENS, a
    return {"start_s": start_s[e.name], "answers": answers}


class PDSet:
    """A set's engines and router, and what its requests answered."""

    def __init__(self, spec: SetSpec, model: Path, logdir: Path) -> None:
        router_bin()  # missing: fail before starting anything
        self.spec = spec
        self.answers: List[Answer] = []
        self.start_s: Dict[str, float] = {}
        #: vLLM's finished-request counter of each engine right after the traffic.
        self.finished: Dict[str, float] = {}
        name = spec.key
        init, alloc = free_port(), free_port()
        ry = receiver_yaml(logdir / f"{name}-receiver.yaml", spec.channel, spec.mode, init, alloc)
        senders = [sender_yaml(logdir / f"{name}-sender{i}.yaml", spec.channel, spec.mode, free_port(),
                   layerwise=spec.layerwise) for i in range(spec.prefills)]
        self.engines: List[Served] = []
        self.router: Optional[Router] = None
        try:
            self.decode = Served(f"{name}-decode", model, logdir, kv_config("kv_consumer", ry))
            self.engines.append(self.decode)
            self.prefills: List[Served] = []
            for i, sy in enumerate(senders):
                self.prefills.append(Served(f"{name}-prefill{i}", model, logdir, kv_config("kv_producer", sy)))
                self.engines.append(self.prefills[-1])
            self.router = Router(f"{name}-router", self.prefills, self.decode, logdir)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.router is not None:
            stop([self.router])
        stop(self.engines)

    def step(self) -> None:
        """One 1-token request straight to each engine (no hand-off): the
        connector's workers poll the library, and write their events, when
        their engine steps."""
        for e in self.engines:
            e.complete([5, 6, 7], 1)


@pytest.fixture(scope="module", params=SETS, ids=[s.key for s in SETS])
def pd_set(request: pytest.FixtureRequest, model: Path, logdir: Path,
           colocated: Dict[str, Any]) -> Iterator[PDSet]:
    spec: SetSpec = request.param
    t0 = time.monotonic()
    s = PDSet(spec, model, logdir)
    try:
        # The router probes the engines every second and binds its port once
        # all are healthy: all spawned at once.
        assert s.router is not None
        s.start_s = start(s.engines + [s.router])
        started = time.monotonic() - t0
        body = s.decode.body([], MAX_TOKENS)
        t1 = time.monotonic()
        s.answers = _traffic(s.router.url, body, warm_ups=spec.prefills)
        traffic = time.monotonic() - t1
        s.finished = {e.name: e.metric("vllm:request_success_total") for e in s.engines}
        ref: List[Answer] = colocated["answers"]
        ttft = [a.seconds for a in s.answers if a.streamed]
        ttft_ref = [a.seconds for a in ref if a.streamed]
        RESULTS[spec.key] = {
            "mode": spec.mode,
            "channel": spec.channel,
            "layerwise": spec.layerwise,
            "prefills": spec.prefills,
            "chunk_size": CHUNK,
            "prompt_lengths": {"non_streamed": [len(p) for p in NON_STREAMED],
                               "streamed": [len(p) for p in STREAMED]},
            "tokens_identical": [a.tokens for a in s.answers] == [a.tokens for a in ref],
            # Filled in by test_decode_loaded_every_prompt_from_its_prefill.
            "remote_kv_checked": False,
            "engine_start_s": s.start_s,
            "set_start_wall_s": round(started, 1),
            "traffic_wall_s": round(traffic, 1),
            "colocated_engine_start_s": colocated["start_s"],
            # Streamed time to the first chunk carrying a token, per prompt,
            # each asked after IDLE_S idle: through the router (prefill,
            # hand-off, decode) and colocated.
            "idle_before_streamed_s": IDLE_S,
            "streamed_ttft_ms_via_router": _ms(ttft),
            "streamed_ttft_ms_colocated": _ms(ttft_ref),
            "streamed_ttft_ms_median": {"via_router": round(1000 * statistics.median(ttft), 1),
                                        "colocated": round(1000 * statistics.median(ttft_ref), 1)},
            # Back to back: on a 2-CPU host mostly vLLM's polling (see _traffic).
            "non_streamed_wall_ms_via_router": _ms([a.seconds for a in s.answers if not a.streamed]),
            "non_streamed_wall_ms_colocated": _ms([a.seconds for a in ref if not a.streamed]),
        }
        yield s
    finally:
        s.stop()


def _compare(got: Sequence[Answer], want: Sequence[Answer]) -> None:
    assert len(got) == len(want)
    for a, w in zip(got, want):
        assert a.prompt == w.prompt
        assert a.tokens == w.tokens, (
            f"{len(a.prompt)}-token prompt ({'streamed' if a.streamed else 'non-streamed'}, {a.response_id}): "
            f"{a.tokens} != colocated {w.tokens}")


def test_non_streamed_tokens_equal_colocated(pd_set: PDSet, colocated: Dict[str, Any]) -> None:
    _compare([a for a in pd_set.answers if not a.streamed],
             [a for a in colocated["answers"] if not a.streamed])


def test_streamed_tokens_equal_colocated(pd_set: PDSet, colocated: Dict[str, Any]) -> None:
    _compare([a for a in pd_set.answers if a.streamed], [a for a in colocated["answers"] if a.streamed])


def test_router_sent_every_request_to_a_prefill_and_the_decode(pd_set: PDSet) -> None:
    """vLLM's own counters: the decode answered every request, the prefills
    between them too (round robin: each prefill its share)."""
    n = len(pd_set.answers) + pd_set.spec.prefills  # + the warm-ups
    per_prefill = [pd_set.finished[p.name] for p in pd_set.prefills]
    RESULTS[pd_set.spec.key]["requests_per_prefill"] = per_prefill
    assert pd_set.finished[pd_set.decode.name] == n, pd_set.finished
    assert sum(per_prefill) == n, per_prefill
    assert all(c == n / len(per_prefill) for c in per_prefill), per_prefill


def _engine_id(answer: Answer) -> str:
    """The vLLM request id an answer's request had (less the random tail):
    the completion's single choice is request ``<id>-0``."""
    return f"{answer.response_id}-0"


def test_decode_loaded_every_prompt_from_its_prefill(pd_set: PDSet) -> None:
    """The decode computed none of these prompts: for every request its
    connector wrote exactly one ``load`` event, ``done``, covering the
    whole prompt; exactly one prefill wrote one ``save`` event for it,
    ``done``; with two prefills, both saved some."""
    s = pd_set
    want = {_engine_id(a): a for a in s.answers}
    RESULTS[s.spec.key]["engine_request_ids"] = sorted(want)
    # A load's event is written before vLLM schedules its request, so before
    # the answer: all are in the file now.
    loads: Dict[str, List[Dict[str, Any]]] = {}
    for ev in s.decode.events_of("load"):
        loads.setdefault(external(ev["req_id"]), []).append(ev)
    got = {k: [(ev["status"], ev["tokens"]) for ev in loads.get(k, [])] for k in want}
    RESULTS[s.spec.key]["decode_loads"] = {k: {"prompt": len(want[k].prompt), "loads": v} for k, v in got.items()}
    RESULTS[s.spec.key]["decode_events"] = _kinds(s.decode)
    bad = {k: (len(want[k].prompt), v) for k, v in got.items() if v != [("done", len(want[k].prompt))]}
    assert not bad, (f"{len(bad)} of {len(want)} requests not loaded whole from a prefill by the decode "
                     f"(request: (prompt length, its load events' status and tokens)): {bad}")
    # A save's event is written when its prefill next polls the library (an
    # engine step): step the engines until each request has one, bounded.
    deadline = time.monotonic() + 60
    while True:
        saves: Dict[str, List[Any]] = {}
        for i, p in enumerate(s.prefills):
            for ev in p.events_of("save"):
                saves.setdefault(external(ev["req_id"]), []).append(
                    (i, ev["status"], ev["tokens"], ev.get("layerwise"), ev.get("parked")))
        if all(k in saves for k in want) or time.monotonic() > deadline:
            break
        s.step()
        time.sleep(0.2)
    RESULTS[s.spec.key]["prefill_saves"] = {k: saves.get(k, []) for k in want}
    all_saves = [v[0] for k, v in saves.items() if k in want and v]
    # Recorded, not asserted: under the router a prefill learns its decode
    # only after it answered, so its saves are parked and go whole, even
    # with pd_layerwise (the worker opens layer-wise saves only for a known
    # decode).
    RESULTS[s.spec.key]["saves_layerwise"] = sum(1 for v in all_saves if v[3] is True)
    RESULTS[s.spec.key]["saves_parked"] = sum(1 for v in all_saves if v[4] is True)
    bad_saves = {k: saves.get(k, []) for k in want if len(saves.get(k, [])) != 1 or saves[k][0][1] != "done"}
    assert not bad_saves, (f"requests not saved exactly once, done (prefill, status, tokens, layerwise, "
                           f"parked): {bad_saves}")
    savers = {saves[k][0][0] for k in want}
    assert savers == set(range(len(s.prefills))), f"prefills that saved: {savers}"
    RESULTS[s.spec.key]["tokens_loaded_remotely"] = sum(len(a.prompt) for a in s.answers)
    RESULTS[s.spec.key]["remote_kv_checked"] = True


def _kinds(e: Served) -> Dict[str, int]:
    """How many events of each kind an engine's connector wrote."""
    out: Dict[str, int] = {}
    for ev in e.all_events():
        out[str(ev.get("event"))] = out.get(str(ev.get("event")), 0) + 1
    return out


def test_pools_back(pd_set: PDSet) -> None:
    """Every pool of every engine has all its pages free again (none pinned
    or quarantined); the engines are stepped until they are, bounded."""
    s = pd_set
    roles = {s.decode.name: "receiver", **{p.name: "sender" for p in s.prefills}}
    deadline = time.monotonic() + 60
    last: Dict[str, Any] = {}
    while True:
        last = {e.name: e.last_pools() for e in s.engines}
        if all(pools_back(last[n]) and roles[n] in last[n] for n in roles):
            break
        assert time.monotonic() < deadline, (f"pools not back at their start after 60 s (the latest event's "
                                             f"counters per engine, {{}}: no event yet): {last}")
        s.step()
        time.sleep(0.5)
    RESULTS[s.spec.key]["pools_after"] = last
    RESULTS[s.spec.key]["events"] = {e.name: _kinds(e) for e in s.engines}
