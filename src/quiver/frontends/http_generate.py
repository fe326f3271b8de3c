"""The generate extension over HTTP: ``.../generate`` (one JSON answer) and
``.../generate_stream`` (Server-Sent Events, one ``data:`` event per response).

As Triton's HTTP server does: a request that fails before inference starts (bad JSON, a
missing or wrongly typed input, an unknown model) is answered with a JSON error and its
status; a stream's status is that of its first response (200, or the first error's), and
later errors arrive as ``data: {"error": ...}`` events, so a client must look at every
event. ``generate`` needs exactly one response: a decoupled model that sends none or
several is an error there (``generate_stream`` serves those). A client that disconnects
cancels its request: the model sees ``is_cancelled()`` and nothing more is sent.

The JSON mapping is :mod:`quiver.protocol.generate`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from quiver.errors import InternalError, QuiverError
from quiver.frontends.status import http_error
from quiver.protocol.generate import decode_generate, encode_generate
from quiver.protocol.v2_json import encode_json
from quiver.service import InferenceService
from quiver.streaming import StreamResponse

T = TypeVar("T")

SSE = b"text/event-stream; charset=utf-8"
JSON = b"application/json"
#: Triton's answer when ``generate`` gets other than one response.
NOT_ONE = (
    "generate expects model to produce exactly 1 response, use generate stream for model that "
    "generates various number of responses"
)


#: ``quiver.frontends.http_body.read_body``: the whole body, bounded, Content-Encoding undone.
ReadBody = Callable[[Receive, bytes | None, bytes | None, int], Awaitable[bytes]]


def _event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


class GenerateEndpoint:
    """Serves generate and generate_stream for one :class:`InferenceService`."""

    def __init__(self, service: InferenceService, max_input_size: int, read_body: ReadBody) -> None:
        self.service = service
        self.max_input_size = max_input_size
        self._read_body = read_body

    async def __call__(
        self, scope: Scope, receive: Receive, send: Send, model: str, version: str, streaming: bool
    ) -> None:
        headers = dict(scope["headers"])
        try:
            body = await self._read_body(
                receive, headers.get(b"content-length"), headers.get(b"content-encoding"), self.max_input_size
            )
            config = await self.service.serving_config(model, version)
            request = decode_generate(body, config, model, version, self.max_input_size)
            items = until_disconnect(self.service.infer_stream(request), receive)
        except ClientDisconnect:
            return
        except Exception as exc:
            status, message = http_error(exc, model=model, where=f"generate on model '{model}'")
            await _reply(send, status, JSON, encode_json({"error": message}))
            return
        try:
            try:
                first = await anext(items)
            except ClientDisconnect:
                return
            except Exception as exc:  # the request as a whole failed (checks, unknown model)
                status, message = http_error(exc, model=model, where=f"generate on model '{model}'")
                await _reply(send, status, JSON, encode_json({"error": message}))
                return
            if streaming:
                await self._stream(first, items, send, model)
            else:
                await self._one(first, items, send, model)
        finally:
            await items.aclose()

    async def _one(
        self, first: StreamResponse, items: AsyncGenerator[StreamResponse, None], send: Send, model: str
    ) -> None:
        answers = [first] if first.response is not None or first.error is not None else []
        try:
            async for item in items:
                if item.response is not None or item.error is not None:
                    answers.append(item)
        except ClientDisconnect:
            return
        if len(answers) != 1:
            status, message = http_error(InternalError(NOT_ONE), model=model, where="generate")
            await _reply(send, status, JSON, encode_json({"error": message}))
            return
        (answer,) = answers
        if answer.error is not None:
            status, message = http_error(answer.error, model=model, where="generate")
            await _reply(send, status, JSON, encode_json({"error": message}))
            return
        assert answer.response is not None
        try:
            payload = encode_json(encode_generate(answer.response))
        except QuiverError as exc:
            status, message = http_error(exc, model=model, where="generate")
            await _reply(send, status, JSON, encode_json({"error": message}))
            return
        await _reply(send, 200, JSON, payload)

    async def _stream(
        self, first: StreamResponse, items: AsyncGenerator[StreamResponse, None], send: Send, model: str
    ) -> None:
        status = 200
        if first.error is not None:
            status, _ = http_error(first.error, model=model, where="generate_stream")
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", SSE)]}
        )
        try:
            await _send_event(send, first, model)
            async for item in items:
                await _send_event(send, item, model)
        except (ClientDisconnect, OSError):
            return
        with contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def _payload(item: StreamResponse, model: str) -> bytes | None:
    if item.error is not None:
        _, message = http_error(item.error, model=model, where="generate_stream")
        return encode_json({"error": message})
    if item.response is None:
        return None  # a flag-only final: nothing to send
    try:
        return encode_json(encode_generate(item.response))
    except QuiverError as exc:
        return encode_json({"error": exc.message})


async def _send_event(send: Send, item: StreamResponse, model: str) -> None:
    payload = _payload(item, model)
    if payload is not None:
        await send({"type": "http.response.body", "body": _event(payload), "more_body": True})


async def _reply(send: Send, status: int, content_type: bytes, payload: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type), (b"content-length", str(len(payload)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": payload})


async def until_disconnect(items: AsyncGenerator[T, None], receive: Receive) -> AsyncGenerator[T, None]:
    """``items`` until the client disconnects (then ClientDisconnect; leaving a stream of
    ``infer_stream`` early cancels its request); closes ``items`` either way, also when the
    task is cancelled."""
    watcher = asyncio.ensure_future(receive())
    step: asyncio.Future[T] | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(items))
            await asyncio.wait((step, watcher), return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                if watcher.result().get("type") == "http.disconnect":
                    raise ClientDisconnect()
                watcher = asyncio.ensure_future(receive())
                await step
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        # The step first (cancelled too when this task is: a model side's request whose
        # worker saw the client go), then the generator: it cannot close while it runs.
        watcher.cancel()
        if step is not None and not step.done():
            step.cancel()
            with contextlib.suppress(BaseException):
                await step
        await items.aclose()

__all__ = ["NOT_ONE", "GenerateEndpoint", "until_disconnect"]
