"""The body of an HTTP request, and a client that goes away while its request waits: what
the v2 inference route (``http.py``), the SageMaker routes and the frontend workers share."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from starlette.requests import ClientDisconnect
from starlette.types import Receive

from quiver.frontends.content_encoding import decompress as _decompress
from quiver.frontends.offload import INFLATE_INLINE_BYTES, in_worker
from quiver.frontends.status import BodyTooLarge
from quiver.service import Watch
from quiver.streaming import Cancellation
from quiver.types import InferenceRequest, InferenceResponse


async def read_body(
    receive: Receive, content_length: bytes | None, encoding: bytes | None, limit: int
) -> bytes:
    """The whole request body from ASGI ``receive``, refused past ``limit`` bytes (before and
    after undoing ``Content-Encoding``); the SageMaker frontend reads its bodies with it too."""
    if content_length is not None and content_length.isdigit() and int(content_length) > limit:
        raise BodyTooLarge(limit)
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientDisconnect()
    body: bytes = message.get("body", b"")
    if message.get("more_body", False):
        chunks = [body]
        size = len(body)
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
    elif len(body) > limit:
        raise BodyTooLarge(limit)
    if encoding is not None:
        name = encoding.decode("latin-1").strip().lower()
        if name != "identity":
            if len(body) < INFLATE_INLINE_BYTES:
                body = _decompress(body, name, limit)
            else:
                body = await in_worker(_decompress, body, name, limit)
    return body


def _whole(at_hand: Callable[[], bytes | None], content_length: bytes | None, limit: int) -> bytes | None:
    """The whole body when the server has all of it and the app has read none (the server's
    ``quiver.body`` extension), refused past ``limit`` bytes; None: read it with ``receive``."""
    if content_length is not None and content_length.isdigit() and int(content_length) > limit:
        raise BodyTooLarge(limit)
    body = at_hand()
    if body is not None and len(body) > limit:
        raise BodyTooLarge(limit)
    return body


def _watch(receive: Receive, request: InferenceRequest) -> Watch:
    """The service's ``watch`` for one request: the wait for a queued request's answer is
    cancelled when the client disconnects (the request told it is cancelled, as the model
    may read)."""

    def watch(work: Awaitable[InferenceResponse]) -> Awaitable[InferenceResponse]:
        return _unless_disconnected(work, receive, request)

    return watch


async def _unless_disconnected(
    work: Awaitable[InferenceResponse], receive: Receive, request: InferenceRequest | None = None
) -> InferenceResponse:
    """Run ``work`` but cancel it if the client disconnects first: a request still waiting
    in a queue then leaves it without costing compute."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(receive())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            message = watcher.result()
            if message.get("type") == "http.disconnect":
                if request is not None:
                    request.cancellation = request.cancellation or Cancellation()  # the model reads it
                    request.cancellation.cancel()
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise ClientDisconnect()
            await task
        return task.result()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


__all__ = ["read_body"]
