"""Triton's restricted APIs: ``--http-restricted-api`` / ``--grpc-restricted-protocol``.

A spec ``model-repository,logging:admin-key=s3cret`` makes those API groups answer only
requests that carry the header ``admin-key: s3cret`` (HTTP 403 / gRPC PERMISSION_DENIED
otherwise). The groups are Triton's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from quiver import messages
from quiver.errors import InvalidArgumentError

API_GROUPS = (
    "health",
    "metadata",
    "inference",
    "shared-memory",
    "model-config",
    "model-repository",
    "statistics",
    "trace",
    "logging",
)


class Restrictions:
    """API group -> (header name, value) it requires."""

    def __init__(self, specs: Iterable[str] = ()) -> None:
        self.required: dict[str, tuple[str, str]] = {}
        for spec in specs:
            groups, sep, header = spec.partition(":")
            key, eq, value = header.partition("=")
            if not sep or not eq or not key.strip() or not groups.strip():
                raise InvalidArgumentError(
                    f"restricted API spec '{spec}' must look like '<api>[,<api>...]:<header>=<value>'"
                )
            for group in (g.strip() for g in groups.split(",")):
                if group not in API_GROUPS:
                    raise InvalidArgumentError(
                        f"restricted API spec '{spec}': unknown API '{group}'; known: {', '.join(API_GROUPS)}"
                    )
                if group in self.required:
                    raise InvalidArgumentError(f"restricted API '{group}' is given more than once")
                self.required[group] = (key.strip().lower(), value)

    def __bool__(self) -> bool:
        return bool(self.required)

    def denied(self, group: str, headers: Mapping[str, str], *, grpc: bool = False) -> str | None:
        """``None`` when allowed, else the message to send (Triton's, which says "protocol"
        over gRPC); ``headers`` keys are lower case."""
        need = self.required.get(group)
        if need is None or headers.get(need[0]) == need[1]:
            return None
        return messages.restricted(need[0], grpc=grpc)


_ACTIONS = {
    "": "metadata",
    "infer": "inference",
    "ready": "health",
    "config": "model-config",
    "stats": "statistics",
    "trace": "trace",
}
_TOP = {
    "health": "health",
    "repository": "model-repository",
    "logging": "logging",
    "trace": "trace",
    "systemsharedmemory": "shared-memory",
    "cudasharedmemory": "shared-memory",
}


def http_group(method: str, path: str) -> str:
    """The API group of an HTTP request, by the structure of Triton's routes (so a model
    named ``ready`` or ``stats`` does not change the group of its metadata route)."""
    parts = path.strip("/").split("/")
    if parts[0] != "v2" or len(parts) == 1:
        return "metadata"
    head, tail = parts[1], parts[2:]
    if head != "models":
        return _TOP.get(head, "metadata")
    if tail == ["stats"]:
        return "statistics"
    if len(tail) >= 3 and tail[1] == "versions":
        action = tail[3] if len(tail) > 3 else ""
    else:
        action = tail[1] if len(tail) > 1 else ""
    return _ACTIONS.get(action, "metadata")
