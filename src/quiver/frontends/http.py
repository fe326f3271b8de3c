"""KServe v2 over HTTP with Triton's routes, JSON field names and binary tensor extension.

This module only does HTTP: read and bound the body, undo ``Content-Encoding``, call the
:class:`~quiver.service.InferenceService`, encode the answer. Errors become statuses at two
places, both through ``quiver.frontends.status.http_error``: the Starlette app's exception
handler (every route but inference) and the direct inference path's one ``except``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
from collections.abc import Awaitable, Callable
from time import monotonic_ns as now_ns
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from quiver import messages
from quiver.errors import InvalidArgumentError, QuiverError
from quiver.frontends.content_encoding import MIN_COMPRESS_BYTES
from quiver.frontends.content_encoding import compress_for as _compress
from quiver.frontends.headers import HeaderForwarding
from quiver.frontends.http_body import _watch, _whole, read_body
from quiver.frontends.http_generate import GenerateEndpoint
from quiver.frontends.offload import OFFLOAD_NS, in_worker
from quiver.frontends.restrictions import Restrictions, http_group
from quiver.frontends.status import BodyTooLarge, http_error
from quiver.protocol.limits import check_body_depth
from quiver.protocol.v2_json import (
    decode_cost,
    decode_request,
    encode_cost,
    encode_json,
    encode_response,
)
from quiver.raw_input import raw_request
from quiver.service import InferenceService
from quiver.tracing import Trace, TraceManager

JSON = "application/json"
BINARY = "application/octet-stream"


#: Triton's answer to /infer on a decoupled model (generate_stream serves those).
DECOUPLED_ERROR = "HTTP end point doesn't support models with decoupled transaction policy"


def _error(status: int, message: str) -> Response:
    return Response(encode_json({"error": message}), status_code=status, media_type=JSON)


def _json(value: Any) -> Response:
    return Response(encode_json(value), media_type=JSON)


class HttpFrontend:
    """Builds the Starlette application for one :class:`InferenceService`."""

    def __init__(
        self,
        service: InferenceService,
        *,
        max_input_size: int = 64 * 1024 * 1024,
        restrictions: Restrictions | None = None,
        header_forward_pattern: str | None = None,
    ) -> None:
        self.service = service
        self.restrictions = restrictions or Restrictions()
        self.forwarding = HeaderForwarding(header_forward_pattern, ignore_case=True)
        self.max_input_size = max_input_size
        self.generate = GenerateEndpoint(service, max_input_size, read_body)
        #: The service's trace settings (None: a service that traces nothing, a worker's).
        self._tracing: TraceManager | None = getattr(service, "tracing", None)
        self._app = Starlette(
            routes=self.routes(),
            exception_handlers={
                404: self._not_found,
                405: self._not_allowed,
                ClientDisconnect: self._disconnected,
                QuiverError: self._failed,
                BodyTooLarge: self._failed,
                # Starlette gives this one to its outermost middleware, which calls it for
                # any exception and then raises the exception again: __call__ drops that.
                Exception: self._failed,
            },
        )

    def routes(self) -> list[Route]:
        model = "/v2/models/{model}"
        versioned = "/v2/models/{model}/versions/{version}"
        return [
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.ready, methods=["GET"]),
            Route("/v2", self.server_metadata, methods=["GET"]),
            # POST .../infer is served by __call__ directly; these give other methods a 405.
            Route(model + "/infer", self._unroutable, methods=["POST"]),
            Route(versioned + "/infer", self._unroutable, methods=["POST"]),
            Route(model + "/generate", self._unroutable, methods=["POST"]),
            Route(versioned + "/generate", self._unroutable, methods=["POST"]),
            Route(model + "/generate_stream", self._unroutable, methods=["POST"]),
            Route(versioned + "/generate_stream", self._unroutable, methods=["POST"]),
            Route("/v2/models/stats", self.model_statistics, methods=["GET"]),
            Route(model + "/stats", self.model_statistics, methods=["GET"]),
            Route(versioned + "/stats", self.model_statistics, methods=["GET"]),
            Route("/v2/repository/index", self.repository_index, methods=["POST"]),
            Route("/v2/repository/models/{model}/load", self.repository_load, methods=["POST"]),
            Route("/v2/repository/models/{model}/unload", self.repository_unload, methods=["POST"]),
            Route("/v2/logging", self.logging, methods=["GET", "POST"]),
            Route("/v2/trace/setting", self.trace_setting, methods=["GET", "POST"]),
            Route(model + "/trace/setting", self.trace_setting, methods=["GET", "POST"]),
            *self._shared_memory_routes(),
            Route(model + "/ready", self.model_ready, methods=["GET"]),
            Route(versioned + "/ready", self.model_ready, methods=["GET"]),
            Route(model + "/config", self.model_config, methods=["GET"]),
            Route(versioned + "/config", self.model_config, methods=["GET"]),
            Route(model, self.model_metadata, methods=["GET"]),
            Route(versioned, self.model_metadata, methods=["GET"]),
        ]

    def app(self) -> ASGIApp:
        """The ASGI application: inference on a direct path, the rest through Starlette."""
        return self

    async def _unroutable(self, request: Request) -> Response:
        return _error(404, f"no route for {request.method} {request.url.path}")

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return _error(404, f"no route for {request.method} {request.url.path}")

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return _error(405, f"method {request.method} is not allowed on {request.url.path}")

    async def _disconnected(self, request: Request, exc: Exception) -> Response:
        return Response(status_code=400)

    async def _failed(self, request: Request, exc: Exception) -> Response:
        """The one translation of the routes' errors to statuses."""
        status, message = http_error(
            exc,
            model=request.path_params.get("model", ""),
            where=f"{request.method} {request.url.path}",
        )
        return _error(status, message)

    # -- health and metadata ---------------------------------------------------------

    async def live(self, request: Request) -> Response:
        return Response(status_code=200)

    async def ready(self, request: Request) -> Response:
        return Response(status_code=200 if self.service.server_ready() else 503)

    async def server_metadata(self, request: Request) -> Response:
        return _json(self.service.server_metadata())

    async def model_ready(self, request: Request) -> Response:
        name = request.path_params["model"]
        version = request.path_params.get("version", "")
        if await self.service.model_ready_checked(name, version):
            return Response(status_code=200)
        self.service.check_model(name, version)
        return Response(status_code=503)  # the model's own is_ready() said no (or raced a load)

    async def model_metadata(self, request: Request) -> Response:
        return _json(
            self.service.model_metadata(request.path_params["model"], request.path_params.get("version", ""))
        )

    async def model_config(self, request: Request) -> Response:
        return _json(
            self.service.model_config(request.path_params["model"], request.path_params.get("version", ""))
        )

    # -- statistics, repository and logging extensions -----------------------------------

    async def model_statistics(self, request: Request) -> Response:
        return _json(
            self.service.model_statistics(
                request.path_params.get("model", ""), request.path_params.get("version", "")
            )
        )

    async def _json_body(self, request: Request) -> dict[str, Any]:
        """A small JSON object body (empty means ``{}``), bounded by the input size limit."""
        limit = self.max_input_size
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise BodyTooLarge(limit)
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(limit)
            chunks.append(chunk)
        body = b"".join(chunks)
        if not body.strip():
            return {}
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise InvalidArgumentError(f"malformed JSON in request body: {exc}") from None
        if not isinstance(value, dict):
            raise InvalidArgumentError("request body must be a JSON object")
        check_body_depth(value, body, "request body")
        return value

    async def repository_index(self, request: Request) -> Response:
        body = await self._json_body(request)
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidArgumentError("'ready' must be true or false")
        return _json(await self.service.repository_index(ready))

    async def repository_load(self, request: Request) -> Response:
        name = request.path_params["model"]
        params = _parameters(await self._json_body(request))
        config = params.pop("config", None)
        if config is not None and not isinstance(config, str):
            raise InvalidArgumentError("load parameter 'config' must be a JSON string")
        files: dict[str, bytes] = {}
        for key, value in params.items():
            if not key.startswith("file:"):
                continue
            if not isinstance(value, str):
                raise InvalidArgumentError(f"load parameter '{key}' must be base64 text")
            try:
                files[key[5:]] = base64.b64decode(value, validate=True)
            except ValueError:  # binascii.Error, or text that is not ASCII at all
                raise InvalidArgumentError(f"load parameter '{key}' is not valid base64") from None
        await self.service.load_model(name, config, files or None)
        return Response(status_code=200)

    async def repository_unload(self, request: Request) -> Response:
        name = request.path_params["model"]
        dependents = _parameters(await self._json_body(request)).get("unload_dependents", False)
        if not isinstance(dependents, bool):
            raise InvalidArgumentError("unload parameter 'unload_dependents' must be true or false")
        await self.service.unload_model(name, dependents)
        return Response(status_code=200)

    async def logging(self, request: Request) -> Response:
        if request.method == "GET":
            return _json(self.service.log_settings())
        return _json(self.service.update_log_settings(await self._json_body(request)))

    async def trace_setting(self, request: Request) -> Response:
        model = request.path_params.get("model", "")
        changes = await self._json_body(request) if request.method == "POST" else None
        return _json(self.service.trace_settings(model, changes))

    # -- shared-memory extensions -----------------------------------------------------------

    def _shared_memory_routes(self) -> list[Route]:
        routes = []
        for kind in ("system", "cuda"):
            base = f"/v2/{kind}sharedmemory"
            status = functools.partial(self._shm_status, kind)
            register = functools.partial(self._shm_register, kind)
            unregister = functools.partial(self._shm_unregister, kind)
            routes += [
                Route(base + "/status", status, methods=["GET"]),
                Route(base + "/region/{region}/status", status, methods=["GET"]),
                Route(base + "/register", register, methods=["POST"]),
                Route(base + "/region/{region}/register", register, methods=["POST"]),
                Route(base + "/unregister", unregister, methods=["POST"]),
                Route(base + "/region/{region}/unregister", unregister, methods=["POST"]),
            ]
        return routes

    async def _shm_status(self, kind: str, request: Request) -> Response:
        shm = self.service.shared_memory
        region = request.path_params.get("region", "")
        return _json(shm.system_status(region) if kind == "system" else shm.cuda_status(region))

    async def _shm_register(self, kind: str, request: Request) -> Response:
        shm = self.service.shared_memory
        region = request.path_params.get("region", "")
        if kind == "cuda":
            shm.register_cuda(region)
        shm.check_allowed()
        if not region:
            shm.register_system(region, "", 0, 0)  # refused: names the missing region name
        body = await self._json_body(request)
        key = body.get("key")
        if key is None:
            raise InvalidArgumentError("Shared memory register request has no 'key' field")
        if not isinstance(key, str):
            raise InvalidArgumentError("Shared memory register request: 'key' must be a string")
        offset = body.get("offset", 0)
        if type(offset) is not int or offset < 0:
            raise InvalidArgumentError(
                "Shared memory register request: 'offset' must be a non-negative integer"
            )
        if "byte_size" not in body:
            raise InvalidArgumentError("Shared memory register request has no 'byte_size' field")
        byte_size = body["byte_size"]
        if type(byte_size) is not int or byte_size < 0:
            raise InvalidArgumentError(
                "Shared memory register request: 'byte_size' must be a non-negative integer"
            )
        await asyncio.to_thread(shm.register_system, region, key, offset, byte_size)
        return Response(status_code=200)

    async def _shm_unregister(self, kind: str, request: Request) -> Response:
        shm = self.service.shared_memory
        region = request.path_params.get("region", "")
        if kind == "system":
            shm.unregister_system(region)
        else:
            shm.unregister_cuda(region)
        return Response(status_code=200)

    # -- inference: a lean ASGI path, no router or request objects -----------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.restrictions.required and scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            denied = self.restrictions.denied(http_group(scope["method"], scope["path"]), headers)
            if denied is not None:
                await _send(send, 403, _error_body(denied))
                return
        if scope["type"] == "http" and scope["method"] == "POST":
            path: str = scope["path"]
            if path.startswith("/v2/models/") and path.endswith("/infer"):
                parts = path[11:-6].split("/")
                if len(parts) == 1 and parts[0]:
                    await self._infer(scope, receive, send, parts[0], "")
                    return
                if len(parts) == 3 and parts[0] and parts[1] == "versions" and parts[2]:
                    await self._infer(scope, receive, send, parts[0], parts[2])
                    return
            elif path.startswith("/v2/models/") and path.endswith(("/generate", "/generate_stream")):
                streaming = path.endswith("_stream")
                parts = path[11 : -16 if streaming else -9].split("/")
                if len(parts) == 1 and parts[0]:
                    await self.generate(scope, receive, send, parts[0], "", streaming)
                    return
                if len(parts) == 3 and parts[0] and parts[1] == "versions" and parts[2]:
                    await self.generate(scope, receive, send, parts[0], parts[2], streaming)
                    return
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        with contextlib.suppress(Exception):  # answered and logged by _failed already
            await self._app(scope, receive, send)

    def _infer(self, scope: Scope, receive: Receive, send: Send, model: str, version: str) -> Awaitable[None]:
        """The inference route: the way with trace timestamps only while tracing is on."""
        tracing = self._tracing
        if tracing is None or not tracing.active:
            return self._infer_traced(scope, receive, send, model, version, None)
        return self._infer_sampled(scope, receive, send, model, version)

    async def _infer_sampled(self, scope: Scope, receive: Receive, send: Send, model: str, version: str) -> None:
        received = now_ns()
        trace = self.service.start_trace(model, lambda: _trace_headers(scope))
        if trace is None:
            await self._infer_traced(scope, receive, send, model, version, None)
            return
        trace.capture("HTTP_RECV_START", received)
        try:
            await self._infer_traced(scope, receive, send, model, version, trace)
        finally:
            trace.capture("HTTP_SEND_END")
            trace.release()

    async def _infer_traced(
        self, scope: Scope, receive: Receive, send: Send, model: str, version: str, trace: Trace | None
    ) -> None:
        extensions = scope.get("extensions")
        respond = extensions.get(RESPOND) if extensions else None
        at_hand = extensions.get(BODY) if extensions else None
        # the last of each header, as a loop over them would keep (one C call, no loop)
        fields: dict[bytes, bytes] = dict(scope["headers"])
        content_length = fields.get(b"content-length")
        raw_length = fields.get(b"inference-header-content-length")
        encoding = fields.get(b"content-encoding")
        accept = fields.get(b"accept-encoding")
        try:
            try:
                body = _whole(at_hand, content_length, self.max_input_size) if at_hand and encoding is None else None
                if body is None:
                    body = await self._read_body(receive, content_length, encoding)
            except BodyTooLarge:
                if raw_length is None or raw_length.strip() != b"0":
                    raise
                size = f"more than {self.max_input_size}"
                if content_length is not None and content_length.isdigit():
                    size = content_length.decode()
                raise BodyTooLarge(
                    self.max_input_size, messages.raw_input_too_large(size, self.max_input_size)
                ) from None
            header_length = None
            if raw_length is not None:
                try:
                    header_length = int(raw_length)
                except ValueError:
                    raise InvalidArgumentError(
                        "Inference-Header-Content-Length must be an integer, got "
                        f"'{raw_length.decode('latin-1')}'"
                    ) from None
            if header_length == 0:  # the whole body is the one input (raw binary request)
                infer_request = raw_request(body, model, version)
            elif decode_cost(body, header_length) < OFFLOAD_NS:
                infer_request = decode_request(body, header_length, model, version)
            else:
                infer_request = await in_worker(decode_request, body, header_length, model, version)
            if trace is not None:
                trace.capture("HTTP_RECV_END")
                infer_request.trace = trace
            if self.forwarding.regex is not None:
                self.forwarding.apply(
                    ((k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]),
                    infer_request,
                )
            response = await self.service.infer(
                infer_request, decoupled_error=DECOUPLED_ERROR, watch=_watch(receive, infer_request)
            )
            if trace is not None:
                trace.capture("INFER_RESPONSE_COMPLETE")
            if encode_cost(response, infer_request) < OFFLOAD_NS:
                payload, json_length = encode_response(response, infer_request)
            else:
                payload, json_length = await in_worker(encode_response, response, infer_request)
        except ClientDisconnect:
            return  # nobody to answer
        except Exception as exc:
            status, message = http_error(exc, model=model, where=f"inference on model '{model}'")
            await _send(send, status, _error_body(message), respond=respond)
            return
        if respond is not None and (accept is None or len(payload) < MIN_COMPRESS_BYTES):
            if trace is not None:
                trace.capture("HTTP_SEND_START")
            respond(200, _JSON_LINES if json_length is None else _BINARY_LINES % json_length, payload)
            return
        headers: list[tuple[bytes, bytes]] = []
        content_type = _JSON
        if json_length is not None:
            headers.append((b"inference-header-content-length", str(json_length).encode()))
            content_type = _BINARY
        if accept is not None:
            payload = await _compress(payload, accept.decode("latin-1"), headers)
        if trace is not None:
            trace.capture("HTTP_SEND_START")
        await _send(send, 200, payload, content_type, headers, respond=respond)

    async def _read_body(self, receive: Receive, content_length: bytes | None, encoding: bytes | None) -> bytes:
        return await read_body(receive, content_length, encoding, self.max_input_size)


_JSON = JSON.encode()
_BINARY = BINARY.encode()


def _error_body(message: str) -> bytes:
    return encode_json({"error": message})


#: The ASGI scope extension of Quiver's HTTP server (``http_server.py``): a callable that
#: answers the request at once, ``respond(status, header_lines, payload)``.
RESPOND = "quiver.respond"
#: Its extension that gives the whole request body at once when it has all of it and the
#: app has read none of it (else None): ``body()``.
BODY = "quiver.body"
_CONTENT_TYPES = {_JSON: b"content-type: application/json\r\n", _BINARY: b"content-type: application/octet-stream\r\n"}
_JSON_LINES = _CONTENT_TYPES[_JSON]
_BINARY_LINES = _CONTENT_TYPES[_BINARY] + b"inference-header-content-length: %d\r\n"


async def _send(
    send: Send,
    status: int,
    payload: bytes,
    content_type: bytes = _JSON,
    headers: list[tuple[bytes, bytes]] | None = None,
    *,
    respond: Callable[[int, bytes, bytes], None] | None = None,
) -> None:
    """The whole response: through ``respond`` (the server's ``quiver.respond`` extension,
    one write, no ASGI messages) when the server offers it, else two ASGI messages."""
    if respond is not None:
        lines = _CONTENT_TYPES.get(content_type) or b"content-type: " + content_type + b"\r\n"
        if headers:
            for name, value in headers:
                lines += name + b": " + value + b"\r\n"
        respond(status, lines, payload)
        return
    all_headers = [(b"content-type", content_type), (b"content-length", str(len(payload)).encode())]
    if headers:
        all_headers.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": payload})


def _trace_headers(scope: Scope) -> dict[str, str]:
    """The headers an OpenTelemetry context may come in (W3C trace context)."""
    return {
        k.decode("latin-1"): v.decode("latin-1")
        for k, v in scope["headers"]
        if k in (b"traceparent", b"tracestate")
    }


def _parameters(body: dict[str, Any]) -> dict[str, Any]:
    params = body.get("parameters", {})
    if not isinstance(params, dict):
        raise InvalidArgumentError("'parameters' must be a JSON object")
    return dict(params)


__all__ = ["HttpFrontend"]
