#!/usr/bin/env python3
"""Heterogeneous TP through the Python package (and so the C ABI).

    python3 tests/python/hetero_tp.py PREFILL_TP DECODE_TP MODE PORT...

Runs, in this one process, PREFILL_TP senders and DECODE_TP receivers over
shm in MODE (push, pull-eager or pull-delay), each rank with its own
engine-owned numpy KV cache holding its heads of one model. Two requests
are saved with one submit_save per prefill rank (per-rank port lists) and
loaded with one submit_load per decode rank under the plain keys. Every
loaded byte must be that decode rank's heads of the model's token, and
every pool must be back where it started. Needs 2 * DECODE_TP + PREFILL_TP
+ 1 free ports. Prints "hetero_tp: OK ..." and exits 0 on success; exits 1
with one "FAIL ..." line per failed check otherwise.
"""

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

failures = 0


def fail(what: str) -> None:
    global failures
    failures += 1
    print(f"FAIL {what}", file=sys.stderr, flush=True)


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


def keys(q: int) -> List[str]:
    return [f"py-tp-{q}@{c}" for c in range((TOKENS[q] + CHUNK - 1) // CHUNK)]


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


def run(a: int, b: int, mode: str, ports: List[int]) -> int:
    init, alloc = ports[:b], ports[b : 2 * b]
    done_ports, proxy = ports[2 * b : 2 * b + a], ports[2 * b + a]
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
    loaded = 0
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
            lo, hi = heads_of(d, b)
            tensors, cache = new_cache(HEADS // b)
            for q in range(len(TOKENS)):
                deadline = time.monotonic() + TIMEOUT_S
                while not r.available(keys(q)) and time.monotonic() < deadline:
                    time.sleep(0.005)
                if not r.available(keys(q)):
                    fail(f"decode rank {d}: req-{q} not available after {TIMEOUT_S:.0f} s")
                    continue
                r.submit_load(f"req-{q}", keys(q), cache, decode_slots(q))
                c = wait_one(r.poll, f"decode rank {d}, load of req-{q}")
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
                                f"decode rank {d}, req-{q}, layer {layer}, plane {plane}: "
                                f"{bad.size} token(s) are not its heads [{lo}, {hi}) of the model, "
                                f"first token {int(bad[0])}"
                            )
                        else:
                            loaded += got.size
            cache.close()
        for p, s in enumerate(senders):
            if not s.drain(TIMEOUT_S):
                fail(f"prefill rank {p}: pulls still pending after {TIMEOUT_S:.0f} s")
            if not settled(s.pool_stats(), s_start[p]):
                fail(f"prefill rank {p}: pool {s.pool_stats()}, at start {s_start[p]}")
        for d, r in enumerate(receivers):
            deadline = time.monotonic() + TIMEOUT_S
            while not settled(r.pool_stats(), r_start[d]) and time.monotonic() < deadline:
                time.sleep(0.01)
            if not settled(r.pool_stats(), r_start[d]):
                fail(f"decode rank {d}: pool {r.pool_stats()}, at start {r_start[d]}")
        for _, cache in prefill:
            cache.close()
    finally:
        for w in senders + receivers:
            w.close()
        scfg.close()
        rcfg.close()
    return loaded


def main(argv: List[str]) -> int:
    if len(argv) < 5:
        print(__doc__, file=sys.stderr)
        return 2
    a, b, mode = int(argv[1]), int(argv[2]), argv[3]
    ports = [int(p) for p in argv[4:]]
    if len(ports) != 2 * b + a + 1:
        print(f"need {2 * b + a + 1} ports, got {len(ports)}", file=sys.stderr)
        return 2
    try:
        loaded = run(a, b, mode, ports)
    except (ascend_pd.AscendPdError, TimeoutError) as e:
        fail(f"{type(e).__name__}: {e}")
        loaded = 0
    if failures:
        print(f"hetero_tp: {failures} check(s) failed", file=sys.stderr)
        return 1
    print(f"hetero_tp: OK prefill TP {a} -> decode TP {b}, {mode}, {loaded} bytes verified")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
