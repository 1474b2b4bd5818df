"""What the scheduler half hands the worker half each step (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

#: The version of the opaque ``kv_transfer_params`` a prefill returns.
PARAMS_VERSION = 1


@dataclass(frozen=True)
class ReceiverAddress:
    """Where a decode instance's receivers listen: one port pair per decode TP rank."""

    host: str
    init_ports: Tuple[int, ...]
    alloc_ports: Tuple[int, ...]


@dataclass(frozen=True)
class SaveSpec:
    """Save request ``req_id``'s prompt KV (prefill side)."""

    req_id: str
    keys: Tuple[str, ...]
    #: One slot per prompt token.
    slots: Tuple[int, ...]
    to: ReceiverAddress


@dataclass(frozen=True)
class LoadSpec:
    """Load request ``req_id``'s prompt KV (decode side)."""

    req_id: str
    keys: Tuple[str, ...]
    #: One slot per token the keys cover; -1 for tokens the decode already
    #: holds (its own prefix cache hits), which are not written.
    slots: Tuple[int, ...]
    #: The blocks the load writes (reported if it fails).
    block_ids: Tuple[int, ...]


@dataclass
class AscendPDConnectorMetadata(KVConnectorMetadata):
    """One engine step's work for the workers."""

    saves: List[SaveSpec] = field(default_factory=list)
    loads: List[LoadSpec] = field(default_factory=list)
    #: Loads the scheduler gave up on (request aborted): cancel them.
    cancels: List[Tuple[str, Tuple[str, ...]]] = field(default_factory=list)
    #: Keys a prefill sent that this decode will not load (its own prefix
    #: cache had them, or the hand-off did not match): free them.
    drops: List[Tuple[str, Tuple[str, ...]]] = field(default_factory=list)
    #: Requests vLLM preempted this step: their blocks may be reused, so a
    #: save still reading them must end first.
    preempted: List[str] = field(default_factory=list)


def prefill_params(num_tokens: int, tag: str, chunk_size: int, mode: str) -> Dict[str, Any]:
    """The ``kv_transfer_params`` a prefill returns; the client passes them
    unchanged to the decode request."""
    return {
        "do_remote_prefill": True,
        "ascend_pd": {
            "v": PARAMS_VERSION,
            "num_tokens": int(num_tokens),
            "model_tag": tag,
            "chunk_size": int(chunk_size),
            "mode": mode,
        },
    }
