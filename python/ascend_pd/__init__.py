"""Python bindings (ctypes) for ascend-pd: KV-cache transfer between
prefill and decode workers.

The library is ``libascend_pd``, which ``pip install ./python`` builds
with cargo and ships inside this package. It is found through the
environment variable ``ASCEND_PD_LIB`` (its full path, an explicit
override), else inside the package, else in ``target/release`` or
``target/debug`` of the repository this package sits in (in-tree
development, ``cargo build --lib``), else by
``ctypes.util.find_library("ascend_pd")``. It is loaded on first use;
:func:`library_path` names the file loaded.

A prefill worker::

    with ascend_pd.Config.from_file("sender.yaml") as cfg, ascend_pd.Sender(cfg) as tx:
        cache = ascend_pd.KVCache.from_vllm(kv_caches)
        tx.submit_save("req-0", keys, cache, slot_mapping, host, init_port, alloc_port)
        done = []
        while not done:
            done = tx.poll()  # [Completion(req_id, status, message)]
            time.sleep(0.005)

A decode worker uses :class:`Receiver` (``available``, ``submit_load``,
``poll``). Failures raise :class:`AscendPdError` subclasses carrying the
library's status and message.
"""

from __future__ import annotations

from ._config import Config
from ._errors import (
    AscendPdError,
    BackendError,
    Busy,
    ClosedHandle,
    ConfigError,
    InternalError,
    InvalidArgument,
    KVCacheError,
)
from ._kv import KVCache
from ._lib import ABI_VERSION, LibraryLoadError, library_path
from ._log import clear_log_callback, set_log_callback
from ._workers import Completion, PoolStats, Receiver, Sender



def _version() -> str:
    """The release: Cargo.toml's ``[package] version`` (its one source).

    From a checkout on ``sys.path`` it is read from the crate's manifest
    next to the package; from an installed wheel, from the package's
    metadata (which ``setup.py`` took from the same manifest)."""
    import os
    import re

    manifest = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "Cargo.toml")
    try:
        with open(manifest, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        text = ""
    package = re.search(r"^\[package\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if package and re.search(r'^name\s*=\s*"ascend-pd"', package.group(1), re.M):
        found = re.search(r'^version\s*=\s*"([^"]+)"', package.group(1), re.M)
        if found:
            return found.group(1)
    from importlib import metadata

    try:
        return metadata.version("ascend-pd")
    except metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _version()

__all__ = [
    "ABI_VERSION",
    "AscendPdError",
    "BackendError",
    "Busy",
    "ClosedHandle",
    "Completion",
    "Config",
    "ConfigError",
    "InternalError",
    "InvalidArgument",
    "KVCache",
    "KVCacheError",
    "LibraryLoadError",
    "PoolStats",
    "Receiver",
    "Sender",
    "abi_version",
    "clear_log_callback",
    "library_path",
    "set_log_callback",
]


def abi_version() -> int:
    """The ABI version of the loaded library (loading it if needed)."""
    from . import _lib

    return int(_lib.lib().apd_abi_version())
