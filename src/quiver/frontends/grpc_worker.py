"""gRPC in a frontend worker process (``--frontend-workers N``).

Each worker serves Triton's ``GRPCInferenceService`` on the gRPC port with the very
:class:`~quiver.frontends.grpc.GrpcFrontend` the single process runs (restrictions, message
size limits, keepalive and channel arguments, response compression, TLS), over a
:class:`~quiver.frontends.remote_service.RemoteService`:

- ``ModelInfer`` is parsed and decoded here and the request handed to the model side, as the
  HTTP worker does; ``ModelStreamInfer`` too, each answer coming back as the model sends it
  (a client that goes away cancels its requests there);
- every other RPC of the service is relayed as its method name and serialized request, and
  the model side's serialized reply or status (:mod:`quiver.frontends.grpc_relay`) is the
  answer, so health, metadata, statistics, the repository, trace and log settings and
  shared-memory registration answer exactly as in one process;
- the standard health service (``grpc.health.v1.Health``) is the worker's own: SERVING while
  it serves, NOT_SERVING once it stops.

The port: the model side holds it bound with ``SO_REUSEPORT`` but never listens on it (so
another server cannot take it, and a connection made while no worker listens is refused,
never accepted by a process that cannot serve it); each worker binds it with
``SO_REUSEPORT`` too and listens, and the kernel spreads new connections over the workers.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from quiver.frontends.grpc import (
    DEFAULT_MAX_MESSAGE_SIZE,
    GrpcFrontend,
    RawInferHandler,
    health_methods,
    inference_methods,
)
from quiver.frontends.grpc_plumbing import SERVICE_NAME, GenericHandlersOnly, raw_method
from quiver.frontends.grpc_relay import RELAYED_RPCS
from quiver.frontends.grpc_server import RpcMethod
from quiver.frontends.remote_service import RelayedStatus, RemoteService
from quiver.frontends.restrictions import Restrictions
from quiver.frontends.status import grpc_error
from quiver.triton_flags import GrpcTls


@dataclass(frozen=True)
class GrpcWorkerSetup:
    """What a worker needs to serve gRPC as the single process would (sent over the link:
    TLS keys never appear on a command line)."""

    address: str
    port: int
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    restricted_protocol: list[str] = field(default_factory=list)
    header_forward_pattern: str | None = None
    tls: GrpcTls | None = None
    options: list[tuple[str, int]] = field(default_factory=list)
    compression_level: int = 0
    server: str = "quiver"  # --grpc-server


class RelayHandler(grpc.GenericRpcHandler):  # type: ignore[misc]
    """Every RPC of Triton's service but the inferences: relayed to the model side, bytes in
    and out."""

    def __init__(self, remote: RemoteService) -> None:
        self._handlers = {
            f"/{SERVICE_NAME}/{method}": grpc.unary_unary_rpc_method_handler(_relay(remote, method))
            for method in RELAYED_RPCS
        }

    def service(self, handler_call_details: Any) -> Any:
        return self._handlers.get(handler_call_details.method)


def _relay(remote: RemoteService, method: str) -> Any:
    async def call(data: bytes, context: Any) -> bytes:
        try:
            metadata = tuple((key, value) for key, value in context.invocation_metadata() or ())
            return await remote.relay(method, data, metadata)
        except RelayedStatus as exc:
            code, message = grpc.StatusCode[exc.code], exc.message
        except Exception as exc:  # the model side has gone: UNAVAILABLE
            code, message = grpc_error(exc, where=f"gRPC {method}")
        await context.abort(code, message)
        raise AssertionError("context.abort returned")  # pragma: no cover

    return call


def reserve_port(address: str, port: int) -> socket.socket:
    """The workers' gRPC port, held by the model side: bound with ``SO_REUSEPORT`` (which each
    worker's gRPC server sets too, then listens) and never listened on, so no other server can
    take the port and a connection made while no worker listens is refused rather than
    accepted by a process that does not serve it. Not ``SO_REUSEADDR``: two sockets with it
    may both bind a port neither listens on, which would let a server without
    ``SO_REUSEPORT`` take it."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((address, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {address}:{port} (gRPC): {exc.strerror}") from None
    return sock


class WorkerGrpcFrontend(GrpcFrontend):
    """The worker's gRPC server: inferences decoded here, the rest relayed."""

    def __init__(self, remote: RemoteService, setup: GrpcWorkerSetup) -> None:
        super().__init__(
            remote,  # type: ignore[arg-type]
            max_message_size=setup.max_message_size,
            restrictions=Restrictions(list(setup.restricted_protocol)),
            header_forward_pattern=setup.header_forward_pattern,
            tls=setup.tls,
            options=setup.options,
            compression_level=setup.compression_level,
            reuse_port=True,  # every worker listens on the port (see the module's docstring)
            server_kind=setup.server,
        )
        self.remote = remote

    def methods(self) -> dict[str, RpcMethod]:
        relayed = (raw_method(method, _relay(self.remote, method)) for method in RELAYED_RPCS)
        return {
            **{method.name: method for method in relayed},
            **inference_methods(self.servicer),
            **health_methods(self.health),
        }

    def add_handlers(self, server: Any) -> None:
        server.add_generic_rpc_handlers((RawInferHandler(self.servicer), RelayHandler(self.remote)))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, GenericHandlersOnly(server))


__all__ = ["GrpcWorkerSetup", "RelayHandler", "WorkerGrpcFrontend", "reserve_port"]
