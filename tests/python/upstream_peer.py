"""An upstream LMCache-style peer, written with msgspec (the encoder LMCache
uses) and pyzmq, talking to a real ascend-pd receiver process. Run by
tests/upstream_peer.rs as
    python3 tests/python/upstream_peer.py ALLOC_PORT METRICS_PORT PRIOR KEY1 KEY2 QUERY_PORT
where KEY1 and KEY2 are stored on the receiver by PRIOR AllocRequests of
an ascend-pd sender. Checks:
- CacheQueryRequest {keys} is answered with CacheQueryResponse naming the
  held keys and their positions in the query, on the allocation socket and
  on pd_peer_query_port (QUERY_PORT);
- an async-style AllocRequest (req_id, is_last_batch, total_chunks) is
  decoded as an AllocRequest (not a malformed frame) and answered with an
  AscendAllocResponse; this peer never did ascend-pd's handshake, so the
  receiver grants it no pages (alloc_failed) by design.
Prints one line per check; exits non-zero on any failure."""

import sys
import time
import urllib.request
from typing import List, Optional, Union

import msgspec
import zmq


class AllocRequest(msgspec.Struct, tag=True):
    keys: List[str]
    fmt: int
    shape: List[int]
    dtype: str
    last_chunk_toks: int
    req_id: Optional[str] = None
    is_last_batch: Optional[bool] = None
    total_chunks: Optional[int] = None


class AscendAllocResponse(msgspec.Struct, tag=True):
    already_sent_indexes: List[int]
    remote_indexes: List[int]
    remote_buffer_uuids: List[str]
    alloc_failed: bool = False


class CacheQueryRequest(msgspec.Struct, tag=True):
    keys: List[str]


class CacheQueryResponse(msgspec.Struct, tag=True):
    cached_keys: List[str]
    cached_indexes: List[int]


REPLIES = msgspec.msgpack.Decoder(Union[AscendAllocResponse, CacheQueryResponse])
failures = 0


def check(what, ok, detail=""):
    global failures
    if ok:
        print(f"ok   {what} {detail}")
    else:
        print(f"FAIL {what} {detail}", file=sys.stderr)
        failures += 1


def ask(sock, msg):
    sock.send(msgspec.msgpack.encode(msg))
    return REPLIES.decode(sock.recv())


def metric(port, name):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def main():
    alloc_port, metrics_port, prior = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    k1, k2, query_port = sys.argv[4], sys.argv[5], int(sys.argv[6])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{alloc_port}")

    reply = ask(sock, CacheQueryRequest(keys=[k1, "upstream-peer@missing", k2]))
    check("cache query answered with CacheQueryResponse", isinstance(reply, CacheQueryResponse), repr(reply))
    if isinstance(reply, CacheQueryResponse):
        check("cached_keys", reply.cached_keys == [k1, k2], repr(reply.cached_keys))
        check("cached_indexes are positions in the query", reply.cached_indexes == [0, 2], repr(reply.cached_indexes))

    qsock = ctx.socket(zmq.REQ)
    qsock.setsockopt(zmq.RCVTIMEO, 10000)
    qsock.setsockopt(zmq.LINGER, 0)
    qsock.connect(f"tcp://127.0.0.1:{query_port}")
    reply = ask(qsock, CacheQueryRequest(keys=["upstream-peer@missing", k2, k1]))
    check(
        "the query port answers too",
        isinstance(reply, CacheQueryResponse) and reply.cached_indexes == [1, 2] and reply.cached_keys == [k2, k1],
        repr(reply),
    )
    qsock.close()

    reply = ask(sock, CacheQueryRequest(keys=[]))
    check("an empty query", isinstance(reply, CacheQueryResponse) and reply.cached_keys == [], repr(reply))

    req = AllocRequest(
        keys=["upstream-peer@0", "upstream-peer@1"],
        fmt=1,
        shape=[2, 2, 16, 32],
        dtype="bfloat16",
        last_chunk_toks=16,
        req_id="cmpl-upstream-0",
        is_last_batch=True,
        total_chunks=2,
    )
    reply = ask(sock, req)
    check("async AllocRequest answered with AscendAllocResponse", isinstance(reply, AscendAllocResponse), repr(reply))
    if isinstance(reply, AscendAllocResponse):
        check("no pages for a peer without a handshake", reply.alloc_failed and not reply.remote_indexes, repr(reply))

    # The receiver counted it as an AllocRequest and a cache query, and
    # nothing as malformed (its metrics refresh every 100 ms).
    deadline = time.time() + 10
    counts = {}
    while time.time() < deadline:
        counts = {
            k: metric(metrics_port, f'ascend_pd_messages_total{{kind="{k}"}}')
            for k in ("alloc_request", "cache_query", "malformed")
        }
        if counts["alloc_request"] >= prior + 1 and counts["cache_query"] >= 3:
            break
        time.sleep(0.1)
    check("decoded as an AllocRequest", counts.get("alloc_request") == prior + 1, repr(counts))
    check("every query counted", counts.get("cache_query") == 3.0, repr(counts))
    check("nothing malformed", counts.get("malformed") == 0.0, repr(counts))

    sock.close()
    ctx.term()
    if failures:
        print(f"{failures} check(s) failed", file=sys.stderr)
        sys.exit(1)
    print("upstream peer: OK")


if __name__ == "__main__":
    main()
