"""The worker half: one per TP rank. Owns this rank's sender and/or
receiver and the engine's wrapped KV cache, submits saves and loads, and
reports what finished. Nothing here waits on the network: the library runs
saves and loads on its own threads and this side polls."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

from .._config import Config
from .._errors import Busy
from .._kv import KVCache
from .._workers import Completion, Receiver, Sender
from .layout import CacheLayout
from .metadata import AscendPDConnectorMetadata, LoadSpec, SaveSpec
from .settings import ConnectorSettings, ModelShape
from .stats import TransferStats

log = logging.getLogger("vllm.ascend_pd")

#: If set, each rank appends one JSON line per finished save or load (and
#: its pools' counters) to this file: what a test or an operator reads to
#: see what moved. ``{rank}`` in it is replaced by the TP rank.
ENV_EVENTS = "ASCEND_PD_VLLM_EVENTS"

#: How long an idle step waits (see ConnectorWorker.idle_pace_s).
IDLE_PACE_S = 0.005


@contextlib.contextmanager
def _unpinned() -> Iterator[None]:
    """Runs the body with this thread allowed on every CPU of the process.

    vLLM's CPU worker pins its thread to the cores its OpenMP threads own
    and keeps them busy; threads the library starts inherit the pin, and
    on a small host they then wait behind the engine's own spinning for
    seconds at a time. Started unpinned, they run wherever a core is free.
    """
    getter = getattr(os, "sched_getaffinity", None)
    setter = getattr(os, "sched_setaffinity", None)
    if getter is None or setter is None:
        yield
        return
    before = getter(0)
    try:
        everything = set(range(os.cpu_count() or 1))
        try:
            setter(0, everything)
        except OSError:
            pass
        yield
    finally:
        try:
            setter(0, before)
        except OSError:
            pass


def _route_library_logs() -> None:
    """The library's records go to vLLM's logging as ``vllm.ascend_pd.lib``
    (warnings and errors; ``ASCEND_PD_LOG=info|debug|trace`` for more)."""
    from .._log import PY_LEVELS, set_log_callback

    lib_log = logging.getLogger("vllm.ascend_pd.lib")
    names = {"error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO,
             "debug": logging.DEBUG, "trace": logging.NOTSET}
    level = names.get(os.environ.get("ASCEND_PD_LOG", "warning").lower(), logging.WARNING)
    if level < logging.WARNING:
        lib_log.setLevel(max(level, logging.DEBUG))

    def emit(lvl: int, target: str, message: str) -> None:
        lib_log.log(PY_LEVELS.get(lvl, logging.DEBUG), "%s: %s", target, message)

    try:
        set_log_callback(emit, level=level)
    except Exception as e:  # the process already has a Rust logger
        log.debug("ascend-pd library logs not routed: %s", e)


def _ended_at(c: Completion) -> float:
    """When ``c`` ended, on :func:`time.monotonic`'s clock (now if the
    library did not say)."""
    return c.ended_s if c.ended_s > 0 else time.monotonic()


def _wall(monotonic_s: float) -> float:
    """``monotonic_s`` as :func:`time.time` (for the events file)."""
    return round(time.time() - (time.monotonic() - monotonic_s), 6)


@dataclass
class _Load:
    spec: LoadSpec
    deadline: float
    submitted_at: Optional[float] = None
    received_at: float = 0.0


@dataclass
class _Save:
    spec: SaveSpec
    submitted_at: Optional[float] = None
    #: The library said the save no longer reads vLLM's blocks.
    released: bool = False
    #: Saved layer by layer during the forward pass (``pd_layerwise``).
    layerwise: bool = False
    #: The layers handed to a layer-wise save so far.
    handed: Set[int] = field(default_factory=set)


@dataclass
class WorkerState:
    """What the worker tracks between steps (exposed for tests)."""

    waiting_loads: Dict[str, _Load] = field(default_factory=dict)
    running_loads: Dict[str, _Load] = field(default_factory=dict)
    queued_saves: List[_Save] = field(default_factory=list)
    running_saves: Dict[str, _Save] = field(default_factory=dict)
    #: Saves that stopped reading vLLM's blocks since the scheduler was
    #: last told (it unpins their blocks once every rank said so).
    released: Set[str] = field(default_factory=set)
    #: Loads cancelled because vLLM aborted their request.
    aborted: Set[str] = field(default_factory=set)
    #: Layer-wise saves opened this step (``pd_layerwise``), closed by
    #: wait_for_save.
    layered: Dict[str, _Save] = field(default_factory=dict)
    #: The step metadata the layered saves were opened for.
    layered_step: Optional[int] = None


class ConnectorWorker:
    """Worker-side logic of :class:`~ascend_pd.vllm.AscendPDConnector`."""

    def __init__(self, settings: ConnectorSettings, shape: ModelShape, identity: Optional[str] = None,
                 drain_s: Optional[float] = None) -> None:
        self.settings = settings
        self.shape = shape
        #: The model identity's tag: the library's handshake refuses a peer
        #: whose KV is of another model (``pd_model_identity``).
        self.identity = identity
        #: How long the sender drains on close (``pd_drain_timeout`` within
        #: vLLM's worker shutdown grace: see compat.drain_bound).
        self.drain_s = drain_s
        self.rank = shape.tp_rank
        self.cache: Optional[KVCache] = None
        self.sender: Optional[Sender] = None
        self.receiver: Optional[Receiver] = None
        self.state = WorkerState()
        self.stats = TransferStats()
        self._load_errors: Set[int] = set()
        self._failed_recving: Set[str] = set()
        self._token_bytes = 0
        #: Loads that ended without running (refused, or aborted while
        #: waiting for their keys), reported at the next get_finished.
        self._recv_ended: Set[str] = set()
        self._layout: Optional[CacheLayout] = None
        self._last_pools: Dict[str, Any] = {}
        self._last_registrations: Dict[str, int] = {}
        #: vLLM's layer names -> the library's layer index (the order the
        #: connector wrapped the caches in); set by the connector.
        self.layer_index: Dict[str, int] = {}

    # ---------------------------------------------------------------- set-up

    def start(self, layout: CacheLayout) -> None:
        """Wraps the engine's cache and starts this rank's sender/receiver."""
        _route_library_logs()
        stream: Any = None
        if layout.device >= 0:
            # On an NPU our copies queue on the engine's stream, behind the
            # kernels that write the KV (torch_npu provides torch.npu).
            import torch

            npu = getattr(torch, "npu", None)
            stream = npu.current_stream() if npu is not None else None
        self.cache = KVCache(
            [p for p in layout.planes],
            fmt=layout.fmt,
            dtype=layout.dtype,
            layers=layout.layers,
            num_blocks=layout.num_blocks,
            block_size=layout.block_size,
            hidden=layout.hidden,
            device=layout.device,
            strides=list(layout.strides),
            num_heads=layout.num_heads,
            head_size=layout.head_size,
            stream=stream,
        )
        # The cache holds addresses into the engine's tensors: keep them alive.
        self._layout = layout
        planes = 1 if layout.fmt == "mla" else 2
        es = {"float16": 2, "bfloat16": 2, "float32": 4, "int8": 1, "uint8": 1}[layout.dtype]
        self._token_bytes = planes * layout.layers * layout.hidden * es
        with _unpinned():
            if self.settings.pd_role in ("sender", "both"):
                with Config.from_yaml(self.settings.role_yaml("sender", self.shape, self.identity)) as cfg:
                    self.sender = Sender(cfg, rank=self.rank)
            if self.settings.pd_role in ("receiver", "both"):
                with Config.from_yaml(self.settings.role_yaml("receiver", self.shape, self.identity)) as cfg:
                    self.receiver = Receiver(cfg, rank=self.rank)
        log.info(
            "ascend-pd connector rank %d: %s, %s mode, cache %d layers x %d blocks x %d tokens, "
            "%d heads x %d (%s), plane strides (block, token, head, element) %s bytes",
            self.rank, self.settings.pd_role, self.settings.mode, layout.layers, layout.num_blocks,
            layout.block_size, layout.num_heads, layout.head_size, layout.dtype,
            list(layout.strides),
        )

    def close(self) -> None:
        """Stops the sender and receiver. The sender drains first (vLLM
        shuts the connector down on SIGTERM): new saves are refused, the
        transfers in flight get ``pd_drain_timeout`` to end, and what is left
        then is cancelled at its decode, which fails those loads at once."""
        if self.sender is not None:
            sender, self.sender = self.sender, None
            report = sender.close(self.drain_s)
            log.info("ascend-pd connector rank %d: sender drained %s", self.rank, report)
            self._event(event="drain", **report)
        if self.receiver is not None:
            self.receiver.close()
        if self.cache is not None:
            self.cache.close()

    # ------------------------------------------------------------------ step

    def start_load_kv(self, meta: AscendPDConnectorMetadata) -> None:
        """Takes the step's orders (loads, cancels, drops, cancelled saves);
        submits what can start."""
        now = time.monotonic()
        for req_id in meta.cancel_saves:
            self._cancel_save(req_id)
        if self.receiver is None:
            return
        for spec in meta.loads:
            load = _Load(spec, now + self.settings.load_timeout_s, received_at=now)
            if spec.error is not None:
                # The scheduler refused the hand-off: fail it now, free what
                # the prefill sent.
                self._event(event="load", req_id=spec.req_id, status="refused", tokens=0, message=spec.error)
                # The scheduler half logged why (once, not once per rank).
                self._fail(load, spec.error, spec.cause or "refused", warn=False)
                self._drop_keys(spec)
                self._recv_ended.add(spec.req_id)
                continue
            if spec.register is not None and not self._register(load):
                continue
            self.state.waiting_loads[spec.req_id] = load
            # The load is known here and waits for its KV (what a test
            # waits for before aborting a request whose KV never came).
            self._event(event="load_queued", req_id=spec.req_id, keys=len(spec.keys))
        for req_id, keys in meta.cancels:
            self._cancel_load(req_id, keys)
        for req_id, keys in meta.drops:
            self._drop_keys(LoadSpec(req_id, keys, (), ()))
        self._submit_loads(now)

    @property
    def layerwise(self) -> bool:
        """Saves go layer by layer during the forward pass (``pd_layerwise``)."""
        return self.sender is not None and self.settings.layerwise

    def save_kv_layer(self, layer_name: str, meta: AscendPDConnectorMetadata) -> None:
        """vLLM wrote layer ``layer_name`` of this step's forward pass: hand
        it to every layer-wise save of the step (opened at the step's first
        layer). Only with ``pd_layerwise``; otherwise saves wait for
        :meth:`wait_for_save`.

        Each layer of every chunk is valid once this step's layer ran: the
        step's saves are those of requests whose last prompt tokens it
        computes, and earlier chunked-prefill steps wrote every layer of
        theirs."""
        if not self.layerwise or not meta.saves:
            return
        assert self.sender is not None
        if self.state.layered_step != id(meta):
            self._open_layered(meta)
        layer = self.layer_index.get(layer_name)
        if layer is None:
            log.warning("ascend-pd: layer %r is not one of the wrapped KV caches; not saved", layer_name)
            return
        stream = self._layer_stream()
        for req_id, save in list(self.state.layered.items()):
            try:
                self.sender.save_layer(req_id, layer, stream)
                save.handed.add(layer)
            except Exception as e:  # handed again at wait_for_save
                log.warning("ascend-pd: layer %d of %s not handed over: %s", layer, req_id, e)

    def _layer_stream(self) -> Optional[int]:
        """The engine's current ``aclrtStream`` for an NPU cache, whose
        layer kernels may still be queued (the library's copies wait for
        them); None for a host cache, whose layer is written when vLLM
        calls save_kv_layer. Untested here: no NPU on the test hosts."""
        if self._layout is None or self._layout.device < 0:
            return None
        import torch

        from .._kv import _stream_address

        npu = getattr(torch, "npu", None)
        return _stream_address(npu.current_stream()) if npu is not None else None

    def _open_layered(self, meta: AscendPDConnectorMetadata) -> None:
        """Opens the layer-wise save of each of the step's saves; one the
        library refuses or cannot queue now is saved whole by wait_for_save."""
        assert self.sender is not None and self.cache is not None
        self.state.layered_step = id(meta)
        for spec in meta.saves:
            if spec.req_id in self.state.layered or spec.to is None:
                # A parked save (no decode known yet) is saved whole.
                continue
            try:
                self.sender.open_layered_save(
                    spec.req_id, list(spec.keys), self.cache, list(spec.slots), spec.to.host,
                    list(spec.to.init_ports), list(spec.to.alloc_ports), is_last_prefill=False,
                )
            except Exception as e:
                log.warning("ascend-pd: layer-wise save of %s not opened (%s); saved whole after the step",
                            spec.req_id, e)
                continue
            self.state.layered[spec.req_id] = _Save(spec, submitted_at=time.monotonic(), layerwise=True)

    def wait_for_save(self, meta: AscendPDConnectorMetadata) -> None:
        """Closes the step's layer-wise saves; queues the others (their KV
        was written by this step's forward)."""
        opened = self.state.layered
        self.state.layered = {}
        self.state.layered_step = None
        layers = self._layout.layers if self._layout is not None else 0
        for req_id, save in opened.items():
            assert self.sender is not None
            # The forward pass is over, so every layer is written: one vLLM
            # did not report (a layer without save_kv_layer, a hand-over that
            # failed) goes now rather than failing the save.
            late = [layer for layer in range(layers) if layer not in save.handed]
            if late:
                log.warning("ascend-pd: layers %s of %s were not handed over during the forward "
                            "pass; handing them over after it", late, req_id)
                stream = self._layer_stream()
                for layer in late:
                    try:
                        self.sender.save_layer(req_id, layer, stream)
                        save.handed.add(layer)
                    except Exception as e:
                        log.error("ascend-pd: layer %d of %s: %s", layer, req_id, e)
            try:
                missing = self.sender.close_layered_save(req_id)
            except Exception as e:
                log.error("ascend-pd: closing the layer-wise save of %s: %s", req_id, e)
                missing = None
            if missing is not None:
                log.warning("ascend-pd: layer %d of %s never came; its save fails", missing, req_id)
            self.state.running_saves[req_id] = save
        for spec in meta.saves:
            if spec.req_id not in opened:
                self.state.queued_saves.append(_Save(spec))
        self._submit_saves()

    def handle_preemptions(self, meta: AscendPDConnectorMetadata) -> None:
        """vLLM preempted these requests and may give their blocks to others.

        Nothing to wait for: the scheduler half pinned the blocks each save
        reads, and they stay pinned until this rank (and every other)
        reported the save's release, so a preempted request's save goes on
        reading valid KV. Never blocks, never raises."""
        if meta.preempted:
            log.debug("ascend-pd: preempted %s; their saves read pinned blocks", sorted(meta.preempted))

    def idle_pace_s(self, meta: AscendPDConnectorMetadata) -> float:
        """How long to pause at the end of a step that ran nothing.

        vLLM keeps an idle prefill stepping while a save still pins its
        blocks (``has_pending_push_work``), which without a pause is a busy
        loop of hundreds of empty steps a second: a core burnt for as long
        as a parked or pulled save waits for its decode, and on vLLM's CPU
        build, where every worker's main thread is bound to the same core,
        a decode engine on that host starved for tens of seconds. A step
        that runs no tokens, carries no order and finds no load of this rank
        waiting or running therefore pauses ``IDLE_PACE_S``: a new request
        waits at most that long, a release is seen at the next step."""
        if not meta.idle or self.sender is None:
            return 0.0
        if self.state.waiting_loads or self.state.running_loads:
            return 0.0
        return IDLE_PACE_S

    def wait_for_loads(self, meta: AscendPDConnectorMetadata, budget_s: float) -> bool:
        """On a step that runs no tokens, waits up to ``budget_s`` for the
        next event of this rank's loads: a running load ended, or a waiting
        load's KV became loadable. True if one came (call
        :meth:`get_finished` again: it reports or submits it at once).

        Without it a load costs a step per event (the KV is there: submit;
        the copy ended: report; then vLLM schedules the request), and an
        engine with nothing else to do spins through empty steps between
        them. With it the step that registered or submitted a load waits
        for the KV and its copy and reports the request ready in that
        step. A step that runs tokens never waits: it has work of its own.
        New requests reaching the engine meanwhile wait at most
        ``load_wait_ms`` (``kv_connector_extra_config``, 20 ms)."""
        if self.receiver is None or not meta.no_tokens or budget_s <= 0 or self._recv_ended:
            return False
        if self.state.running_loads:
            return self.receiver.wait_ended(budget_s)
        for load in self.state.waiting_loads.values():
            if load.spec.keys:
                return self.receiver.wait_available(list(load.spec.keys), budget_s)
        return False

    def step_finished(self, finished_req_ids: Set[str],
                      meta: AscendPDConnectorMetadata) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """:meth:`get_finished` at the end of step ``meta``; a step with
        nothing to compute first waits up to ``load_wait_ms`` for its loads
        (:meth:`wait_for_loads`), woken by the library the moment the KV
        lands or a copy ends, so the load that step registered or submitted
        can be reported in it."""
        sending, recving = self.get_finished(finished_req_ids)
        deadline = time.monotonic() + self.settings.load_wait_s
        while not (sending or recving) and self.wait_for_loads(meta, deadline - time.monotonic()):
            sending, recving = self.get_finished(set())
        return sending, recving

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """The requests whose load ended since the last call (saves are
        never reported here: their blocks are pinned by the scheduler half,
        which frees them on :meth:`take_released`)."""
        recving: Set[str] = set()
        if self.sender is not None:
            self._submit_saves()
            self._poll_saves()
        if self.receiver is not None:
            now = time.monotonic()
            recving |= self._registered()
            self._submit_loads(now)
            recving |= self._recv_ended
            self._recv_ended = set()
            for c in self.receiver.poll():
                load = self.state.running_loads.pop(c.req_id, None)
                if load is None:
                    continue
                recving.add(c.req_id)
                loaded = sum(1 for s in load.spec.slots if s >= 0)
                # Timed from when the library ended it, not from this poll.
                ended = _ended_at(c)
                took = max(0.0, ended - (load.submitted_at or ended))
                self._event(
                    event="load", req_id=c.req_id, status=c.status, tokens=loaded, message=c.message,
                    # Seconds waiting for the KV to arrive, then loading it.
                    wait_s=round((load.submitted_at or now) - load.received_at, 6),
                    load_s=round(took, 6), ended_t=_wall(ended),
                )
                if c.req_id in self.state.aborted:
                    self.state.aborted.discard(c.req_id)
                    continue
                if c.status == "done":
                    self.stats.record("load", loaded * self._token_bytes, took, tokens=loaded)
                else:
                    self._fail(load, f"{c.status}: {c.message}", "transfer")
            for req_id in list(self.state.waiting_loads):
                load = self.state.waiting_loads[req_id]
                if now >= load.deadline:
                    del self.state.waiting_loads[req_id]
                    recving.add(req_id)
                    why = (f"its KV did not arrive within load_timeout_s={self.settings.load_timeout_s} "
                           "(is the prefill alive, and does it reach this decode's receiver ports?)")
                    self._event(event="load", req_id=req_id, status="timeout", tokens=0, message=why)
                    self._fail(load, why, "timeout")
                    self._drop_keys(load.spec)
        if os.environ.get(ENV_EVENTS) and self.pool_stats() != self._last_pools:
            self._event(event="pools")
        if os.environ.get(ENV_EVENTS) and self.sender is not None:
            # Parked transfers and registrations (expired, refused, forged
            # or replayed registrations dropped), whenever they changed.
            reg = self.sender.registration_stats()
            if reg != self._last_registrations:
                self._last_registrations = reg
                self._event(event="registrations", **reg)
        return None, (recving or None)

    def handshake(self) -> Optional[Tuple[str, int]]:
        """Where this rank takes decode registrations (a prefill), else None."""
        if self.sender is None:
            return None
        host = self.settings.yaml.get("pd_peer_host") or "127.0.0.1"
        return str(host), self.sender.register_port

    def take_released(self) -> Dict[str, int]:
        """The saves of this rank that stopped reading vLLM's blocks since
        the last call, as ``{req_id: 1}`` (the scheduler sums the ranks)."""
        if self.sender is not None:
            self._poll_saves()
        out = {r: 1 for r in self.state.released}
        self.state.released = set()
        return out

    def take_failed_recving(self) -> Set[str]:
        """Requests whose load failed since the last call."""
        out, self._failed_recving = self._failed_recving, set()
        return out

    def take_load_errors(self) -> Set[int]:
        """Blocks a failed load was to write, since the last call."""
        out, self._load_errors = self._load_errors, set()
        return out

    def pool_stats(self) -> Dict[str, Any]:
        """This rank's pool counters (sender and/or receiver)."""
        out: Dict[str, Any] = {}
        if self.sender is not None:
            out["sender"] = self.sender.pool_stats()._asdict()
        if self.receiver is not None:
            out["receiver"] = self.receiver.pool_stats()._asdict()
        return out

    # -------------------------------------------------------------- internal

    def _event(self, **fields: Any) -> None:
        path = os.environ.get(ENV_EVENTS)
        if not path:
            return
        fields["rank"] = self.rank
        fields["t"] = time.time()
        fields["pools"] = self.pool_stats()
        # A "pools" event is written whenever the counters differ from the
        # last ones any event carried, so the latest event always has them.
        self._last_pools = fields["pools"]
        with open(path.replace("{rank}", str(self.rank)), "a", encoding="utf-8") as f:
            f.write(json.dumps(fields) + "\n")

    def _save_ended(self, c: Completion) -> None:
        save = self.state.running_saves.pop(c.req_id, None)
        n = len(save.spec.slots) if save is not None else 0
        # Timed from when the library ended it: an idle prefill polls it
        # only at its next step, which may be the next request's.
        ended = _ended_at(c)
        took = max(0.0, ended - save.submitted_at) if save is not None and save.submitted_at else 0.0
        parked = save is not None and save.spec.to is None
        extra: Dict[str, Any] = {}
        if parked and self.sender is not None:
            # The registration counters after this parked save ended.
            extra["registrations"] = self.sender.registration_stats()
        self._event(event="save", req_id=c.req_id, status=c.status, tokens=n, message=c.message,
                    save_s=round(took, 6), ended_t=_wall(ended), layerwise=save is not None and save.layerwise,
                    parked=parked,
                    **extra)
        if c.status == "done":
            self.stats.record("save", n * self._token_bytes, took)
        else:
            self.stats.record_failure("save", c.status)
            log.warning("ascend-pd save of %s %s: %s", c.req_id, c.status, c.message)
        if save is not None and not save.released:
            # An ended save reads nothing (its release may have been dropped
            # from the library's bounded list).
            self._released(save)

    def _released(self, save: _Save) -> None:
        save.released = True
        self.state.released.add(save.spec.req_id)
        self._event(event="released", req_id=save.spec.req_id,
                    after_s=round(time.monotonic() - (save.submitted_at or time.monotonic()), 6))

    def _poll_saves(self) -> None:
        """Takes the saves that ended and those that stopped reading vLLM's
        blocks. Ends first: the library reports a save's release before its
        end, so every save that ended has its release taken below before
        the end is handled (the other order could miss a release that came
        between the two calls)."""
        assert self.sender is not None
        ended = self.sender.poll()
        for req_id in self.sender.poll_released():
            save = self.state.running_saves.get(req_id)
            if save is not None and not save.released:
                self._released(save)
        for c in ended:
            self._save_ended(c)

    def _submit_saves(self) -> None:
        assert self.sender is not None and self.cache is not None
        while self.state.queued_saves:
            save = self.state.queued_saves[0]
            s = save.spec
            try:
                if s.to is None:
                    self.sender.submit_parked_save(s.req_id, list(s.keys), self.cache, list(s.slots))
                else:
                    self.sender.submit_save(
                        s.req_id, list(s.keys), self.cache, list(s.slots), s.to.host,
                        list(s.to.init_ports), list(s.to.alloc_ports), is_last_prefill=False,
                    )
            except Busy:
                return  # the queue is full: retried next step
            except Exception as e:  # refused: the request's blocks may go
                log.error("ascend-pd save of %s refused: %s", s.req_id, e)
                self.stats.record_failure("save", "refused")
                self.state.queued_saves.pop(0)
                self._event(event="save", req_id=s.req_id, status="refused", tokens=0, message=str(e),
                            save_s=0.0, layerwise=False)
                self._released(save)
                continue
            save.submitted_at = time.monotonic()
            self.state.queued_saves.pop(0)
            self.state.running_saves[s.req_id] = save

    def _cancel_save(self, req_id: str) -> None:
        """Cancels the save of a request that ended without a hand-off."""
        for save in self.state.queued_saves:
            if save.spec.req_id == req_id:
                self.state.queued_saves.remove(save)
                self._event(event="save", req_id=req_id, status="cancelled", tokens=0,
                            message="the request ended before its save started", save_s=0.0, layerwise=False)
                self._released(save)
                return
        if req_id in self.state.running_saves and self.sender is not None:
            try:
                state = self.sender.cancel(req_id)
            except Exception as e:  # it ends on its own; its release unpins
                log.warning("ascend-pd: cancelling the save of %s: %s", req_id, e)
                return
            log.info("ascend-pd: cancelled the save of %s (%s)", req_id, state)

    def _submit_loads(self, now: float) -> None:
        assert self.receiver is not None and self.cache is not None
        for req_id in list(self.state.waiting_loads):
            load = self.state.waiting_loads[req_id]
            s = load.spec
            try:
                if not self.receiver.available(list(s.keys)):
                    continue
            except Exception as e:  # its deadline reports it
                log.warning("ascend-pd: whether the KV of %s is here: %s", req_id, e)
                continue
            try:
                self.receiver.submit_load(req_id, list(s.keys), self.cache, list(s.slots))
            except Busy:
                return
            except Exception as e:
                del self.state.waiting_loads[req_id]
                self._fail(load, f"refused: {e}", "refused")
                self._drop_keys(s)
                self._recv_ended.add(req_id)
                continue
            load.submitted_at = now
            del self.state.waiting_loads[req_id]
            self.state.running_loads[req_id] = load
            self.stats.record_wait(now - load.received_at)
            self._event(event="load_start", req_id=req_id, wait_s=round(now - load.received_at, 6))

    def _register(self, load: _Load) -> bool:
        """Registers this decode with the prefill that parked ``load``'s KV
        (every rank registers; the prefill takes the first). False: it
        could not be sent, and the load failed."""
        spec = load.spec
        assert self.receiver is not None and spec.register is not None
        try:
            self.receiver.register(spec.req_id, spec.register.at.host, list(spec.register.at.ports),
                                   spec.save_id or spec.req_id, spec.register.held_tokens)
        except Exception as e:
            why = f"registering with the prefill at {spec.register.at.host}: {e}"
            self._event(event="load", req_id=spec.req_id, status="failed", tokens=0, message=why)
            self._fail(load, why, "registration")
            self._recv_ended.add(spec.req_id)
            return False
        self._event(event="register", req_id=spec.req_id, host=spec.register.at.host,
                    ports=list(spec.register.at.ports), held_tokens=spec.register.held_tokens)
        return True

    def _registered(self) -> Set[str]:
        """Loads whose registration the prefill refused (or never answered)
        fail now, not at load_timeout_s."""
        assert self.receiver is not None
        ended: Set[str] = set()
        for c in self.receiver.poll_registrations():
            if c.status == "done":
                continue
            load = self.state.waiting_loads.pop(c.req_id, None)
            if load is None:
                continue
            why = f"registering with the prefill failed: {c.message}"
            self._event(event="load", req_id=c.req_id, status="failed", tokens=0, message=why)
            self._fail(load, why, "registration")
            ended.add(c.req_id)
        return ended

    def _fail(self, load: _Load, why: str, cause: str, warn: bool = True) -> None:
        log.log(logging.WARNING if warn else logging.DEBUG,
                "ascend-pd load of %s failed (%s); reported as a load error of its %d block(s): "
                "vLLM recomputes or fails it as kv_load_failure_policy says",
                load.spec.req_id, why, len(load.spec.block_ids))
        # A refused hand-off is one decision for every rank: counted once.
        if warn or self.rank == 0:
            self.stats.record_failure("load", cause)
        self._failed_recving.add(load.spec.req_id)
        self._load_errors.update(load.spec.block_ids)

    def _drop_keys(self, spec: LoadSpec) -> None:
        """Frees whatever of ``spec``'s keys arrived (or arrive later)."""
        assert self.receiver is not None
        keys = list(spec.sent_keys or spec.keys)
        if not keys:
            return
        try:
            # Under the prefill's id: its hold on the keys goes, and chunks
            # of that save arriving later are refused by the receiver.
            found = self.receiver.cancel(spec.save_id or spec.req_id, keys)
            self._event(event="drop", req_id=spec.save_id or spec.req_id, keys=len(keys), found=found)
        except Exception as e:
            log.warning("ascend-pd cancel of %s: %s", spec.req_id, e)

    def _cancel_load(self, req_id: str, keys: Tuple[str, ...]) -> None:
        if req_id in self.state.waiting_loads:
            load = self.state.waiting_loads.pop(req_id)
            self._event(event="load", req_id=req_id, status="cancelled", tokens=0,
                        message="the request ended before its KV arrived")
            self._drop_keys(load.spec)
            self._recv_ended.add(req_id)
            return
        if req_id in self.state.running_loads:
            self.state.aborted.add(req_id)
            assert self.receiver is not None
            try:
                self.receiver.cancel(req_id, list(keys))
            except Exception as e:  # it ends on its own and is reported then
                log.warning("ascend-pd: cancelling the load of %s: %s", req_id, e)
