"""Logging configuration, and Triton's logging extension (``/v2/logging``) over it.

Settings, by Triton's names: ``log_info``, ``log_warning``, ``log_error`` (booleans),
``log_verbose_level`` (0 = off, >0 = debug), ``log_format`` (``default`` or ``ISO8601``),
``log_file`` (empty = standard error).

``log_file`` is the operator's (``--log-file``). Through the API it cannot be changed, as in
Triton (which refuses it since CVE-2024-0087: a client could create and append to any file
the server may write), unless the server was started with ``--allow-log-file-api`` and
``--log-file-dir DIR``; then a client may name a file inside DIR and nothing else. The name
is checked without trusting it: no NUL byte, no ``..``, an absolute path only inside DIR; the
file is opened relative to a descriptor of DIR held since start-up, one component at a time,
with ``O_NOFOLLOW`` at every step, so no symbolic link (planted before or swapped in during
the open) is followed; it must be a regular file with no other hard link.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import sys
import threading
from typing import Any, TextIO

from quiver.errors import InvalidArgumentError

_FORMATS = {
    "default": ("%(asctime)s.%(msecs)03d %(levelname).1s %(name)s] %(message)s", "%H:%M:%S"),
    "ISO8601": ("%(asctime)s %(levelname).1s %(name)s] %(message)s", "%Y-%m-%dT%H:%M:%S%z"),
}
#: The flags that let the logging API set ``log_file`` (named in the refusal).
API_FLAGS = "--allow-log-file-api and --log-file-dir DIR"
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
#: ``--log-file-dir`` when the API may set ``log_file``: (its real path, a descriptor of it).
_file_dir: tuple[str, int] | None = None


class _OpenedFileHandler(logging.StreamHandler[TextIO]):
    """A handler over a file opened here; closing closes it (and never reopens it by name,
    as ``logging.FileHandler`` would)."""

    def close(self) -> None:
        self.acquire()
        try:
            try:
                self.flush()
            finally:
                self.stream.close()
        finally:
            self.release()
            super().close()


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


def _apply(new: logging.Handler | None) -> None:
    """Install ``new`` (if given) in place of the current handler; apply format and level."""
    global _handler
    root = logging.getLogger()
    if new is not None:
        if _handler is not None:
            root.removeHandler(_handler)
            _handler.close()
        root.addHandler(new)
        _handler = new
    if _handler is not None:
        fmt, datefmt = _FORMATS[_settings["log_format"]]
        _handler.setFormatter(logging.Formatter(fmt, datefmt))
    root.setLevel(_level())


def _not_allowed() -> InvalidArgumentError:
    return InvalidArgumentError(
        "logging setting 'log_file' cannot be changed through the logging API; start the "
        f"server with {API_FLAGS} to allow files inside DIR"
    )


def _refuse(requested: str, why: str) -> InvalidArgumentError:
    shown = requested if len(requested) <= 256 else requested[:256] + "..."
    shown = shown.encode("unicode_escape").decode("ascii")
    return InvalidArgumentError(f"logging setting 'log_file' '{shown}' is refused: {why}")


def _open_in_dir(requested: str) -> tuple[TextIO, str]:
    """Open ``requested`` for appending inside ``--log-file-dir`` following no link; returns
    the stream and the path it is reported by."""
    if _file_dir is None:
        raise _not_allowed()
    root, root_fd = _file_dir
    if "\x00" in requested:
        raise _refuse(requested, "it contains a NUL byte")
    relative = requested
    if os.path.isabs(requested):
        prefix = root.rstrip("/") + "/"
        if not requested.startswith(prefix):
            raise _refuse(requested, f"it is outside the log folder '{root}' (--log-file-dir)")
        relative = requested[len(prefix) :]
    parts = [p for p in relative.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise _refuse(requested, "'..' is not allowed")
    if not parts or relative.endswith("/"):
        raise _refuse(requested, "it names a folder, not a file")
    fd = -1
    folder = root_fd
    try:
        for part in parts[:-1]:
            try:
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _refuse(requested, f"'{part}' is a symbolic link or not a folder") from None
                raise
            if folder != root_fd:
                os.close(folder)
            folder = inner
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        fd = os.open(parts[-1], flags, 0o640, dir_fd=folder)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refuse(requested, "it is not a regular file")
        if info.st_nlink > 1:
            raise _refuse(requested, "the file has other hard links")
        os.set_blocking(fd, True)
        stream = open(fd, "a", encoding="utf-8", errors="backslashreplace")  # noqa: SIM115 - the handler owns it
    except OSError as exc:
        if fd >= 0:
            os.close(fd)
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
            raise _refuse(requested, "the file is a symbolic link, which is never followed") from None
        raise _refuse(requested, f"cannot open it: {exc.strerror}") from None
    except InvalidArgumentError:
        if fd >= 0:
            os.close(fd)
        raise
    finally:
        if folder != root_fd:
            os.close(folder)
    return stream, os.path.join(root, *parts)


def configure(
    *,
    verbose: int = 0,
    info: bool = True,
    warning: bool = True,
    error: bool = True,
    log_file: str = "",
    log_format: str = "default",
    log_file_dir: str | None = None,
) -> None:
    """Set up logging at start (the CLI's ``--log-*`` flags). ``log_file_dir``: the folder
    inside which the logging API may set ``log_file`` (``None``: the API may not change it)."""
    global _file_dir
    with _lock:
        previous = _file_dir
        _file_dir = None
        if previous is not None:
            os.close(previous[1])
        if log_file_dir is not None:
            root = os.path.realpath(log_file_dir)
            try:
                _file_dir = (root, os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
            except OSError as exc:
                raise InvalidArgumentError(
                    f"--log-file-dir '{log_file_dir}' is not a folder Quiver can open: {exc.strerror}"
                ) from None
    _update(
        {
            "log_verbose_level": verbose,
            "log_info": info,
            "log_warning": warning,
            "log_error": error,
            "log_file": log_file,
            "log_format": log_format,
        },
        trusted=True,
    )


def settings() -> dict[str, Any]:
    with _lock:
        return dict(_settings)


def update(changes: dict[str, Any]) -> dict[str, Any]:
    """Apply some settings from a client of the logging API (unknown names, wrong types and a
    ``log_file`` the server does not allow are INVALID_ARG); returns them all."""
    return _update(changes, trusted=False)


_MAX_UINT32 = (1 << 32) - 1


def _update(changes: dict[str, Any], *, trusted: bool) -> dict[str, Any]:
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
                if type(value) is not int or not 0 <= value <= _MAX_UINT32:
                    # gRPC's LogSettings carries it as a uint32: a larger level could be set
                    # over HTTP but never read back over gRPC
                    raise InvalidArgumentError(
                        f"logging setting '{key}' must be an integer from 0 to {_MAX_UINT32}"
                    )
            elif not isinstance(value, str):
                raise InvalidArgumentError(f"logging setting '{key}' must be a string")
            candidate[key] = value
        if candidate["log_format"] not in _FORMATS:
            raise InvalidArgumentError(
                f"logging setting 'log_format' must be one of {', '.join(_FORMATS)}, "
                f"got '{candidate['log_format']}'"
            )
        new: logging.Handler | None = None
        requested = changes.get("log_file")
        if requested is not None and not trusted and _file_dir is None:
            raise _not_allowed()
        if requested is not None or _handler is None:
            path = candidate["log_file"]
            if not path:
                new = logging.StreamHandler(sys.stderr)
            elif trusted:  # the operator's --log-file
                try:
                    new = logging.FileHandler(path)
                except OSError as exc:
                    raise InvalidArgumentError(f"cannot open log file '{path}': {exc.strerror}") from None
            else:
                stream, candidate["log_file"] = _open_in_dir(path)
                new = _OpenedFileHandler(stream)
        _settings.update(candidate)
        _apply(new)
        return dict(_settings)
