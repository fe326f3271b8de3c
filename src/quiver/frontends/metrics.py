"""The metrics listener: ``GET /metrics`` in Triton's Prometheus text, on its own port.

A second HTTP server (frontends/http_server.py) on the runner's event loop with a tiny ASGI app; the text is
rendered from the registry when scraped (:mod:`quiver.metrics.prometheus`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

from prometheus_client.registry import CollectorRegistry

from quiver.frontends.asgi import AsgiServer, serve
from quiver.metrics.prometheus import CONTENT_TYPE, render

logger = logging.getLogger(__name__)

_Receive = Callable[[], Any]
_Send = Callable[[dict[str, Any]], Any]


class MetricsFrontend:
    """``bind`` (fails early, before any other listener opens), ``start``, ``stop``."""

    def __init__(
        self,
        registry: CollectorRegistry,
        on_stop: Callable[[], None] | None = None,
        on_request: Callable[[], None] | None = None,
    ) -> None:
        self.registry = registry
        self._on_stop = on_stop
        #: Called as each scrape arrives (``InferenceService.request_came``: a scrape is work).
        self._on_request = on_request
        self._socket: socket.socket | None = None
        self._server: AsgiServer | None = None
        self._serving: asyncio.Task[None] | None = None

    async def __call__(self, scope: dict[str, Any], receive: _Receive, send: _Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != "/metrics":
            status, body, content_type = 404, b"not found: metrics are at /metrics\n", "text/plain"
        elif scope["method"] not in ("GET", "HEAD"):
            status, body, content_type = 405, b"method not allowed\n", "text/plain"
        else:
            status, body, content_type = 200, render(self.registry), CONTENT_TYPE
        headers = [
            (b"content-type", content_type.encode()),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

    def bind(self, address: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            sock = socket.create_server((address.strip("[]"), port), family=family, backlog=128)
        except OSError as exc:
            raise OSError(f"cannot listen on {address}:{port} for metrics: {exc.strerror}") from None
        sock.setblocking(False)
        self._socket = sock

    async def start(self) -> tuple[str, int]:
        """Serve on the bound socket; logs and returns the address (the real port, for port 0)."""
        assert self._socket is not None, "bind() first"
        self._server, self._serving = await serve(self, self._socket, graceful_seconds=5, on_request=self._on_request)
        host, port = self._socket.getsockname()[:2]
        logger.info("started Metrics service at %s:%d", host, port)
        return host, port

    async def stop(self) -> None:
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            await self._serving
        if self._socket is not None:
            self._socket.close()
        if self._on_stop is not None:
            self._on_stop()
