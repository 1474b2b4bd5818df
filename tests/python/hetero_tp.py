#!/usr/bin/env python3
"""Heterogeneous TP through the Python package (and so the C ABI).

    python3 tests/python/hetero_tp.py PREFILL_TP DECODE_TP MODE PORT...

Runs, in this one process, PREFILL_TP senders and DECODE_TP receivers over
shm in MODE (push, pull-eager or pull-delay), each rank with its own
engine-owned numpy KV cache holding its heads of one model.

1. direct: two requests are saved with one submit_save per prefill rank
   (per-rank port lists) and loaded with one submit_load per decode rank
   under the plain keys.
2. parked (router-native flow): two more requests are saved with one
   submit_parked_save per prefill rank; then EVERY decode rank's receiver
   registers for each with ALL prefill ranks' register ports (as vLLM's
   decode ranks do: identical registrations, the prefill takes the first
   and accepts the rest); every registration must end done, every parked
   save done, each prefill rank must have attached each request once.
   Before that, a receiver configured with another tp_size than the
   prefill's pd_peer_tp_size registers for the first request: it must be
   refused promptly with a message naming pd_peer_tp_size, get nothing,
   and leave every parked save parked.

In both, every loaded byte must be that decode rank's heads of the model's
token, and every pool must be back where it started. Needs 2 * DECODE_TP +
PREFILL_TP + 3 free ports. Prints one "ok ..." line per passed check of
the parked flow, then "hetero_tp: OK ..." and exits 0 on success; exits 1
with one "FAIL ..." line per failed check otherwise.
"""

import faulthandler
import os
import sys
import time
from typing import List, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import numpy as np  # noqa: E402

import ascend_pd  # noqa: E402

HEADS = 4  # KV heads of the model
HEAD = 16  # elements per head
LAYERS = 2
PLANES = 2
NUM_BLOCKS = 16
BLOCK = 16
CHUNK = 16
TOKENS = [37, 21]  # two requests, each ending in a partial chunk
TIMEOUT_S = 30.0
WATCHDOG_S = 240.0  # a call that never returns ends the run with every thread's stack

failures = 0


def fail(what: str) -> None:
    global failures
    failures += 1
    print(f"FAIL {what}", file=sys.stderr, flush=True)


def report(ok: bool, what: str) -> bool:
    if ok:
        print(f"ok   {what}", flush=True)
    else:
        fail(what)
    return ok


def yaml(role: str, tp: int, peer_tp: int, mode: str, lines: List[str]) -> str:
    pull, delay = {"push": (False, False), "pull-eager": (True, False), "pull-delay": (True, True)}[mode]
    return "\n".join(
        [
            "enable_pd: True",
            "local_cpu: False",
            'transfer_channel: "shm"',
            f'pd_role: "{role}"',
            'pd_peer_host: "127.0.0.1"',
            "pd_buffer_size: 2097152",
            'pd_buffer_device: "cpu"',
            f"chunk_size: {CHUNK}",
            f"kv_num_layers: {LAYERS}",
            f"kv_num_heads: {HEADS // tp}",
            f"kv_head_size: {HEAD}",
            'kv_dtype: "float16"',
            f"tp_size: {tp}",
            f"pd_peer_tp_size: {peer_tp}",
            f"pd_pull_mode: {pull}",
            f"pd_delay_pull: {delay}",
        ]
        + lines
    ) + "\n"


def heads_of(rank: int, tp: int) -> Tuple[int, int]:
    per = HEADS // tp
    return rank * per, (rank + 1) * per


def model_rows(q: int, layer: int, plane: int) -> np.ndarray:
    """Request q's tokens of one (layer, plane) over the whole model: [tokens, HEADS * HEAD * 2] bytes."""
    t = np.arange(TOKENS[q], dtype=np.int64)[:, None]
    b = np.arange(HEADS * HEAD * 2, dtype=np.int64)[None, :]
    return ((q * 97 + layer * 31 + plane * 17 + t * 13 + b * 5) & 0xFF).astype(np.uint8)


def new_cache(heads: int) -> Tuple[List[np.ndarray], "ascend_pd.KVCache"]:
    tensors = [
        np.zeros((NUM_BLOCKS, BLOCK, heads, HEAD), dtype=np.float16) for _ in range(LAYERS * PLANES)
    ]
    cache = ascend_pd.KVCache(
        tensors,
        fmt="kv",
        dtype="float16",
        layers=LAYERS,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK,
        hidden=heads * HEAD,
    )
    return tensors, cache


def rows(tensor: np.ndarray) -> np.ndarray:
    return tensor.view(np.uint8).reshape(NUM_BLOCKS * BLOCK, -1)


def prefill_slots(q: int) -> np.ndarray:
    return np.arange(TOKENS[q], dtype=np.int64) + q * 64


def decode_slots(q: int) -> np.ndarray:
    # Reverse order, other blocks: a piece cannot land right by accident.
    return NUM_BLOCKS * BLOCK - 1 - q * 64 - np.arange(TOKENS[q], dtype=np.int64)


def keys(q: int, prefix: str = "py-tp") -> List[str]:
    return [f"{prefix}-{q}@{c}" for c in range((TOKENS[q] + CHUNK - 1) // CHUNK)]


def parked_keys(q: int) -> List[str]:
    return keys(q, "py-park")


def wait_one(poll, what: str) -> "ascend_pd.Completion":
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        done = poll()
        if done:
            return done[0]
        time.sleep(0.005)
    raise TimeoutError(f"{what}: no completion within {TIMEOUT_S:.0f} s")


def settled(stats: "ascend_pd.PoolStats", start: "ascend_pd.PoolStats") -> bool:
    return stats == start and stats.free == stats.total and stats.pinned == 0 and stats.quarantined == 0


def load_and_verify(d: int, r: "ascend_pd.Receiver", b: int, req: str, keys_of) -> int:
    """Loads every request into a fresh cache of decode rank `d` (request q
    as f"{req}-{q}" under keys_of(q)) and checks every byte is the rank's
    heads of the model. The bytes verified."""
    loaded = 0
    lo, hi = heads_of(d, b)
    tensors, cache = new_cache(HEADS // b)
    for q in range(len(TOKENS)):
        deadline = time.monotonic() + TIMEOUT_S
        while not r.available(keys_of(q)) and time.monotonic() < deadline:
            time.sleep(0.005)
        if not r.available(keys_of(q)):
            fail(f"decode rank {d}: {req}-{q} not available after {TIMEOUT_S:.0f} s")
            continue
        r.submit_load(f"{req}-{q}", keys_of(q), cache, decode_slots(q))
        c = wait_one(r.poll, f"decode rank {d}, load of {req}-{q}")
        if c.status != "done":
            fail(f"decode rank {d}: load of {c.req_id}: {c.status}: {c.message}")
            continue
        for layer in range(LAYERS):
            for plane in range(PLANES):
                want = model_rows(q, layer, plane)[:, lo * HEAD * 2 : hi * HEAD * 2]
                got = rows(tensors[layer * PLANES + plane])[decode_slots(q)]
                bad = np.nonzero((got != want).any(axis=1))[0]
                if bad.size:
                    fail(
                        f"decode rank {d}, {req}-{q}, layer {layer}, plane {plane}: "
                        f"{bad.size} token(s) are not its heads [{lo}, {hi}) of the model, "
                        f"first token {int(bad[0])}"
                    )
                else:
                    loaded += got.size
    cache.close()
    return loaded


def collect(poll, n: int, what: str, seconds: float = TIMEOUT_S) -> List["ascend_pd.Completion"]:
    """Up to `n` completions `poll` reports within `seconds` (fewer: a FAIL line)."""
    got: List["ascend_pd.Completion"] = []
    deadline = time.monotonic() + seconds
    while len(got) < n and time.monotonic() < deadline:
        got += poll()
        if len(got) < n:
            time.sleep(0.005)
    if len(got) < n:
        fail(f"{what}: {len(got)} of {n} completion(s) within {seconds:.0f} s: {got}")
    return got


def settle_all(tag: str, senders, receivers, s_start, r_start) -> None:
    """Every pulled save drained and every pool back where it started."""
    for p, s in enumerate(senders):
        if not s.drain(TIMEOUT_S):
            fail(f"{tag}prefill rank {p}: pulls still pending after {TIMEOUT_S:.0f} s")
        if not settled(s.pool_stats(), s_start[p]):
            fail(f"{tag}prefill rank {p}: pool {s.pool_stats()}, at start {s_start[p]}")
    for d, r in enumerate(receivers):
        deadline = time.monotonic() + TIMEOUT_S
        while not settled(r.pool_stats(), r_start[d]) and time.monotonic() < deadline:
            time.sleep(0.01)
        if not settled(r.pool_stats(), r_start[d]):
            fail(f"{tag}decode rank {d}: pool {r.pool_stats()}, at start {r_start[d]}")


def wrong_tp_of(b: int) -> int:
    """A decode TP size other than `b` that divides the model's heads."""
    return b + 1 if HEADS % (b + 1) == 0 else b - 1


def run_parked(a, b, mode, senders, receivers, prefill, s_start, r_start, init, alloc, spare) -> int:
    """The router-native flow (check 2 of the module doc): `init`, `alloc`
    the decode ranks' ports, `spare` two free ones. The bytes verified."""
    tag = f"parked {a} -> {b} {mode}"
    n = len(TOKENS)
    reg_ports = [s.register_port for s in senders]
    for q in range(n):
        for p, s in enumerate(senders):
            s.submit_parked_save(f"park-{q}", parked_keys(q), prefill[p][1], prefill_slots(q))
    for p, s in enumerate(senders):
        want = {f"park-{q}" for q in range(n)}
        got: set = set()
        deadline = time.monotonic() + TIMEOUT_S
        while not want <= got and time.monotonic() < deadline:
            got |= set(s.poll_released())
            time.sleep(0.005)
        deadline = time.monotonic() + TIMEOUT_S
        while s.registration_stats()["parked_now"] != n and time.monotonic() < deadline:
            time.sleep(0.005)
        st = s.registration_stats()
        report(
            want <= got and st["parked_now"] == n and s.poll() == [],
            f"{tag}: prefill rank {p} (register port {reg_ports[p]}) gathered and parked "
            f"{sorted(want & got)} of {sorted(want)}, nothing ended: {st}",
        )

    # A decode of another TP size registers for park-0 with every prefill
    # rank: refused, naming pd_peer_tp_size; nothing reaches it; still parked.
    wrong = wrong_tp_of(b)
    # Its rank 0 listens on the spare ports; the others are only named.
    w_init, w_alloc = [spare[0]] + init[: wrong - 1], [spare[1]] + alloc[: wrong - 1]
    wcfg = ascend_pd.Config.from_yaml(
        yaml("receiver", wrong, a, mode, [f"pd_peer_init_port: {w_init}", f"pd_peer_alloc_port: {w_alloc}"])
    )
    wr = ascend_pd.Receiver(wcfg, rank=0)
    try:
        t0 = time.monotonic()
        wr.register("wrong-tp-park-0", "127.0.0.1", reg_ports, "park-0")
        reg = collect(wr.poll_registrations, 1, f"{tag}: registration of a decode of TP {wrong}")
        took = time.monotonic() - t0
        report(
            len(reg) == 1 and reg[0].req_id == "wrong-tp-park-0" and reg[0].status == "failed"
            and "pd_peer_tp_size" in reg[0].message and took < 5.0,
            f"{tag}: a decode of TP {wrong} (registering {wrong} rank(s), prefill pd_peer_tp_size {b}) "
            f"refused in {took:.2f} s: {reg}",
        )
        time.sleep(0.2)
        stats = [s.registration_stats() for s in senders]
        report(
            not any(wr.available([k]) for k in parked_keys(0))
            and all(st["parked_now"] == n and st["attached"] == 0 for st in stats)
            and all(s.poll() == [] for s in senders),
            f"{tag}: the refused decode got nothing and every save is still parked: {stats}",
        )
    finally:
        wr.close()
        wcfg.close()

    # Every decode rank registers for every request with every prefill rank.
    t0 = time.monotonic()
    for q in range(n):
        for d, r in enumerate(receivers):
            r.register(f"dec{d}-park-{q}", "127.0.0.1", reg_ports, f"park-{q}")
    for d, r in enumerate(receivers):
        reg = collect(r.poll_registrations, n, f"{tag}: registrations of decode rank {d}")
        report(
            sorted((c.req_id, c.status) for c in reg) == [(f"dec{d}-park-{q}", "done") for q in range(n)],
            f"{tag}: decode rank {d} registered {n} request(s) with prefill ranks {reg_ports}, "
            f"all done in {time.monotonic() - t0:.2f} s: {reg}",
        )
    for p, s in enumerate(senders):
        ended = collect(s.poll, n, f"{tag}: parked saves of prefill rank {p}")
        report(
            sorted((c.req_id, c.status) for c in ended) == [(f"park-{q}", "done") for q in range(n)],
            f"{tag}: prefill rank {p}: every parked save ended done: {ended}",
        )
    loaded = 0
    failed_before = failures
    for d, r in enumerate(receivers):
        loaded += load_and_verify(d, r, b, "park", parked_keys)
    report(
        failures == failed_before and loaded == b * sum(TOKENS) * LAYERS * PLANES * (HEADS // b) * HEAD * 2,
        f"{tag}: every decode rank loaded its heads of every request byte-exact ({loaded} bytes)",
    )
    failed_before = failures
    settle_all(f"{tag}: ", senders, receivers, s_start, r_start)
    report(failures == failed_before, f"{tag}: every pool back to full")
    stats = [s.registration_stats() for s in senders]
    # Each chunk goes as one piece to each decode rank its heads reach.
    pieces = sum((t + CHUNK - 1) // CHUNK for t in TOKENS) * max(1, b // a)
    report(
        all(
            st["attached"] == n and st["parked_now"] == 0 and st["expired"] == 0
            and st["chunks_sent"] == pieces and st["chunks_skipped"] == 0
            for st in stats
        ),
        f"{tag}: each prefill rank attached each request once ({b} identical registration(s) "
        f"each) and sent {pieces} chunk piece(s): {stats}",
    )
    return loaded


def run(a: int, b: int, mode: str, ports: List[int]) -> Tuple[int, int]:
    init, alloc = ports[:b], ports[b : 2 * b]
    done_ports, proxy = ports[2 * b : 2 * b + a], ports[2 * b + a]
    spare = ports[2 * b + a + 1 : 2 * b + a + 3]
    rcfg = ascend_pd.Config.from_yaml(
        yaml("receiver", b, a, mode, [f"pd_peer_init_port: {init}", f"pd_peer_alloc_port: {alloc}"])
    )
    scfg = ascend_pd.Config.from_yaml(
        yaml(
            "sender",
            a,
            b,
            mode,
            ['pd_proxy_host: "127.0.0.1"', f"pd_proxy_port: {proxy}", f"pd_pull_done_port: {done_ports}"],
        )
    )
    receivers = [ascend_pd.Receiver(rcfg, rank=d) for d in range(b)]
    senders = [ascend_pd.Sender(scfg, rank=p) for p in range(a)]
    r_start = [r.pool_stats() for r in receivers]
    s_start = [s.pool_stats() for s in senders]
    loaded = parked = 0
    prefill = []
    try:
        prefill = [new_cache(HEADS // a) for _ in range(a)]
        for q in range(len(TOKENS)):
            for p, (tensors, _) in enumerate(prefill):
                lo, hi = heads_of(p, a)
                for layer in range(LAYERS):
                    for plane in range(PLANES):
                        piece = model_rows(q, layer, plane)[:, lo * HEAD * 2 : hi * HEAD * 2]
                        rows(tensors[layer * PLANES + plane])[prefill_slots(q)] = piece
        for q in range(len(TOKENS)):
            for p, s in enumerate(senders):
                s.submit_save(
                    f"req-{q}", keys(q), prefill[p][1], prefill_slots(q), "127.0.0.1", init, alloc,
                    is_last_prefill=False,
                )
            for p, s in enumerate(senders):
                c = wait_one(s.poll, f"prefill rank {p}, save of req-{q}")
                if c.status != "done":
                    fail(f"prefill rank {p}: save of {c.req_id}: {c.status}: {c.message}")

        for d, r in enumerate(receivers):
            loaded += load_and_verify(d, r, b, "req", keys)
        settle_all("", senders, receivers, s_start, r_start)

        parked = run_parked(a, b, mode, senders, receivers, prefill, s_start, r_start, init, alloc, spare)
    finally:
        for _, cache in prefill:
            cache.close()
        for w in senders + receivers:
            w.close()
        scfg.close()
        rcfg.close()
    return loaded, parked


def main(argv: List[str]) -> int:
    if len(argv) < 5:
        print(__doc__, file=sys.stderr)
        return 2
    a, b, mode = int(argv[1]), int(argv[2]), argv[3]
    ports = [int(p) for p in argv[4:]]
    if len(ports) != 2 * b + a + 3:
        print(f"need {2 * b + a + 3} ports, got {len(ports)}", file=sys.stderr)
        return 2
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    started = time.monotonic()
    try:
        loaded, parked = run(a, b, mode, ports)
    except (ascend_pd.AscendPdError, TimeoutError) as e:
        fail(f"{type(e).__name__}: {e}")
        loaded = parked = 0
    if failures:
        print(f"hetero_tp: {failures} check(s) failed", file=sys.stderr)
        return 1
    print(
        f"hetero_tp: OK prefill TP {a} -> decode TP {b}, {mode}, {loaded} bytes verified direct, "
        f"{parked} parked, {time.monotonic() - started:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
