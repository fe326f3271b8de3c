"""``--http-header-forward-pattern`` / ``--grpc-header-forward-pattern``: HTTP headers (gRPC
metadata keys) whose name matches the pattern reach the model as string request parameters,
as in Triton (the pattern may match anywhere in the name; names Triton reserves for its own
parameters are refused)."""

from __future__ import annotations

import re
from collections.abc import Iterable

from quiver import messages
from quiver.errors import InvalidArgumentError
from quiver.types import InferenceRequest

#: Triton's ``kReservedParameterKeys``: a header of one of these names is refused.
RESERVED = frozenset(
    {"sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "headers", "binary_data_output"}
)


class HeaderForwarding:
    """The compiled pattern (falsy when no pattern was given)."""

    def __init__(self, pattern: str | None, *, ignore_case: bool = False) -> None:
        """``ignore_case`` for HTTP, whose header names arrive lower-cased (HTTP names are
        case-insensitive): ``^X-Trace`` still matches a client's ``X-Trace-Id``."""
        flags = re.IGNORECASE if ignore_case else 0
        self.regex = re.compile(pattern, flags) if pattern else None

    def __bool__(self) -> bool:
        return self.regex is not None

    def apply(self, headers: Iterable[tuple[str, str | bytes]], request: InferenceRequest) -> None:
        """Add the matching headers to ``request``'s parameters."""
        regex = self.regex
        if regex is None:
            return
        for key, value in headers:
            if not regex.search(key):
                continue
            if key in RESERVED or key.startswith("triton_"):
                raise InvalidArgumentError(messages.header_reserved(key))
            request.parameters[key] = value.decode("latin-1") if isinstance(value, bytes) else value


__all__ = ["RESERVED", "HeaderForwarding"]
