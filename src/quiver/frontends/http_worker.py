"""An HTTP frontend worker process (``--http-workers N``): the v2 HTTP protocol work of a
request on a core of its own, the model side's work in the one model-side process.

The model side starts it as ``python -m quiver.frontends.http_worker`` with the listening
socket and one end of a socket pair (:mod:`quiver.frontends.worker_link`) as inherited file
descriptors. It serves the v2 API on that socket with the very :class:`HttpFrontend` the
single-process server runs (restrictions, body limits, ``Content-Encoding``, JSON and binary
tensor decoding, response encoding and compression, client disconnects), over a
:class:`RemoteService` whose ``infer`` sends the decoded request to the model side and awaits
its answer there: one table of models, one memory budget, one scheduler (and batcher) per
model, one set of statistics and metrics. Every other route goes to the model side's own
application unchanged (``forward``), so health, metadata, statistics, the repository and
logging APIs answer exactly as in one process.

When the model side goes away (its socket closes), requests waiting for it are answered 503
UNAVAILABLE and the worker exits. SIGTERM stops taking connections and lets the requests in
flight finish (the HTTP server's graceful stop), then the worker exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable
from typing import Any

from starlette.types import Receive, Scope, Send

from quiver.errors import ErrorCode, UnavailableError, error_for_code
from quiver.frontends.asgi import serve
from quiver.frontends.http import HttpFrontend, _send, read_body
from quiver.frontends.restrictions import Restrictions
from quiver.frontends.status import http_error
from quiver.frontends.worker_link import Link
from quiver.protocol.v2_json import encode_json
from quiver.service import Watch
from quiver.types import InferenceRequest, InferenceResponse

logger = logging.getLogger("quiver.frontends.http_worker")

GONE = "the model side of the server has stopped"


class RemoteService:
    """What :class:`HttpFrontend`'s inference path needs of an ``InferenceService``, answered
    by the model side over ``link``."""

    def __init__(self) -> None:
        self.link: Link | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._queues: dict[tuple[str, str], bool] = {}
        self.gone = asyncio.Event()

    # -- the link --------------------------------------------------------------------

    def on_message(self, message: tuple[Any, ...]) -> None:
        kind, ident = message[0], message[1]
        future = self._waiting.pop(ident, None)
        if future is None or future.done():
            return
        if kind == "ok":
            response: InferenceResponse = message[2]
            self._queues[(response.model_name, "")] = message[3]
            future.set_result(response)
        elif kind == "error":
            future.set_exception(error_for_code(ErrorCode[message[2]], message[3]))
        else:  # "http"
            future.set_result(message[2:])

    def on_lost(self) -> None:
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(UnavailableError(GONE))
        self.gone.set()

    async def _call(self, kind: str, *payload: Any) -> Any:
        link = self.link
        if link is None or link.closed:
            raise UnavailableError(GONE)
        ident = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[ident] = future
        link.send((kind, ident, *payload))
        try:
            return await future
        except asyncio.CancelledError:
            if self._waiting.pop(ident, None) is not None:
                link.send(("cancel", ident))  # the client went away: leave the queue
            raise

    # -- what HttpFrontend calls -----------------------------------------------------

    def queues(self, name: str, version: str = "") -> bool:
        """Whether the model's requests may wait in a queue (so a client that goes away takes
        its request out), as the model side said with its last answer for it; until one came,
        yes: watching for the client costs a little, a queued request nobody waits for more."""
        return self._queues.get((name, ""), True)

    async def infer(
        self, request: InferenceRequest, *, decoupled_error: str = "", watch: Watch | None = None
    ) -> InferenceResponse:
        work: Awaitable[InferenceResponse] = self._call("infer", request, decoupled_error)
        if watch is not None and self.queues(request.model_name, request.model_version):
            work = watch(work)
        response: InferenceResponse = await work
        return response

    def start_trace(self, model: str, headers: Any = None) -> None:
        """None: the model side samples the traces of the requests a worker hands it."""
        return None

    async def forward(self, scope: dict[str, Any], body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        status, headers, payload = await self._call("forward", scope, body)
        return status, headers, payload


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
        """The generate extension is answered by the model side's application (a
        ``generate_stream`` answer reaches the client once complete)."""
        await self._forward(scope, receive, send)

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        headers = dict(scope["headers"])
        try:
            # Unchanged bytes: the model side's application undoes Content-Encoding itself.
            body = await read_body(receive, headers.get(b"content-length"), None, self.max_input_size)
            status, response_headers, payload = await self.remote.forward(
                {key: scope[key] for key in _SCOPE_KEYS if key in scope}, body
            )
        except Exception as exc:
            status, message = http_error(exc, where=f"{scope['method']} {scope['path']}")
            await _send(send, status, encode_json({"error": message}))
            return
        await send({"type": "http.response.start", "status": status, "headers": response_headers})
        await send({"type": "http.response.body", "body": payload})


async def run(
    listen_fd: int,
    link_fd: int,
    max_input_size: int,
    restricted: list[str],
    graceful: float,
    header_forward_pattern: str | None = None,
) -> int:
    loop = asyncio.get_running_loop()
    remote = RemoteService()
    link_socket = socket.socket(fileno=link_fd)
    _, link = await loop.create_unix_connection(lambda: Link(remote.on_message, remote.on_lost), sock=link_socket)
    remote.link = link
    frontend = WorkerFrontend(
        remote,
        max_input_size=max_input_size,
        restrictions=Restrictions(restricted),
        header_forward_pattern=header_forward_pattern,
    )
    listener = socket.socket(fileno=listen_fd)
    listener.setblocking(False)
    server, serving = await serve(frontend.app(), listener, graceful_seconds=graceful)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    link.send(("ready", os.getpid()))
    gone = asyncio.create_task(remote.gone.wait())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({gone, stopped, serving}, return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    if remote.gone.is_set() and not stop.is_set():
        logger.error("HTTP worker %d: %s; exiting", os.getpid(), GONE)
        server.force_exit = True
    await serving
    for task in (gone, stopped):
        task.cancel()
    link.close()
    return 1 if remote.gone.is_set() and not stop.is_set() else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="quiver.frontends.http_worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--link-fd", type=int, required=True)
    parser.add_argument("--max-input-size", type=int, required=True)
    parser.add_argument("--restricted-api", default="[]", help="a JSON list of --http-restricted-api values")
    parser.add_argument("--graceful-seconds", type=float, default=30.0)
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--http-header-forward-pattern", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.log_verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency
        runner = asyncio.run
    code: int = runner(
        run(
            args.listen_fd,
            args.link_fd,
            args.max_input_size,
            json.loads(args.restricted_api),
            args.graceful_seconds,
            args.http_header_forward_pattern,
        )
    )
    return code


if __name__ == "__main__":
    sys.exit(main())
