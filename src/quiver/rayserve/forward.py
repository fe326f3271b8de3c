"""An HTTP request carried from the Ray Serve ingress to a replica, and answered there by
Quiver's own ASGI applications, in process, exactly as the single-process server answers it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.types import ASGIApp, Message


@dataclass(slots=True)
class ForwardedRequest:
    api: str  # routing.V2 or routing.SAGEMAKER
    method: str
    path: str
    raw_path: bytes
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    #: A SageMaker name the ingress saw registered (``POST /models``) with its body, so a
    #: replica that has not seen the registration can replay it before answering.
    registration: bytes | None = None


@dataclass(slots=True)
class ForwardedResponse:
    status: int
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""


async def call_asgi(app: ASGIApp, request: ForwardedRequest) -> ForwardedResponse:
    """Run ``app`` on ``request`` and collect its response, as an ASGI server would.

    The client stays connected until the response is complete. When the caller is cancelled
    (Ray Serve cancels a request whose client went away), the application is not: it sees
    ``http.disconnect``, as under an HTTP server, and finishes on its own. An exception the
    application raises after it sent its response leaves that response as it was; one raised
    before is a 500.
    """
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.raw_path,
        "query_string": request.query_string,
        "root_path": "",
        "headers": request.headers,
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    sent_body = False
    gone = asyncio.Event()  # the response is complete, or nobody waits for it any more
    response = ForwardedResponse(500)
    started = False
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal started
        if message["type"] == "http.response.start":
            started = True
            response.status = int(message["status"])
            response.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False):
                gone.set()

    running = asyncio.ensure_future(app(scope, receive, send))
    running.add_done_callback(_retrieve)
    try:
        await asyncio.shield(running)
    except asyncio.CancelledError:
        gone.set()  # the application now sees the client gone, and ends on its own
        raise
    except Exception as exc:
        if not started:
            return ForwardedResponse(
                500,
                [(b"content-type", b"application/json")],
                orjson.dumps({"error": f"internal error: {type(exc).__name__}: {exc}"}),
            )
    finally:
        gone.set()
    response.body = b"".join(chunks)
    return response


def _retrieve(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()  # observed: an application that failed after its caller left
