"""KServe v2 over gRPC with Triton's service (``inference.GRPCInferenceService``).

The servicer subclasses the base class ``tritonclient`` ships, so every RPC not written here
answers UNIMPLEMENTED, as the base class does. This module only does gRPC: decode messages,
call the :class:`~quiver.service.InferenceService`, encode the answer. Errors become statuses
at one place, :func:`_rpc` (``quiver.frontends.status.grpc_error``): a unary RPC aborts with
the status, a stream's request is answered with ``error_message``. The standard health service
(``grpc.health.v1.Health``) runs beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import gc
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from time import monotonic_ns as now_ns
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from quiver.errors import InvalidArgumentError
from quiver.frontends.grpc_plumbing import (
    SERVICE_NAME,
    Arrivals,
    GenericHandlersOnly,
    RestrictionInterceptor,
    raw_method,
    service_methods,
)
from quiver.frontends.grpc_server import GrpcServer, RpcMethod, keepalive_from, tls_context
from quiver.frontends.grpc_stream import StreamAborted, serve_stream
from quiver.frontends.headers import HeaderForwarding
from quiver.frontends.offload import OFFLOAD_NS, PARSE_INLINE_BYTES, in_worker
from quiver.frontends.restrictions import Restrictions
from quiver.frontends.status import grpc_error
from quiver.protocol.v2_grpc import (
    decode_cost,
    decode_infer_request,
    encode_cost,
    encode_infer_response,
)
from quiver.service import InferenceService
from quiver.triton_flags import GrpcTls
from quiver.types import InferenceRequest, InferenceResponse

DEFAULT_MAX_MESSAGE_SIZE = 64 * 1024 * 1024


#: (model, request id) of the current RPC or stream request, once known: an unexpected
#: error's message names the model, a stream's error answer carries the id. Each RPC and each
#: stream request runs in its own task, with its own copy.
_call: contextvars.ContextVar[tuple[str, str]] = contextvars.ContextVar("quiver_grpc_call", default=("", ""))

#: Triton's answer to ModelInfer on a decoupled model (ModelStreamInfer serves those).
DECOUPLED_ERROR = "ModelInfer RPC doesn't support models with decoupled transaction policy"

#: Messages this small decode inline whatever they hold: at most one element per byte, at
#: most 250 ns per element (v2_grpc.decode_cost), under OFFLOAD_NS.
_DECODE_INLINE_BYTES = OFFLOAD_NS // 250

_Reply = TypeVar("_Reply")
_Servicer = TypeVar("_Servicer", bound="InferenceServicer")


def _translated(exc: Exception, rpc: str) -> tuple[grpc.StatusCode, str]:
    model = _call.get()[0]
    where = f"gRPC {rpc} on model '{model}'" if model else f"gRPC {rpc}"
    return grpc_error(exc, model=model, where=where)


def _rpc(
    method: Callable[[_Servicer, Any, Any], Awaitable[_Reply]],
) -> Callable[[_Servicer, Any, Any], Awaitable[_Reply]]:
    """The one translation of a unary RPC's errors: ``context.abort`` with the status."""

    @functools.wraps(method)
    async def call(self: _Servicer, request: Any, context: Any) -> _Reply:
        _call.set((getattr(request, "name", "") or getattr(request, "model_name", ""), ""))
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise  # the method aborted with its own status
        except Exception as exc:
            code, message = _translated(exc, method.__name__)
        await context.abort(code, message)
        raise AssertionError("context.abort returned")  # pragma: no cover

    return call


def _tensor_metadata(entries: list[dict[str, Any]]) -> list[Any]:
    return [
        pb.ModelMetadataResponse.TensorMetadata(
            name=t["name"], datatype=t["datatype"], shape=t["shape"]
        )
        for t in entries
    ]


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """Triton's GRPCInferenceService over one :class:`InferenceService`."""

    def __init__(self, service: InferenceService, header_forward_pattern: str | None = None) -> None:
        self.service = service
        self.forwarding = HeaderForwarding(header_forward_pattern)
        self._in_flight = 0  # inferences received and not yet answered
        self._idle = asyncio.Event()
        self._idle.set()

    def _enter(self) -> None:
        self._in_flight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._in_flight -= 1
        if not self._in_flight:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Until no inference is in flight (open streams with nothing pending are idle)."""
        await self._idle.wait()

    # -- health and metadata ---------------------------------------------------------

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=self.service.server_ready())

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        metadata = self.service.server_metadata()
        return pb.ServerMetadataResponse(
            name=metadata["name"], version=metadata["version"], extensions=metadata["extensions"]
        )

    @_rpc
    async def ModelReady(self, request: Any, context: Any) -> Any:
        # Triton answers an unknown model with ready=false, not an error; a version that is
        # not a positive integer is INVALID_ARGUMENT.
        return pb.ModelReadyResponse(ready=await self.service.model_ready_checked(request.name, request.version))

    @_rpc
    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        metadata = self.service.model_metadata(request.name, request.version)
        return pb.ModelMetadataResponse(
            name=metadata["name"],
            versions=metadata["versions"],
            platform=metadata["platform"],
            inputs=_tensor_metadata(metadata["inputs"]),
            outputs=_tensor_metadata(metadata["outputs"]),
        )

    @_rpc
    async def ModelConfig(self, request: Any, context: Any) -> Any:
        return pb.ModelConfigResponse(config=self.service.model_config_proto(request.name, request.version))

    # -- statistics, repository and logging extensions -------------------------------------

    @_rpc
    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        stats = self.service.model_statistics(request.name, request.version)
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)

    @_rpc
    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        entries = await self.service.repository_index(request.ready)
        return pb.RepositoryIndexResponse(
            models=[pb.RepositoryIndexResponse.ModelIndex(**entry) for entry in entries]
        )

    @_rpc
    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        config: str | None = None
        files: dict[str, bytes] = {}
        for key, value in request.parameters.items():
            if key == "config":
                if value.WhichOneof("parameter_choice") != "string_param":
                    raise InvalidArgumentError("load parameter 'config' must be a string_param")
                config = value.string_param
            elif key.startswith("file:"):
                if value.WhichOneof("parameter_choice") != "bytes_param":
                    raise InvalidArgumentError(f"load parameter '{key}' must be a bytes_param")
                files[key[5:]] = value.bytes_param
        await self.service.load_model(request.model_name, config, files or None)
        return pb.RepositoryModelLoadResponse()

    @_rpc
    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        dependents = False
        if "unload_dependents" in request.parameters:
            value = request.parameters["unload_dependents"]
            if value.WhichOneof("parameter_choice") != "bool_param":
                raise InvalidArgumentError("unload parameter 'unload_dependents' must be a bool_param")
            dependents = value.bool_param
        await self.service.unload_model(request.model_name, dependents)
        return pb.RepositoryModelUnloadResponse()

    @_rpc
    async def LogSettings(self, request: Any, context: Any) -> Any:
        changes: dict[str, Any] = {}
        for key, value in request.settings.items():
            kind = value.WhichOneof("parameter_choice")
            changes[key] = getattr(value, kind) if kind else None
        settings = self.service.update_log_settings(changes) if changes else self.service.log_settings()
        response = pb.LogSettingsResponse()
        for key, setting in settings.items():
            entry = response.settings[key]
            if isinstance(setting, bool):
                entry.bool_param = setting
            elif isinstance(setting, int):
                entry.uint32_param = setting
            else:
                entry.string_param = str(setting)
        return response

    @_rpc
    async def TraceSetting(self, request: Any, context: Any) -> Any:
        changes = {key: list(value.value) or None for key, value in request.settings.items()}
        settings = self.service.trace_settings(request.model_name, changes or None)
        response = pb.TraceSettingResponse()
        for key, value in settings.items():
            response.settings[key].value.extend(value if isinstance(value, list) else [value])
        return response

    # -- shared-memory extensions -------------------------------------------------------

    @_rpc
    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        response = pb.SystemSharedMemoryStatusResponse()
        for region in self.service.shared_memory.system_status(request.name):
            response.regions[str(region["name"])].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(**region)
            )
        return response

    @_rpc
    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        shm = self.service.shared_memory
        await asyncio.to_thread(
            shm.register_system, request.name, request.key, request.offset, request.byte_size
        )
        return pb.SystemSharedMemoryRegisterResponse()

    @_rpc
    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        self.service.shared_memory.unregister_system(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @_rpc
    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        self.service.shared_memory.cuda_status(request.name)  # none: no GPU support
        return pb.CudaSharedMemoryStatusResponse()

    @_rpc
    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        self.service.shared_memory.register_cuda(request.name)
        return pb.CudaSharedMemoryRegisterResponse()  # pragma: no cover - always refused

    @_rpc
    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        self.service.shared_memory.unregister_cuda(request.name)
        return pb.CudaSharedMemoryUnregisterResponse()

    # -- inference -------------------------------------------------------------------
    #
    # ModelInfer and ModelStreamInfer are served by RawInferHandler with no (de)serializers:
    # the servicer gets the message bytes and returns bytes, so a large message is parsed,
    # decoded, encoded and serialized on a codec thread (frontends/offload.py), and a small
    # one inline, as grpc would have. A message that is not a ModelInferRequest is then
    # INVALID_ARGUMENT rather than grpc's own failure.

    async def _infer(
        self, data: bytes, serialize: Callable[[InferenceResponse], bytes], context: Any = None
    ) -> bytes:
        """Parse, decode, infer, encode and serialize one ModelInferRequest."""
        request = await self.decode(data, context)
        trace = request.trace
        try:
            response = await self.service.infer(request, decoupled_error=DECOUPLED_ERROR)
            if trace is not None:
                trace.capture("INFER_RESPONSE_COMPLETE")
                trace.capture("GRPC_SEND_START")
            if encode_cost(response) < OFFLOAD_NS:
                return serialize(response)
            return await in_worker(serialize, response)
        finally:
            if trace is not None:
                trace.capture("GRPC_SEND_END")  # handed to grpc, which sends it
                trace.release()

    async def model_infer_bytes(self, data: bytes, context: Any) -> bytes:
        """ModelInfer: a serialized ModelInferRequest in, a ModelInferResponse out (errors
        translated as :func:`_rpc` does, inline: this runs for every request)."""
        self._in_flight += 1
        self._idle.clear()
        try:
            return await self._infer(data, _serialized_response, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            code, message = _translated(exc, "ModelInfer")
        finally:
            self._leave()
        await context.abort(code, message)
        raise AssertionError("context.abort returned")  # pragma: no cover

    async def decode(self, data: bytes, context: Any = None) -> InferenceRequest:
        """A serialized ModelInferRequest -> the request (large ones on a codec thread), with
        its forwarded headers and its trace when sampled (the caller releases it once the
        request is answered)."""
        received = now_ns()
        size = len(data)
        if size < PARSE_INLINE_BYTES:
            message = _parse_request(data)
        else:
            message = await in_worker(_parse_request, data)
        _call.set((message.model_name, message.id))
        # Decoding costs per element, and a message holds fewer elements than it has bytes:
        # a small one is decoded inline without estimating (decode_cost walks the inputs).
        if size < _DECODE_INLINE_BYTES or decode_cost(message) < OFFLOAD_NS:
            request = decode_infer_request(message)
        else:
            request = await in_worker(decode_infer_request, message)
        if self.forwarding and context is not None:
            self.forwarding.apply(context.invocation_metadata() or (), request)
        trace = self.service.start_trace(request.model_name, lambda: _metadata(context))
        if trace is not None:
            trace.capture("GRPC_WAITREAD_START", received)
            trace.capture("GRPC_WAITREAD_END")
            request.trace = trace
        return request

    async def model_stream_infer_bytes(
        self, request_iterator: AsyncIterator[bytes], context: Any
    ) -> AsyncIterator[bytes]:
        """ModelStreamInfer: see :mod:`quiver.frontends.grpc_stream`."""
        metadata = {key.lower(): value for key, value in (context.invocation_metadata() or ())}
        abort = str(metadata.get("triton_grpc_error", "")).strip().lower() == "true"
        try:
            async for message in serve_stream(self, request_iterator, abort_on_error=abort, context=context):
                yield message
        except StreamAborted as exc:
            await context.abort(exc.code, exc.message)


def _metadata(context: Any) -> dict[str, str]:
    """The call's metadata an OpenTelemetry context may come in (W3C trace context)."""
    if context is None:
        return {}
    return {k: v for k, v in (context.invocation_metadata() or ()) if k in ("traceparent", "tracestate")}


def _parse_request(data: bytes) -> Any:
    try:
        return pb.ModelInferRequest.FromString(data)
    except DecodeError as exc:
        raise InvalidArgumentError(f"malformed ModelInferRequest message: {exc}") from None


def _serialized_response(response: InferenceResponse) -> bytes:
    serialized: bytes = encode_infer_response(response).SerializeToString()
    return serialized


class RawInferHandler(grpc.GenericRpcHandler):  # type: ignore[misc]
    """ModelInfer and ModelStreamInfer with bytes in and out (see InferenceServicer)."""

    def __init__(self, servicer: InferenceServicer) -> None:
        self._handlers = {
            f"/{SERVICE_NAME}/ModelInfer": grpc.unary_unary_rpc_method_handler(
                servicer.model_infer_bytes
            ),
            f"/{SERVICE_NAME}/ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                servicer.model_stream_infer_bytes
            ),
        }

    def service(self, handler_call_details: Any) -> Any:
        return self._handlers.get(handler_call_details.method)


def inference_methods(servicer: InferenceServicer) -> dict[str, RpcMethod]:
    """ModelInfer and ModelStreamInfer with bytes in and out (see InferenceServicer), their
    answers compressed at --grpc-infer-response-compression-level (Triton compresses those)."""
    methods = (
        raw_method("ModelInfer", servicer.model_infer_bytes, compressed=True),
        raw_method("ModelStreamInfer", servicer.model_stream_infer_bytes, streaming=True, compressed=True),
    )
    return {method.name: method for method in methods}


def health_methods(servicer: Any) -> dict[str, RpcMethod]:
    """The standard health service (``grpc.health.v1.Health``) on ``servicer``."""
    return service_methods(health_pb2.DESCRIPTOR.services_by_name["Health"], servicer)


#: --grpc-server: Quiver's own HTTP/2 server on the event loop, or grpcio's grpc.aio server.
GRPC_SERVERS = ("quiver", "grpcio")


class GrpcFrontend:
    """The gRPC server (Quiver's own, or ``grpc.aio``'s with ``server_kind="grpcio"``): the
    inference service, the health service, start and stop."""

    def __init__(
        self,
        service: InferenceService,
        *,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        restrictions: Restrictions | None = None,
        header_forward_pattern: str | None = None,
        tls: GrpcTls | None = None,
        options: Sequence[tuple[str, int]] = (),
        compression_level: int = 0,
        reuse_port: bool = False,
        server_kind: str = "quiver",
        on_request: Callable[[], None] | None = None,
    ) -> None:
        if server_kind not in GRPC_SERVERS:
            raise ValueError(f"unknown gRPC server '{server_kind}'; known: {', '.join(GRPC_SERVERS)}")
        self.server_kind = server_kind
        self.service = service
        self.max_message_size = max_message_size
        self.restrictions = restrictions or Restrictions()
        self.tls = tls
        #: keepalive and HTTP/2 ping channel arguments (--grpc-keepalive-* ...).
        self.options = list(options)
        self.compression_level = compression_level
        self.reuse_port = reuse_port
        #: Called as each call arrives, whatever it asks (``InferenceService.request_came``).
        self.on_request = on_request
        self.servicer = InferenceServicer(service, header_forward_pattern)
        self.health = health.aio.HealthServicer()
        self.server: Any = None

    def methods(self) -> dict[str, RpcMethod]:
        """What Quiver's own server dispatches to: Triton's service and the health service."""
        skip = frozenset(("ModelInfer", "ModelStreamInfer"))
        triton = service_methods(pb.DESCRIPTOR.services_by_name["GRPCInferenceService"], self.servicer, skip)
        return {**triton, **inference_methods(self.servicer), **health_methods(self.health)}

    async def start(self, address: str, port: int) -> int:
        """Bind and start serving (health NOT_SERVING until :meth:`set_serving`); returns the port."""
        if self.server_kind == "grpcio":
            return await self._start_grpcio(address, port)
        server = GrpcServer(
            self.methods(),
            max_receive_message_size=self.max_message_size,
            max_send_message_size=self.max_message_size,
            restrictions=self.restrictions,
            compression_level=self.compression_level,
            keepalive=keepalive_from(self.options),
            on_request=self.on_request,
        )
        context = tls_context(self.tls) if self.tls is not None else None
        bound = await server.start(address, port, ssl_context=context, reuse_port=self.reuse_port)
        await self.set_serving(False)
        self.server = server
        return bound

    async def _start_grpcio(self, address: str, port: int) -> int:
        options: list[tuple[str, int]] = [
            ("grpc.max_receive_message_length", self.max_message_size),
            ("grpc.max_send_message_length", self.max_message_size),
            # a port in use is an error, not a shared listener (unless --reuse-grpc-port)
            ("grpc.so_reuseport", 1 if self.reuse_port else 0),
            *self.options,
        ]
        compression = None
        if self.compression_level:  # --grpc-infer-response-compression-level
            compression = grpc.Compression.Gzip
            options.append(("grpc.default_compression_level", self.compression_level))
        server = grpc.aio.server(
            interceptors=[RestrictionInterceptor(self.restrictions)] if self.restrictions else None,
            options=options,
            compression=compression,
        )
        self.add_handlers(server)
        target = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        try:
            if self.tls is None:
                bound = int(server.add_insecure_port(target))
            else:
                credentials = grpc.ssl_server_credentials(
                    [(self.tls.server_key, self.tls.server_cert)],
                    root_certificates=self.tls.root_cert,
                    require_client_auth=self.tls.mutual,
                )
                bound = int(server.add_secure_port(target, credentials))
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {target} (gRPC): {exc}") from None
        if bound == 0:
            raise OSError(f"cannot listen on {target} (gRPC)")
        await self.set_serving(False)
        await server.start()
        self.server = server
        return bound

    def add_handlers(self, server: Any) -> None:
        """Triton's service and the health service on ``server``."""
        if self.on_request is not None:  # first: asked for every call
            server.add_generic_rpc_handlers((Arrivals(self.on_request),))
        # Then: the generated handler's ModelInfer and ModelStreamInfer are never reached.
        server.add_generic_rpc_handlers((RawInferHandler(self.servicer),))
        generic_only = GenericHandlersOnly(server)
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(self.servicer, generic_only)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, generic_only)

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def begin_shutdown(self) -> None:
        """Health NOT_SERVING for good (later :meth:`set_serving` calls are ignored)."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float = 30.0) -> None:
        """Health NOT_SERVING, refuse new RPCs, let in-flight inferences finish within
        ``grace``, then close what is left: open streams with nothing pending (a stream or
        health watch a client keeps open must not hold the shutdown for the whole grace)."""
        await self.begin_shutdown()
        server, self.server = self.server, None
        if server is None:
            return
        if isinstance(server, GrpcServer):
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace
            server.begin_stop()  # GOAWAY: no new calls
            idle = asyncio.gather(self.servicer.wait_idle(), server.wait_unary_calls())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(idle, grace)
            await server.drain(deadline - loop.time())  # answers on their way finish
            await server.close()
            return
        stopping = asyncio.create_task(server.stop(grace))  # refuses new RPCs now
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.servicer.wait_idle(), grace)
        await server.stop(0)
        await stopping
        # Let the stopped server be freed now, while its event loop still runs: freed later,
        # at interpreter exit after the loop has closed, grpc.aio can crash the process
        # (SIGSEGV; seen when start-up failed right after the gRPC listener opened).
        del server, stopping
        gc.collect()
        await asyncio.sleep(0)


__all__ = [
    "DECOUPLED_ERROR", "GRPC_SERVERS", "GrpcFrontend", "InferenceServicer", "RawInferHandler", "health_methods",
    "inference_methods",
]
