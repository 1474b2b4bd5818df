"""``AscendPDConnector``: ascend-pd as a vLLM KV connector (``KVConnectorBase_V1``).

A thin facade: vLLM builds one instance in the scheduler process
(``role=SCHEDULER``) and one in each worker (``role=WORKER``); each
delegates to :class:`~ascend_pd.vllm.scheduler.ConnectorScheduler` or
:class:`~ascend_pd.vllm.worker.ConnectorWorker`.
"""

from __future__ import annotations

import logging
import re
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from . import compat
from . import settings as settings_mod
from .identity import ModelIdentity, model_identity
from .layout import LayoutError, check_geometry, describe
from .metadata import AscendPDConnectorMetadata, AscendPDWorkerMetadata, RegisterHandshake
from .scheduler import ConnectorScheduler
from .settings import DTYPES, ModelShape
from .stats import AscendPDPromMetrics, TransferStats
from .worker import ConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("vllm.ascend_pd")


def _model_shape(vllm_config: Any, tp_rank: int) -> ModelShape:
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    cache_dtype = str(getattr(cc, "cache_dtype", "auto"))
    dtype = str(mc.dtype) if cache_dtype == "auto" else cache_dtype
    if dtype not in DTYPES:
        raise settings_mod._err(
            f"KV cache dtype {dtype} is not one ascend-pd moves: use float16, bfloat16 or float32 "
            "(--kv-cache-dtype auto with one of those --dtype)"
        )
    use_mla = bool(getattr(mc, "use_mla", False))
    served = mc.served_model_name
    return ModelShape(
        layers=int(mc.get_num_layers(pc)),
        num_heads=1 if use_mla else int(mc.get_num_kv_heads(pc)),
        head_size=int(mc.get_head_size()),
        dtype=DTYPES[dtype],
        use_mla=use_mla,
        tp_size=int(pc.tensor_parallel_size),
        tp_rank=int(tp_rank),
        model=str(served[0] if isinstance(served, (list, tuple)) else served),
    )


def _identity(vllm_config: Any, shape: ModelShape, chunk_size: int) -> ModelIdentity:
    """What both sides must share for their chunks to be interchangeable
    (see :mod:`.identity`): not the TP layout, since under heterogeneous TP
    each rank carries its heads under the same keys."""
    mc = vllm_config.model_config
    heads = 1 if shape.use_mla else int(mc.get_total_num_kv_heads())
    geometry = f"{shape.layers} layers x {heads} KV heads x {shape.head_size}{' MLA' if shape.use_mla else ''}"
    return model_identity(vllm_config, geometry, chunk_size)


def _check_supported(vllm_config: Any, kv_cache_config: Any) -> None:
    """Refuses, by name, what the connector does not move yet."""
    for name, size in compat.parallel_sizes(vllm_config).items():
        if size > 1:
            raise settings_mod._err(
                f"{name} is {size}: AscendPDConnector moves the KV of tensor-parallel ranks only; "
                f"run the prefill and the decode with {name} 1"
            )
    if kv_cache_config is not None and compat.kv_cache_group_count(kv_cache_config) > 1:
        raise settings_mod._err(
            f"this model has {compat.kv_cache_group_count(kv_cache_config)} KV cache groups (a hybrid model: "
            "sliding-window, Mamba or mixed attention layers): AscendPDConnector moves one full-attention "
            "group only"
        )


_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def _layer_order(name: str) -> Tuple[int, str]:
    m = _LAYER_INDEX.search(name)
    return (int(m.group(1)) if m else 1 << 30, name)


class AscendPDConnector(KVConnectorBase_V1):
    """Moves a request's prompt KV from a prefill vLLM to a decode vLLM
    through ascend-pd (push, pull-eager or pull-delay, as the YAML says)."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "Optional[KVCacheConfig]" = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self._settings = settings_mod.load(ktc.kv_role, dict(ktc.kv_connector_extra_config or {}))
        self._block_size = int(vllm_config.cache_config.block_size)
        self._scheduler: Optional[ConnectorScheduler] = None
        self._worker: Optional[ConnectorWorker] = None
        #: Keeps finished requests whose blocks a save pins, where vLLM has
        #: no has_pending_push_work (see compat.FinishedHold).
        self._hold: Optional[compat.FinishedHold] = None
        _check_supported(vllm_config, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            shape = _model_shape(vllm_config, 0)
            settings_mod.check_model_keys(self._settings, shape)
            self._scheduler = ConnectorScheduler(
                self._settings,
                _identity(vllm_config, shape, self._settings.chunk_size),
                self._block_size,
                num_workers=shape.tp_size,
            )
            self._hold = compat.finished_hold()
            if not compat.passes_handshake_metadata():
                log.warning("vLLM %s does not pass the workers' handshake metadata to the scheduler: the "
                            "router-native flow (kv_transfer_params without receiver_host) is not available; "
                            "name the decode's receiver ports", compat.vllm_version())
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            shape = _model_shape(vllm_config, get_tensor_model_parallel_rank())
            settings_mod.check_model_keys(self._settings, shape)
            drain = None
            if self._settings.pd_role in ("sender", "both"):
                drain = compat.drain_bound(vllm_config, float(self._settings.yaml.get("pd_drain_timeout", 20.0)))
            self._worker = ConnectorWorker(
                self._settings, shape, identity=_identity(vllm_config, shape, self._settings.chunk_size).tag,
                drain_s=drain)

    # ------------------------------------------------------------ scheduler

    def _sched(self) -> ConnectorScheduler:
        assert self._scheduler is not None, "called on a worker-side connector"
        return self._scheduler

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.kv_cache_manager = compat.kv_cache_manager(self)
            self._scheduler.block_pool = gpu_block_pool

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        compat.observe_step(self._sched().kv_cache_manager, scheduler_output)
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        released = meta.released if isinstance(meta, AscendPDWorkerMetadata) else {}
        self._sched().update_connector_output(connector_output.finished_recving, released)
        if self._hold is not None:
            self._hold.released(connector_output, self._sched().pinned_requests)

    def has_pending_push_work(self) -> bool:
        # Keeps an idle engine stepping while a save holds pinned blocks or
        # orders wait for the workers: the workers submit saves and report
        # their releases only in steps.
        return self._scheduler is not None and self._scheduler.has_pending_work()

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        delay_free, params = self._sched().request_finished(request, block_ids)
        if self._hold is not None:
            delay_free = self._hold.finished(request.request_id, delay_free,
                                             request.request_id in self._sched().pinned_requests)
        return delay_free, params

    def set_xfer_handshake_metadata(self, metadata: Dict[int, Any]) -> None:
        # Where each prefill rank takes decode registrations (router-native flow).
        if self._scheduler is None:
            return
        ports = {int(rank): (m.host, int(m.port)) for rank, m in metadata.items()
                 if isinstance(m, RegisterHandshake)}
        self._scheduler.set_registration_ports(ports)

    def get_handshake_metadata(self) -> Optional[RegisterHandshake]:
        if self._worker is None:
            return None
        at = self._worker.handshake()
        return RegisterHandshake(at[0], at[1]) if at is not None else None

    # --------------------------------------------------------------- worker

    def _work(self) -> ConnectorWorker:
        assert self._worker is not None, "called on a scheduler-side connector"
        return self._worker

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        worker = self._work()
        names = sorted(kv_caches, key=_layer_order)
        sfc = self._vllm_config.compilation_config.static_forward_context
        backends, isas = set(), set()
        for n in names:
            layer = sfc.get(n)
            backend = getattr(layer, "attn_backend", None)
            backends.add(backend.get_name() if backend is not None else "")
            isas.add(getattr(layer, "isa", None))
        if len(backends) != 1:
            raise settings_mod._err(f"layers use different attention backends {sorted(backends)}: not supported")
        backend = backends.pop()
        isa = isas.pop() if len(isas) == 1 else "mixed"
        first = kv_caches[names[0]]
        if backend == "CPU_ATTN" and isa is None:
            # The kernel the CPU backend picks decides its cache's interior.
            isa = compat.cpu_attention_isa(first, worker.shape.head_size)
        layout = describe(
            [kv_caches[n] for n in names],
            backend,
            worker.shape.num_heads,
            worker.shape.head_size,
            worker.shape.use_mla,
            isa=isa,
        )
        try:
            check_geometry(layout, worker.shape.layers, worker.shape.num_heads, worker.shape.head_size,
                           self._block_size, worker.shape.dtype)
        except LayoutError as e:
            raise settings_mod._err(str(e)) from None
        worker.layer_index = {n: i for i, n in enumerate(names)}
        worker.start(layout)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if isinstance(kv_connector_metadata, AscendPDConnectorMetadata):
            self._work().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, AscendPDConnectorMetadata)
        self._work().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish before their request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # With pd_layerwise each layer goes as vLLM writes it; otherwise
        # whole-request saves run from wait_for_save.
        worker = self._work()
        if worker.layerwise:
            meta = self._get_connector_metadata()
            assert isinstance(meta, AscendPDConnectorMetadata)
            worker.save_kv_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, AscendPDConnectorMetadata)
        if meta.saves and self._work().sender is not None:
            self._work().wait_for_save(meta)

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        work = self._work()
        meta = getattr(self, "_connector_metadata", None)
        if isinstance(meta, AscendPDConnectorMetadata):
            sending, recving = work.step_finished(finished_req_ids, meta)
        else:
            sending, recving = work.get_finished(finished_req_ids)
        if isinstance(meta, AscendPDConnectorMetadata) and not (sending or recving):
            pause = self._work().idle_pace_s(meta)
            if pause:
                time.sleep(pause)
        return sending, recving

    def get_transfer_results(self, finished_req_ids: Set[str]) -> Any:
        # KVConnectorTransferResults, on vLLM that has it (and calls this).
        sending, recving = self.get_finished(finished_req_ids)
        return compat.transfer_results(sending, recving, self._work().take_failed_recving())

    def get_block_ids_with_load_errors(self) -> Set[int]:
        if not compat.reports_failed_recving():
            # This vLLM learns of failed loads from their blocks alone.
            self._work().take_failed_recving()
        return self._work().take_load_errors()

    def build_connector_worker_meta(self) -> Optional[AscendPDWorkerMetadata]:
        released = self._work().take_released()
        return AscendPDWorkerMetadata(released) if released else None

    #: The scheduler half's counters as last reported (see get_kv_connector_stats).
    _scheduler_stats: Optional[TransferStats] = None

    def get_kv_connector_stats(self) -> Optional[TransferStats]:
        # Called every engine step, in each worker and in the scheduler;
        # vLLM sums the workers' and joins the scheduler's.
        worker = self._worker
        if worker is not None:
            try:
                reg = worker.sender.registration_stats() if worker.sender is not None else None
                worker.stats.sample(worker.rank, worker.pool_stats(), reg)
            except Exception as e:  # metrics never fail a step (a worker shutting down)
                log.debug("ascend-pd: pool counters not sampled: %s", e)
            return worker.stats.take()
        if self._scheduler is None:
            return None
        if self._scheduler_stats is None:
            self._scheduler_stats = TransferStats()
        c = self._scheduler.counters
        self._scheduler_stats.count_scheduler({"saves_cancelled": c.saves_cancelled,
                                               "keys_dropped": c.keys_dropped})
        return self._scheduler_stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> Optional[TransferStats]:
        return TransferStats(data) if data is not None else TransferStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: Dict[Any, Any],
        labelnames: List[str],
        per_engine_labelvalues: Dict[int, List[object]],
    ) -> AscendPDPromMetrics:
        """The ``vllm:ascend_pd_*`` series on vLLM's ``/metrics`` (see :mod:`.stats`)."""
        return AscendPDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
