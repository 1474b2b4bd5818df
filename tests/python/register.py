"""The router-native flow through the Python package: parked saves and
decode registrations, senders and receivers in one process over tcp on
loopback. Run by tests/examples.rs as
    python3 tests/python/register.py MODE PORT x 13
(MODE push, pull-eager or pull-delay; ASCEND_PD_LIB set). Checks:
1. a parked save is released (poll_released) but nothing reaches the
   receiver before a decode registers; registration_stats says it is parked;
2. a registration is done, the keys become available, the load brings
   every byte, the save ends done and both pools are full again;
3. a decode that holds the first chunk (held_tokens) never gets that
   chunk's key; the rest loads byte-exact and the pools are full again;
4. a registration for a transfer the prefill does not know fails at once,
   naming the transfer, also when two receivers of one process register
   with the same prefill rank at the same time;
5. a parked save nobody registers for within pd_park_timeout fails naming
   it, is counted as expired, its pages are freed, and a late registration
   is told it expired;
6. with pd_auth_secret_file on both sides, registration works; a decode
   without the secret, or with another one, gets no answer (failed) and
   its registration is counted as dropped; the parked save stays and a
   legit registration after them still gets every byte.
Prints one line per check; exits non-zero on any failure."""

import faulthandler
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import numpy as np  # noqa: E402

# The environment's secret would override every worker's pd_auth_secret_file.
os.environ.pop("ASCEND_PD_AUTH_SECRET_FILE", None)

import ascend_pd as apd  # noqa: E402

LAYERS, BLOCKS, BLOCK, HEADS, HEAD, CHUNK = 2, 16, 8, 2, 16, 16
TOKENS = 45  # 3 chunks, the last partial
HOST = "127.0.0.1"
ROUNDS = 10  # of concurrent registrations (check 4)
WATCHDOG_S = 120.0
failures = 0


def report(ok, what):
    global failures
    print(f"ok   {what}" if ok else f"FAIL {what}", file=sys.stdout if ok else sys.stderr, flush=True)
    if not ok:
        failures += 1


def wait_for(what, fn, seconds=20.0):
    """Polls `fn` until it returns something truthy (None after `seconds`)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.005)
    report(False, f"{what}: nothing within {seconds} s")
    return None


def pattern(seed, layer, plane, tokens):
    """The values of `tokens` tokens of (layer, plane) of request `seed`."""
    t = np.arange(tokens, dtype=np.uint32)[:, None, None]
    h = np.arange(HEADS, dtype=np.uint32)[None, :, None]
    e = np.arange(HEAD, dtype=np.uint32)[None, None, :]
    v = (t * 131 + h * 37 + e * 3 + layer * 1009 + plane * 503 + seed * 7919 + 1) % 30000
    return v.astype(np.float16)


def flat(t):
    return t.reshape(BLOCKS * BLOCK, HEADS, HEAD)


class Side:
    """A KV cache (numpy tensors) and its KVCache."""

    def __init__(self):
        self.tensors = [np.zeros((BLOCKS, BLOCK, HEADS, HEAD), np.float16) for _ in range(2 * LAYERS)]
        self.cache = apd.KVCache(
            self.tensors, layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK, hidden=HEADS * HEAD
        )

    def write(self, seed, slots):
        for layer in range(LAYERS):
            for plane in range(2):
                flat(self.tensors[2 * layer + plane])[slots] = pattern(seed, layer, plane, len(slots))

    def differ(self, seed, slots, first=0):
        """Elements at `slots[first:]` that are not request `seed`'s tokens `first..`."""
        bad = 0
        for layer in range(LAYERS):
            for plane in range(2):
                got = flat(self.tensors[2 * layer + plane])[slots[first:]]
                want = pattern(seed, layer, plane, len(slots))[first:]
                bad += int(np.count_nonzero(got.view(np.uint16) != want.view(np.uint16)))
        return bad

    def nonzero(self, slots):
        return sum(int(np.count_nonzero(flat(t)[slots].view(np.uint16))) for t in self.tensors)


def mode_yaml(role, mode, lines):
    pull, delay = {"push": (False, False), "pull-eager": (True, False), "pull-delay": (True, True)}[mode]
    return "\n".join(
        [
            "enable_pd: True",
            "local_cpu: False",
            'transfer_channel: "tcp"',
            f'pd_role: "{role}"',
            f'pd_peer_host: "{HOST}"',
            "pd_buffer_size: 1048576",
            'pd_buffer_device: "cpu"',
            f"chunk_size: {CHUNK}",
            f"kv_num_layers: {LAYERS}",
            f"kv_num_heads: {HEADS}",
            f"kv_head_size: {HEAD}",
            'kv_dtype: "float16"',
            f"pd_pull_mode: {pull}",
            f"pd_delay_pull: {delay}",
        ]
        + lines
    ) + "\n"


def receiver(mode, init, alloc, secret=None):
    lines = [f"pd_peer_init_port: {init}", f"pd_peer_alloc_port: {alloc}"]
    if secret:
        lines.append(f'pd_auth_secret_file: "{secret}"')
    return apd.Receiver(apd.Config.from_yaml(mode_yaml("receiver", mode, lines)))


def sender(mode, done_port, park_timeout=None, secret=None):
    lines = [f'pd_proxy_host: "{HOST}"', "pd_proxy_port: 9"]
    if mode != "push":
        lines.append(f"pd_pull_done_port: {done_port}")
    if park_timeout is not None:
        lines.append(f"pd_park_timeout: {park_timeout}")
    if secret:
        lines.append(f'pd_auth_secret_file: "{secret}"')
    return apd.Sender(apd.Config.from_yaml(mode_yaml("sender", mode, lines)))


def slots_of(q, decode):
    """Request q's token slots: scattered over the blocks, other ones on each side."""
    if decode:
        return [((1 + q * 5 + t // BLOCK * 3) % BLOCKS) * BLOCK + (BLOCK - 1 - t % BLOCK) for t in range(TOKENS)]
    return [((3 + q * 7 + t // BLOCK * 5) % BLOCKS) * BLOCK + t % BLOCK for t in range(TOKENS)]


def keys_of(name):
    return [f"{name}@{i}" for i in range((TOKENS + CHUNK - 1) // CHUNK)]


def full(stats, start):
    return stats == start and stats.free == stats.total and stats.pinned == 0 and stats.quarantined == 0


def settle(what, worker, start):
    got = wait_for(f"{what} pool back", lambda: full(worker.pool_stats(), start))
    report(bool(got), f"{what} pool back to full: {worker.pool_stats()}")


def one(what, poll, seconds=20.0):
    """The one completion `poll` reports (a list, for the report)."""
    got = wait_for(what, poll, seconds)
    return got or []


def released(s, req_id, what):
    got = wait_for(f"{what}: release of {req_id}", lambda: req_id in s.poll_released())
    report(bool(got), f"{what}: parked save {req_id} released (its gather done)")


def register_and_load(tag, s, r, dec, req_id, seed, q, held_chunks, s_start, r_start):
    """Registers `r` for `req_id` parked at `s` holding `held_chunks`
    chunks, loads the rest into `dec` and checks bytes, keys, save end and
    pools (checks 2 and 3; 6's legit registration)."""
    keys, dslots = keys_of(req_id), slots_of(q, True)
    first = held_chunks * CHUNK
    need = keys[held_chunks:]
    # A waiter from before the registration, as the engine's step that
    # registers: woken by the landing (push) or the proxies' arrival
    # (pull-delay) itself, not its 20 s timeout: a path that forgets to
    # wake waiters shows here.
    waited = {}

    def waiter():
        w0 = time.monotonic()
        waited["got"] = r.wait_available(need, 20.0)
        waited["s"] = time.monotonic() - w0

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    r.register(f"dec-{req_id}", HOST, [s.register_port], req_id, held_tokens=first)
    reg = one(f"{tag}: registration for {req_id}", r.poll_registrations)
    report(
        [(c.req_id, c.status) for c in reg] == [(f"dec-{req_id}", "done")],
        f"{tag}: registration for {req_id} (held_tokens {first}) done in {time.monotonic() - t0:.2f} s: {reg}",
    )
    th.join()
    report(waited.get("got") is True and r.available(need) and waited["s"] < 10.0,
           f"{tag}: keys {need[0]}.. of {req_id} available after the registration (a wait_available from "
           f"before it woke after {waited.get('s', -1):.3f} s of its 20 s)")
    if held_chunks:
        report(
            not any(r.available([k]) for k in keys[:held_chunks]),
            f"{tag}: the {held_chunks} held chunk(s) {keys[:held_chunks]} never stored at the receiver",
        )
    submitted = time.monotonic()
    r.submit_load(f"load-{req_id}", need, dec.cache, dslots[first:])
    t0 = time.monotonic()
    ended = r.wait_ended(20.0) and time.monotonic() - t0 < 10.0
    time.sleep(0.2)  # polled well after it ended: ended_s says when it ended, not when it was polled
    polled = time.monotonic()
    loaded = r.poll()  # no wait: wait_ended returned because it ended
    report(ended, f"{tag}: wait_ended woke when the load of {req_id} ended")
    report(len(loaded) == 1 and submitted <= loaded[0].ended_s <= polled - 0.19,
           f"{tag}: the load's ended_s ({loaded[0].ended_s if loaded else None}) lies between its submit "
           f"({submitted}) and 0.2 s before its poll ({polled})")
    report(
        [(c.req_id, c.status) for c in loaded] == [(f"load-{req_id}", "done")],
        f"{tag}: load of {req_id} done: {loaded}",
    )
    bad = dec.differ(seed, dslots, first)
    total = LAYERS * 2 * (TOKENS - first) * HEADS * HEAD
    report(bad == 0, f"{tag}: every loaded element of {req_id} matches the prefill ({total} elements, {bad} differ)")
    if held_chunks:
        stray = dec.nonzero(dslots[:first])
        report(stray == 0, f"{tag}: the held tokens' decode slots untouched ({stray} nonzero elements)")
    saved = one(f"{tag}: save of {req_id}", s.poll)
    report(
        [(c.req_id, c.status) for c in saved] == [(req_id, "done")],
        f"{tag}: parked save {req_id} ended done: {saved}",
    )
    if held_chunks:
        report(
            not any(r.available([k]) for k in keys[:held_chunks]),
            f"{tag}: the held chunk(s) still not at the receiver after the save ended",
        )
    settle(f"{tag}: receiver", r, r_start)
    settle(f"{tag}: sender", s, s_start)


def main():
    # A call that never returns (a deadlock in the library) ends the run
    # with every thread's stack instead of hanging the test.
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    mode = sys.argv[1]
    ports = [int(p) for p in sys.argv[2:]]
    if len(ports) != 13:
        sys.exit(f"usage: register.py MODE PORT x 13 (got {len(ports)} ports)")
    started = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="apd-register-")
    secrets = []
    contents = [b"register-test-shared-secret-0123456789\n", b"another-deployments-secret-9876543210\n"]
    for i, content in enumerate(contents):
        path = os.path.join(tmp, f"secret{i}")
        with open(path, "wb") as f:
            f.write(content)
        os.chmod(path, 0o600)
        secrets.append(path)
    pre, dec = Side(), Side()

    # --- 1-4: one sender and its receivers, no secret -------------------------
    tag = mode
    r = receiver(mode, ports[0], ports[1])
    s = sender(mode, ports[6])
    r_start, s_start = r.pool_stats(), s.pool_stats()
    port = s.register_port
    report(1 <= port <= 65535, f"{tag}: sender takes registrations on port {port}")

    # 1. parked: released, nothing at the receiver, parked_now 1.
    keys = keys_of("reg-a")
    pre.write(1, slots_of(0, False))
    s.submit_parked_save("reg-a", keys, pre.cache, slots_of(0, False))
    released(s, "reg-a", f"{tag} [1]")
    t0 = time.monotonic()
    waited = r.wait_available(keys, 0.3)
    report(not waited and time.monotonic() - t0 >= 0.29,
           f"{tag} [1]: wait_available of unregistered keys returned False at its timeout")
    t0 = time.monotonic()
    report(not r.wait_ended(0.05) and time.monotonic() - t0 >= 0.04,
           f"{tag} [1]: wait_ended with no load in flight returned False at its timeout")
    report(not r.available(keys) and not any(r.available([k]) for k in keys),
           f"{tag} [1]: nothing at the receiver before a registration")
    report(r.pool_stats() == r_start, f"{tag} [1]: receiver pool untouched: {r.pool_stats()}")
    report(s.poll() == [], f"{tag} [1]: the parked save has not ended")
    st = s.registration_stats()
    report(st["parked_now"] == 1 and st["parked"] == 1, f"{tag} [1]: registration_stats {st}")
    parked_alloc = s.pool_stats().allocated
    report(parked_alloc > 0, f"{tag} [1]: the parked save holds {parked_alloc} sender page(s)")

    # 2. register -> done, available, byte-exact load, done, pools full.
    register_and_load(f"{tag} [2]", s, r, dec, "reg-a", 1, 0, 0, s_start, r_start)
    st = s.registration_stats()
    report(
        st["attached"] == 1 and st["parked_now"] == 0 and st.get("chunks_sent") == 3 and st.get("chunks_skipped") == 0,
        f"{tag} [2]: registration_stats (3 chunks sent, none skipped) {st}",
    )

    # 3. held_tokens = 1 chunk: its key never comes, the rest loads.
    keys = keys_of("reg-b")
    pre.write(2, slots_of(1, False))
    s.submit_parked_save("reg-b", keys, pre.cache, slots_of(1, False))
    released(s, "reg-b", f"{tag} [3]")
    wait_for(f"{tag} [3]: reg-b parked", lambda: s.registration_stats()["parked_now"] == 1)
    register_and_load(f"{tag} [3]", s, r, dec, "reg-b", 2, 1, 1, s_start, r_start)
    st = s.registration_stats()
    report(
        st["attached"] == 2 and st["parked_now"] == 0 and st.get("chunks_sent") == 5 and st.get("chunks_skipped") == 1,
        f"{tag} [3]: registration_stats (2 more chunks sent, 1 skipped) {st}",
    )

    # 4. an unknown transfer id: failed at once, naming it.
    refused = s.registration_stats()["refused"]
    t0 = time.monotonic()
    r.register("dec-unknown", HOST, [port], "no-such-transfer-42")
    reg = one(f"{tag} [4]: registration for an unknown transfer", r.poll_registrations)
    took = time.monotonic() - t0
    report(
        len(reg) == 1 and reg[0].status == "failed" and "no-such-transfer-42" in reg[0].message and took < 5.0,
        f"{tag} [4]: unknown transfer refused in {took:.2f} s: {reg}",
    )
    st = s.registration_stats()
    report(st["refused"] == refused + 1, f"{tag} [4]: counted as refused: {st}")

    # Two receivers of this process (decode ranks started together) register
    # with the same prefill rank at once: each gets its answer promptly.
    # Whether two registrations overlap is timing, so up to ROUNDS rounds,
    # stopping at the first one that goes wrong.
    rn = receiver(mode, ports[4], ports[5])  # no secret (used again in 6)
    rp = receiver(mode, ports[11], ports[12])
    bad_round = None
    for k in range(ROUNDS):
        t0 = time.monotonic()
        for i, rr in enumerate((rn, rp)):
            rr.register(f"dec-twin-{k}-{i}", HOST, [port], f"no-such-transfer-{k}-{i}")
        # Both polled together, so each one's time is its own.
        got = {}
        while len(got) < 2 and time.monotonic() - t0 < 15.0:
            for i, rr in enumerate((rn, rp)):
                for c in rr.poll_registrations():
                    got[i] = (time.monotonic() - t0, c)
            time.sleep(0.005)
        for i in range(2):
            took, c = got.get(i, (None, None))
            ok = (
                c is not None and c.status == "failed" and f"no-such-transfer-{k}-{i}" in c.message
                and took < 5.0
            )
            if not ok and bad_round is None:
                bad_round = f"round {k}, receiver {i}: " + (
                    f"after {took:.2f} s: {c}" if c else "no outcome within 15 s"
                )
        if bad_round:
            break
    report(
        bad_round is None,
        f"{tag} [4]: two receivers registering at once, {ROUNDS} rounds: each refused promptly"
        + (f"; not so in {bad_round}" if bad_round else ""),
    )
    st = s.registration_stats()
    want = refused + 1 + 2 * (k + 1)
    report(
        st["refused"] == want,
        f"{tag} [4]: every concurrent registration reached the port ({want - refused} refused expected): {st}",
    )

    # --- 5: a sender parking for 1 s ------------------------------------------
    se = sender(mode, ports[7], park_timeout=1.0)
    se_start = se.pool_stats()
    keys = keys_of("reg-e")
    t0 = time.monotonic()
    se.submit_parked_save("reg-e", keys, pre.cache, slots_of(0, False))
    released(se, "reg-e", f"{tag} [5]")
    ended = one(f"{tag} [5]: expiry of reg-e", se.poll, seconds=10.0)
    took = time.monotonic() - t0
    report(
        len(ended) == 1 and ended[0].req_id == "reg-e" and ended[0].status == "failed"
        and "pd_park_timeout" in ended[0].message and 0.9 <= took < 5.0,
        f"{tag} [5]: unregistered parked save failed after {took:.2f} s: {ended}",
    )
    st = se.registration_stats()
    report(st["expired"] == 1 and st["parked_now"] == 0 and st["attached"] == 0, f"{tag} [5]: registration_stats {st}")
    settle(f"{tag} [5]: sender", se, se_start)
    r.register("dec-late", HOST, [se.register_port], "reg-e")
    reg = one(f"{tag} [5]: late registration", r.poll_registrations)
    report(
        len(reg) == 1 and reg[0].status == "failed" and "expired" in reg[0].message,
        f"{tag} [5]: late registration refused: {reg}",
    )
    report(not r.available(keys), f"{tag} [5]: nothing of the expired save at the receiver")
    if mode != "push":
        se.drain(5.0)
    se.close()

    # --- 6: sealed registrations ----------------------------------------------
    sa = sender(mode, ports[8], secret=secrets[0])
    ra = receiver(mode, ports[2], ports[3], secret=secrets[0])
    ro = receiver(mode, ports[9], ports[10], secret=secrets[1])  # another deployment's
    sa_start, ra_start = sa.pool_stats(), ra.pool_stats()
    keys = keys_of("reg-s")
    pre.write(3, slots_of(2, False))
    sa.submit_parked_save("reg-s", keys, pre.cache, slots_of(2, False))
    released(sa, "reg-s", f"{tag} [6]")
    t0 = time.monotonic()
    rn.register("dec-nosecret", HOST, [sa.register_port], "reg-s")
    ro.register("dec-othersecret", HOST, [sa.register_port], "reg-s")
    for who, rr in (("no secret", rn), ("another secret", ro)):
        reg = one(f"{tag} [6]: registration with {who}", rr.poll_registrations, seconds=15.0)
        took = time.monotonic() - t0
        report(
            len(reg) == 1 and reg[0].status == "failed"
            and "no answer from the prefill's registration port" in reg[0].message,
            f"{tag} [6]: registration with {who} failed after {took:.2f} s: {reg}",
        )
        report(not rr.available(keys), f"{tag} [6]: nothing reached the receiver with {who}")
    st = sa.registration_stats()
    report(
        st["dropped"] == 2 and st["parked_now"] == 1 and st["attached"] == 0,
        f"{tag} [6]: both registrations without the secret dropped, the save still parked: {st}",
    )
    report(sa.poll() == [], f"{tag} [6]: the parked save has not ended")
    dec6 = Side()
    register_and_load(f"{tag} [6]", sa, ra, dec6, "reg-s", 3, 2, 0, sa_start, ra_start)
    st = sa.registration_stats()
    report(st["attached"] == 1 and st["parked_now"] == 0, f"{tag} [6]: registration_stats {st}")

    for w in (s, sa):
        if mode != "push":
            w.drain(5.0)
        w.close()
    for w in (r, ra, rn, ro, rp):
        w.close()
    pre.cache.close()
    dec.cache.close()
    dec6.cache.close()
    for p in secrets:
        os.unlink(p)
    os.rmdir(tmp)
    if failures:
        print(f"{failures} check(s) failed", file=sys.stderr)
        sys.exit(1)
    print(f"register: OK ({mode}, {time.monotonic() - started:.1f} s)")


if __name__ == "__main__":
    main()
