"""Chunk keys derived from content, so both sides name a chunk alike.

A chunk's key hashes the model's identity, the key of the chunk before it
and the chunk's own token ids (prefix-chained, like vLLM's block hashes):
two prompts that share their first ``k`` chunks share those ``k`` keys, and a
prefill and a decode of the same model compute the same keys from the same
prompt without talking to each other. Only the last chunk may be partial;
its key covers exactly the tokens it holds.
"""

from __future__ import annotations

import hashlib
import struct
from typing import List, Sequence

#: Bytes of a key's digest (the key is its hex: 32 characters).
DIGEST_BYTES = 16


def model_tag(*parts: object) -> str:
    """A short tag of everything that must match for two sides' chunks to be
    interchangeable (model, geometry, dtype, chunk size)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(repr(p).encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()


def chunk_keys(tag: str, token_ids: Sequence[int], chunk_size: int) -> List[str]:
    """The keys of ``token_ids`` in chunks of ``chunk_size`` tokens."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size is {chunk_size}: it must be positive")
    keys: List[str] = []
    prev = tag.encode("ascii")
    for start in range(0, len(token_ids), chunk_size):
        chunk = token_ids[start : start + chunk_size]
        h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"ascend-pd-kv")
        h.update(prev)
        h.update(struct.pack(f"<I{len(chunk)}q", len(chunk), *chunk))
        digest = h.hexdigest()
        keys.append(digest)
        prev = digest.encode("ascii")
    return keys
