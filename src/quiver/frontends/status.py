"""Errors -> transport statuses: the one table, and the one translation each transport calls.

HTTP follows Triton's ``HttpCodeFromError`` with two deliberate changes: UNKNOWN, which in
Quiver means something failed inside the server or a model, is a 500, not a 400; and
ALREADY_EXISTS is 409 Conflict, not 400.
gRPC follows Triton's ``GrpcStatusUtil::CodeToStatus``.

Each transport turns exceptions into statuses at one place, through :func:`http_error` or
:func:`grpc_error`: the v2 HTTP app's Starlette exception handlers and its direct inference
path, the SageMaker app's guard, the gRPC servicer's wrapper. An exception that is not a
:class:`~quiver.errors.QuiverError` is unexpected: it is logged here, once, with its
traceback, and answered 500 / INTERNAL with a message naming the model when it is known.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from quiver.errors import ErrorCode, QuiverError

logger = logging.getLogger(__name__)

#: code -> (HTTP status, gRPC status name)
STATUS: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.INVALID_ARG: (400, "INVALID_ARGUMENT"),
    ErrorCode.NOT_FOUND: (404, "NOT_FOUND"),
    ErrorCode.ALREADY_EXISTS: (409, "ALREADY_EXISTS"),
    ErrorCode.CANCELLED: (400, "CANCELLED"),
    ErrorCode.UNSUPPORTED: (501, "UNIMPLEMENTED"),
    ErrorCode.UNAVAILABLE: (503, "UNAVAILABLE"),
    ErrorCode.INTERNAL: (500, "INTERNAL"),
    ErrorCode.UNKNOWN: (500, "UNKNOWN"),
}


def http_status(code: ErrorCode) -> int:
    return STATUS[code][0]


def grpc_status_name(code: ErrorCode) -> str:
    return STATUS[code][1]


def grpc_status(code: ErrorCode) -> grpc.StatusCode:
    """The ``grpc.StatusCode`` for ``code`` (``context.abort`` takes it)."""
    return _GRPC[code]


_GRPC: dict[ErrorCode, grpc.StatusCode] = {
    code: getattr(grpc.StatusCode, name) for code, (_, name) in STATUS.items()
}


class BodyTooLarge(Exception):
    """An HTTP body past ``--http-max-input-size``: 413 on every HTTP listener."""

    def __init__(self, limit: int, message: str | None = None) -> None:
        super().__init__(
            message or f"request body is larger than the limit of {limit} bytes (--http-max-input-size)"
        )


def _quiver_http_status(exc: QuiverError) -> int:
    return http_status(exc.code)


def http_error(
    exc: Exception,
    *,
    model: str = "",
    where: str,
    status_of: Callable[[QuiverError], int] = _quiver_http_status,
) -> tuple[int, str]:
    """The HTTP status and message ``exc`` is answered with. ``where`` says what failed, for
    the log; ``status_of`` is the table unless a frontend maps some errors its own way."""
    if isinstance(exc, QuiverError):
        return status_of(exc), exc.message
    if isinstance(exc, BodyTooLarge):
        return 413, str(exc)
    return 500, _unexpected(exc, model, where)


def grpc_error(exc: Exception, *, model: str = "", where: str) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message ``exc`` is answered with (see :func:`http_error`)."""
    if isinstance(exc, QuiverError):
        return grpc_status(exc.code), exc.message
    return grpc.StatusCode.INTERNAL, _unexpected(exc, model, where)


def _unexpected(exc: Exception, model: str, where: str) -> str:
    """Log an exception no layer below expected (once, with its traceback); the client's message."""
    logger.error("%s failed unexpectedly", where, exc_info=exc)
    if model:
        return f"internal error in model '{model}': {type(exc).__name__}: {exc}"
    return f"internal error: {type(exc).__name__}: {exc}"
