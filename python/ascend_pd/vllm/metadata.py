"""What passes between the connector's halves and between a prefill and a
decode (plain data).

- :class:`AscendPDConnectorMetadata`: the scheduler half's orders to the
  workers for one engine step.
- :class:`AscendPDWorkerMetadata`: the workers' answer to the scheduler:
  which saves no longer read vLLM's blocks.
- :func:`prefill_params` / :func:`parse_handoff`: the ``kv_transfer_params``
  a prefill returns and a decode is given, unchanged, by the client or
  router.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

#: The version of the ``kv_transfer_params`` a prefill returns. 2: chunk keys
#: name the model identity and the request's extra inputs; the params carry
#: the keys and the identity's parts.
PARAMS_VERSION = 2

_KEY = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class ReceiverAddress:
    """Where a decode instance's receivers listen: one port pair per decode TP rank."""

    host: str
    init_ports: Tuple[int, ...]
    alloc_ports: Tuple[int, ...]


@dataclass(frozen=True)
class RegistrationPoint:
    """Where a prefill's ranks take decode registrations (router-native
    flow): one host, one port per prefill TP rank."""

    host: str
    ports: Tuple[int, ...]


@dataclass
class RegisterHandshake(KVConnectorHandshakeMetadata):
    """What a prefill worker tells its scheduler at start: where its rank
    takes registrations."""

    host: str
    port: int


@dataclass(frozen=True)
class Registration:
    """A decode load whose prefill parked the KV: register with it first."""

    at: RegistrationPoint
    #: Leading tokens this decode holds (their whole chunks are not sent).
    held_tokens: int


@dataclass(frozen=True)
class SaveSpec:
    """Save request ``req_id``'s prompt KV (prefill side)."""

    req_id: str
    keys: Tuple[str, ...]
    #: One slot per prompt token.
    slots: Tuple[int, ...]
    #: The decode receiver; None: parked until a decode registers.
    to: Optional[ReceiverAddress]


@dataclass(frozen=True)
class LoadSpec:
    """Load request ``req_id``'s prompt KV (decode side)."""

    req_id: str
    keys: Tuple[str, ...]
    #: One slot per token the keys cover; -1 for tokens not written (the
    #: decode already holds them, or vLLM computes them itself).
    slots: Tuple[int, ...]
    #: The blocks the load writes (reported if it fails).
    block_ids: Tuple[int, ...]
    #: Set when the scheduler already knows the load cannot run (the
    #: prefill's KV is not this request's): the worker reports it failed at
    #: once, with this message, counted under ``cause``.
    error: Optional[str] = None
    cause: str = ""
    #: The keys the prefill sent under (equal to ``keys`` unless ``error``):
    #: what is freed here if the load does not run.
    sent_keys: Tuple[str, ...] = ()
    #: The prefill's id for its save (its chunks arrive under it): what a
    #: drop names, so the receiver also refuses them if they arrive later.
    save_id: str = ""
    #: The prefill parked the KV: register with it (under ``save_id``).
    register: Optional[Registration] = None


@dataclass
class AscendPDConnectorMetadata(KVConnectorMetadata):
    """One engine step's work for the workers."""

    saves: List[SaveSpec] = field(default_factory=list)
    loads: List[LoadSpec] = field(default_factory=list)
    #: Loads the scheduler gave up on (request aborted): cancel them.
    cancels: List[Tuple[str, Tuple[str, ...]]] = field(default_factory=list)
    #: Keys a prefill sent that this decode will not load (its own prefix
    #: cache had them, the hand-off did not match, the request ended before
    #: its load): free them.
    drops: List[Tuple[str, Tuple[str, ...]]] = field(default_factory=list)
    #: Saves of prefill requests that ended without a hand-off (aborted,
    #: failed): cancel them, so nothing is held for a decode that never loads.
    cancel_saves: List[str] = field(default_factory=list)
    #: Requests vLLM preempted this step (their saves read pinned blocks).
    preempted: List[str] = field(default_factory=list)
    #: The step runs no tokens and carries no order: vLLM steps only because
    #: a save still pins blocks (see ConnectorWorker.idle_pace_s).
    idle: bool = False
    #: The step runs no tokens (orders or not): a worker with a load in
    #: flight may wait for it in the step (see ConnectorWorker.get_finished).
    no_tokens: bool = False


try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata as _WorkerMetaBase
except ImportError:  # vLLM without worker metadata
    _WorkerMetaBase = object


class AscendPDWorkerMetadata(_WorkerMetaBase):
    """What the workers tell the scheduler after a step: per request, how
    many TP ranks' saves stopped reading vLLM's blocks (summed over ranks)."""

    def __init__(self, released: Optional[Dict[str, int]] = None) -> None:
        self.released: Dict[str, int] = dict(released or {})

    def aggregate(self, other: Any) -> "AscendPDWorkerMetadata":
        for req_id, n in getattr(other, "released", {}).items():
            self.released[req_id] = self.released.get(req_id, 0) + n
        return self


def prefill_params(num_tokens: int, keys: Tuple[str, ...], identity: Mapping[str, str], mode: str,
                   save_id: str, nonce: Optional[str], inputs: Optional[Mapping[str, str]] = None,
                   register: Optional[RegistrationPoint] = None) -> Dict[str, Any]:
    """The ``kv_transfer_params`` a prefill returns; the client passes them
    unchanged to the decode request. ``register``: the KV is parked under
    ``save_id`` until the decode registers there (router-native flow)."""
    ours: Dict[str, Any] = {
        "v": PARAMS_VERSION,
        "num_tokens": int(num_tokens),
        "keys": list(keys),
        "identity": dict(identity),
        "mode": mode,
        "save_id": save_id,
        "inputs": dict(inputs or {}),
    }
    if nonce is not None:
        ours["nonce"] = nonce
    if register is not None:
        ours["register"] = {"host": register.host, "ports": list(register.ports)}
    return {"do_remote_prefill": True, "ascend_pd": ours}


@dataclass(frozen=True)
class HandOff:
    """A decode request's ``kv_transfer_params`` from an ascend-pd prefill."""

    num_tokens: int
    keys: Tuple[str, ...]
    identity: Dict[str, Any]
    mode: str
    save_id: str
    nonce: Optional[str]
    #: A short digest per kind of input (see :func:`.keys.input_digests`).
    inputs: Dict[str, str] = field(default_factory=dict)
    #: Set when the prefill parked the KV: register there to receive it.
    register: Optional[RegistrationPoint] = None


class HandOffError(ValueError):
    """The params are ours but unusable; ``keys`` holds the prefill's keys
    when they could be read (to free what it sent)."""

    def __init__(self, cause: str, message: str, keys: Tuple[str, ...] = (), save_id: str = "") -> None:
        super().__init__(message)
        self.cause = cause
        self.keys = keys
        self.save_id = save_id


def parse_handoff(params: Any) -> Optional[HandOff]:
    """The hand-off in a decode request's ``kv_transfer_params``: ``None``
    when they are not an ascend-pd prefill's (no ``do_remote_prefill``, no
    ``ascend_pd``). Raises :class:`HandOffError` when they are ours but
    cannot be used, naming why."""
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None
    ours = params.get("ascend_pd")
    if not isinstance(ours, dict):
        return None
    raw_keys = ours.get("keys")
    keys: Tuple[str, ...] = ()
    if isinstance(raw_keys, list) and all(isinstance(k, str) and _KEY.match(k) for k in raw_keys):
        keys = tuple(raw_keys)
    raw_id = ours.get("save_id")
    save_id = raw_id if isinstance(raw_id, str) else ""
    v = ours.get("v")
    if v != PARAMS_VERSION:
        raise HandOffError(
            "version",
            f"the prefill's kv_transfer_params are version {v!r}, this decode's connector reads version "
            f"{PARAMS_VERSION}: run the same ascend-pd release on the prefill and the decode",
            keys,
            save_id,
        )
    n = ours.get("num_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0 or raw_keys is None or not keys and n > 0:
        raise HandOffError("malformed", f"the prefill's kv_transfer_params are malformed: {ours!r:.300}", keys,
                           save_id)
    identity = ours.get("identity")
    nonce = ours.get("nonce")
    inputs = ours.get("inputs")
    register: Optional[RegistrationPoint] = None
    raw_reg = ours.get("register")
    if raw_reg is not None:
        host = raw_reg.get("host") if isinstance(raw_reg, dict) else None
        ports = raw_reg.get("ports") if isinstance(raw_reg, dict) else None
        if (not isinstance(host, str) or not host or not isinstance(ports, list) or not ports
                or not all(isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= 65535 for p in ports)):
            raise HandOffError("malformed", f"the prefill's registration address is malformed: {raw_reg!r:.200} "
                               "(pass the prefill's kv_transfer_params unchanged)", keys, save_id)
        register = RegistrationPoint(host, tuple(ports))
    return HandOff(
        num_tokens=n,
        keys=keys,
        identity=dict(identity) if isinstance(identity, dict) else {},
        mode=str(ours.get("mode", "")),
        save_id=save_id,
        nonce=nonce if isinstance(nonce, str) and nonce else None,
        inputs={str(k): str(v) for k, v in inputs.items()} if isinstance(inputs, dict) else {},
        register=register,
    )
