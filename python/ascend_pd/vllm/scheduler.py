"""The scheduler half: decides what each worker saves or loads, and when
vLLM's blocks may be reused. It never touches the network.

Prefill: when a request's prompt is computed, its save is ordered and the
blocks it reads are pinned in vLLM's block pool (one reference of ours), so
neither the request's end, its abort nor its preemption lets vLLM reuse
them before every TP rank said its save stopped reading them
(:class:`~ascend_pd.vllm.metadata.AscendPDWorkerMetadata`). An aborted
request's save is cancelled.

Decode: a request's hand-off is checked against what this decode computes
for it (model identity, prompt length, chunk keys). One that does not
match is not loaded: it is reported as a failed load at once, so vLLM
recomputes or fails it as ``kv_load_failure_policy`` says, and the keys
the prefill sent are freed. A request that ends before its load ran frees
them too.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from . import compat
from .identity import ModelIdentity, adapter_identity
from .keys import KeyInputs, chunk_keys, input_digests, key_inputs, unhashable
from .metadata import (
    AscendPDConnectorMetadata,
    HandOff,
    HandOffError,
    LoadSpec,
    ReceiverAddress,
    Registration,
    RegistrationPoint,
    SaveSpec,
    parse_handoff,
    prefill_params,
)
from .settings import ConnectorSettings

log = logging.getLogger("vllm.ascend_pd")


def receiver_address(params: Mapping[str, Any]) -> ReceiverAddress:
    """The decode receiver named by a prefill request's ``kv_transfer_params``
    (LMCache's disagg spec names); raises ``ValueError`` naming what is wrong."""
    host = params.get("receiver_host")
    if not isinstance(host, str) or not host:
        raise ValueError("kv_transfer_params has do_remote_decode but no receiver_host (the decode's host)")
    ports: List[Tuple[int, ...]] = []
    for name in ("receiver_init_port", "receiver_alloc_port"):
        value = params.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)) or not value:
            raise ValueError(f"kv_transfer_params {name} is {value!r}: pass a list with one port per decode TP rank")
        for p in value:
            if not isinstance(p, int) or isinstance(p, bool) or not 1 <= p <= 65535:
                raise ValueError(f"kv_transfer_params {name} holds {p!r}: ports are 1 to 65535")
        ports.append(tuple(value))
    if len(ports[0]) != len(ports[1]):
        raise ValueError(
            f"kv_transfer_params has {len(ports[0])} receiver_init_port(s) but {len(ports[1])} "
            "receiver_alloc_port(s): give one of each per decode TP rank"
        )
    return ReceiverAddress(host, ports[0], ports[1])


def slots_for(block_ids: Sequence[int], block_size: int, num_tokens: int, skip: int = 0,
              end: Optional[int] = None) -> Tuple[int, ...]:
    """The slot of each of the first ``num_tokens`` tokens in ``block_ids``;
    -1 for tokens before ``skip`` and from ``end`` on (not written)."""
    stop = num_tokens if end is None else end
    if not 0 <= skip <= stop <= num_tokens:
        raise ValueError(f"tokens [{skip}, {stop}) are not within the {num_tokens} the keys cover")
    if (stop + block_size - 1) // block_size > len(block_ids):
        raise ValueError(
            f"{stop} tokens need {(stop + block_size - 1) // block_size} blocks of "
            f"{block_size}, but the request has {len(block_ids)}"
        )
    return tuple(
        block_ids[t // block_size] * block_size + t % block_size if skip <= t < stop else -1
        for t in range(num_tokens)
    )


@dataclass
class _SaveState:
    request: Any
    #: None: parked until a decode registers (router-native flow).
    to: Optional[ReceiverAddress]
    shipped: bool = False
    keys: Tuple[str, ...] = ()
    nonce: Optional[str] = None
    inputs: Dict[str, str] = field(default_factory=dict)


@dataclass
class _Offer:
    """What get_num_new_matched_tokens offered a decode request."""

    num_tokens: int
    #: Tokens the decode's own prefix cache held when it was offered.
    local: int
    keys: Tuple[str, ...]
    #: The keys the prefill sent under (what is freed if nothing loads).
    sent_keys: Tuple[str, ...]
    error: Optional[str] = None
    cause: str = ""
    #: The prefill's id for its save (what drops name).
    save_id: str = ""
    #: The prefill parked the KV: register there.
    register: Optional[RegistrationPoint] = None


@dataclass
class _Pin:
    """Blocks a save reads, pinned until every TP rank released them."""

    block_ids: List[int]
    remaining: int


@dataclass
class SchedulerCounters:
    """What the scheduler half decided (exposed for tests and logs)."""

    handoffs_refused: Dict[str, int] = field(default_factory=dict)
    saves_cancelled: int = 0
    keys_dropped: int = 0


class ConnectorScheduler:
    """Scheduler-side logic of :class:`~ascend_pd.vllm.AscendPDConnector`."""

    def __init__(self, settings: ConnectorSettings, identity: ModelIdentity, block_size: int,
                 num_workers: int = 1) -> None:
        self.settings = settings
        self.identity = identity
        self.tag = identity.tag
        self.block_size = block_size
        self.num_workers = num_workers
        self.is_producer = settings.pd_role in ("sender", "both")
        self.is_consumer = settings.pd_role in ("receiver", "both")
        self.counters = SchedulerCounters()
        self._saves: Dict[str, _SaveState] = {}
        self._offers: Dict[str, _Offer] = {}
        self._new_loads: List[LoadSpec] = []
        #: Loads handed to the workers and not reported finished.
        self._loading: Dict[str, LoadSpec] = {}
        self._cancels: List[Tuple[str, Tuple[str, ...]]] = []
        self._drops: List[Tuple[str, Tuple[str, ...]]] = []
        self._cancel_saves: List[str] = []
        self._pins: Dict[str, _Pin] = {}
        self.kv_cache_manager: Any = None
        self.block_pool: Any = None
        #: Where this prefill's ranks take registrations (from the workers'
        #: handshake metadata); None until they reported.
        self.registration: Optional[RegistrationPoint] = None

    def set_registration_ports(self, by_rank: Mapping[int, Tuple[str, int]]) -> None:
        """The workers' registration addresses, by TP rank."""
        if not by_rank:
            return
        ranks = sorted(by_rank)
        if ranks != list(range(self.num_workers)):
            log.error("ascend-pd: registration ports came from TP ranks %s of %d: the router-native flow "
                      "is off (prefill requests without receiver_host are not saved)", ranks, self.num_workers)
            return
        hosts = {by_rank[r][0] for r in ranks}
        if len(hosts) != 1:
            log.error("ascend-pd: prefill ranks advertise different hosts %s for registrations: set one "
                      "pd_peer_host", sorted(hosts))
            return
        self.registration = RegistrationPoint(hosts.pop(), tuple(by_rank[r][1] for r in ranks))
        log.info("ascend-pd: this prefill takes decode registrations at %s ports %s",
                 self.registration.host, list(self.registration.ports))
    # ----------------------------------------------------------------- keys

    def key_inputs(self, request: Any, nonce: Optional[str]) -> Tuple[KeyInputs, List[str]]:
        """What ``request``'s keys hash, and what of it cannot be hashed
        (then only a nonce names its KV)."""
        inputs = compat.request_inputs(request)
        lost = unhashable(inputs)
        lora = None
        if inputs.lora_name is not None:
            lora = adapter_identity(inputs.lora_name, inputs.lora_path)
            if lora is None:
                lost.append(f"LoRA adapter {inputs.lora_name!r}, whose files cannot be read here")
        return key_inputs(inputs, lora, nonce), lost

    def request_keys(self, request: Any, nonce: Optional[str]) -> Tuple[str, ...]:
        """The chunk keys of ``request``'s prompt (see :mod:`.keys`)."""
        ki, _ = self.key_inputs(request, nonce)
        return tuple(chunk_keys(self.tag, ki, self.settings.chunk_size))

    # ---------------------------------------------------------------- decode

    def _offer(self, request: Any, num_computed: int) -> Optional[_Offer]:
        """The hand-off of ``request`` checked against this decode (None:
        not an ascend-pd hand-off, or already loaded once)."""
        if not self.is_consumer:
            return None
        old = self._offers.get(request.request_id)
        if old is not None:
            old.local = num_computed
            return old
        try:
            handoff = parse_handoff(request.kv_transfer_params)
        except HandOffError as e:
            n = compat.request_inputs(request).num_tokens
            offer = _Offer(n, num_computed, (), e.keys, str(e), e.cause, e.save_id)
        else:
            if handoff is None:
                return None
            offer = self._check(request, handoff, num_computed)
        self._offers[request.request_id] = offer
        return offer

    def _check(self, request: Any, handoff: HandOff, num_computed: int) -> _Offer:
        inputs = compat.request_inputs(request)
        n = inputs.num_tokens

        def refuse(cause: str, why: str) -> _Offer:
            return _Offer(n, num_computed, (), handoff.keys, why, cause, handoff.save_id)

        diffs = self.identity.differences(handoff.identity)
        if diffs:
            return refuse("model", "the prefill's KV is of another model or configuration ("
                          + "; ".join(diffs) + "): run the prefill and the decode from the same model files "
                          "with the same dtype, KV-cache dtype, quantization, hf_overrides and chunk_size")
        if handoff.num_tokens != n:
            return refuse("prompt", f"the prefill saved {handoff.num_tokens} prompt tokens but this request "
                          f"has {n}: the decode request must carry the prefill request's prompt unchanged")
        ki, lost = self.key_inputs(request, handoff.nonce)
        if lost and handoff.nonce is None:
            return refuse("inputs", "this request has inputs whose KV cannot be named by a hash ("
                          + "; ".join(lost) + ") but the prefill named its KV by hash")
        keys = tuple(chunk_keys(self.tag, ki, self.settings.chunk_size))
        if keys != handoff.keys:
            mine = input_digests(ki)
            differ = sorted(k for k in mine if handoff.inputs.get(k) != mine[k]) if handoff.inputs else []
            names = {"tokens": "the prompt's tokens", "lora": "the LoRA adapter", "cache_salt": "cache_salt",
                     "nonce": "the request's nonce", "mm": "the images or audio", "embeds": "the prompt embeddings"}
            what = ", ".join(names.get(k, k) for k in differ) or (
                "its LoRA adapter, images or audio, prompt embeddings, cache_salt or tokens")
            verb = "differs" if len(differ) == 1 else "differ"
            return refuse("inputs", f"the prefill computed this prompt's KV with other inputs than this request "
                          f"carries ({what} {verb}): send the decode the prefill request's body unchanged")
        return _Offer(n, num_computed, keys, handoff.keys, save_id=handoff.save_id, register=handoff.register)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        offer = self._offer(request, num_computed_tokens)
        if offer is None or offer.num_tokens <= num_computed_tokens:
            return 0, False
        return offer.num_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if self.is_producer and isinstance(params, dict) and params.get("do_remote_decode"):
            if request.request_id not in self._saves:
                if params.get("receiver_host") is None:
                    # The router-native flow: no receiver named; the KV is
                    # parked until the decode registers.
                    if self.registration is None:
                        log.error("request %s: not saving its KV: kv_transfer_params name no receiver_host "
                                  "and this prefill's workers reported no registration port",
                                  request.request_id)
                    else:
                        self._saves[request.request_id] = _SaveState(request, None)
                else:
                    try:
                        to = receiver_address(params)
                    except ValueError as e:
                        log.error("request %s: not saving its KV: %s", request.request_id, e)
                    else:
                        self._saves[request.request_id] = _SaveState(request, to)
        offer = self._offers.pop(request.request_id, None)
        if offer is None:
            return
        # Loaded (or refused) once: a preempted and resumed request computes
        # what it lost.
        assert isinstance(params, dict)
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            # vLLM loads nothing (its own prefix cache holds the prompt).
            self._drop(offer.save_id or request.request_id, offer.sent_keys)
            return
        # vLLM may grant fewer tokens than offered (its prefix-replay path
        # trims the hit to a block boundary): write exactly those it counts
        # as loaded, from where its own prefix cache ends.
        start, end = offer.local, offer.local + num_external_tokens
        block_ids = list(blocks.get_block_ids()[0])
        first, last = start // self.block_size, (end + self.block_size - 1) // self.block_size
        if offer.error is not None or end > offer.num_tokens:
            why = offer.error or (f"vLLM counts tokens [{start}, {end}) as loaded but the prefill saved "
                                  f"{offer.num_tokens}")
            self._refuse(request.request_id, offer.cause or "prompt", why)
            spec = LoadSpec(request.request_id, (), (), tuple(block_ids[first:last]), why,
                            offer.cause or "prompt", offer.sent_keys, offer.save_id)
        elif offer.register is not None:
            # The prefill parked the KV: it sends only the chunks after the
            # whole ones this decode holds, and the load reads only those.
            slots = slots_for(block_ids, self.block_size, offer.num_tokens, skip=start, end=end)
            skip = start // self.settings.chunk_size
            spec = LoadSpec(request.request_id, offer.keys[skip:], slots[skip * self.settings.chunk_size:],
                            tuple(block_ids[first:last]), sent_keys=offer.sent_keys[skip:],
                            save_id=offer.save_id, register=Registration(offer.register, start))
        else:
            slots = slots_for(block_ids, self.block_size, offer.num_tokens, skip=start, end=end)
            spec = LoadSpec(request.request_id, offer.keys, slots, tuple(block_ids[first:last]),
                            sent_keys=offer.sent_keys, save_id=offer.save_id)
        self._new_loads.append(spec)
        self._loading[request.request_id] = spec

    def _refuse(self, req_id: str, cause: str, why: str) -> None:
        c = self.counters.handoffs_refused
        c[cause] = c.get(cause, 0) + 1
        log.warning("request %s: not loading its KV from the prefill: %s. Reported as a failed load "
                    "(kv_load_failure_policy decides: recompute or fail)", req_id, why)

    def _drop(self, req_id: str, keys: Tuple[str, ...]) -> None:
        if keys:
            self._drops.append((req_id, keys))
            self.counters.keys_dropped += len(keys)

    # --------------------------------------------------------------- prefill

    def _save_spec(self, req_id: str, state: _SaveState) -> SaveSpec:
        """The save of a request whose prompt is computed, its blocks pinned."""
        if self.block_pool is None:
            raise RuntimeError("vLLM did not bind its block pool to the connector (bind_gpu_block_pool): "
                               "without it the blocks a save reads cannot be kept from reuse")
        request = state.request
        ki, lost = self.key_inputs(request, None)
        if lost:
            state.nonce = uuid.uuid4().hex
            log.info("request %s: its KV is keyed for itself alone (%s)", req_id, "; ".join(lost))
            ki, _ = self.key_inputs(request, state.nonce)
        state.keys = tuple(chunk_keys(self.tag, ki, self.settings.chunk_size))
        state.inputs = input_digests(ki)
        n = len(ki.token_ids)
        block_ids = compat.prompt_block_ids(self.kv_cache_manager, req_id)
        slots = slots_for(block_ids, self.block_size, n)
        used = block_ids[: (n + self.block_size - 1) // self.block_size]
        if used:
            compat.pin_blocks(self.block_pool, used)
            pin = self._pins.get(req_id)
            if pin is None:
                self._pins[req_id] = _Pin(list(used), self.num_workers)
            else:  # the same id again (ids not randomized): both pins held
                pin.block_ids += used
                pin.remaining += self.num_workers
        return SaveSpec(req_id, state.keys, slots, state.to)

    def build_connector_meta(self, scheduler_output: Any) -> AscendPDConnectorMetadata:
        meta = AscendPDConnectorMetadata(loads=self._new_loads, cancels=self._cancels, drops=self._drops,
                                         cancel_saves=self._cancel_saves)
        self._new_loads, self._cancels, self._drops, self._cancel_saves = [], [], [], []
        meta.preempted = [r for r in (scheduler_output.preempted_req_ids or ()) if r in self._pins]
        if self._saves:
            progress: Dict[str, int] = {}
            for new in scheduler_output.scheduled_new_reqs:
                progress[new.req_id] = new.num_computed_tokens
            cached = scheduler_output.scheduled_cached_reqs
            for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
                progress[req_id] = computed
            for req_id, computed in progress.items():
                state = self._saves.get(req_id)
                if state is None or state.shipped:
                    continue
                done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
                if done >= compat.num_prompt_tokens(state.request):
                    # The prompt's KV is complete after this step: save it then.
                    try:
                        meta.saves.append(self._save_spec(req_id, state))
                    except (ValueError, OSError, RuntimeError) as e:
                        # Not saved: the request answers without a hand-off
                        # and its decode computes the prompt itself.
                        log.error("request %s: not saving its KV: %s", req_id, e)
                        del self._saves[req_id]
                        continue
                    state.shipped = True
        meta.no_tokens = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        meta.idle = (
            meta.no_tokens
            and not (meta.loads or meta.cancels or meta.drops or meta.cancel_saves or meta.saves
                     or meta.preempted)
        )
        return meta

    def request_finished(self, request: Any, block_ids: Sequence[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        req_id = request.request_id
        state = self._saves.pop(req_id, None)
        if state is not None and state.shipped:
            # The save's blocks are pinned: vLLM may free the request now.
            if compat.finished_normally(request):
                n = compat.num_prompt_tokens(request)
                return False, prefill_params(n, state.keys, self.identity.as_dict(), self.settings.mode,
                                             req_id, state.nonce, state.inputs,
                                             register=self.registration if state.to is None else None)
            # Ended without a hand-off: nobody will load what it saves.
            self._cancel_saves.append(req_id)
            self.counters.saves_cancelled += 1
            log.info("request %s ended (%s) after its save started: cancelling the save", req_id,
                     getattr(request, "status", "?"))
            return False, None
        spec = self._loading.pop(req_id, None)
        if spec is not None:
            # Ended while its load runs or waits: cancel it, and keep the
            # blocks until the worker says nothing writes them any more.
            self._cancels.append((req_id, spec.keys or spec.sent_keys))
            return True, None
        offer = self._offers.pop(req_id, None)
        if offer is not None:
            # Ended before its load was planned: free what the prefill sent.
            self._drop(offer.save_id or req_id, offer.sent_keys)
        elif self.is_consumer:
            try:
                handoff = parse_handoff(request.kv_transfer_params)
            except HandOffError as e:
                self._drop(e.save_id or req_id, e.keys)
            else:
                if handoff is not None:
                    self._drop(handoff.save_id or req_id, handoff.keys)
        return False, None

    def update_connector_output(self, finished_recving: Optional[Set[str]], released: Mapping[str, int]) -> None:
        for req_id in finished_recving or ():
            self._loading.pop(req_id, None)
        for req_id, n in released.items():
            pin = self._pins.get(req_id)
            if pin is None:
                continue
            pin.remaining -= n
            if pin.remaining <= 0:
                del self._pins[req_id]
                compat.unpin_blocks(self.block_pool, pin.block_ids)

    def has_pending_work(self) -> bool:
        """Whether the engine must keep stepping for this connector: pinned
        blocks wait for a save's release, or orders wait for the workers."""
        return bool(self._pins or self._new_loads or self._cancels or self._drops or self._cancel_saves)

    @property
    def pinned_requests(self) -> Set[str]:
        """Requests whose save still holds vLLM blocks (for tests)."""
        return set(self._pins)
