"""The gRPC server's plumbing around Triton's service: the restriction interceptor
(``--grpc-restricted-protocol``), request parsing that answers a malformed message
INVALID_ARGUMENT, and the generic-handler-only registration (see each class) for ``grpc.aio``;
the method tables Quiver's own server dispatches to (:func:`service_methods`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import message_factory

from quiver.frontends.grpc_call import CallFailed
from quiver.frontends.grpc_server import RpcMethod
from quiver.frontends.restrictions import Restrictions

#: The service name of Triton's inference service.
SERVICE_NAME = "inference.GRPCInferenceService"


#: Triton's API group of each RPC, for --grpc-restricted-protocol.
RPC_GROUPS = {
    "ServerLive": "health",
    "ServerReady": "health",
    "ModelReady": "health",
    "ServerMetadata": "metadata",
    "ModelMetadata": "metadata",
    "ModelInfer": "inference",
    "ModelStreamInfer": "inference",
    "ModelConfig": "model-config",
    "ModelStatistics": "statistics",
    "RepositoryIndex": "model-repository",
    "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "SystemSharedMemoryStatus": "shared-memory",
    "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory",
    "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory",
    "CudaSharedMemoryUnregister": "shared-memory",
    "TraceSetting": "trace",
    "LogSettings": "logging",
}


class RestrictionInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses restricted RPCs whose metadata lacks the required header (PERMISSION_DENIED)."""

    def __init__(self, restrictions: Restrictions) -> None:
        self.restrictions = restrictions

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        method = details.method.rsplit("/", 1)[-1]
        group = RPC_GROUPS.get(method) if details.method.startswith(f"/{SERVICE_NAME}/") else None
        if group is not None:
            metadata = {key.lower(): value for key, value in (details.invocation_metadata or ())}
            denied = self.restrictions.denied(group, metadata, grpc=True)
            if denied is not None:
                return _denied_handler(method, denied)
        return await continuation(details)


def _denied_handler(method: str, message: str) -> Any:
    async def unary(request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)

    async def stream(request_iterator: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)
        yield  # pragma: no cover - makes this an async generator

    if method == "ModelStreamInfer":
        return grpc.stream_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)


class _Malformed:
    """A request message that did not parse; the method answers INVALID_ARGUMENT for it."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class ParsedByUs(grpc.GenericRpcHandler):  # type: ignore[misc]
    """A generated service's handlers, with request parsing the server's own business.

    grpc calls a method's deserializer before the servicer is reached, and a message that
    does not parse there is answered UNKNOWN, a server error to the client. Here the
    deserializer hands back :class:`_Malformed` instead, and the method answers
    INVALID_ARGUMENT naming the message type (a client's mistake), for every unary and
    server-streaming method (Triton's service and the health service).
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def service(self, handler_call_details: Any) -> Any:
        handler = self._inner.service(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        method = handler_call_details.method.rsplit("/", 1)[-1]

        def tolerant(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as exc:  # DecodeError, or what a deserializer raises instead
                return _Malformed(exc)

        async def refuse(request: _Malformed, context: Any) -> None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"malformed {method} request message: {request.error}",
            )

        def unary_like(inner: Any) -> Any:
            async def unary(request: Any, context: Any) -> Any:
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                return await inner(request, context)

            return unary

        if handler.unary_unary is not None:
            return handler._replace(
                request_deserializer=tolerant, unary_unary=unary_like(handler.unary_unary)
            )
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream
            if not inspect.isasyncgenfunction(inner_stream):  # writes with context.write
                return handler._replace(request_deserializer=tolerant, unary_stream=unary_like(inner_stream))

            async def stream(request: Any, context: Any) -> Any:
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                async for item in inner_stream(request, context):
                    yield item

            return handler._replace(request_deserializer=tolerant, unary_stream=stream)
        return handler


class Arrivals(grpc.GenericRpcHandler):  # type: ignore[misc]
    """The first generic handler of a ``grpc.aio`` server: asked for every call first, it
    tells ``on_request`` the call came and serves none (the model side's idle detector)."""

    def __init__(self, on_request: Callable[[], None]) -> None:
        self._on_request = on_request

    def service(self, handler_call_details: Any) -> None:
        self._on_request()


class GenericHandlersOnly:
    """What the generated ``add_*Servicer_to_server`` functions see instead of the server:
    their generic handler is added, their registered-method handlers are not.

    Behaviour is the same (the generic handler serves every method of the service; an
    unknown method is UNIMPLEMENTED either way), but ``grpc.aio``'s serving loop keeps one
    pending request-call future per registered method and waits on all of them
    (``asyncio.wait``) for every call it accepts: with Triton's 20 methods and the health
    service's 3 that cost more per RPC than all of Quiver's own conversion code. With the
    generic handler alone it waits on one future.
    """

    def __init__(self, server: Any) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self._server.add_generic_rpc_handlers(tuple(ParsedByUs(h) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: Any) -> None:
        pass


def _parser(message_class: Any, method: str) -> Callable[[bytes], Any]:
    """``message_class.FromString``, a message that does not parse answered INVALID_ARGUMENT
    naming the message type (as :class:`ParsedByUs` does for ``grpc.aio``)."""
    parse = message_class.FromString

    def tolerant(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # DecodeError, or what a parser raises instead
            raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {method} request message: {exc}") from None

    return tolerant


def _serialized(message: Any) -> bytes:
    data: bytes = message.SerializeToString()
    return data


def service_methods(descriptor: Any, servicer: Any, skip: frozenset[str] = frozenset()) -> dict[str, RpcMethod]:
    """Every method of the service ``descriptor`` describes (but ``skip``), on ``servicer``'s
    methods of the same names, with protobuf messages in and out; Triton's methods carry their
    API group for ``--grpc-restricted-protocol``."""
    methods = {}
    triton = descriptor.full_name == SERVICE_NAME
    for method in descriptor.methods:
        if method.name in skip:
            continue
        path = f"/{descriptor.full_name}/{method.name}"
        methods[path] = RpcMethod(
            path,
            getattr(servicer, method.name),
            request_streaming=method.client_streaming,
            response_streaming=method.server_streaming,
            parse=_parser(message_factory.GetMessageClass(method.input_type), method.name),
            serialize=_serialized,
            group=RPC_GROUPS.get(method.name) if triton else None,
        )
    return methods


def raw_method(name: str, handler: Callable[..., Any], *, streaming: bool = False, compressed: bool = False) -> RpcMethod:
    """A method of Triton's service with bytes in and out (the inferences, the workers' relays)."""
    return RpcMethod(
        f"/{SERVICE_NAME}/{name}", handler, request_streaming=streaming, response_streaming=streaming,
        compressed=compressed, group=RPC_GROUPS.get(name),
    )


__all__ = [
    "RPC_GROUPS", "SERVICE_NAME", "GenericHandlersOnly", "ParsedByUs", "RestrictionInterceptor", "raw_method",
    "service_methods",
]
