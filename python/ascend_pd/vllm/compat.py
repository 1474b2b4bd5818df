"""What the connector reads from vLLM objects whose shape changes between
vLLM versions, in one place: a request's inputs that change its KV, how it
finished, the block pool, and the parallel layout.

Everything else in :mod:`ascend_pd.vllm` goes through these functions
rather than reading vLLM attributes itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Span:
    """A non-text input placed over prompt tokens ``[offset, offset + length)``
    (an image's or an audio clip's placeholder tokens)."""

    modality: str
    #: vLLM's content hash of the input (or the client's ``multi_modal_uuids``
    #: entry); ``None`` when vLLM gave none, which makes the request unhashable.
    identifier: Optional[str]
    offset: int
    length: int


@dataclass(frozen=True)
class RequestInputs:
    """Everything of a request that changes its prompt's KV, besides the model."""

    #: One id per prompt token (zeros where the prompt is embeddings).
    token_ids: Tuple[int, ...]
    lora_name: Optional[str]
    lora_path: Optional[str]
    spans: Tuple[Span, ...]
    #: The prompt embeddings (a tensor, one row per prompt token), if any.
    prompt_embeds: Any
    #: Mixed prompts: which positions are token ids (the rest are embeddings).
    is_token: Optional[Tuple[bool, ...]]
    cache_salt: Optional[str]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def request_inputs(request: Any) -> RequestInputs:
    """The KV-relevant inputs of a vLLM ``Request``."""
    n = num_prompt_tokens(request)
    ids = getattr(request, "prompt_token_ids", None)
    mask = getattr(request, "prompt_is_token_ids", None)
    if ids is None:
        token_ids: Tuple[int, ...] = (0,) * n
    elif mask is not None:
        token_ids = tuple(int(t) if m else 0 for t, m in zip(ids, mask))
    else:
        token_ids = tuple(int(t) for t in ids[:n])
    lora = getattr(request, "lora_request", None)
    salt = getattr(request, "cache_salt", None)
    lora_path = str(getattr(lora, "lora_path", "") or "") if lora is not None else ""
    return RequestInputs(
        token_ids=token_ids,
        lora_name=str(lora.lora_name) if lora is not None else None,
        lora_path=lora_path or None,
        spans=_spans(request),
        prompt_embeds=getattr(request, "prompt_embeds", None),
        is_token=tuple(bool(m) for m in mask) if mask is not None else None,
        cache_salt=str(salt) if salt else None,
    )


def num_prompt_tokens(request: Any) -> int:
    """How many tokens the request's prompt has (ids or embeddings)."""
    n = getattr(request, "num_prompt_tokens", None)
    if isinstance(n, int):
        return n
    return len(getattr(request, "prompt_token_ids", None) or ())


def _spans(request: Any) -> Tuple[Span, ...]:
    features = getattr(request, "mm_features", None)
    out: List[Span] = []
    if features:
        for f in features:
            pos = f.mm_position
            ident = getattr(f, "identifier", None)
            out.append(Span(str(getattr(f, "modality", "mm")), str(ident) if ident else None,
                            int(pos.offset), int(pos.length)))
        return tuple(out)
    # vLLM before mm_features: parallel lists of hashes and positions.
    hashes: Sequence[Any] = getattr(request, "mm_hashes", None) or ()
    positions: Sequence[Any] = getattr(request, "mm_positions", None) or ()
    for i, pos in enumerate(positions):
        ident = hashes[i] if i < len(hashes) else None
        out.append(Span("mm", str(ident) if ident else None, int(pos.offset), int(pos.length)))
    return tuple(out)


def finished_normally(request: Any) -> bool:
    """Whether ``request`` ended by producing its output (stop or length),
    not by an abort, an error or being ignored."""
    from vllm.v1.request import RequestStatus

    normal = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED}
    repetition = getattr(RequestStatus, "FINISHED_REPETITION", None)
    if repetition is not None:
        normal.add(repetition)
    return request.status in normal


def prompt_block_ids(kv_cache_manager: Any, req_id: str) -> List[int]:
    """The request's block ids (the single KV cache group)."""
    return list(kv_cache_manager.get_block_ids(req_id)[0])


def pin_blocks(block_pool: Any, block_ids: Iterable[int]) -> None:
    """Takes one reference on each block: vLLM will not hand it to another
    request, even after the request that owns it is freed or preempted,
    until :func:`unpin_blocks`."""
    block_pool.touch([block_pool.blocks[b] for b in block_ids])


def unpin_blocks(block_pool: Any, block_ids: Sequence[int]) -> None:
    """Drops the references :func:`pin_blocks` took (tail first, so a shared
    prefix is evicted last)."""
    block_pool.free_blocks(block_pool.blocks[b] for b in reversed(block_ids))


def load_failure_policy(kv_transfer_config: Any) -> str:
    """``kv_load_failure_policy`` (``recompute`` where vLLM has no such key)."""
    return str(getattr(kv_transfer_config, "kv_load_failure_policy", "recompute") or "recompute")


def kv_cache_group_count(kv_cache_config: Any) -> int:
    """How many KV cache groups vLLM made (more than one: hybrid models)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    return len(groups) if groups is not None else 1


def parallel_sizes(vllm_config: Any) -> Dict[str, int]:
    """The parallel layouts the connector refuses above 1, by config name."""
    pc = vllm_config.parallel_config
    names = ("pipeline_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size")
    return {n: int(getattr(pc, n, 1) or 1) for n in names}
