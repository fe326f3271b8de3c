"""The model side's half of gRPC through frontend workers: a worker relays every RPC of
Triton's service that is not an inference (health, metadata, config, statistics, the
repository, trace and log settings, shared memory) as its method name and serialized
request; :func:`answer_rpc` runs it on the very :class:`~quiver.frontends.grpc.InferenceServicer`
methods the single process serves, and returns the serialized reply or the gRPC status and
message, which the worker answers with unchanged.
"""

from __future__ import annotations

from typing import Any

import grpc
from tritonclient.grpc import service_pb2 as pb

from quiver.frontends.grpc import InferenceServicer
from quiver.frontends.grpc_plumbing import RPC_GROUPS
from quiver.frontends.status import grpc_error

#: Answered by the worker itself (decoded there, inferred over the link).
INFERENCE_RPCS = frozenset({"ModelInfer", "ModelStreamInfer"})
#: The RPCs a worker relays, with their request message types.
RELAYED_RPCS: dict[str, Any] = {
    method: getattr(pb, f"{method}Request") for method in RPC_GROUPS if method not in INFERENCE_RPCS
}


class _Aborted(Exception):
    pass


class RelayContext:
    """What the servicer's methods use of a ``grpc.aio`` context: the call's metadata and
    ``abort``, which records the status the worker answers with."""

    def __init__(self, metadata: tuple[tuple[str, Any], ...]) -> None:
        self._metadata = metadata
        self.status: tuple[grpc.StatusCode, str] | None = None

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        self.status = (code, details)
        raise grpc.aio.AbortError()


async def answer_rpc(
    servicer: InferenceServicer, method: str, data: bytes, metadata: tuple[tuple[str, Any], ...]
) -> tuple[Any, ...]:
    """``("rpc-ok", reply bytes)`` or ``("rpc-error", status name, message)`` (the id is the
    caller's to add)."""
    request_type = RELAYED_RPCS.get(method)
    if request_type is None:  # the worker relays only these; anything else is a broken peer
        return ("rpc-error", grpc.StatusCode.UNIMPLEMENTED.name, "Method not found!")
    try:
        request = request_type.FromString(data)
    except Exception as exc:  # as ParsedByUs answers a message that does not parse
        return ("rpc-error", grpc.StatusCode.INVALID_ARGUMENT.name, f"malformed {method} request message: {exc}")
    context = RelayContext(metadata)
    try:
        reply = await getattr(servicer, method)(request, context)
    except grpc.aio.AbortError:
        assert context.status is not None
        code, message = context.status
        return ("rpc-error", code.name, message)
    except Exception as exc:  # the RPCs outside the servicer's _rpc translation
        code, message = grpc_error(exc, where=f"gRPC {method}")
        return ("rpc-error", code.name, message)
    return ("rpc-ok", reply.SerializeToString())


__all__ = ["INFERENCE_RPCS", "RELAYED_RPCS", "RelayContext", "answer_rpc"]
