#!/usr/bin/env python3
"""The example prefill worker: saves five requests to a decode worker,
cancels one after its save, and checks that every pool page came back.

    python3 examples/python/prefill.py CONFIG_YAML RECEIVER_HOST RECEIVER_INIT_PORT RECEIVER_ALLOC_PORT

CONFIG_YAML is a sender config (pd_role: sender); the library is found
through ASCEND_PD_LIB (or the checkout's target/ directory). The last line
of a successful run is "prefill: OK ..."; exit code 0 on success, 1 if any
check failed (one "FAIL ..." line each on stderr).
"""

import logging
import sys
import time
from typing import Dict, List, Optional

from example_common import (
    CHUNK,
    HIDDEN,
    LAYERS,
    NUM_BLOCKS,
    BLOCK_SIZE,
    REQUESTS,
    TIMEOUT_S,
    Checks,
    ascend_pd,
    keys,
    new_cache_tensors,
    pools_at_start,
    prefill_slots,
    print_log,
    req_id,
    say,
    write_request,
)

CANCELLED_AFTER_SAVE = 2
DRAIN_TIMEOUT_S = 30.0


def run(config_path: str, host: str, init_port: int, alloc_port: int, checks: Checks) -> None:
    ascend_pd.set_log_callback(print_log, level=logging.WARNING)
    config = ascend_pd.Config.from_file(config_path)
    sender: Optional[ascend_pd.Sender] = None
    cache: Optional[ascend_pd.KVCache] = None
    try:
        chunk = config.chunk_size
        if not checks.expect(chunk == CHUNK, f"the config's chunk_size is {chunk}, the example needs {CHUNK}"):
            return
        sender = ascend_pd.Sender(config, rank=0)
        start = sender.pool_stats()
        say(f"prefill: sender started, pools {start}")

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
        for q in REQUESTS:
            write_request(tensors, q, prefill_slots(q))

        finished: Dict[str, ascend_pd.Completion] = {}

        def collect(done: List[ascend_pd.Completion]) -> None:
            for c in done:
                if c.req_id in finished or c.req_id not in {req_id(q) for q in REQUESTS}:
                    checks.fail(f"unexpected completion {c}")
                    continue
                finished[c.req_id] = c
                if checks.expect(c.status == "done", f"save of {c.req_id}: {c.status}: {c.message}"):
                    say(f"prefill: save of {c.req_id} done")

        deadline = time.monotonic() + TIMEOUT_S
        for q in REQUESTS:
            while True:
                try:
                    sender.submit_save(
                        req_id(q),
                        keys(q),
                        cache,
                        prefill_slots(q),
                        host,
                        init_port,
                        alloc_port,
                        is_last_prefill=True,
                    )
                    break
                except ascend_pd.Busy:
                    # The save queue is full: collect finished saves, retry.
                    if time.monotonic() > deadline:
                        raise
                    collect(sender.poll())
                    time.sleep(0.005)
        say(f"prefill: {len(REQUESTS)} saves submitted")

        while len(finished) < len(REQUESTS) and time.monotonic() < deadline:
            collect(sender.poll())
            if len(finished) < len(REQUESTS):
                time.sleep(0.005)
        missing = [req_id(q) for q in REQUESTS if req_id(q) not in finished]
        checks.expect(not missing, f"saves not completed after {TIMEOUT_S:.0f} s: {missing}")

        rid = req_id(CANCELLED_AFTER_SAVE)
        state = sender.cancel(rid)
        say(f"prefill: {rid} cancelled after its save (state {state})")
        checks.expect(state == "already_ended", f"cancel of {rid} after its save: state {state}, want already_ended")

        drained = sender.drain(DRAIN_TIMEOUT_S)
        checks.expect(drained, f"drain({DRAIN_TIMEOUT_S:.0f} s): pulls still pending, pools {sender.pool_stats()}")

        end = sender.pool_stats()
        checks.expect(pools_at_start(end, start), f"pools not back at start: {end}, at start {start}")

        sender.close()
        cache.close()
        config.close()
    finally:
        for obj in (sender, cache, config):
            if obj is not None:
                try:
                    obj.close()
                except ascend_pd.AscendPdError as e:
                    checks.fail(f"closing {obj!r}: {e}")


def main(argv: List[str]) -> int:
    if len(argv) != 5:
        print(
            "usage: prefill.py CONFIG_YAML RECEIVER_HOST RECEIVER_INIT_PORT RECEIVER_ALLOC_PORT",
            file=sys.stderr,
        )
        return 2
    checks = Checks("prefill")
    try:
        run(argv[1], argv[2], int(argv[3]), int(argv[4]), checks)
    except ascend_pd.AscendPdError as e:
        checks.fail(f"{type(e).__name__} (status {e.status}): {e.message}")
    except ascend_pd.LibraryLoadError as e:
        checks.fail(str(e))
    code = checks.exit_code()
    if code == 0:
        say(f"prefill: OK {len(REQUESTS)} saves, 1 cancelled after save")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
