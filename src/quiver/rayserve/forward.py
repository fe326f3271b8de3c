"""An HTTP request carried from the Ray Serve ingress to a replica, and answered there by
Quiver's own ASGI applications, in process, exactly as the single-process server answers it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message


@dataclass(slots=True)
class ForwardedRequest:
    api: str  # routing.V2 or routing.SAGEMAKER
    method: str
    path: str
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
    """Run ``app`` on ``request`` and collect its response. The client stays connected until
    the response is complete (no ``http.disconnect`` before that)."""
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode("latin-1", "replace"),
        "query_string": request.query_string,
        "root_path": "",
        "headers": request.headers,
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    sent_body = False
    done = asyncio.Event()
    response = ForwardedResponse(500)
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            response.status = int(message["status"])
            response.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False):
                done.set()

    try:
        await app(scope, receive, send)
    finally:
        done.set()
    response.body = b"".join(chunks)
    return response
