"""The one table from Quiver's error codes to transport statuses.

HTTP follows Triton's ``HttpCodeFromError`` with two deliberate changes: UNKNOWN, which in
Quiver means something failed inside the server or a model, is a 500, not a 400; and
ALREADY_EXISTS is 409 Conflict, not 400.
gRPC follows Triton's ``GrpcStatusUtil::CodeToStatus``.
"""

from __future__ import annotations

import grpc

from quiver.errors import ErrorCode

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
