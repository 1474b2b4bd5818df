"""The prefill side (:class:`Sender`) and the decode side (:class:`Receiver`)."""

from __future__ import annotations

import ctypes
import operator
import threading
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

from . import _lib
from ._config import Config
from ._errors import InvalidArgument, check
from ._kv import KVCache

#: Completion statuses, by ``APD_REQ_*`` code.
_STATUS = {_lib.REQ_DONE: "done", _lib.REQ_FAILED: "failed", _lib.REQ_CANCELLED: "cancelled"}
#: Cancel results, by ``APD_CANCEL_*`` code.
_CANCEL = {
    _lib.CANCEL_NOT_STARTED: "not_started",
    _lib.CANCEL_CANCELLING: "cancelling",
    _lib.CANCEL_ALREADY_ENDED: "already_ended",
    _lib.CANCEL_UNKNOWN: "unknown",
}
# Completions fetched per apd_*_poll call (more are fetched while it fills up).
_POLL_BATCH = 32


class Completion(NamedTuple):
    """One finished request.

    Attributes:
        req_id: the request id.
        status: ``"done"``, ``"failed"`` or ``"cancelled"``.
        message: why it failed (empty otherwise).
        ended_s: when it ended, not when it was polled, on the clock of
            :func:`time.monotonic` (``CLOCK_MONOTONIC``; 0.0 if unknown).
    """

    req_id: str
    status: str
    message: str
    ended_s: float = 0.0


class PoolStats(NamedTuple):
    """Page counters of a worker's pools (CPU and NPU summed).

    Attributes:
        total: pages in the pools.
        free: pages free.
        allocated: pages handed out (pinned and quarantined included).
        pinned: pages pinned for a pull.
        quarantined: pages waiting until no peer can touch them.
    """

    total: int
    free: int
    allocated: int
    pinned: int
    quarantined: int


def _bad(message: str) -> InvalidArgument:
    return InvalidArgument(_lib.ERR_INVALID_ARGUMENT, message)


def _encode(name: str, s: Any) -> bytes:
    if isinstance(s, bytes):
        return s
    if isinstance(s, str):
        return s.encode("utf-8")
    raise TypeError(f"{name} must be str, not {type(s).__name__}")


def _keys(keys: Iterable[Any]) -> Tuple[Any, int]:
    """A ``const char *const *`` array of ``keys`` and its length."""
    if isinstance(keys, (str, bytes)):
        raise TypeError("keys must be a list of str (one per chunk), not a single string")
    encoded = [_encode(f"keys[{i}]", k) for i, k in enumerate(keys)]
    return (ctypes.c_char_p * len(encoded))(*encoded), len(encoded)


def _slots(slot_mapping: Any) -> Tuple[Any, int, Any]:
    """An ``int64_t`` pointer to ``slot_mapping``, its length, and what keeps it alive."""
    if hasattr(slot_mapping, "__array_interface__"):
        import numpy  # only reached with an array, so numpy is there

        arr = numpy.ascontiguousarray(slot_mapping, dtype=numpy.int64).reshape(-1)
        ptr = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)) if arr.size else None
        return ptr, int(arr.size), arr
    tolist: Optional[Callable[[], Any]] = getattr(slot_mapping, "tolist", None)
    values: Sequence[Any] = tolist() if callable(tolist) else list(slot_mapping)
    try:
        buf = (ctypes.c_int64 * len(values))(*(int(v) for v in values))
    except (TypeError, OverflowError) as e:
        raise _bad(f"slot_mapping must hold int64 slot numbers: {e}") from None
    return buf, len(values), buf


def _completions(poll_fn: Callable[..., int], handle: Any) -> List[Completion]:
    """Every completion ``poll_fn`` has now (several calls if needed)."""
    done: List[Completion] = []
    while True:
        buf = (_lib.ApdCompletion * _POLL_BATCH)()
        count = ctypes.c_uint64()
        check(poll_fn(handle, buf, _POLL_BATCH, ctypes.byref(count)))
        for rec in buf[: count.value]:
            done.append(
                Completion(
                    rec.req_id.decode("utf-8", "replace"),
                    _STATUS.get(rec.status, f"unknown({rec.status})"),
                    rec.message.decode("utf-8", "replace"),
                    rec.ended_ns / 1e9,
                )
            )
        if count.value < _POLL_BATCH:
            return done


def _released(handle: Any) -> List[str]:
    """Every id ``apd_sender_poll_released`` has now (several calls if needed)."""
    ids: List[str] = []
    while True:
        buf = (_lib.ApdReqId * _POLL_BATCH)()
        count = ctypes.c_uint64()
        check(_lib.lib().apd_sender_poll_released(handle, buf, _POLL_BATCH, ctypes.byref(count)))
        ids.extend(rec.req_id.decode("utf-8", "replace") for rec in buf[: count.value])
        if count.value < _POLL_BATCH:
            return ids


def _pool_stats(fn: Callable[..., int], handle: Any) -> PoolStats:
    out = _lib.ApdPoolStats()
    check(fn(handle, ctypes.byref(out)))
    return PoolStats(out.total, out.free, out.allocated, out.pinned, out.quarantined)


class _InFlight:
    """The caches of submitted requests, kept alive until they complete.

    The lock guards only this bookkeeping, never a call into the library.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: Dict[str, List[KVCache]] = {}

    def add(self, req_id: str, cache: KVCache) -> None:
        with self._lock:
            self._by_id.setdefault(req_id, []).append(cache)

    def remove(self, req_id: str) -> None:
        """Forgets the oldest cache of ``req_id`` (its request completed)."""
        with self._lock:
            caches = self._by_id.get(req_id)
            if caches:
                caches.pop(0)
                if not caches:
                    del self._by_id[req_id]

    def discard(self, req_id: str, cache: KVCache) -> None:
        """Forgets exactly ``cache`` as added last for ``req_id`` (its submit
        failed), leaving the cache of a request still running under the
        same id alone."""
        with self._lock:
            caches = self._by_id.get(req_id)
            if caches:
                for i in range(len(caches) - 1, -1, -1):
                    if caches[i] is cache:
                        del caches[i]
                        break
                if not caches:
                    del self._by_id[req_id]

    def clear(self) -> None:
        with self._lock:
            self._by_id.clear()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(c) for c in self._by_id.values())


def _port(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} is {value!r}: pass a port number (1 to 65535)")
    try:
        port = operator.index(value)
    except TypeError:
        try:
            port = int(value)  # "5555", 5555.0
        except (TypeError, ValueError, OverflowError):
            raise TypeError(f"{name} is {value!r}: pass a port number (1 to 65535)") from None
        if port != value and not isinstance(value, (str, bytes)):
            raise ValueError(f"{name} is {value!r}: not a whole port number")
    if not 1 <= port <= 65535:
        raise ValueError(f"{name} is {port}: a port is 1 to 65535")
    return port


def _ports(name: str, value: Any) -> Union[int, List[int]]:
    """One port (an int, numpy integer, 0-d array or numeric string), or a
    list of them (any other sequence: one per decode rank)."""
    scalar = isinstance(value, (str, bytes)) or getattr(value, "ndim", None) == 0
    if not scalar:
        try:
            operator.index(value)
            scalar = True
        except TypeError:
            scalar = not isinstance(value, Iterable)
    if scalar:
        return _port(name, value)
    return [_port(f"{name}[{i}]", v) for i, v in enumerate(value)]


def _config_handle(config: Config) -> _lib.ApdConfig:
    if not isinstance(config, Config):
        raise TypeError(
            f"config must be an ascend_pd.Config (Config.from_file / Config.from_yaml), "
            f"not {type(config).__name__}"
        )
    return config.handle


def _cache_handle(cache: KVCache) -> _lib.ApdKvCache:
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be an ascend_pd.KVCache, not {type(cache).__name__}")
    return cache.handle


class Sender:
    """A prefill worker's sender (TP rank ``rank``) and its save queue.

    Started from a configuration with ``pd_role: sender``. Saves are
    queued with :meth:`submit_save` and reported by :meth:`poll`. Usable as
    a context manager (closes on exit). Every method may be called from
    any thread.
    """

    def __init__(self, config: Config, rank: int = 0) -> None:
        """Starts the sender; raises :class:`ConfigError` for a receiver config."""
        self._handle = _lib.ApdSender(0)
        self._closed = True  # until started
        self._inflight = _InFlight()
        out = _lib.ApdSender()
        check(_lib.lib().apd_sender_start(_config_handle(config), int(rank), ctypes.byref(out)))
        self._handle = out
        self._closed = False
        self.rank: int = int(rank)

    @property
    def handle(self) -> _lib.ApdSender:
        """The underlying ``ApdSender`` handle (its id stays the same once closed)."""
        return self._handle

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def submit_save(
        self,
        req_id: str,
        keys: Sequence[str],
        cache: KVCache,
        slot_mapping: Any,
        host: str,
        init_port: Union[int, Sequence[int]],
        alloc_port: Union[int, Sequence[int]],
        is_last_prefill: bool = True,
    ) -> None:
        """Queues the save of request ``req_id`` and returns at once.

        Its chunks are gathered from ``cache`` at ``slot_mapping`` (one slot
        per token: a list of ints or an int64 array; no negative padding
        slot, which is refused naming its index) and sent to the
        receiver at ``host`` (its ``pd_peer_init_port`` ``init_port`` and
        ``pd_peer_alloc_port`` ``alloc_port``) as ``keys``, one per chunk of
        ``chunk_size`` tokens. ``is_last_prefill`` sends the proxy its
        notification after the save. :meth:`poll` reports the end; the
        cache is kept alive until then. Raises :class:`Busy` when the queue
        is full (poll, then retry).

        When the decode side runs several TP ranks, pass ``init_port`` and
        ``alloc_port`` as lists with one port per decode rank (index = its
        rank): under a larger decode TP each decode rank this rank feeds
        gets its heads at its own ports. A single int serves every rank.
        """
        self._submit(False, req_id, keys, cache, slot_mapping, host, init_port, alloc_port, is_last_prefill)

    def open_layered_save(
        self,
        req_id: str,
        keys: Sequence[str],
        cache: KVCache,
        slot_mapping: Any,
        host: str,
        init_port: Union[int, Sequence[int]],
        alloc_port: Union[int, Sequence[int]],
        is_last_prefill: bool = True,
    ) -> None:
        """Opens the layer-wise save of request ``req_id`` (push mode,
        ``pd_layerwise: True``) before the forward pass writes its KV.

        The arguments are :meth:`submit_save`'s. The receiver allocates the
        request's pages at once; each layer's rows of every chunk are
        gathered from ``cache`` and sent as soon as :meth:`save_layer` hands
        the layer over; the receiver holds the request only after the last
        layer landed. End it with :meth:`close_layered_save`; :meth:`poll`
        reports how it ended. A pull-mode sender refuses it
        (:class:`InvalidArgument`). Under chunked prefill, open it in the
        step that computes the request's last tokens: earlier steps already
        wrote every layer of theirs.
        """
        self._submit(True, req_id, keys, cache, slot_mapping, host, init_port, alloc_port, is_last_prefill)

    def submit_parked_save(self, req_id: str, keys: Sequence[str], cache: KVCache, slot_mapping: Any) -> None:
        """Queues the save of request ``req_id`` whose decode is not known
        yet (router-native flow) and returns at once.

        Its chunks are gathered from ``cache`` as :meth:`submit_save`'s
        (:meth:`poll_released` reports it then) and parked under ``req_id``
        until a decode registers for it on this rank's
        :attr:`register_port`; then they go to that decode's receiver,
        without the chunks the decode said it holds. A save no decode
        registered for within ``pd_park_timeout`` ends as failed
        (:meth:`poll`) and its pages go back to the pool.
        """
        key_array, num_keys = _keys(keys)
        slots, num_slots, _keep = _slots(slot_mapping)
        rid = req_id if isinstance(req_id, str) else _encode("req_id", req_id).decode("utf-8", "replace")
        self._inflight.add(rid, cache)
        try:
            check(
                _lib.lib().apd_sender_submit_parked_save(
                    self._handle, _encode("req_id", req_id), key_array, num_keys, _cache_handle(cache),
                    slots, num_slots,
                )
            )
        except BaseException:
            self._inflight.discard(rid, cache)
            raise

    @property
    def register_port(self) -> int:
        """The port this rank takes decode registrations on
        (``pd_register_port``, or a free port chosen at start)."""
        port = ctypes.c_uint16()
        check(_lib.lib().apd_sender_register_port(self._handle, ctypes.byref(port)))
        return int(port.value)

    def registration_stats(self) -> Dict[str, int]:
        """Parked transfers and registrations: ``parked``, ``attached``,
        ``expired``, ``refused``, ``dropped`` (forged or replayed),
        ``malformed``, ``parked_now``, ``chunks_sent``, ``chunks_skipped``
        (chunks the decode's registration said it held)."""
        out = _lib.ApdRegistrationStats()
        check(_lib.lib().apd_sender_registration_stats(self._handle, ctypes.byref(out)))
        return {name: int(getattr(out, name)) for name, *_ in out._fields_}

    def save_layer(self, req_id: str, layer: int, stream: Optional[int] = None) -> None:
        """Layer ``layer`` (0 first) of request ``req_id`` is written: its
        rows of every chunk are gathered and sent now.

        Layers may come in any order, each once; a layer beyond the model's,
        a layer handed over twice, or a request without an open layer-wise
        save raises :class:`InvalidArgument`. ``stream``: for an NPU cache
        whose engine queued the layer's kernels on an ``aclrtStream`` and
        has not waited for them, that stream's handle (an int); the layer's
        copies then run after the kernels queued on it so far. Leave it
        None for a host cache.
        """
        lib = _lib.lib()
        rid = _encode("req_id", req_id)
        index = operator.index(layer)
        if index < 0:
            raise _bad(f"layer is {index}: pass the layer's index, 0 first")
        if stream is None:
            check(lib.apd_sender_save_layer(self._handle, rid, index))
        else:
            check(lib.apd_sender_save_layer_after(self._handle, rid, index, ctypes.c_void_p(int(stream))))

    def close_layered_save(self, req_id: str) -> Optional[int]:
        """Ends request ``req_id``'s layer-wise save: no more layers come.

        Returns None when every layer was handed over (the save finishes as
        usual), or the first layer that never was: the save then fails
        (:meth:`poll` says ``"failed"``, naming the layer) and the receiver
        drops what it allocated.
        """
        missing = ctypes.c_int64()
        check(
            _lib.lib().apd_sender_close_layered_save(
                self._handle, _encode("req_id", req_id), ctypes.byref(missing)
            )
        )
        return None if missing.value < 0 else int(missing.value)

    def _submit(
        self,
        layered: bool,
        req_id: str,
        keys: Sequence[str],
        cache: KVCache,
        slot_mapping: Any,
        host: str,
        init_port: Union[int, Sequence[int]],
        alloc_port: Union[int, Sequence[int]],
        is_last_prefill: bool,
    ) -> None:
        """:meth:`submit_save` (or, ``layered``, :meth:`open_layered_save`)."""
        key_array, num_keys = _keys(keys)
        # `_keep` holds the slot array alive until the call returned (the library copies it).
        slots, num_slots, _keep = _slots(slot_mapping)
        host_b = _encode("host", host)
        inits, allocs = _ports("init_port", init_port), _ports("alloc_port", alloc_port)
        per_rank = isinstance(inits, list) or isinstance(allocs, list)
        if per_rank:
            if not isinstance(inits, list) or not isinstance(allocs, list):
                raise TypeError("init_port and alloc_port must both be ports or both be lists of ports")
            if len(inits) != len(allocs) or not inits:
                raise ValueError(
                    f"init_port has {len(inits)} port(s) and alloc_port {len(allocs)}: "
                    "give one of each per decode rank"
                )
            peers = (_lib.ApdPeer * len(inits))(
                *(_lib.ApdPeer(host_b, i, a) for i, a in zip(inits, allocs))
            )
        else:
            assert isinstance(inits, int) and isinstance(allocs, int)
            peer = _lib.ApdPeer(host_b, inits, allocs)
        request = (
            self._handle,
            _encode("req_id", req_id),
            key_array,
            num_keys,
            _cache_handle(cache),
            slots,
            num_slots,
        )
        last = 1 if is_last_prefill else 0
        rid = req_id if isinstance(req_id, str) else _encode("req_id", req_id).decode("utf-8", "replace")
        self._inflight.add(rid, cache)
        lib = _lib.lib()
        try:
            if per_rank:
                ranks_fn = lib.apd_sender_open_layered_save_ranks if layered else lib.apd_sender_submit_save_ranks
                check(ranks_fn(*request, peers, len(peers), last))
            else:
                one_fn = lib.apd_sender_open_layered_save if layered else lib.apd_sender_submit_save
                check(one_fn(*request, ctypes.byref(peer), last))
        except BaseException:
            self._inflight.discard(rid, cache)
            raise

    def poll(self) -> List[Completion]:
        """The saves finished since the last poll (possibly none).

        A done save's KV blocks may be reused by the engine.
        """
        done = _completions(_lib.lib().apd_sender_poll, self._handle)
        for c in done:
            self._inflight.remove(c.req_id)
        return done

    def poll_released(self) -> List[str]:
        """The ids of saves that no longer read the engine's KV cache, since the last call.

        Once a save's id is here, the engine may reuse the KV blocks of its
        slot mapping, though its transfer to the receiver may still run:
        :meth:`poll` still reports how it ends. Each submitted save is
        reported once — when its gather from the cache completed (on an
        NPU, once the device copies ran), or, if it failed or was
        cancelled before or during its gather, once no copy of it reads
        the cache any more (a save cancelled before it started: at once).
        Ids wait until asked for (:meth:`poll` does not take them); past
        ``APD_RELEASED_MAX`` (16384) the oldest are dropped, so call this
        every step, or treat a save's end from :meth:`poll` as its release
        too.
        """
        return _released(self._handle)

    def cancel(self, req_id: str) -> str:
        """Cancels request ``req_id``; the receiver is told to drop what it holds.

        Returns what was found: ``"not_started"`` (it will be reported as
        cancelled), ``"cancelling"`` (running; reported as cancelled when it
        ends), ``"already_ended"`` (what it left behind is being released)
        or ``"unknown"``.
        """
        state = ctypes.c_int32()
        check(_lib.lib().apd_sender_cancel(self._handle, _encode("req_id", req_id), ctypes.byref(state)))
        return _CANCEL.get(state.value, f"unknown({state.value})")

    def pool_stats(self) -> PoolStats:
        """Page counters of the sender's pools."""
        return _pool_stats(_lib.lib().apd_sender_pool_stats, self._handle)

    def drain(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` seconds until no pull is pending.

        In pull modes, every receiver's PullDoneSignal has then arrived, so
        every pinned page is free. Returns True if none is left. Call it
        before :meth:`close` for a clean stop. ``float("inf")`` waits as long
        as it takes.
        """
        if not timeout_s >= 0:  # also refuses NaN
            raise _bad(f"timeout_s is {timeout_s}: pass 0 or more seconds")
        forever = 2**64 - 1
        ms = forever if timeout_s * 1000 >= forever else int(round(timeout_s * 1000))
        drained = ctypes.c_int32()
        check(_lib.lib().apd_sender_drain(self._handle, ms, ctypes.byref(drained)))
        return drained.value != 0

    def close(self, drain_timeout_s: Optional[float] = None) -> Dict[str, int]:
        """Drains, then closes the sender (a no-op if already closed).

        The drain (a rolling restart's clean stop): new saves are refused at
        once; saves in flight, parked saves a decode registers for meanwhile
        and pulls not yet read get up to ``drain_timeout_s`` (None: the
        config's ``pd_drain_timeout``; 0: no wait) to end. At the bound what
        is left is cancelled, and the receivers are told, so their loads fail
        at once. Then saves running finish, saves not started fail, sockets
        close. When it returns no save reads any cache any more, so the
        caches of unfinished requests are released.

        Returns how the drain ended: ``drained`` (1: everything ended in
        time), ``waited_ms``, ``saves_left``, ``parked_cancelled``,
        ``pulls_cancelled`` (all 0 when already closed).
        """
        report = _lib.ApdDrainReport()
        if self._closed:
            return {name: 0 for name, *_ in report._fields_}
        self._closed = True
        handle = self._handle
        if drain_timeout_s is None:
            ms = 2**64 - 1
        else:
            ms = max(0, min(int(round(drain_timeout_s * 1000)), 2**64 - 2))
        try:
            check(_lib.lib().apd_sender_drain_close(handle, ms, ctypes.byref(report)))
        finally:
            self._inflight.clear()
        return {name: int(getattr(report, name)) for name, *_ in report._fields_}

    def __enter__(self) -> "Sender":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        handle: Optional[_lib.ApdSender] = getattr(self, "_handle", None)
        if handle is not None and not getattr(self, "_closed", True) and _lib is not None:
            try:
                _lib.lib().apd_sender_close(handle)
            except Exception:
                pass

    def __repr__(self) -> str:
        return f"<ascend_pd.Sender id={self._handle.id}{' closed' if self.closed else ''}>"


class Receiver:
    """A decode worker's receiver (TP rank ``rank``) and its load queue.

    Started from a configuration with ``pd_role: receiver``. Loads are
    queued with :meth:`submit_load` once :meth:`available` says the keys
    are here, and reported by :meth:`poll`. Usable as a context manager
    (closes on exit). Every method may be called from any thread.
    """

    def __init__(self, config: Config, rank: int = 0) -> None:
        """Starts the receiver; raises :class:`ConfigError` for a sender config."""
        self._handle = _lib.ApdReceiver(0)
        self._closed = True  # until started
        self._inflight = _InFlight()
        out = _lib.ApdReceiver()
        check(_lib.lib().apd_receiver_start(_config_handle(config), int(rank), ctypes.byref(out)))
        self._handle = out
        self._closed = False
        self.rank: int = int(rank)

    @property
    def handle(self) -> _lib.ApdReceiver:
        """The underlying ``ApdReceiver`` handle (its id stays the same once closed)."""
        return self._handle

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def available(self, keys: Sequence[str]) -> bool:
        """Whether every key is stored here (landed, or a pull-delay proxy),
        so the request can be loaded."""
        key_array, num_keys = _keys(keys)
        ready = ctypes.c_int32()
        check(_lib.lib().apd_receiver_available(self._handle, key_array, num_keys, ctypes.byref(ready)))
        return ready.value != 0

    def wait_available(self, keys: Sequence[str], timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` until :meth:`available` would say True
        (returns the moment the last chunk lands); whether it does. The GIL
        is released while it waits."""
        key_array, num_keys = _keys(keys)
        ready = ctypes.c_int32()
        ms = max(0, int(timeout_s * 1000))
        check(_lib.lib().apd_receiver_wait_available(self._handle, key_array, num_keys, ms, ctypes.byref(ready)))
        return ready.value != 0

    def wait_ended(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` until a load has ended and :meth:`poll`
        would report it (returns the moment it ends); whether one has. The
        GIL is released while it waits."""
        ended = ctypes.c_int32()
        ms = max(0, int(timeout_s * 1000))
        check(_lib.lib().apd_receiver_wait_ended(self._handle, ms, ctypes.byref(ended)))
        return ended.value != 0

    def submit_load(self, req_id: str, keys: Sequence[str], cache: KVCache, slot_mapping: Any) -> None:
        """Queues the load of request ``req_id`` (``keys``, one per chunk) into
        ``cache`` at ``slot_mapping`` (one slot per token the keys hold; a
        negative slot skips its token) and returns at once.

        :meth:`poll` reports the end; the cache is kept alive until then. A
        mapping that does not match the stored tokens (a chunk before the
        last not full, or the last not covering exactly the slots left)
        fails the load before any byte moves.
        After a done load the request's pages here are free. Raises
        :class:`Busy` when the queue is full (poll, then retry).
        """
        key_array, num_keys = _keys(keys)
        # `_keep` holds the slot array alive until the call returned (the library copies it).
        slots, num_slots, _keep = _slots(slot_mapping)
        rid = req_id if isinstance(req_id, str) else _encode("req_id", req_id).decode("utf-8", "replace")
        self._inflight.add(rid, cache)
        try:
            check(
                _lib.lib().apd_receiver_submit_load(
                    self._handle,
                    _encode("req_id", req_id),
                    key_array,
                    num_keys,
                    _cache_handle(cache),
                    slots,
                    num_slots,
                )
            )
        except BaseException:
            self._inflight.discard(rid, cache)
            raise

    def poll(self) -> List[Completion]:
        """The loads finished since the last poll (possibly none)."""
        done = _completions(_lib.lib().apd_receiver_poll, self._handle)
        for c in done:
            self._inflight.remove(c.req_id)
        return done

    def register(self, req_id: str, prefill_host: str, ports: Sequence[int], transfer_id: str,
                 held_tokens: int = 0) -> None:
        """Registers this decode's receiver for transfer ``transfer_id``,
        which a prefill parked (router-native flow), with each prefill rank
        (``prefill_host``, one registration port per rank in ``ports``),
        saying it already holds the first ``held_tokens`` tokens. Returns at
        once; :meth:`poll_registrations` reports the outcome under
        ``req_id``."""
        if not ports:
            raise _bad("ports is empty: pass one registration port per prefill rank")
        try:
            arr = (ctypes.c_uint16 * len(ports))(*(int(p) for p in ports))
        except (TypeError, OverflowError) as e:
            raise _bad(f"ports must be port numbers: {e}") from None
        check(
            _lib.lib().apd_receiver_register(
                self._handle, _encode("req_id", req_id), _encode("prefill_host", prefill_host), arr,
                len(ports), _encode("transfer_id", transfer_id), int(held_tokens),
            )
        )

    def poll_registrations(self) -> List[Completion]:
        """Registrations that ended since the last call: status ``done``
        (the prefill sends) or ``failed`` with why (refused: unknown or
        expired transfer; or no answer) — then the KV never comes."""
        return _completions(_lib.lib().apd_receiver_poll_registrations, self._handle)

    def cancel(self, req_id: str, keys: Sequence[str]) -> str:
        """Cancels request ``req_id`` whose chunks are ``keys``.

        Its load is dropped or reported as cancelled, and what this
        receiver holds of ``keys`` is freed (pull-delay proxies are
        discarded, so senders release their pins). Returns what was found:
        ``"not_started"``, ``"cancelling"``, ``"already_ended"`` or
        ``"unknown"`` (never submitted here).

        Name the request as the prefill's save did (its ``req_id``). Unless
        its load here already ended, the request is then withdrawn for
        ``pd_resident_ttl`` (600 s when that is 0; a running load withdraws
        it if it fails): a save of it that reaches this receiver later is
        answered as already sent, so nothing is stored, its sender writes
        nothing (push) or releases its pins at once (pull), and the save
        ends as done.
        """
        key_array, num_keys = _keys(keys)
        state = ctypes.c_int32()
        check(
            _lib.lib().apd_receiver_cancel(
                self._handle, _encode("req_id", req_id), key_array, num_keys, ctypes.byref(state)
            )
        )
        return _CANCEL.get(state.value, f"unknown({state.value})")

    def pool_stats(self) -> PoolStats:
        """Page counters of the receiver's pools."""
        return _pool_stats(_lib.lib().apd_receiver_pool_stats, self._handle)

    def close(self) -> None:
        """Closes the receiver (a no-op if already closed).

        Loads running now finish, loads not started fail and their keys are
        dropped, sockets close.
        """
        if self._closed:
            return
        self._closed = True
        handle = self._handle
        try:
            check(_lib.lib().apd_receiver_close(handle))
        finally:
            self._inflight.clear()

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        handle: Optional[_lib.ApdReceiver] = getattr(self, "_handle", None)
        if handle is not None and not getattr(self, "_closed", True) and _lib is not None:
            try:
                _lib.lib().apd_receiver_close(handle)
            except Exception:
                pass

    def __repr__(self) -> str:
        return f"<ascend_pd.Receiver id={self._handle.id}{' closed' if self.closed else ''}>"
