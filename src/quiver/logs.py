"""Logging configuration, and Triton's logging extension (``/v2/logging``) over it.

Settings, by Triton's names: ``log_info``, ``log_warning``, ``log_error`` (booleans),
``log_verbose_level`` (0 = off, >0 = debug), ``log_format`` (``default`` or ``ISO8601``),
``log_file`` (empty = standard error).
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from quiver.errors import InvalidArgumentError

_FORMATS = {
    "default": ("%(asctime)s.%(msecs)03d %(levelname).1s %(name)s] %(message)s", "%H:%M:%S"),
    "ISO8601": ("%(asctime)s %(levelname).1s %(name)s] %(message)s", "%Y-%m-%dT%H:%M:%S%z"),
}
_lock = threading.Lock()
_settings: dict[str, Any] = {
    "log_file": "",
    "log_info": True,
    "log_warning": True,
    "log_error": True,
    "log_verbose_level": 0,
    "log_format": "default",
}
_handler: logging.Handler | None = None


def _level() -> int:
    if _settings["log_verbose_level"] > 0:
        return logging.DEBUG
    if _settings["log_info"]:
        return logging.INFO
    if _settings["log_warning"]:
        return logging.WARNING
    if _settings["log_error"]:
        return logging.ERROR
    return logging.CRITICAL + 1


def _apply() -> None:
    global _handler
    root = logging.getLogger()
    new: logging.Handler
    if _settings["log_file"]:
        new = logging.FileHandler(_settings["log_file"])
    else:
        new = logging.StreamHandler(sys.stderr)
    fmt, datefmt = _FORMATS[_settings["log_format"]]
    new.setFormatter(logging.Formatter(fmt, datefmt))
    if _handler is not None:
        root.removeHandler(_handler)
        _handler.close()
    root.addHandler(new)
    _handler = new
    root.setLevel(_level())


def configure(*, verbose: int = 0, info: bool = True, log_file: str = "", log_format: str = "default") -> None:
    """Set up logging at start (the CLI's ``--log-*`` flags)."""
    update({"log_verbose_level": verbose, "log_info": info, "log_file": log_file, "log_format": log_format})


def settings() -> dict[str, Any]:
    with _lock:
        return dict(_settings)


def update(changes: dict[str, Any]) -> dict[str, Any]:
    """Apply some settings (unknown names or wrong types are INVALID_ARG); returns them all."""
    with _lock:
        candidate = dict(_settings)
        for key, value in changes.items():
            if key not in candidate:
                raise InvalidArgumentError(
                    f"logging setting '{key}' is unknown; known: {', '.join(sorted(candidate))}"
                )
            if value is None:
                continue
            current = candidate[key]
            if isinstance(current, bool):
                if not isinstance(value, bool):
                    raise InvalidArgumentError(f"logging setting '{key}' must be true or false")
            elif isinstance(current, int):
                if type(value) is not int or value < 0:
                    raise InvalidArgumentError(f"logging setting '{key}' must be a non-negative integer")
            elif not isinstance(value, str):
                raise InvalidArgumentError(f"logging setting '{key}' must be a string")
            candidate[key] = value
        if candidate["log_format"] not in _FORMATS:
            raise InvalidArgumentError(
                f"logging setting 'log_format' must be one of {', '.join(_FORMATS)}, "
                f"got '{candidate['log_format']}'"
            )
        previous = dict(_settings)
        _settings.update(candidate)
        try:
            _apply()
        except OSError as exc:
            _settings.update(previous)
            _apply()
            raise InvalidArgumentError(f"cannot open log file '{candidate['log_file']}': {exc}") from None
        return dict(_settings)
