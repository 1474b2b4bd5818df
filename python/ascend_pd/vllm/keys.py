"""Chunk keys: a name for a chunk's KV that two requests share only if their
KV for it is the same.

A chunk's key hashes, prefix-chained like vLLM's block hashes:

- the **root** of the request: the model's identity (weights, config, dtype,
  KV dtype, quantization, geometry, chunk size: :mod:`.identity`) and what of
  the request applies to every token: its LoRA adapter, its ``cache_salt``,
  and, for a request whose inputs cannot all be hashed, a nonce of its own
  that no other request shares;
- the key of the chunk before it (the root for the first);
- the chunk's token ids, and what else sits over its tokens: every
  multimodal input overlapping it (its content hash, where it starts
  relative to the chunk, how long it is) and a digest of the prompt
  embeddings of its tokens.

So two prompts that share their first ``k`` chunks and everything above
share those ``k`` keys; a prefill and a decode of the same deployment
compute the same keys from the same request without talking; and a
request with another adapter, image, embedding, salt or model gets other
keys for every chunk. Only the last chunk may be partial: its key covers
exactly the tokens (and inputs) it holds — vLLM hashes full blocks only,
the partial tail of a request is keyed here too.

Nothing here imports vLLM or torch: :class:`KeyInputs` is plain data (the
connector builds it from a vLLM request in :func:`key_inputs`).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .compat import RequestInputs, Span

#: Bytes of a key's digest (the key is its hex: 32 characters).
DIGEST_BYTES = 16

#: The version of how keys are derived; part of the model identity, so two
#: sides that derive keys differently never take each other's chunks.
KEY_FORMAT = 2


@dataclass(frozen=True)
class KeyInputs:
    """What a request's keys hash, besides the model's identity."""

    token_ids: Sequence[int]
    #: Inputs that apply to every token, as ``(name, value)`` pairs:
    #: ``("lora", adapter identity)``, ``("cache_salt", salt)``,
    #: ``("nonce", n)``.
    request_extras: Tuple[Tuple[str, str], ...] = ()
    #: Inputs placed over token ranges (images, audio).
    spans: Tuple[Span, ...] = ()
    #: Digest of the prompt embeddings of tokens ``[start, end)``, if the
    #: prompt has embeddings.
    embeds_digest: Optional[Callable[[int, int], bytes]] = None


def model_tag(*parts: object) -> str:
    """A short digest of ``parts`` (the model identity's fields)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(repr(p).encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()


def _field(h: Any, value: bytes) -> None:
    """Length-prefixed, so no two field sequences hash alike."""
    h.update(struct.pack("<Q", len(value)))
    h.update(value)


def chunk_keys(tag: str, inputs: "KeyInputs | Sequence[int]", chunk_size: int) -> List[str]:
    """The keys of a request's prompt in chunks of ``chunk_size`` tokens
    (``inputs`` may be bare token ids: a text-only request without extras)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size is {chunk_size}: it must be positive")
    if not isinstance(inputs, KeyInputs):
        inputs = KeyInputs(tuple(inputs))
    root = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"ascend-pd-root")
    _field(root, tag.encode("utf-8"))
    for name, value in inputs.request_extras:
        _field(root, name.encode("utf-8"))
        _field(root, value.encode("utf-8"))
    prev = root.digest()
    keys: List[str] = []
    ids = inputs.token_ids
    for start in range(0, len(ids), chunk_size):
        end = min(start + chunk_size, len(ids))
        chunk = ids[start:end]
        h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"ascend-pd-kv")
        h.update(prev)
        h.update(struct.pack(f"<I{len(chunk)}q", len(chunk), *chunk))
        for s in inputs.spans:
            if s.offset < end and s.offset + s.length > start:
                _field(h, b"span")
                _field(h, s.modality.encode("utf-8"))
                _field(h, (s.identifier or "").encode("utf-8"))
                h.update(struct.pack("<qq", s.offset - start, s.length))
        if inputs.embeds_digest is not None:
            _field(h, b"embeds")
            _field(h, inputs.embeds_digest(start, end))
        prev = h.digest()
        keys.append(prev.hex())
    return keys


def unhashable(inputs: RequestInputs) -> List[str]:
    """What of ``inputs`` cannot be named by a hash (the request then gets
    keys of its own); empty when everything can."""
    out: List[str] = []
    for s in inputs.spans:
        if not s.identifier:
            out.append(f"a {s.modality} input at token {s.offset} without a content hash")
    if inputs.prompt_embeds is not None and not _can_digest(inputs.prompt_embeds):
        out.append("prompt embeddings that are not a tensor")
    return out


def _can_digest(t: Any) -> bool:
    return all(hasattr(t, a) for a in ("shape", "dtype", "detach"))


def embeds_digest(t: Any, is_token: Optional[Tuple[bool, ...]]) -> Callable[[int, int], bytes]:
    """Digest of the rows ``[start, end)`` of embeddings tensor ``t`` (its
    dtype, the rows' shape and bytes, and which positions are token ids)."""
    import torch

    def digest(start: int, end: int) -> bytes:
        rows = t[start:end].detach().to("cpu").contiguous()
        h = hashlib.blake2b(digest_size=DIGEST_BYTES)
        _field(h, str(rows.dtype).encode())
        _field(h, repr(tuple(rows.shape)).encode())
        _field(h, rows.reshape(-1).view(torch.uint8).numpy().tobytes())
        if is_token is not None:
            _field(h, bytes(int(b) for b in is_token[start:end]))
        return h.digest()

    return digest


def key_inputs(inputs: RequestInputs, lora_identity: Optional[str], nonce: Optional[str]) -> KeyInputs:
    """The :class:`KeyInputs` of a request: its adapter (by ``lora_identity``,
    which names the adapter's content; by name and path when that is
    ``None``, with a nonce then), salt, spans, embeddings, and ``nonce``
    when it has inputs that cannot be hashed."""
    extras: List[Tuple[str, str]] = []
    if inputs.lora_name is not None:
        extras.append(("lora", lora_identity or f"{inputs.lora_name}@{inputs.lora_path}"))
    if inputs.cache_salt:
        extras.append(("cache_salt", inputs.cache_salt))
    if nonce:
        extras.append(("nonce", nonce))
    digest = None
    if inputs.prompt_embeds is not None and _can_digest(inputs.prompt_embeds):
        digest = embeds_digest(inputs.prompt_embeds, inputs.is_token)
    return KeyInputs(inputs.token_ids, tuple(extras), inputs.spans, digest)


def input_digests(inputs: KeyInputs) -> Dict[str, str]:
    """A short digest per kind of input (``tokens``, ``lora``,
    ``cache_salt``, ``nonce``, ``mm``, ``embeds``), so a decode whose keys
    differ from the prefill's can say which kind differs."""

    def short(*parts: bytes) -> str:
        h = hashlib.blake2b(digest_size=6)
        for p in parts:
            _field(h, p)
        return h.hexdigest()

    out = {"tokens": short(struct.pack(f"<{len(inputs.token_ids)}q", *inputs.token_ids))}
    extras = dict(inputs.request_extras)
    for name in ("lora", "cache_salt", "nonce"):
        out[name] = short(extras[name].encode()) if name in extras else "none"
    spans = [f"{s.modality}|{s.identifier}|{s.offset}|{s.length}".encode() for s in inputs.spans]
    out["mm"] = short(*spans) if spans else "none"
    if inputs.embeds_digest is not None:
        out["embeds"] = short(inputs.embeds_digest(0, len(inputs.token_ids)))
    else:
        out["embeds"] = "none"
    return out
