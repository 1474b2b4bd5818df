"""Loading ``libascend_pd`` and the ctypes mirror of ``include/ascend_pd.h``.

Every function of the header is declared here with its exact argument and
return types; the rest of the package only calls through :func:`lib`.
Handles are structs holding one ``uint64`` id and are passed by value, as
in C.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
from pathlib import Path
from typing import List, Optional

#: The ABI version these bindings were written for (``APD_ABI_VERSION``).
ABI_VERSION = 2

# Status codes (APD_OK, APD_ERR_*).
OK = 0
ERR_INVALID_ARGUMENT = 1
ERR_CONFIG = 2
ERR_CLOSED = 3
ERR_BACKEND = 4
ERR_KV_CACHE = 5
ERR_BUSY = 6
ERR_INTERNAL = 7

# Chunk memory formats (APD_FMT_*).
FMT_KV_2LTD = 1
FMT_MLA = 6

# Element types (APD_DTYPE_*).
DTYPE_BFLOAT16 = 0
DTYPE_FLOAT16 = 1
DTYPE_FLOAT32 = 2
DTYPE_INT8 = 3
DTYPE_UINT8 = 4

#: ``ApdKvCacheDesc.device`` of a host cache.
DEVICE_CPU = -1

# Request outcomes (APD_REQ_*).
REQ_DONE = 0
REQ_FAILED = 1
REQ_CANCELLED = 2

# What a cancel found (APD_CANCEL_*).
CANCEL_NOT_STARTED = 0
CANCEL_CANCELLING = 1
CANCEL_ALREADY_ENDED = 2
CANCEL_UNKNOWN = 3

REQ_ID_MAX = 256
MESSAGE_MAX = 1024

#: The environment variable naming the library's full path.
ENV_LIB = "ASCEND_PD_LIB"


# ------------------------------------------------------------------ structs


class ApdConfig(ctypes.Structure):
    """``ApdConfig``: a configuration handle."""

    _fields_ = [("id", ctypes.c_uint64)]


class ApdKvCache(ctypes.Structure):
    """``ApdKvCache``: a KV cache handle."""

    _fields_ = [("id", ctypes.c_uint64)]


class ApdSender(ctypes.Structure):
    """``ApdSender``: a sender handle."""

    _fields_ = [("id", ctypes.c_uint64)]


class ApdReceiver(ctypes.Structure):
    """``ApdReceiver``: a receiver handle."""

    _fields_ = [("id", ctypes.c_uint64)]


class ApdKvTensor(ctypes.Structure):
    """``ApdKvTensor``: one engine tensor (address and size in bytes)."""

    _fields_ = [("addr", ctypes.c_uint64), ("bytes", ctypes.c_uint64)]


class ApdKvCacheDesc(ctypes.Structure):
    """``ApdKvCacheDesc``: the geometry and memory of a KV cache."""

    _fields_ = [
        ("fmt", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("layers", ctypes.c_uint64),
        ("num_blocks", ctypes.c_uint64),
        ("block_size", ctypes.c_uint64),
        ("hidden", ctypes.c_uint64),
        ("device", ctypes.c_int32),
        ("tensors", ctypes.POINTER(ApdKvTensor)),
        ("num_tensors", ctypes.c_uint64),
        ("stream", ctypes.c_void_p),
    ]


class ApdKvStrides(ctypes.Structure):
    """``ApdKvStrides``: how one plane of each layer of a KV cache lays out
    its elements (KV heads, elements per head, and block/token/head/element
    strides in bytes; ``elem_stride`` 0 is the element size)."""

    _fields_ = [
        ("num_heads", ctypes.c_uint64),
        ("head_size", ctypes.c_uint64),
        ("block_stride", ctypes.c_uint64),
        ("token_stride", ctypes.c_uint64),
        ("head_stride", ctypes.c_uint64),
        ("elem_stride", ctypes.c_uint64),
    ]


class ApdPeer(ctypes.Structure):
    """``ApdPeer``: a receiver's host and side-channel ports."""

    _fields_ = [
        ("host", ctypes.c_char_p),
        ("init_port", ctypes.c_uint16),
        ("alloc_port", ctypes.c_uint16),
    ]


class ApdCompletion(ctypes.Structure):
    """``ApdCompletion``: one finished request."""

    _fields_ = [
        ("req_id", ctypes.c_char * REQ_ID_MAX),
        ("status", ctypes.c_int32),
        ("message", ctypes.c_char * MESSAGE_MAX),
        ("ended_ns", ctypes.c_uint64),
    ]


class ApdReqId(ctypes.Structure):
    """``ApdReqId``: the id of a save that no longer reads the engine's cache."""

    _fields_ = [("req_id", ctypes.c_char * REQ_ID_MAX)]


class ApdRegistrationStats(ctypes.Structure):
    """``ApdRegistrationStats``: a sender's parked transfers and registrations."""

    _fields_ = [
        ("parked", ctypes.c_uint64),
        ("attached", ctypes.c_uint64),
        ("expired", ctypes.c_uint64),
        ("refused", ctypes.c_uint64),
        ("dropped", ctypes.c_uint64),
        ("malformed", ctypes.c_uint64),
        ("parked_now", ctypes.c_uint64),
        ("chunks_sent", ctypes.c_uint64),
        ("chunks_skipped", ctypes.c_uint64),
    ]


class ApdDrainReport(ctypes.Structure):
    """``ApdDrainReport``: how a sender's drain before close ended."""

    _fields_ = [
        ("drained", ctypes.c_int32),
        ("waited_ms", ctypes.c_uint64),
        ("saves_left", ctypes.c_uint64),
        ("parked_cancelled", ctypes.c_uint64),
        ("pulls_cancelled", ctypes.c_uint64),
    ]


class ApdPoolStats(ctypes.Structure):
    """``ApdPoolStats``: page counters of a worker's pools."""

    _fields_ = [
        ("total", ctypes.c_uint64),
        ("free", ctypes.c_uint64),
        ("allocated", ctypes.c_uint64),
        ("pinned", ctypes.c_uint64),
        ("quarantined", ctypes.c_uint64),
    ]


#: ``ApdLogCallback``: ``void (*)(int32_t level, const char *target,
#: const char *message, void *user_data)``.
LOG_CALLBACK = ctypes.CFUNCTYPE(
    None, ctypes.c_int32, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p
)

_i32 = ctypes.c_int32
_u32 = ctypes.c_uint32
_u64 = ctypes.c_uint64
_P = ctypes.POINTER
_str = ctypes.c_char_p
_strs = _P(ctypes.c_char_p)
_slots = _P(ctypes.c_int64)

# name: (restype, argtypes), one entry per function of the header.
_PROTOTYPES = {
    "apd_abi_version": (_u32, []),
    "apd_last_error": (_str, []),
    "apd_set_log_callback": (_i32, [LOG_CALLBACK, ctypes.c_void_p, _i32]),
    "apd_config_from_yaml": (_i32, [_str, _P(ApdConfig)]),
    "apd_config_from_file": (_i32, [_str, _P(ApdConfig)]),
    "apd_config_chunk_size": (_i32, [ApdConfig, _P(_u64)]),
    "apd_config_free": (_i32, [ApdConfig]),
    "apd_kv_cache_wrap": (_i32, [_P(ApdKvCacheDesc), _P(ApdKvCache)]),
    "apd_kv_cache_wrap_strided": (
        _i32,
        [_P(ApdKvCacheDesc), _P(ApdKvStrides), _u64, _P(ApdKvCache)],
    ),
    "apd_kv_cache_free": (_i32, [ApdKvCache]),
    "apd_sender_start": (_i32, [ApdConfig, _u32, _P(ApdSender)]),
    "apd_sender_submit_save": (
        _i32,
        [ApdSender, _str, _strs, _u64, ApdKvCache, _slots, _u64, _P(ApdPeer), _i32],
    ),
    "apd_sender_submit_save_ranks": (
        _i32,
        [ApdSender, _str, _strs, _u64, ApdKvCache, _slots, _u64, _P(ApdPeer), _u64, _i32],
    ),
    "apd_sender_open_layered_save": (
        _i32,
        [ApdSender, _str, _strs, _u64, ApdKvCache, _slots, _u64, _P(ApdPeer), _i32],
    ),
    "apd_sender_open_layered_save_ranks": (
        _i32,
        [ApdSender, _str, _strs, _u64, ApdKvCache, _slots, _u64, _P(ApdPeer), _u64, _i32],
    ),
    "apd_sender_save_layer": (_i32, [ApdSender, _str, _u64]),
    "apd_sender_save_layer_after": (_i32, [ApdSender, _str, _u64, ctypes.c_void_p]),
    "apd_sender_close_layered_save": (_i32, [ApdSender, _str, _P(ctypes.c_int64)]),
    "apd_sender_submit_parked_save": (_i32, [ApdSender, _str, _strs, _u64, ApdKvCache, _slots, _u64]),
    "apd_sender_register_port": (_i32, [ApdSender, _P(ctypes.c_uint16)]),
    "apd_sender_registration_stats": (_i32, [ApdSender, _P(ApdRegistrationStats)]),
    "apd_sender_poll": (_i32, [ApdSender, _P(ApdCompletion), _u64, _P(_u64)]),
    "apd_sender_poll_released": (_i32, [ApdSender, _P(ApdReqId), _u64, _P(_u64)]),
    "apd_sender_cancel": (_i32, [ApdSender, _str, _P(_i32)]),
    "apd_sender_pool_stats": (_i32, [ApdSender, _P(ApdPoolStats)]),
    "apd_sender_drain": (_i32, [ApdSender, _u64, _P(_i32)]),
    "apd_sender_close": (_i32, [ApdSender]),
    "apd_sender_drain_close": (_i32, [ApdSender, ctypes.c_uint64, _P(ApdDrainReport)]),
    "apd_receiver_start": (_i32, [ApdConfig, _u32, _P(ApdReceiver)]),
    "apd_receiver_available": (_i32, [ApdReceiver, _strs, _u64, _P(_i32)]),
    "apd_receiver_wait_available": (_i32, [ApdReceiver, _strs, _u64, _u64, _P(_i32)]),
    "apd_receiver_wait_ended": (_i32, [ApdReceiver, _u64, _P(_i32)]),
    "apd_receiver_submit_load": (
        _i32,
        [ApdReceiver, _str, _strs, _u64, ApdKvCache, _slots, _u64],
    ),
    "apd_receiver_poll": (_i32, [ApdReceiver, _P(ApdCompletion), _u64, _P(_u64)]),
    "apd_receiver_register": (
        _i32,
        [ApdReceiver, _str, _str, _P(ctypes.c_uint16), _u64, _str, _u64],
    ),
    "apd_receiver_poll_registrations": (_i32, [ApdReceiver, _P(ApdCompletion), _u64, _P(_u64)]),
    "apd_receiver_cancel": (_i32, [ApdReceiver, _str, _strs, _u64, _P(_i32)]),
    "apd_receiver_pool_stats": (_i32, [ApdReceiver, _P(ApdPoolStats)]),
    "apd_receiver_close": (_i32, [ApdReceiver]),
}


class LibraryLoadError(OSError):
    """``libascend_pd`` could not be found or loaded, or speaks another ABI."""


_FIX = (
    "Install the package's wheel (docs/install.md), or `pip install ./python` from the ascend-pd "
    "repository (it builds and ships the library), or build it there with `cargo build --lib` "
    "(or `cargo build --release --lib`), or set the environment variable "
    f"{ENV_LIB} to the full path of libascend_pd.so."
)


def _file_names() -> List[str]:
    if sys.platform == "darwin":
        return ["libascend_pd.dylib"]
    if sys.platform == "win32":
        return ["ascend_pd.dll"]
    return ["libascend_pd.so"]


def _shipped() -> List[str]:
    """The library ``pip install`` built and put inside this package."""
    here = Path(__file__).resolve().parent
    return [str(here / name) for name in _file_names()]


def _in_tree() -> List[str]:
    """``target/release`` then ``target/debug`` of every directory above this
    package that holds a ``Cargo.toml`` (the repository root when the
    package is used from a checkout)."""
    found: List[str] = []
    here = Path(__file__).resolve().parent
    for d in [here, *here.parents]:
        if not (d / "Cargo.toml").is_file():
            continue
        for profile in ("release", "debug"):
            for name in _file_names():
                found.append(str(d / "target" / profile / name))
    return found


def candidates() -> List[str]:
    """The paths tried, in order, when ``ASCEND_PD_LIB`` is not set.

    The library shipped inside this package (``pip install ./python``
    builds it), then ``target/release`` and ``target/debug`` of the
    repository this package sits in, for in-tree development (of those
    that exist, the most recently built is loaded); after these, what
    ``ctypes.util.find_library("ascend_pd")`` finds.
    """
    return _shipped() + _in_tree()


def _locate() -> str:
    env = os.environ.get(ENV_LIB)
    if env:
        if not os.path.isfile(env):
            raise LibraryLoadError(
                f"{ENV_LIB} is {env!r}, which is not a file. Set it to the full path of "
                "libascend_pd.so (built by `cargo build --lib` in target/debug or "
                "target/release), or unset it to use the library installed with the "
                "package or the repository's target directory."
            )
        return env
    for shipped in _shipped():
        if os.path.isfile(shipped):
            return shipped
    # Both profiles may be built, one of them stale: take the newest.
    built = [p for p in _in_tree() if os.path.isfile(p)]
    if built:
        return max(built, key=lambda p: os.stat(p).st_mtime)
    tried = candidates()
    system = ctypes.util.find_library("ascend_pd")
    if system:
        return system
    where = "".join(f"\n  {p}" for p in tried) or "\n  (no Cargo.toml above the package)"
    raise LibraryLoadError(
        f"libascend_pd was not found: {ENV_LIB} is not set, none of these exist:{where}\n"
        f"and ctypes.util.find_library('ascend_pd') found nothing. {_FIX}"
    )


def _declare(cdll: ctypes.CDLL, path: str) -> None:
    for name, (restype, argtypes) in _PROTOTYPES.items():
        try:
            fn = getattr(cdll, name)
        except AttributeError:
            raise LibraryLoadError(
                f"{path} has no function {name}: it is not a matching libascend_pd. {_FIX}"
            ) from None
        fn.restype = restype
        fn.argtypes = argtypes


_loaded: Optional[ctypes.CDLL] = None
_path: Optional[str] = None
_load_lock = threading.Lock()


def lib() -> ctypes.CDLL:
    """The loaded library with every prototype declared (loaded on first use).

    Raises :class:`LibraryLoadError` if it cannot be found or loaded, or if
    its ``apd_abi_version()`` is not :data:`ABI_VERSION`.
    """
    global _loaded, _path
    cdll = _loaded
    if cdll is not None:
        return cdll
    with _load_lock:
        if _loaded is not None:
            return _loaded
        path = _locate()
        try:
            # CDLL (not PyDLL): the GIL is released during every call, so
            # library threads can run Python log callbacks meanwhile.
            cdll = ctypes.CDLL(path)
        except OSError as e:
            raise LibraryLoadError(f"cannot load {path}: {e}. {_FIX}") from e
        try:
            version_fn = cdll.apd_abi_version
        except AttributeError:
            raise LibraryLoadError(
                f"{path} has no apd_abi_version: it is not libascend_pd, or a build from "
                f"before the C ABI (stale; rebuild it). {_FIX}"
            ) from None
        version_fn.restype = ctypes.c_uint32
        version_fn.argtypes = []
        version = version_fn()
        if version != ABI_VERSION:
            raise LibraryLoadError(
                f"{path} speaks ABI version {version}, these Python bindings speak version "
                f"{ABI_VERSION}: use the ascend_pd package of the same ascend-pd checkout "
                f"as the library, or rebuild the library from it (`cargo build --lib`) and "
                f"point {ENV_LIB} at it."
            )
        _declare(cdll, path)
        _path = path
        _loaded = cdll
        return cdll


def library_path() -> str:
    """The path of the library in use: the file loaded (loading it if needed).

    Found through ``ASCEND_PD_LIB``, else in the order of :func:`candidates`.
    """
    lib()
    assert _path is not None
    return _path
