"""The one error vocabulary of Quiver.

Every failure that reaches a client is a :class:`QuiverError` carrying one of Triton's
error codes. Transports map the code to a status through the tables in
``quiver.frontends.status``; nothing below the frontends knows about HTTP or gRPC.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """Triton's ``TRITONSERVER_Error_Code`` values."""

    UNKNOWN = "UNKNOWN"
    INTERNAL = "INTERNAL"
    NOT_FOUND = "NOT_FOUND"
    INVALID_ARG = "INVALID_ARG"
    UNAVAILABLE = "UNAVAILABLE"
    UNSUPPORTED = "UNSUPPORTED"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    CANCELLED = "CANCELLED"


class QuiverError(Exception):
    """Base class: an error with a Triton error code and a message for the client."""

    code: ErrorCode = ErrorCode.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class UnknownError(QuiverError):
    code = ErrorCode.UNKNOWN


class InternalError(QuiverError):
    code = ErrorCode.INTERNAL


class NotFoundError(QuiverError):
    code = ErrorCode.NOT_FOUND


class InvalidArgumentError(QuiverError):
    code = ErrorCode.INVALID_ARG


class UnavailableError(QuiverError):
    code = ErrorCode.UNAVAILABLE


class UnsupportedError(QuiverError):
    code = ErrorCode.UNSUPPORTED


class AlreadyExistsError(QuiverError):
    code = ErrorCode.ALREADY_EXISTS


class CancelledError(QuiverError):
    code = ErrorCode.CANCELLED


_BY_CODE: dict[ErrorCode, type[QuiverError]] = {
    cls.code: cls
    for cls in (
        UnknownError,
        InternalError,
        NotFoundError,
        InvalidArgumentError,
        UnavailableError,
        UnsupportedError,
        AlreadyExistsError,
        CancelledError,
    )
}


def error_for_code(code: ErrorCode, message: str) -> QuiverError:
    """Build the exception class that carries ``code``."""
    return _BY_CODE[code](message)


class ConfigError(InvalidArgumentError):
    """A model configuration that cannot be used; the message names file and field."""


def format_exception(exc: BaseException) -> str:
    """``Type: message`` (just ``Type`` when the message is empty), as errors quote exceptions."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
