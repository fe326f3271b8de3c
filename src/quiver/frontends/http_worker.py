"""HTTP in a frontend worker process (``--frontend-workers N``, :mod:`quiver.frontends.frontend_worker`):
the v2 HTTP protocol work of a request on a core of its own, the model side's work in the one
model-side process.

The worker serves the v2 API on the HTTP socket the model side bound with the very
:class:`HttpFrontend` the single-process server runs (restrictions, body limits,
``Content-Encoding``, JSON and binary tensor decoding, response encoding and compression,
client disconnects), over a :class:`~quiver.frontends.remote_service.RemoteService` whose
``infer`` sends the decoded request to the model side and awaits its answer there: one table
of models, one memory budget, one scheduler (and batcher) per model, one set of statistics and
metrics. Every other route goes to the model side's own application unchanged (``forward``),
so health, metadata, statistics, the repository and logging APIs answer exactly as in one
process. When the model side has gone, requests waiting for it are answered 503 UNAVAILABLE.
"""

from __future__ import annotations

from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from quiver.frontends.http import HttpFrontend, _send
from quiver.frontends.http_body import read_body
from quiver.frontends.http_generate import until_disconnect
from quiver.frontends.remote_service import RemoteService
from quiver.frontends.restrictions import Restrictions
from quiver.frontends.status import http_error
from quiver.protocol.v2_json import encode_json

_SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "query_string", "root_path", "headers", "server", "client")


class WorkerFrontend(HttpFrontend):
    """:class:`HttpFrontend`'s inference path over a :class:`RemoteService`; every other
    route answered by the model side's application."""

    def __init__(
        self,
        remote: RemoteService,
        *,
        max_input_size: int,
        restrictions: Restrictions,
        header_forward_pattern: str | None = None,
    ) -> None:
        super().__init__(
            remote,  # type: ignore[arg-type]
            max_input_size=max_input_size,
            restrictions=restrictions,
            header_forward_pattern=header_forward_pattern,
        )
        self.remote = remote
        self._app = self._forward  # type: ignore[assignment]
        self.generate = self._forward_generate  # type: ignore[assignment]

    async def _forward_generate(
        self, scope: Scope, receive: Receive, send: Send, model: str, version: str, streaming: bool
    ) -> None:
        """The generate extension is answered by the model side's application;
        ``generate_stream``'s events reach the client one by one, as the model sends them."""
        await self._forward(scope, receive, send)

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        await forward_http(self.remote, "http", scope, receive, send, self.max_input_size)


async def forward_http(
    remote: RemoteService, app: str, scope: Scope, receive: Receive, send: Send, max_input_size: int
) -> None:
    """An HTTP request answered whole by the model side's application ``app`` ("http": the
    v2 API, "sagemaker": the SageMaker routes)."""
    if scope["type"] != "http":
        return
    headers = dict(scope["headers"])
    try:
        # Unchanged bytes: the model side's application undoes Content-Encoding itself.
        body = await read_body(receive, headers.get(b"content-length"), None, max_input_size)
        status, response_headers, payload, rest = await remote.forward(
            {key: scope[key] for key in _SCOPE_KEYS if key in scope}, body, app
        )
    except Exception as exc:
        status, message = http_error(exc, where=f"{scope['method']} {scope['path']}")
        await _send(send, status, encode_json({"error": message}))
        return
    await send({"type": "http.response.start", "status": status, "headers": response_headers})
    if rest is None:
        await send({"type": "http.response.body", "body": payload})
        return
    try:
        await send({"type": "http.response.body", "body": payload, "more_body": True})
        async for part in until_disconnect(rest, receive):
            await send({"type": "http.response.body", "body": part, "more_body": True})
    except ClientDisconnect:
        return  # leaving the parts cancelled the request on the model side
    finally:
        await rest.aclose()
    await send({"type": "http.response.body", "body": b"", "more_body": False})

__all__ = ["WorkerFrontend", "forward_http"]
