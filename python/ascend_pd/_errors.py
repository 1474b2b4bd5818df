"""The exceptions raised for the library's status codes."""

from __future__ import annotations

from typing import Dict, Type

from . import _lib


class AscendPdError(Exception):
    """A call into libascend_pd failed.

    Attributes:
        status: the library's status code (``APD_ERR_*``).
        message: the library's message for the failure (``apd_last_error()``),
            which names the argument or problem and the fix.
    """

    status: int
    message: str

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def __repr__(self) -> str:
        return f"{type(self).__name__}(status={self.status}, message={self.message!r})"


class InvalidArgument(AscendPdError, ValueError):
    """A pointer, length, string or value passed in is unusable (status 1)."""


class ConfigError(AscendPdError):
    """The configuration is invalid; the message lists every problem (status 2)."""


class ClosedHandle(AscendPdError):
    """The object was closed, never opened, or is of another kind (status 3)."""


class BackendError(AscendPdError):
    """A transfer, socket or peer failed (status 4)."""


class KVCacheError(AscendPdError):
    """A KV cache operation failed: geometry, device (status 5)."""


class Busy(AscendPdError):
    """The queue is full: poll finished requests and retry (status 6)."""


class InternalError(AscendPdError):
    """A bug in the library (a caught panic); the message says where (status 7)."""


_BY_STATUS: Dict[int, Type[AscendPdError]] = {
    _lib.ERR_INVALID_ARGUMENT: InvalidArgument,
    _lib.ERR_CONFIG: ConfigError,
    _lib.ERR_CLOSED: ClosedHandle,
    _lib.ERR_BACKEND: BackendError,
    _lib.ERR_KV_CACHE: KVCacheError,
    _lib.ERR_BUSY: Busy,
    _lib.ERR_INTERNAL: InternalError,
}


def error_for(status: int, message: str) -> AscendPdError:
    """The exception for ``status`` (the base class for an unknown status)."""
    return _BY_STATUS.get(status, AscendPdError)(status, message)


def check(status: int) -> None:
    """Raises the exception of a non-zero ``status`` with ``apd_last_error()``.

    Must be called right after the failing call, on the same thread (the
    library's last error is per thread and replaced by the next call).
    """
    if status == _lib.OK:
        return
    raw = _lib.lib().apd_last_error()
    message = raw.decode("utf-8", "replace") if raw else ""
    if not message:
        message = f"libascend_pd returned status {status} without a message"
    raise error_for(status, message)
