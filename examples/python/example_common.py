"""What the example prefill and decode workers share: the fixed geometry,
the request plan, the byte pattern and the failure bookkeeping (see
prefill.py and decode.py)."""

import os
import sys
import time
from typing import Callable, List

# The package from this checkout, no install needed.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import numpy as np  # noqa: E402

import ascend_pd  # noqa: E402

LAYERS = 2
PLANES = 2  # K and V
NUM_BLOCKS = 64
BLOCK_SIZE = 16
KV_HEADS = 2
HEAD_SIZE = 16
HIDDEN = KV_HEADS * HEAD_SIZE
TOKEN_BYTES = HIDDEN * 2  # float16
CHUNK = 16

TOKENS = [40, 16, 33, 50, 20]
REQUESTS = range(len(TOKENS))
TIMEOUT_S = 60.0


def req_id(q: int) -> str:
    return f"req-{q}"


def keys(q: int) -> List[str]:
    n = (TOKENS[q] + CHUNK - 1) // CHUNK
    return [f"ex-req-{q}@{i}" for i in range(n)]


def prefill_slots(q: int) -> np.ndarray:
    t = np.arange(TOKENS[q], dtype=np.int64)
    return ((q * 5 + t // 16) % NUM_BLOCKS) * BLOCK_SIZE + t % 16


def decode_slots(q: int) -> np.ndarray:
    t = np.arange(TOKENS[q], dtype=np.int64)
    return ((q * 7 + 3 + t // 16) % NUM_BLOCKS) * BLOCK_SIZE + t % 16


def pattern(q: int, layer: int, plane: int) -> np.ndarray:
    """The bytes of request q in one tensor: [tokens, TOKEN_BYTES] uint8."""
    t = np.arange(TOKENS[q], dtype=np.int64)[:, None]
    b = np.arange(TOKEN_BYTES, dtype=np.int64)[None, :]
    return ((q * 131 + layer * 31 + plane * 17 + t * 7 + b) & 0xFF).astype(np.uint8)


def new_cache_tensors() -> List[np.ndarray]:
    """The vLLM layout: one zeroed tensor per layer and plane (l0.K, l0.V, l1.K, l1.V)."""
    return [
        np.zeros((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE), dtype=np.float16)
        for _ in range(LAYERS * PLANES)
    ]


def token_rows(tensor: np.ndarray) -> np.ndarray:
    """A [slots, TOKEN_BYTES] uint8 view of one tensor (writes go to the tensor)."""
    return tensor.view(np.uint8).reshape(NUM_BLOCKS * BLOCK_SIZE, TOKEN_BYTES)


def write_request(tensors: List[np.ndarray], q: int, slots: np.ndarray) -> None:
    for layer in range(LAYERS):
        for plane in range(PLANES):
            token_rows(tensors[layer * PLANES + plane])[slots] = pattern(q, layer, plane)


def print_log(level: int, _target: str, message: str) -> None:
    """The library's warnings and errors, on stdout."""
    print(f"log: {level} {message}", flush=True)


def say(line: str) -> None:
    print(line, flush=True)


class Checks:
    """Counts failed checks; each prints one FAIL line to stderr."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.failures = 0

    def fail(self, what: str) -> None:
        self.failures += 1
        print(f"FAIL {what}", file=sys.stderr, flush=True)

    def expect(self, ok: bool, what: str) -> bool:
        if not ok:
            self.fail(what)
        return ok

    def exit_code(self) -> int:
        if self.failures:
            print(f"{self.who}: {self.failures} check(s) failed", file=sys.stderr, flush=True)
            return 1
        return 0


def wait_for(cond: Callable[[], bool], timeout_s: float, interval_s: float) -> bool:
    """Calls cond every interval_s until it is true (True) or timeout_s passed (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if cond():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


def pools_at_start(stats: "ascend_pd.PoolStats", start: "ascend_pd.PoolStats") -> bool:
    return (
        stats == start
        and stats.free == stats.total
        and stats.pinned == 0
        and stats.quarantined == 0
    )

