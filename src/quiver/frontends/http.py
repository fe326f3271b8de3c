"""KServe v2 over HTTP with Triton's routes, JSON field names and binary tensor extension.

This module only does HTTP: read and bound the body, undo ``Content-Encoding``, call the
:class:`~quiver.service.InferenceService`, encode the answer, map errors to statuses.
"""

from __future__ import annotations

import gzip
import logging
import zlib
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from quiver.errors import InvalidArgumentError, QuiverError
from quiver.frontends.status import http_status
from quiver.protocol.v2_json import decode_request, encode_json, encode_response
from quiver.service import InferenceService

logger = logging.getLogger(__name__)

JSON = "application/json"
BINARY = "application/octet-stream"
HEADER_LENGTH = "inference-header-content-length"
#: Responses smaller than this are sent uncompressed even when the client accepts gzip.
MIN_COMPRESS_SIZE = 0


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"request body is larger than the limit of {limit} bytes (--http-max-input-size)")


def _error(status: int, message: str) -> Response:
    return Response(encode_json({"error": message}), status_code=status, media_type=JSON)


def error_response(exc: QuiverError) -> Response:
    return _error(http_status(exc.code), exc.message)


def _json(value: Any) -> Response:
    return Response(encode_json(value), media_type=JSON)


class HttpFrontend:
    """Builds the Starlette application for one :class:`InferenceService`."""

    def __init__(self, service: InferenceService, *, max_input_size: int = 64 * 1024 * 1024) -> None:
        self.service = service
        self.max_input_size = max_input_size

    def routes(self) -> list[Route]:
        model = "/v2/models/{model}"
        versioned = "/v2/models/{model}/versions/{version}"
        return [
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.ready, methods=["GET"]),
            Route("/v2", self.server_metadata, methods=["GET"]),
            Route(model + "/infer", self.infer, methods=["POST"]),
            Route(versioned + "/infer", self.infer, methods=["POST"]),
            Route(model + "/ready", self.model_ready, methods=["GET"]),
            Route(versioned + "/ready", self.model_ready, methods=["GET"]),
            Route(model + "/config", self.model_config, methods=["GET"]),
            Route(versioned + "/config", self.model_config, methods=["GET"]),
            Route(model, self.model_metadata, methods=["GET"]),
            Route(versioned, self.model_metadata, methods=["GET"]),
        ]

    def app(self) -> Starlette:
        return Starlette(
            routes=self.routes(),
            exception_handlers={404: self._not_found, 405: self._not_allowed},
        )

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return _error(404, f"no route for {request.method} {request.url.path}")

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return _error(405, f"method {request.method} is not allowed on {request.url.path}")

    # -- health and metadata ---------------------------------------------------------

    async def live(self, request: Request) -> Response:
        return Response(status_code=200)

    async def ready(self, request: Request) -> Response:
        return Response(status_code=200 if self.service.ready else 503)

    async def server_metadata(self, request: Request) -> Response:
        return _json(self.service.server_metadata())

    async def model_ready(self, request: Request) -> Response:
        name = request.path_params["model"]
        version = request.path_params.get("version", "")
        if self.service.model_ready(name, version):
            return Response(status_code=200)
        try:
            self.service.manager.get(name, version)
        except QuiverError as exc:
            return error_response(exc)
        return Response(status_code=503)  # pragma: no cover - raced with a load

    async def model_metadata(self, request: Request) -> Response:
        try:
            return _json(
                self.service.model_metadata(
                    request.path_params["model"], request.path_params.get("version", "")
                )
            )
        except QuiverError as exc:
            return error_response(exc)

    async def model_config(self, request: Request) -> Response:
        try:
            return _json(
                self.service.model_config(
                    request.path_params["model"], request.path_params.get("version", "")
                )
            )
        except QuiverError as exc:
            return error_response(exc)

    # -- inference -------------------------------------------------------------------

    async def infer(self, request: Request) -> Response:
        model = request.path_params["model"]
        try:
            body = await self._read_body(request)
            raw_length = request.headers.get(HEADER_LENGTH)
            header_length = None
            if raw_length is not None:
                try:
                    header_length = int(raw_length)
                except ValueError:
                    raise InvalidArgumentError(
                        f"Inference-Header-Content-Length must be an integer, got '{raw_length}'"
                    ) from None
            infer_request = decode_request(
                body, header_length, model, request.path_params.get("version", "")
            )
            response = await self.service.infer(infer_request)
            payload, json_length = encode_response(response, infer_request)
        except QuiverError as exc:
            return error_response(exc)
        except BodyTooLarge as exc:
            return _error(413, str(exc))
        except ClientDisconnect:
            return Response(status_code=400)
        except Exception as exc:
            logger.exception("inference on model '%s' failed unexpectedly", model)
            return _error(500, f"internal error in model '{model}': {type(exc).__name__}: {exc}")
        headers: dict[str, str] = {}
        media_type = JSON
        if json_length is not None:
            headers["Inference-Header-Content-Length"] = str(json_length)
            media_type = BINARY
        accept = request.headers.get("accept-encoding")
        if accept and len(payload) >= MIN_COMPRESS_SIZE:
            payload = _compress(payload, accept, headers)
        return Response(payload, headers=headers, media_type=media_type)

    async def _read_body(self, request: Request) -> bytes:
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
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        encoding = request.headers.get("content-encoding")
        if encoding and encoding != "identity":
            body = _decompress(body, encoding.strip().lower(), limit)
        return body


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """Undo gzip/deflate, refusing output past ``limit`` (a small body can inflate hugely)."""
    if encoding == "gzip":
        wbits = 16 + zlib.MAX_WBITS
    elif encoding == "deflate":
        wbits = zlib.MAX_WBITS
    else:
        raise InvalidArgumentError(
            f"unsupported Content-Encoding '{encoding}'; use gzip, deflate or identity"
        )
    decompressor = zlib.decompressobj(wbits)
    try:
        out = decompressor.decompress(body, limit + 1)
        if len(out) > limit or decompressor.unconsumed_tail:
            raise BodyTooLarge(limit)
        out += decompressor.flush()
    except zlib.error as exc:
        raise InvalidArgumentError(f"request body is not valid {encoding} data: {exc}") from None
    if not decompressor.eof:
        raise InvalidArgumentError(f"request body is truncated {encoding} data")
    return out


def _compress(payload: bytes, accept: str, headers: dict[str, str]) -> bytes:
    accepted = {part.split(";")[0].strip().lower() for part in accept.split(",")}
    if "gzip" in accepted:
        headers["Content-Encoding"] = "gzip"
        return gzip.compress(payload, compresslevel=1)
    if "deflate" in accepted:
        headers["Content-Encoding"] = "deflate"
        return zlib.compress(payload, 1)
    return payload


__all__ = ["HttpFrontend"]
