"""The engine-level benchmark (benchmarks/engine_bench.py) run for real,
small: a push pair through ``MODE:lib=PATH`` (this package's library, named
explicitly), the ``no-kv`` pair and the colocated engine, every case kind
with a few prompts, then its report checked:

1. it exits 0 and writes engine_bench.json and the plot;
2. every configuration answered every prompt of every case, none failed;
3. the push pair's decode loaded every request's KV (a load event per
   request, each done, none without one; the connector's own counter on
   /metrics agrees and counts no failed load), and its pair ran the
   library ``lib=`` named;
4. the hand-over is broken down per phase, with the overhead against both
   references (the colocated engine and the no-kv pair), and the no-kv
   pair never loaded anything (it has no connector);
5. an option it cannot honour fails before any engine starts, naming it
   (``lib=`` naming no file; an option on ``no-kv``).

Slow (four engines start, one after another in pairs): about 5 minutes
on 2 cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from conftest import RESULTS
from harness import free_port
from test_restart import base_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "engine_bench.py"
TIMEOUT_S = 1500


def _library() -> str:
    from ascend_pd import _lib

    return _lib.library_path()


def _run(args: List[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("ASCEND_PD_LIB", None)
    return subprocess.run([sys.executable, str(SCRIPT)] + args, capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(ROOT))


def test_an_option_the_benchmark_cannot_honour_fails_before_any_engine(tmp_path: Path) -> None:
    for modes, want in (("push:lib=/nonexistent/libascend_pd.so", "is not a file"),
                        ("no-kv:load_wait_ms=0", "no-kv takes no options"),
                        ("pushy", "unknown mode 'pushy'")):
        r = _run(["--out", str(tmp_path / "out"), "--modes", modes], timeout=120)
        assert r.returncode != 0, f"--modes {modes} was accepted:\n{r.stdout[-2000:]}"
        assert want in r.stderr + r.stdout, f"--modes {modes}: no {want!r} in:\n{r.stderr[-2000:]}"
        assert not (tmp_path / "out" / "logs").exists() or not any((tmp_path / "out" / "logs").iterdir()), \
            f"--modes {modes} started something"


def test_a_small_run_reports_every_case_and_the_hand_over(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    lib = _library()
    push = f"push:lib={lib}"
    args = ["--out", str(out), "--modes", f"{push},no-kv", "--input-lens", "96", "--rates", "2",
            "--num-prompts", "4", "--warmup-prompts", "1", "--seq-prompts", "3", "--seq-rate", "2",
            "--sat-prompts", "4", "--load-fraction", "0.5",
            "--prefill-port", str(free_port()), "--decode-port", str(free_port()),
            "--coloc-port", str(free_port()), "--router-port", str(free_port()),
            "--router-metrics-port", str(free_port()), "--pd-base-port", str(base_port())]
    r = _run(args, timeout=TIMEOUT_S)
    (tmp_path / "stdout.txt").write_text(r.stdout + "\n---\n" + r.stderr)
    assert r.returncode == 0, f"engine_bench exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    report: Dict[str, Any] = json.loads((out / "engine_bench.json").read_text())
    assert report.get("plot") and Path(report["plot"]).is_file(), "no plot written"

    name = push.replace("/", "_")
    rows = report["rows"]
    kinds = {(row["config"], row["kind"]) for row in rows}
    for config in (name, "no-kv", "colocated"):
        for kind in ("seq", "measure", "sat", "load"):
            assert (config, kind) in kinds, f"no {kind} case for {config}: {sorted(kinds)}"
    want = {"seq": 3, "measure": 4, "sat": 4, "load": 4}
    for row in rows:
        s = row["summary"]
        assert s["completed"] == want.get(row["kind"], s["completed"]) and not s.get("failed"), \
            f"{row['config']} {row['kind']}: {s.get('completed')} completed, {s.get('failed')} failed"

    cfg = report["configs"][name]
    assert cfg["ascend_pd_lib"] == str(Path(lib).resolve()), cfg.get("ascend_pd_lib")
    answered = sum(row["summary"]["completed"] for row in rows if row["config"] == name)
    m = cfg["metrics"]
    # Every request of the pair (its one warm-up prompt included) handed
    # over: one load each, every prompt token loaded, none failed. (The
    # prefill's own counters are published at its next step, which an idle
    # prefill may not take before the scrape: the decode's are the check.)
    assert m["decode_loads"] == answered + 1 and m["decode_load_failures"] == 0, m
    assert m["decode_load_tokens"] == 96 * m["decode_loads"], m

    seq = next(row for row in rows if row["config"] == name and row["kind"] == "seq")
    h = seq["handover"]
    assert h["loads_not_done"] == 0 and h["requests_without_load_event"] == 0, h
    assert h["join"]["requests"] == 3, h["join"]
    phases = h["phases_ms"]
    for key in ("decode_seen_to_load_start (KV here)", "load_start_to_load_done",
                "load_done_to_first_token (client)"):
        assert phases[key]["p50"] is not None and phases[key]["p50"] >= 0, (key, phases[key])
    vs_coloc = phases["overhead_decode (issue def., decode clock from first event)"]
    vs_no_kv = next(v for k, v in phases.items() if k.startswith("overhead_decode vs the no-kv pair"))
    assert vs_coloc["p50"] is not None and vs_no_kv["p50"] is not None, phases
    assert all("overhead_decode_vs_no_kv_ms" in req for req in h["requests"]), h["requests"]
    assert not (out / "logs" / "no-kv-decode-events.jsonl").exists() or \
        not any('"event": "load"' in line for line in
                (out / "logs" / "no-kv-decode-events.jsonl").read_text().splitlines())
    assert "handover" not in next(row for row in rows if row["config"] == "no-kv" and row["kind"] == "seq")

    RESULTS["engine-bench"] = {
        "configs": sorted({row["config"] for row in rows}),
        "push_seq_phases_p50_ms": {k: v["p50"] for k, v in phases.items()},
        "push_decode_loads": m["decode_loads"],
    }


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
