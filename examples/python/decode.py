#!/usr/bin/env python3
"""The example decode worker: loads three of the prefill's five requests,
cancels one itself, verifies every byte of its KV cache, and checks that
every pool page came back (including those of the request the prefill
cancelled).

    python3 examples/python/decode.py CONFIG_YAML

CONFIG_YAML is a receiver config (pd_role: receiver); the library is found
through ASCEND_PD_LIB (or the checkout's target/ directory). It prints
"decode: ready" once it listens, and after verifying reads stdin until EOF
(close it once the prefill exited) before its final pool check. The last
line of a successful run is "decode: OK ..."; exit code 0 on success, 1 if
any check failed (one "FAIL ..." line each on stderr).
"""

import logging
import sys
import time
from typing import List, Optional

import numpy as np

from example_common import (
    BLOCK_SIZE,
    CHUNK,
    HIDDEN,
    LAYERS,
    NUM_BLOCKS,
    PLANES,
    TIMEOUT_S,
    TOKEN_BYTES,
    TOKENS,
    Checks,
    ascend_pd,
    decode_slots,
    keys,
    new_cache_tensors,
    pattern,
    pools_at_start,
    print_log,
    req_id,
    say,
    token_rows,
    wait_for,
)

# Requests the decode side waits for, in order; the last is cancelled here.
WANTED = [0, 1, 3, 4]
CANCELLED_HERE = 4
CANCELLED_BY_PREFILL = 2
POOL_TIMEOUT_S = 20.0


def wait_load(receiver: "ascend_pd.Receiver", rid: str, checks: Checks) -> Optional["ascend_pd.Completion"]:
    """Polls every 5 ms until the load of rid completes (None after TIMEOUT_S)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        for c in receiver.poll():
            if c.req_id == rid:
                return c
            checks.fail(f"unexpected completion {c}")
        time.sleep(0.005)
    return None


def verify(tensors: List[np.ndarray], loaded: List[int], checks: Checks) -> int:
    """Checks every byte of the cache: the loaded requests' bytes at their
    decode slots, zero everywhere else. Returns the request bytes checked."""
    request_bytes = 0
    for layer in range(LAYERS):
        for plane in range(PLANES):
            index = layer * PLANES + plane
            actual = token_rows(tensors[index])
            expected = np.zeros_like(actual)
            in_request = np.zeros(actual.shape[0], dtype=bool)
            for q in loaded:
                slots = decode_slots(q)
                expected[slots] = pattern(q, layer, plane)
                in_request[slots] = True
                request_bytes += len(slots) * TOKEN_BYTES
            wrong = actual != expected
            wrong_in_requests = int(np.count_nonzero(wrong[in_request]))
            stray = int(np.count_nonzero(wrong[~in_request]))
            if wrong_in_requests:
                rows, cols = np.nonzero(wrong & in_request[:, None])
                slot, b = int(rows[0]), int(cols[0])
                checks.fail(
                    f"tensor {index}: {wrong_in_requests} loaded byte(s) wrong; first at slot {slot} "
                    f"byte {b}: {actual[slot, b]}, want {expected[slot, b]}"
                )
            if stray:
                rows, cols = np.nonzero(wrong & ~in_request[:, None])
                checks.fail(
                    f"tensor {index}: {stray} byte(s) outside the loaded requests are not zero; "
                    f"first at slot {int(rows[0])} byte {int(cols[0])}"
                )
    return request_bytes


def run(config_path: str, checks: Checks) -> int:
    """The decode plan; returns the request bytes verified."""
    ascend_pd.set_log_callback(print_log, level=logging.WARNING)
    config = ascend_pd.Config.from_file(config_path)
    receiver: Optional[ascend_pd.Receiver] = None
    cache: Optional[ascend_pd.KVCache] = None
    try:
        chunk = config.chunk_size
        if not checks.expect(chunk == CHUNK, f"the config's chunk_size is {chunk}, the example needs {CHUNK}"):
            return 0
        receiver = ascend_pd.Receiver(config, rank=0)
        start = receiver.pool_stats()
        tensors = new_cache_tensors()
        cache = ascend_pd.KVCache(
            tensors,
            fmt="kv",
            dtype="float16",
            layers=LAYERS,
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            hidden=HIDDEN,
        )
        say(f"decode: ready, pools {start}")

        for q in WANTED:
            rid, ks = req_id(q), keys(q)
            rx = receiver
            if not wait_for(lambda: rx.available(ks), TIMEOUT_S, 0.005):
                checks.fail(f"{rid}: its {len(ks)} key(s) not available after {TIMEOUT_S:.0f} s")
                continue
            if q == CANCELLED_HERE:
                state = receiver.cancel(rid, ks)
                say(f"decode: {rid} cancelled (state {state})")
                continue
            receiver.submit_load(rid, ks, cache, decode_slots(q))
            c = wait_load(receiver, rid, checks)
            if c is None:
                checks.fail(f"load of {rid} not completed after {TIMEOUT_S:.0f} s")
            elif checks.expect(c.status == "done", f"load of {rid}: {c.status}: {c.message}"):
                say(f"decode: load of {rid} done ({TOKENS[q]} tokens)")

        loaded = [q for q in WANTED if q != CANCELLED_HERE]
        verified = verify(tensors, loaded, checks)
        say(f"decode: verified {verified} loaded bytes and the zeros around them")

        # The harness closes stdin once the prefill exited.
        sys.stdin.buffer.read()
        say("decode: stdin closed")

        rx = receiver
        last = [start]

        def back() -> bool:
            last[0] = rx.pool_stats()
            return pools_at_start(last[0], start)

        checks.expect(
            wait_for(back, POOL_TIMEOUT_S, 0.01),
            f"pools not back at start after {POOL_TIMEOUT_S:.0f} s: {last[0]}, at start {start}",
        )
        dropped = req_id(CANCELLED_BY_PREFILL)
        checks.expect(
            not receiver.available(keys(CANCELLED_BY_PREFILL)),
            f"{dropped}'s keys are still stored after the prefill's cancel",
        )

        receiver.close()
        cache.close()
        config.close()
        return verified
    finally:
        for obj in (receiver, cache, config):
            if obj is not None:
                try:
                    obj.close()
                except ascend_pd.AscendPdError as e:
                    checks.fail(f"closing {obj!r}: {e}")


def main(argv: List[str]) -> int:
    if len(argv) != 2:
        print("usage: decode.py CONFIG_YAML", file=sys.stderr)
        return 2
    checks = Checks("decode")
    verified = 0
    try:
        verified = run(argv[1], checks)
    except ascend_pd.AscendPdError as e:
        checks.fail(f"{type(e).__name__} (status {e.status}): {e.message}")
    except ascend_pd.LibraryLoadError as e:
        checks.fail(str(e))
    code = checks.exit_code()
    if code == 0:
        say(
            f"decode: OK {len(WANTED) - 1} loads verified ({verified} bytes), "
            "1 cancelled here, 1 cancelled by the prefill"
        )
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
