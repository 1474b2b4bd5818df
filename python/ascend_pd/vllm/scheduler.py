"""The scheduler half: decides what each worker saves or loads, and when
vLLM may free a request's blocks. It never touches the network."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from .keys import chunk_keys
from .metadata import (
    PARAMS_VERSION,
    AscendPDConnectorMetadata,
    LoadSpec,
    ReceiverAddress,
    SaveSpec,
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


def slots_for(block_ids: Sequence[int], block_size: int, num_tokens: int, skip: int = 0) -> Tuple[int, ...]:
    """The slot of each of the first ``num_tokens`` tokens in ``block_ids``
    (-1 for the first ``skip``)."""
    if (num_tokens + block_size - 1) // block_size > len(block_ids):
        raise ValueError(
            f"{num_tokens} tokens need {(num_tokens + block_size - 1) // block_size} blocks of "
            f"{block_size}, but the request has {len(block_ids)}"
        )
    return tuple(
        -1 if t < skip else block_ids[t // block_size] * block_size + t % block_size for t in range(num_tokens)
    )


@dataclass
class _SaveState:
    request: Any
    to: ReceiverAddress
    shipped: bool = False


class ConnectorScheduler:
    """Scheduler-side logic of :class:`~ascend_pd.vllm.AscendPDConnector`."""

    def __init__(self, settings: ConnectorSettings, tag: str, block_size: int) -> None:
        self.settings = settings
        self.tag = tag
        self.block_size = block_size
        self.is_producer = settings.pd_role in ("sender", "both")
        self.is_consumer = settings.pd_role in ("receiver", "both")
        self._saves: Dict[str, _SaveState] = {}
        self._new_loads: List[LoadSpec] = []
        #: Loads handed to the workers and not reported finished: req -> keys.
        self._loading: Dict[str, Tuple[str, ...]] = {}
        self._cancels: List[Tuple[str, Tuple[str, ...]]] = []
        self._drops: List[Tuple[str, Tuple[str, ...]]] = []
        self.kv_cache_manager: Any = None

    # ---------------------------------------------------------------- decode

    def _remote(self, request: Any) -> Optional[int]:
        """How many prompt tokens the prefill saved for ``request`` (None: not ours)."""
        if not self.is_consumer:
            return None
        params = request.kv_transfer_params
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        ours = params.get("ascend_pd")
        if not isinstance(ours, dict):
            return None
        prompt = request.prompt_token_ids or []
        problem = None
        if ours.get("v") != PARAMS_VERSION:
            problem = f"kv_transfer_params version {ours.get('v')!r}, this connector speaks {PARAMS_VERSION}"
        elif ours.get("model_tag") != self.tag:
            problem = (
                "the prefill's model, KV geometry or chunk size differ from this decode's "
                f"(model_tag {ours.get('model_tag')!r} != {self.tag!r})"
            )
        elif ours.get("num_tokens") != len(prompt):
            problem = f"the prefill saved {ours.get('num_tokens')!r} tokens but this prompt has {len(prompt)}"
        if problem is not None:
            log.warning("request %s: not loading its KV from the prefill (%s); computing it here",
                        request.request_id, problem)
            return None
        return len(prompt)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        n = self._remote(request)
        if n is None or n <= num_computed_tokens:
            return 0, False
        return n - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if self.is_producer and isinstance(params, dict) and params.get("do_remote_decode"):
            if request.request_id not in self._saves:
                try:
                    to = receiver_address(params)
                except ValueError as e:
                    log.error("request %s: not saving its KV: %s", request.request_id, e)
                else:
                    self._saves[request.request_id] = _SaveState(request, to)
        n = self._remote(request)
        if n is None:
            if self.is_consumer and isinstance(params, dict) and params.get("do_remote_prefill"):
                # A hand-off we will not load: free what the prefill sent.
                self._drop(request)
            return
        prompt = list(request.prompt_token_ids or [])
        if num_external_tokens <= 0:
            # The decode's own prefix cache holds the whole prompt.
            self._drop(request)
            return
        local = n - num_external_tokens
        block_ids = list(blocks.get_block_ids()[0])
        keys = tuple(chunk_keys(self.tag, prompt, self.settings.chunk_size))
        slots = slots_for(block_ids, self.block_size, n, skip=local)
        first, end = local // self.block_size, (n + self.block_size - 1) // self.block_size
        spec = LoadSpec(request.request_id, keys, slots, tuple(block_ids[first:end]))
        self._new_loads.append(spec)
        self._loading[request.request_id] = keys
        # Loaded once: a preempted and resumed request computes what it lost.
        assert isinstance(params, dict)
        params["do_remote_prefill"] = False

    def _drop(self, request: Any) -> None:
        params = request.kv_transfer_params
        ours = params.get("ascend_pd") if isinstance(params, dict) else None
        if not isinstance(ours, dict) or not isinstance(ours.get("chunk_size"), int):
            return
        prompt = list(request.prompt_token_ids or [])
        # The keys the prefill computed (its chunk size and model tag).
        tag, chunk = ours.get("model_tag"), ours["chunk_size"]
        if isinstance(tag, str) and chunk > 0:
            self._drops.append((request.request_id, tuple(chunk_keys(tag, prompt, chunk))))
        params["do_remote_prefill"] = False

    # --------------------------------------------------------------- prefill

    def _save_spec(self, req_id: str, state: _SaveState) -> SaveSpec:
        prompt = list(state.request.prompt_token_ids or [])
        block_ids = list(self.kv_cache_manager.get_block_ids(req_id)[0])
        keys = tuple(chunk_keys(self.tag, prompt, self.settings.chunk_size))
        return SaveSpec(req_id, keys, slots_for(block_ids, self.block_size, len(prompt)), state.to)

    def build_connector_meta(self, scheduler_output: Any) -> AscendPDConnectorMetadata:
        meta = AscendPDConnectorMetadata(loads=self._new_loads, cancels=self._cancels, drops=self._drops)
        self._new_loads, self._cancels, self._drops = [], [], []
        meta.preempted = [r for r in (scheduler_output.preempted_req_ids or ()) if r in self._saves]
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
                if done >= len(state.request.prompt_token_ids or []):
                    # The prompt's KV is complete after this step: save it then.
                    meta.saves.append(self._save_spec(req_id, state))
                    state.shipped = True
        return meta

    def request_finished(self, request: Any, block_ids: Sequence[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        req_id = request.request_id
        state = self._saves.pop(req_id, None)
        if state is not None and state.shipped:
            # Blocks stay until the worker's save has gathered them.
            n = len(request.prompt_token_ids or [])
            return True, prefill_params(n, self.tag, self.settings.chunk_size, self.settings.mode)
        keys = self._loading.pop(req_id, None)
        if keys is not None:
            # Aborted while its load runs: cancel it, and keep the blocks
            # until the worker says nothing writes them any more.
            self._cancels.append((req_id, keys))
            return True, None
        return False, None

    def update_connector_output(self, finished_recving: Optional[Set[str]]) -> None:
        for req_id in finished_recving or ():
            self._loading.pop(req_id, None)
