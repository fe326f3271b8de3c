"""The SageMaker container contract, as Triton's SageMaker frontend serves it.

One ASGI app on ``--sagemaker-port`` (8080, or ``SAGEMAKER_BIND_TO_PORT``):

- ``GET /ping``: 200 when the server is ready (``SAGEMAKER_TRITON_PING_MODE=ready``, the
  default; in single-model mode the default model must be READY too) or merely live
  (``live``), else 503.
- ``POST /invocations``: single-model mode infers on ``SAGEMAKER_TRITON_DEFAULT_MODEL_NAME``
  (or the only model loaded that is not a step of a loaded ensemble); multi-model mode
  (``SAGEMAKER_MULTI_MODEL=true``) on the model the ``X-Amzn-SageMaker-Target-Model``
  header names (missing: 400).
- The multi-model API: ``POST /models`` ``{"model_name", "url"}`` (load; 409 when
  ``model_name`` is loaded, 507 out of memory), ``GET /models`` (``max_results``,
  ``next_page_token`` -> ``nextPageToken``), ``GET /models/{name}``, ``DELETE
  /models/{name}`` (unload with the ensemble's composing models nothing else uses) and
  ``POST /models/{name}/invoke``.

Inference bodies are KServe v2 JSON, or JSON followed by binary tensors with content type
``application/vnd.sagemaker-triton.binary+json;json-header-size=N`` (SageMaker allows no
custom headers, so the JSON length travels in the content type); answers mirror that.
Errors are ``{"error": message}`` with the status of ``quiver.frontends.status``, except
that running out of memory or disk (:data:`quiver.service.CAPACITY_ERRORS`) is 507, the
status that makes SageMaker unload models and try again.

``model_name`` in the multi-model API is SageMaker's opaque name (a hash of the
TargetModel). What it maps to, where a ``url`` loads from, and what unloads with it are the
service's decisions (:meth:`InferenceService.register_sagemaker_model` and its neighbours);
this module only speaks HTTP.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from time import monotonic_ns as now_ns
from typing import Any
from urllib.parse import parse_qs, unquote

import orjson
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from quiver.errors import (
    InvalidArgumentError,
    NotFoundError,
    QuiverError,
    UnavailableError,
)
from quiver.frontends.http import DECOUPLED_ERROR, _trace_headers
from quiver.frontends.http_body import _watch, read_body
from quiver.frontends.http_generate import GenerateEndpoint
from quiver.frontends.offload import OFFLOAD_NS, in_worker
from quiver.frontends.status import http_error, http_status
from quiver.protocol.limits import check_body_depth
from quiver.protocol.v2_json import (
    decode_cost,
    decode_request,
    encode_cost,
    encode_json,
    encode_response,
)
from quiver.service import CAPACITY_ERRORS, InferenceService, Registration
from quiver.tracing import Trace
from quiver.types import InferenceResponse

logger = logging.getLogger(__name__)

BINARY_JSON = "application/vnd.sagemaker-triton.binary+json"
BINARY_JSON_PREFIX = BINARY_JSON + ";json-header-size="
TARGET_MODEL_HEADER = "x-amzn-sagemaker-target-model"
DEFAULT_PORT = 8080
#: ``GET /models`` pages hold at most this many models unless ``max_results`` says fewer.
MAX_PAGE = 1000
_TRUE = {"true", "1", "yes", "on"}
#: ``SAGEMAKER_TRITON_INFERENCE_TYPE`` / ``--sagemaker-inference-type`` values.
INFERENCE_TYPES = ("infer", "generate", "generate_stream")


def _env_true(value: str | None) -> bool:
    return value is not None and value.strip().lower() in _TRUE


def enabled_by_env(env: Mapping[str, str] | None = None) -> bool:
    """SageMaker variables turn the frontend on, as Triton's SageMaker container does."""
    env = os.environ if env is None else env
    return "SAGEMAKER_MULTI_MODEL" in env or any(k.startswith("SAGEMAKER_TRITON_") for k in env)


def parse_port_range(text: str) -> tuple[int, int]:
    """``SAGEMAKER_SAFE_PORT_RANGE`` / ``--sagemaker-safe-port-range``: ``LOW-HIGH``."""
    low, sep, high = text.strip().partition("-")
    try:
        first, last = int(low), int(high)
    except ValueError:
        raise InvalidArgumentError(
            f"SageMaker safe port range must be LOW-HIGH, such as 8000-9999; got '{text}'"
        ) from None
    if not sep or not 0 < first <= last <= 65535:
        raise InvalidArgumentError(
            f"SageMaker safe port range must be LOW-HIGH with 0 < LOW <= HIGH <= 65535; got '{text}'"
        )
    return first, last


def check_port(port: int, safe_range: tuple[int, int] | None) -> None:
    """Refuse a SageMaker port outside the safe range (port 0 means: a free one inside it)."""
    if safe_range is None or port == 0:
        return
    low, high = safe_range
    if not low <= port <= high:
        raise InvalidArgumentError(
            f"SageMaker port {port} is outside the safe port range {low}-{high} "
            "(SAGEMAKER_SAFE_PORT_RANGE / --sagemaker-safe-port-range)"
        )


@dataclass(frozen=True, slots=True)
class SageMakerSettings:
    """What Triton's SageMaker variables say; :meth:`from_env` reads them."""

    multi_model: bool = False
    default_model: str = ""
    ping_mode: str = "ready"
    #: What ``POST /invocations`` does (``SAGEMAKER_TRITON_INFERENCE_TYPE``): ``infer``, or
    #: the generate extension's ``generate`` / ``generate_stream``.
    inference_type: str = "infer"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SageMakerSettings:
        env = os.environ if env is None else env
        ping = env.get("SAGEMAKER_TRITON_PING_MODE", "ready").strip().lower() or "ready"
        if ping not in ("ready", "live"):
            raise InvalidArgumentError(
                f"SAGEMAKER_TRITON_PING_MODE must be 'ready' or 'live', got '{ping}'"
            )
        kind = env.get("SAGEMAKER_TRITON_INFERENCE_TYPE", "").strip() or "infer"
        if kind not in INFERENCE_TYPES:
            raise InvalidArgumentError(
                f"Invalid SAGEMAKER_TRITON_INFERENCE_TYPE '{kind}': must be one of: "
                f"{', '.join(INFERENCE_TYPES)}"
            )
        return cls(
            multi_model=_env_true(env.get("SAGEMAKER_MULTI_MODEL")),
            default_model=env.get("SAGEMAKER_TRITON_DEFAULT_MODEL_NAME", "").strip(),
            ping_mode=ping,
            inference_type=kind,
        )


@dataclass(slots=True)
class _Reply:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    trace: Trace | None = None  # a traced invocation's trace, released once the reply is sent


#: An inference handler of the routes: (model, scope, receive) -> the reply.


def _error(status: int, message: str) -> _Reply:
    return _Reply(status, encode_json({"error": message}))


def error_status(exc: QuiverError) -> int:
    """The status table's code, except capacity errors, which are 507."""
    if isinstance(exc, CAPACITY_ERRORS):
        return 507
    return http_status(exc.code)


def _json(value: Any, status: int = 200) -> _Reply:
    return _Reply(status, encode_json(value))


def header_length_from_content_type(content_type: str, body_size: int) -> int | None:
    """N from ``application/vnd.sagemaker-triton.binary+json;json-header-size=N``; None for
    any other content type (the whole body is JSON)."""
    media, _, params = content_type.partition(";")
    if media.strip().lower() != BINARY_JSON:
        if BINARY_JSON in content_type.lower():
            raise InvalidArgumentError(
                f"expected the content type for binary data to start with '{BINARY_JSON_PREFIX}', "
                f"got '{content_type}'"
            )
        return None
    size: str | None = None
    for param in params.split(";"):
        key, _, value = param.partition("=")
        if key.strip().lower() == "json-header-size":
            size = value.strip()
    if size is None:
        raise InvalidArgumentError(
            f"content type '{content_type}' needs the JSON header length: '{BINARY_JSON_PREFIX}N'"
        )
    if not size.isdigit():
        raise InvalidArgumentError(f"json-header-size must be a non-negative integer, got '{size}'")
    length = int(size)
    if length > body_size:
        raise InvalidArgumentError(
            f"json-header-size is {length} but the body has only {body_size} bytes"
        )
    return length


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


class SageMakerFrontend:
    """The ASGI application of the SageMaker listener for one :class:`InferenceService`."""

    def __init__(
        self,
        service: InferenceService,
        settings: SageMakerSettings | None = None,
        *,
        max_input_size: int = 64 * 1024 * 1024,
    ) -> None:
        self.service = service
        self.settings = settings or SageMakerSettings()
        self.max_input_size = max_input_size
        self.generate = GenerateEndpoint(service, max_input_size, read_body)

    @property
    def registered(self) -> dict[str, Registration]:
        """SageMaker model_name -> registration (the service keeps them)."""
        return self.service.registered

    def aliases(self) -> dict[str, str]:
        """SageMaker names and target-model values of registered, READY models -> the model
        each stands for (a cluster router learns these names as served here)."""
        return self.service.aliases()

    # -- ASGI ------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # no websockets, no lifespan
        method: str = scope["method"]
        path: str = scope["path"]
        if path == "/invocations" and method == "POST" and self.settings.inference_type != "infer":
            await self._invoke_generate(scope, receive, send)
            return
        try:
            reply = await self._route(method, path, scope, receive)
        except ClientDisconnect:
            return  # nobody to answer
        if reply is None:
            return
        logger.debug("SageMaker %s %s: %d", method, path, reply.status)  # --log-verbose
        headers = [
            (b"content-type", reply.content_type.encode("latin-1")),
            (b"content-length", str(len(reply.body)).encode()),
            *reply.headers,
        ]
        trace = reply.trace
        if trace is not None:
            trace.capture("HTTP_SEND_START")
        try:
            await send({"type": "http.response.start", "status": reply.status, "headers": headers})
            await send({"type": "http.response.body", "body": reply.body})
        finally:
            if trace is not None:
                trace.capture("HTTP_SEND_END")
                trace.release()

    async def _route(self, method: str, path: str, scope: Scope, receive: Receive) -> _Reply | None:
        if path == "/ping":
            if method not in ("GET", "HEAD"):
                return _not_allowed(method, path)
            return self.ping()
        if path == "/invocations":
            if method != "POST":
                return _not_allowed(method, path)
            return await self._guard(self._invocations(scope, receive), path)
        if path in ("/models", "/models/"):
            if method == "GET":
                return await self._guard(self._list(scope), path)
            if method == "POST":
                return await self._guard(self._load(scope, receive), path)
            return _not_allowed(method, path)
        if path.startswith("/models/"):
            rest = path[len("/models/") :]
            parts = rest.split("/")
            if len(parts) == 2 and parts[0] and parts[1] == "invoke":
                if method != "POST":
                    return _not_allowed(method, path)
                name = unquote(parts[0])
                return await self._guard(self._invoke_named(name, scope, receive), path)
            if len(parts) == 1 and parts[0]:
                name = unquote(parts[0])
                if method == "GET":
                    return await self._guard(self._get(name), path)
                if method == "DELETE":
                    return await self._guard(self._unload(name), path)
                return _not_allowed(method, path)
        return _error(404, f"no route for {method} {path}")

    async def _guard(self, work: Awaitable[_Reply | None], path: str) -> _Reply | None:
        """The one translation of this app's errors to statuses (capacity errors: 507)."""
        try:
            return await work
        except ClientDisconnect:
            raise
        except Exception as exc:
            status, message = http_error(exc, where=f"SageMaker {path}", status_of=error_status)
            return _error(status, message)

    # -- ping --------------------------------------------------------------------------

    def ping(self) -> _Reply:
        if self.settings.ping_mode == "live":
            return _Reply(200)
        if not self.service.ready:
            return _Reply(503)
        default = self.settings.default_model
        if not self.settings.multi_model and default and not self.service.model_ready(default):
            return _Reply(503)
        return _Reply(200)

    # -- inference ---------------------------------------------------------------------

    def default_model(self) -> str:
        """Single-model mode's model: the configured one, else the only one loaded."""
        if self.settings.default_model:
            return self.settings.default_model
        tops = self.service.top_level_models()
        if len(tops) == 1:
            return tops[0]
        if not tops:
            raise UnavailableError("no model is loaded to serve /invocations")
        raise NotFoundError(
            f"/invocations cannot choose among {len(tops)} loaded models ({', '.join(tops)}); "
            "set SAGEMAKER_TRITON_DEFAULT_MODEL_NAME, or SAGEMAKER_MULTI_MODEL=true and the "
            "X-Amzn-SageMaker-Target-Model header"
        )

    async def _invoke_generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``/invocations`` as the generate extension (``SAGEMAKER_TRITON_INFERENCE_TYPE``
        ``generate`` or ``generate_stream``) on the model it would infer on."""
        try:
            model = self._invocation_model(scope)
        except QuiverError as exc:
            reply = _error(*http_error(exc, where="SageMaker /invocations", status_of=error_status))
            await send({"type": "http.response.start", "status": reply.status,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": reply.body})
            return
        await self.generate(scope, receive, send, model, "", self.settings.inference_type == "generate_stream")

    def _invocation_model(self, scope: Scope) -> str:
        return self.invocation_model(self.target_of(scope))

    def target_of(self, scope: Scope) -> str | None:
        """The TargetModel header of a multi-model endpoint's request (None otherwise)."""
        return _headers(scope).get(TARGET_MODEL_HEADER, "").strip() if self.settings.multi_model else None

    def invocation_model(self, target: str | None) -> str:
        """The model ``/invocations`` infers on, given :meth:`target_of` its request."""
        if self.settings.multi_model:
            if not target:
                raise InvalidArgumentError(
                    "multi-model endpoint: the X-Amzn-SageMaker-Target-Model header (TargetModel) "
                    "is required"
                )
            return self.service.resolve_target(target)
        return self.default_model()

    async def _invocations(self, scope: Scope, receive: Receive) -> _Reply | None:
        return await self._infer(self._invocation_model(scope), scope, receive)

    async def _invoke_named(self, name: str, scope: Scope, receive: Receive) -> _Reply | None:
        return await self._infer(self.service.resolve_target(name), scope, receive)

    async def _infer(self, model: str, scope: Scope, receive: Receive) -> _Reply | None:
        received = now_ns()
        trace = self.service.start_trace(model, lambda: _trace_headers(scope))
        if trace is None:
            return await self._infer_traced(model, scope, receive, None)
        trace.capture("HTTP_RECV_START", received)
        try:
            reply = await self._infer_traced(model, scope, receive, trace)
        except BaseException:
            trace.release()
            raise
        if reply is not None:
            reply.trace = trace
        return reply

    async def _infer_traced(self, model: str, scope: Scope, receive: Receive, trace: Trace | None) -> _Reply | None:
        content_length = content_type = encoding = raw_length = None
        for key, value in scope["headers"]:
            if key == b"content-length":
                content_length = value
            elif key == b"content-type":
                content_type = value.decode("latin-1")
            elif key == b"content-encoding":
                encoding = value
            elif key == b"inference-header-content-length":
                raw_length = value
        body = await read_body(receive, content_length, encoding, self.max_input_size)
        header_length = (
            header_length_from_content_type(content_type, len(body)) if content_type else None
        )
        if header_length is None and raw_length is not None:
            # Not SageMaker's way (it allows no custom headers), but what tritonclient sends.
            try:
                header_length = int(raw_length)
            except ValueError:
                raise InvalidArgumentError(
                    f"Inference-Header-Content-Length must be an integer, got '{raw_length.decode('latin-1')}'"
                ) from None
        if decode_cost(body, header_length) < OFFLOAD_NS:
            request = decode_request(body, header_length, model, "")
        else:
            request = await in_worker(decode_request, body, header_length, model, "")
        if trace is not None:
            trace.capture("HTTP_RECV_END")
            request.trace = trace
        response: InferenceResponse
        response = await self.service.infer(request, decoupled_error=DECOUPLED_ERROR, watch=_watch(receive, request))
        if trace is not None:
            trace.capture("INFER_RESPONSE_COMPLETE")
        if encode_cost(response, request) < OFFLOAD_NS:
            payload, json_length = encode_response(response, request)
        else:
            payload, json_length = await in_worker(encode_response, response, request)
        if json_length is None:
            return _Reply(200, payload)
        return _Reply(200, payload, BINARY_JSON_PREFIX + str(json_length))

    # -- multi-model API ---------------------------------------------------------------

    async def _list(self, scope: Scope) -> _Reply:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        limit = MAX_PAGE
        raw_max = query.get("max_results", [""])[-1]
        if raw_max:
            if not (raw_max.isascii() and raw_max.isdigit()) or int(raw_max) < 1:
                raise InvalidArgumentError(f"max_results must be a positive integer, got '{raw_max}'")
            limit = min(int(raw_max), MAX_PAGE)
        after = ""
        token = query.get("next_page_token", [""])[-1]
        if token:
            after = _decode_token(token)
        entries = self.service.sagemaker_models()
        names = sorted(n for n in entries if n > after)
        page = names[:limit]
        reply: dict[str, Any] = {"models": [{"modelName": n, "modelUrl": entries[n]} for n in page]}
        if len(names) > limit:
            reply["nextPageToken"] = _encode_token(page[-1])
        return _json(reply)

    async def _get(self, name: str) -> _Reply:
        url = self.service.sagemaker_models().get(name)
        if url is None:
            raise NotFoundError(f"model '{name}' is not loaded")
        return _json({"modelName": name, "modelUrl": url})

    async def _load(self, scope: Scope, receive: Receive) -> _Reply:
        headers = _headers(scope)
        body = await read_body(
            receive,
            headers.get("content-length", "").encode("latin-1") or None,
            headers.get("content-encoding", "").encode("latin-1") or None,
            self.max_input_size,
        )
        try:
            value = orjson.loads(body) if body.strip() else None
        except orjson.JSONDecodeError as exc:
            raise InvalidArgumentError(f"malformed JSON in load request: {exc}") from None
        if not isinstance(value, dict):
            raise InvalidArgumentError('load request must be a JSON object {"model_name": ..., "url": ...}')
        check_body_depth(value, body, "load request")
        name, url = value.get("model_name"), value.get("url")
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError("load request needs 'model_name', a non-empty string")
        if not isinstance(url, str) or not url:
            raise InvalidArgumentError("load request needs 'url', a non-empty string")
        target = headers.get(TARGET_MODEL_HEADER, "").strip()
        await self.service.register_sagemaker_model(name, url, target)
        return _Reply(200)

    async def _unload(self, name: str) -> _Reply:
        await self.service.unregister_sagemaker_model(name)
        return _Reply(200)


def _encode_token(last: str) -> str:
    """A page token: the last name of the page, URL-safe base64 without padding."""
    return base64.urlsafe_b64encode(last.encode("utf-8")).decode("ascii").rstrip("=")


def _decode_token(token: str) -> str:
    try:
        if not token.isascii() or not token.replace("-", "").replace("_", "").isalnum():
            raise ValueError(token)
        raw = base64.b64decode(token + "=" * (-len(token) % 4), altchars=b"-_", validate=True)
        return raw.decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError):
        raise InvalidArgumentError(f"next_page_token '{token}' is not one this server gave") from None


def _not_allowed(method: str, path: str) -> _Reply:
    return _error(405, f"method {method} is not allowed on {path}")


__all__ = [
    "BINARY_JSON_PREFIX",
    "SageMakerFrontend",
    "SageMakerSettings",
    "check_port",
    "enabled_by_env",
    "parse_port_range",
]
