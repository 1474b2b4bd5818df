"""Routing the library's log records to Python."""

from __future__ import annotations

import atexit
import logging
import traceback
from typing import Any, Callable, List, Optional

from . import _lib
from ._errors import check

#: The logger records go to by default.
logger = logging.getLogger("ascend_pd")

#: A log function: ``fn(level, target, message)`` with the library's level
#: (1 error, 2 warning, 3 info, 4 debug, 5 trace), its module and the text.
LogFunction = Callable[[int, str, str], None]

#: Library level -> Python logging level.
PY_LEVELS = {1: logging.ERROR, 2: logging.WARNING, 3: logging.INFO, 4: logging.DEBUG, 5: logging.DEBUG}

# Every callback object ever handed to the library stays referenced: a
# library thread may still be running an earlier one right after it was
# replaced, so none may be garbage-collected.
_installed: List[Any] = []
_active = False


def max_level_for(level: int) -> int:
    """The library's ``max_level`` (0 off … 5 trace) for a Python logging level.

    ``logging.WARNING`` gives 2 (errors and warnings); anything below
    ``logging.DEBUG`` (e.g. ``logging.NOTSET``) gives 5 (trace); above
    ``logging.ERROR`` gives 0 (off).
    """
    if level < logging.DEBUG:
        return 5
    if level <= logging.DEBUG:
        return 4
    if level <= logging.INFO:
        return 3
    if level <= logging.WARNING:
        return 2
    if level <= logging.ERROR:
        return 1
    return 0


def _to_logging(level: int, target: str, message: str) -> None:
    logger.log(PY_LEVELS.get(level, logging.DEBUG), "%s", message, extra={"apd_target": target})


def set_log_callback(fn: Optional[LogFunction] = None, level: int = logging.WARNING) -> None:
    """Routes the library's log records at ``level`` and above to ``fn``.

    Without ``fn``, records go to the Python logger ``"ascend_pd"`` (library
    levels 1..5 become ERROR, WARNING, INFO, DEBUG, DEBUG; the module is in
    the record's ``apd_target`` attribute). ``fn(level, target, message)``
    gets the library's level (1 error … 5 trace), its module and the text.

    ``level`` is a Python logging level (``logging.WARNING``: errors and
    warnings; ``logging.DEBUG``: up to debug; ``logging.NOTSET``: trace).
    The callback runs on the library's threads, possibly concurrently;
    exceptions it raises are printed and never reach the library. Raises
    :class:`InvalidArgument` if the process already has a Rust logger.
    """
    global _active
    target_fn: LogFunction = fn if fn is not None else _to_logging

    def trampoline(lvl: int, target: Optional[bytes], message: Optional[bytes], _user: Any) -> None:
        try:
            target_fn(
                int(lvl),
                target.decode("utf-8", "replace") if target else "",
                message.decode("utf-8", "replace") if message else "",
            )
        except BaseException:
            try:
                traceback.print_exc()
            except BaseException:
                pass

    callback = _lib.LOG_CALLBACK(trampoline)
    _installed.append(callback)
    check(_lib.lib().apd_set_log_callback(callback, None, max_level_for(level)))
    _active = True


def clear_log_callback() -> None:
    """Stops the library's logging. A record already being delivered may
    still reach the previous callback, which is why every callback ever
    installed stays referenced."""
    global _active
    check(_lib.lib().apd_set_log_callback(_lib.LOG_CALLBACK(), None, 0))
    _active = False


@atexit.register
def _clear_at_exit() -> None:
    # Library threads may outlive the interpreter's shutdown: they must not
    # call into Python then.
    if _active:
        try:
            _lib.lib().apd_set_log_callback(_lib.LOG_CALLBACK(), None, 0)
        except Exception:
            pass
