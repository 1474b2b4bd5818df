"""What the connector reads from vLLM objects whose shape changes between
vLLM versions, in one place: a request's inputs that change its KV, how it
finished, the block pool, the parallel layout, and the parts of the
connector API that vLLM grew between releases.

Everything else in :mod:`ascend_pd.vllm` goes through these functions
rather than reading vLLM attributes itself.

Supported: vLLM 0.23 (what vLLM-Ascend 0.23.0.post1 runs) to 0.32. What
changed between them and what this module does about it (detected by what
vLLM has, not by its version number; the first vLLM with each is named for
the reader only):

- ``KVConnectorTransferResults`` / ``get_transfer_results`` (0.30: failed
  loads reported by request). Before, vLLM learns of a failed load from
  its blocks alone (``get_block_ids_with_load_errors``), which the worker
  always reports; :func:`transfer_results` is never called and the
  per-request list is discarded each step.
- ``has_pending_push_work`` (0.24: vLLM keeps stepping an idle engine for
  the connector). Before, :class:`FinishedHold` keeps a finished request
  whose save still pins its blocks in vLLM's hands instead
  (``request_finished`` answers ``delay_free``), so the engine steps until
  every rank released them, then reports it in ``finished_sending``.
- ``bind_kv_cache_manager`` (0.30: the scheduler's KV cache manager, which
  gives a request's block ids). Before, :class:`BlockTable` keeps each
  request's block ids from the scheduler outputs instead.
- The CPU attention backend's kernel choice (``layer.isa``, 0.29): before,
  :func:`cpu_attention_isa` asks vLLM's chooser.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

log = logging.getLogger("vllm.ascend_pd")


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


# ----------------------------------------------------- the connector API


@functools.lru_cache(maxsize=None)
def _connector_base() -> Any:
    """vLLM's ``kv_connector.v1.base`` module (imported on first use, so
    the rest of this module works without vLLM)."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    return base


def vllm_version() -> str:
    """The running vLLM's version, for messages."""
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except ImportError:
        return "not installed"


def reports_failed_recving() -> bool:
    """Whether vLLM takes failed loads by request (``get_transfer_results``
    returning ``KVConnectorTransferResults.failed_recving``). Without it,
    vLLM learns of them from their blocks alone."""
    return hasattr(_connector_base(), "KVConnectorTransferResults")


def transfer_results(sending: Optional[Set[str]], recving: Optional[Set[str]], failed: Set[str]) -> Any:
    """A step's ``KVConnectorTransferResults`` (only vLLM that has the class
    asks for it)."""
    cls = getattr(_connector_base(), "KVConnectorTransferResults", None)
    if cls is None:
        raise RuntimeError(f"vLLM {vllm_version()} has no KVConnectorTransferResults: "
                           "get_transfer_results is not part of its connector API")
    return cls(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
               failed_recving=set(failed))


def steps_for_pending_work() -> bool:
    """Whether vLLM keeps stepping an idle engine while the connector's
    ``has_pending_push_work`` says so."""
    return hasattr(_connector_base().KVConnectorBase_V1, "has_pending_push_work")


def passes_handshake_metadata() -> bool:
    """Whether vLLM hands the workers' ``get_handshake_metadata`` to the
    scheduler half (``set_xfer_handshake_metadata``): what tells a prefill
    where its ranks take registrations (the router-native flow)."""
    base = _connector_base().KVConnectorBase_V1
    return hasattr(base, "get_handshake_metadata") and hasattr(base, "set_xfer_handshake_metadata")


def kv_cache_manager(connector: Any) -> Any:
    """What answers ``get_block_ids(req_id)`` for the scheduler half: the
    KV cache manager vLLM bound to ``connector`` (``bind_kv_cache_manager``),
    or, on vLLM that binds none, a :class:`BlockTable` the connector feeds
    each scheduler output (see :func:`observe_step`)."""
    manager = getattr(connector, "_kv_cache_manager", None)
    return manager if manager is not None else BlockTable()


def observe_step(kv_cache_manager: Any, scheduler_output: Any) -> None:
    """Feeds a scheduler output to a :class:`BlockTable` (nothing to do for
    vLLM's own KV cache manager)."""
    if isinstance(kv_cache_manager, BlockTable):
        kv_cache_manager.observe(scheduler_output)


class BlockTable:
    """Each scheduled request's block ids (the single KV cache group), as
    the scheduler outputs give them to the workers, where vLLM binds no KV
    cache manager to the connector. Answers ``get_block_ids`` as vLLM's
    ``KVCacheManager`` does."""

    def __init__(self) -> None:
        self._ids: Dict[str, List[int]] = {}

    def observe(self, scheduler_output: Any) -> None:
        """One step's output, before the connector orders its saves."""
        for ended in (getattr(scheduler_output, "finished_req_ids", None),
                      getattr(scheduler_output, "preempted_req_ids", None)):
            for req_id in ended or ():
                self._ids.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._ids[new.req_id] = _first_group(new.block_ids)
        cached = scheduler_output.scheduled_cached_reqs
        resumed: Set[str] = set(getattr(cached, "resumed_req_ids", None) or ())
        flags = getattr(cached, "resumed_from_preemption", None)  # vLLM before resumed_req_ids
        if flags is not None:
            resumed |= {r for r, f in zip(cached.req_ids, flags) if f}
        for req_id, added in zip(cached.req_ids, cached.new_block_ids):
            ids = _first_group(added)
            if req_id in resumed:
                self._ids[req_id] = ids
            else:
                self._ids.setdefault(req_id, []).extend(ids)

    def get_block_ids(self, req_id: str) -> Tuple[List[int]]:
        return (list(self._ids.get(req_id, ())),)


def _first_group(block_ids: Any) -> List[int]:
    return [int(b) for b in block_ids[0]] if block_ids else []


class FinishedHold:
    """For vLLM without ``has_pending_push_work``: an idle engine stops
    stepping, and with it the workers' reports that a save released its
    blocks. A finished request whose save still pins blocks is kept in
    vLLM's hands instead (``request_finished`` answers ``delay_free``): vLLM
    steps while it has such requests. Once every rank released the save,
    the request is added to the step's ``finished_sending``, which makes
    vLLM free it."""

    def __init__(self) -> None:
        self._held: Set[str] = set()

    def finished(self, req_id: str, delay_free: bool, pinned: bool) -> bool:
        """``request_finished``'s ``delay_free`` answer for ``req_id``."""
        if pinned and not delay_free:
            self._held.add(req_id)
            return True
        return delay_free

    def released(self, connector_output: Any, pinned: Set[str]) -> None:
        """After the scheduler half took a step's releases: the held
        requests nothing pins any more go back to vLLM."""
        done = {r for r in self._held if r not in pinned}
        if done:
            self._held -= done
            connector_output.finished_sending = set(connector_output.finished_sending or ()) | done

    @property
    def held(self) -> Set[str]:
        """The requests kept from vLLM now (for tests)."""
        return set(self._held)


def finished_hold() -> Optional[FinishedHold]:
    """A :class:`FinishedHold` where vLLM needs one (no
    ``has_pending_push_work``), else None."""
    if steps_for_pending_work():
        return None
    log.info("vLLM %s has no has_pending_push_work: a finished prefill request whose save still reads its "
             "blocks is kept (request_finished delays its free) until every rank released them; orders for "
             "requests that ended otherwise (freeing what a prefill sent a decode request that never loaded) "
             "go out at the engine's next step", vllm_version())
    return FinishedHold()


def cpu_attention_isa(kv_cache: Any, head_size: int) -> Optional[str]:
    """For vLLM whose CPU attention backend does not set ``layer.isa``: the
    kernel it picks for this cache (which decides the cache's interior), as
    vLLM's own chooser picks it. None for a cache not of one tensor."""
    if isinstance(kv_cache, (tuple, list)):
        return None
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(kv_cache.dtype, int(kv_cache.shape[2]), head_size))


def drain_bound(vllm_config: Any, drain_timeout_s: float) -> float:
    """How long a prefill's sender may drain when vLLM shuts its worker
    down: ``pd_drain_timeout``, cut to fit inside the grace vLLM gives a
    worker before it kills it (``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``; a
    fixed 4 s in vLLM before that setting), less a second, so the drain
    ends and reports rather than being killed mid-way. Warns when vLLM's settings cut or defeat it (an API server
    with ``--shutdown-timeout 0`` kills the engine at once on SIGTERM)."""
    bound = float(drain_timeout_s)
    try:
        import vllm.envs as envs

        grace = getattr(envs, "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", None)
    except Exception:
        grace = None
    if grace is None:
        # vLLM before the setting: a fixed grace, not configurable.
        grace, how = 4.0, f"(fixed in vLLM {vllm_version()}; a newer vLLM makes it configurable)"
    else:
        how = "(VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS; set it above pd_drain_timeout + 1)"
    if bound > float(grace) - 1.0:
        cut = max(0.0, float(grace) - 1.0)
        log.warning("pd_drain_timeout is %.1f s but vLLM kills a worker %s s after asking it to stop %s: "
                    "the drain on shutdown is cut to %.1f s", bound, grace, how, cut)
        bound = cut
    if getattr(vllm_config, "shutdown_timeout", None) == 0:
        log.warning("vllm serve runs with --shutdown-timeout 0: on SIGTERM it kills the engine at once and "
                    "this prefill cannot drain its transfers (decodes then recompute); set "
                    "--shutdown-timeout above pd_drain_timeout + 5")
    return bound
