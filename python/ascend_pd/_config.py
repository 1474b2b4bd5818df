"""The parsed configuration."""

from __future__ import annotations

import ctypes
import os
from typing import Any, Optional, Type, Union

from . import _lib
from ._errors import check

PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]


class Config:
    """A parsed and validated configuration (LMCache-style YAML keys).

    Create one with :meth:`from_yaml` or :meth:`from_file`. Senders and
    receivers started from it keep their own copy, so it may be closed
    once they are started. Usable as a context manager (closes on exit).
    """

    def __init__(self, handle: _lib.ApdConfig) -> None:
        """Wraps an ``ApdConfig`` handle (use :meth:`from_yaml` or :meth:`from_file`)."""
        self._handle = handle
        self._closed = False

    @classmethod
    def from_yaml(cls: Type["Config"], text: str) -> "Config":
        """Parses and validates the YAML configuration ``text``.

        Raises :class:`ConfigError` listing every problem if it is invalid.
        """
        if not isinstance(text, str):
            raise TypeError(f"from_yaml takes the YAML text as str, not {type(text).__name__}")
        out = _lib.ApdConfig()
        check(_lib.lib().apd_config_from_yaml(text.encode("utf-8"), ctypes.byref(out)))
        return cls(out)

    @classmethod
    def from_file(cls: Type["Config"], path: PathLike) -> "Config":
        """Reads, parses and validates the YAML configuration file at ``path``."""
        out = _lib.ApdConfig()
        check(_lib.lib().apd_config_from_file(os.fsencode(path), ctypes.byref(out)))
        return cls(out)

    @property
    def handle(self) -> _lib.ApdConfig:
        """The underlying ``ApdConfig`` handle (its id stays the same once closed)."""
        return self._handle

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def chunk_size(self) -> int:
        """Tokens per chunk: a request of N tokens has ceil(N / chunk_size) keys."""
        out = ctypes.c_uint64()
        check(_lib.lib().apd_config_chunk_size(self._handle, ctypes.byref(out)))
        return out.value

    def close(self) -> None:
        """Frees the configuration (a no-op if already closed)."""
        if self._closed:
            return
        self._closed = True
        handle = self._handle
        check(_lib.lib().apd_config_free(handle))

    def __enter__(self) -> "Config":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        handle: Optional[_lib.ApdConfig] = getattr(self, "_handle", None)
        if handle is not None and not getattr(self, "_closed", True) and _lib is not None:
            try:
                _lib.lib().apd_config_free(handle)
            except Exception:
                pass

    def __repr__(self) -> str:
        return f"<ascend_pd.Config id={self._handle.id}{' closed' if self.closed else ''}>"
