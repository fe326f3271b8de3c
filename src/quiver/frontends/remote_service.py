"""What a frontend worker's frontends need of an ``InferenceService``, answered by the model
side over the worker's link (:mod:`quiver.frontends.worker_link`): inferences (one answer,
or a stream of them), HTTP requests that are not inferences (``forward``) and gRPC calls that
are not inferences (``relay``).

When the model side goes away (the link closes), everything waiting for it fails
UNAVAILABLE ("the model side of the server has stopped") and :attr:`RemoteService.gone` is set.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator
from typing import Any

from quiver.errors import ErrorCode, QuiverError, UnavailableError, error_for_code
from quiver.frontends.link_codec import pack_request, unpack_response
from quiver.frontends.worker_link import Link
from quiver.lifecycle.urls import CAPACITY_ERRORS
from quiver.service import Watch
from quiver.streaming import StreamResponse
from quiver.types import InferenceRequest, InferenceResponse

GONE = "the model side of the server has stopped"

#: Messages that end a stream on the worker's side.
_STREAM_ENDS = ("end", "error")


def _error(message: tuple[Any, ...]) -> QuiverError:
    """``("error", id, code name, text[, capacity])`` -> the error; ``capacity`` is the index
    of a :data:`CAPACITY_ERRORS` class (out of memory or disk: SageMaker answers those 507)."""
    capacity = message[4] if len(message) > 4 else None
    if capacity is not None:
        error: QuiverError = CAPACITY_ERRORS[capacity](message[3])
        return error
    return error_for_code(ErrorCode[message[2]], message[3])


def capacity_index(exc: BaseException) -> int | None:
    """Which of :data:`CAPACITY_ERRORS` ``exc`` is (None: none)."""
    return next((i for i, kind in enumerate(CAPACITY_ERRORS) if isinstance(exc, kind)), None)


class RelayedStatus(Exception):
    """A gRPC call the model side answered with a status (a ``grpc.StatusCode`` name)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class RemoteService:
    """The model side's ``InferenceService``, as far as the frontends of a worker use it."""

    def __init__(self) -> None:
        self.link: Link | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._streams: dict[int, asyncio.Queue[tuple[Any, ...]]] = {}
        self._queues: dict[tuple[str, str], bool] = {}
        self.gone = asyncio.Event()

    # -- the link --------------------------------------------------------------------

    def on_message(self, message: tuple[Any, ...]) -> None:
        kind, ident = message[0], message[1]
        stream = self._streams.get(ident)
        if stream is not None:
            if kind in _STREAM_ENDS or (kind == "http-chunk" and not message[3]):
                del self._streams[ident]
            stream.put_nowait(message)
            return
        future = self._waiting.pop(ident, None)
        if future is None or future.done():
            return
        if kind == "ok":
            response = unpack_response(message[2])
            self._queues[(response.model_name, "")] = message[3]
            future.set_result(response)
        elif kind == "error":
            future.set_exception(_error(message))
        elif kind in ("rpc-ok", "value"):
            future.set_result(message[2])
        elif kind == "rpc-error":
            future.set_exception(RelayedStatus(message[2], message[3]))
        elif kind == "http-start":  # an answer in parts: the rest arrive on a queue
            queue: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
            self._streams[ident] = queue
            future.set_result((*message[2:], queue))
        else:  # "http"
            future.set_result((*message[2:], None))

    def on_lost(self) -> None:
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(UnavailableError(GONE))
        streams, self._streams = self._streams, {}
        for queue in streams.values():
            queue.put_nowait(("error", 0, ErrorCode.UNAVAILABLE.name, GONE))
        self.gone.set()

    def _send(self, message: tuple[Any, ...]) -> Link:
        link = self.link
        if link is None or link.closed:
            raise UnavailableError(GONE)
        link.send(message)
        return link

    async def _call(self, kind: str, *payload: Any) -> Any:
        return await self._call_as(next(self._ids), kind, *payload)

    async def _call_as(self, ident: int, kind: str, *payload: Any) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        link = self._send((kind, ident, *payload))
        self._waiting[ident] = future
        try:
            return await future
        except asyncio.CancelledError:
            if self._waiting.pop(ident, None) is not None:
                link.send(("cancel", ident))  # the client went away: leave the queue
            raise

    # -- what the frontends call ---------------------------------------------------------

    def queues(self, name: str, version: str = "") -> bool:
        """Whether the model's requests may wait in a queue (so a client that goes away takes
        its request out), as the model side said with its last answer for it; until one came,
        yes: watching for the client costs a little, a queued request nobody waits for more."""
        return self._queues.get((name, ""), True)

    async def infer(
        self, request: InferenceRequest, *, decoupled_error: str = "", watch: Watch | None = None
    ) -> InferenceResponse:
        # One coroutine, no _call/_call_as frames: this is every inference's way.
        ident = next(self._ids)
        future: asyncio.Future[InferenceResponse] = asyncio.get_running_loop().create_future()
        link = self._send(("infer", ident, pack_request(request), decoupled_error))
        self._waiting[ident] = future
        try:
            if watch is not None and self.queues(request.model_name, request.model_version):
                return await watch(future)  # a client that leaves cancels the future
            return await future
        except BaseException:
            if self._waiting.pop(ident, None) is not None:
                link.send(("cancel", ident))  # the client went away: leave the queue
            raise

    async def open_stream(self, request: InferenceRequest) -> tuple[bool, AsyncGenerator[StreamResponse, None]]:
        """As ``InferenceService.open_stream``: the model side says whether the model is
        decoupled, then sends each answer as the model gives it."""
        ident = next(self._ids)
        queue: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        link = self._send(("stream", ident, pack_request(request)))
        self._streams[ident] = queue
        try:
            first = await queue.get()
        except asyncio.CancelledError:
            if self._streams.pop(ident, None) is not None:
                link.send(("cancel", ident))
            raise
        if first[0] == "error":
            raise _error(first)
        return bool(first[2]), self._items(ident, queue, link)

    async def _items(
        self, ident: int, queue: asyncio.Queue[tuple[Any, ...]], link: Link
    ) -> AsyncGenerator[StreamResponse, None]:
        try:
            while True:
                message = await queue.get()
                kind = message[0]
                if kind == "item":
                    error: QuiverError | None = None
                    if message[3] is not None:
                        error = error_for_code(ErrorCode[message[3][0]], message[3][1])
                    response = None if message[2] is None else unpack_response(message[2])
                    yield StreamResponse(response=response, error=error, final=message[4])
                elif kind == "end":
                    return
                else:  # "error"
                    raise _error(message)
        finally:
            if self._streams.pop(ident, None) is not None:
                link.send(("cancel", ident))  # left early: the client went away

    def start_trace(self, model: str, headers: Any = None) -> None:
        """None: the model side samples the traces of the requests a worker hands it."""
        return None

    async def forward(
        self, scope: dict[str, Any], body: bytes, app: str = "http"
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes, AsyncGenerator[bytes, None] | None]:
        """An HTTP request answered by the model side's application ``app``: status, headers,
        the body (its first part), and for an answer sent in parts (server-sent events) the
        rest as they come (None: the body is whole). A rest that breaks off (the model side
        went away) raises :class:`UnavailableError`; leaving it early cancels the request."""
        ident = next(self._ids)
        status, headers, payload, queue = await self._call_as(ident, "forward", scope, body, app)
        if queue is None:
            return status, headers, payload, None
        return status, headers, payload, self._parts(ident, queue)

    async def _parts(self, ident: int, queue: asyncio.Queue[tuple[Any, ...]]) -> AsyncGenerator[bytes, None]:
        link = self.link
        try:
            while True:
                message = await queue.get()
                if message[0] != "http-chunk" or message[2] is None:
                    raise UnavailableError(GONE if message[0] == "error" else "the answer broke off on the model side")
                if message[2]:
                    yield message[2]
                if not message[3]:
                    return
        finally:
            if self._streams.pop(ident, None) is not None and link is not None:
                link.send(("cancel", ident))  # left early: the client went away

    async def sagemaker_model(self, route: str, value: str | None) -> str:
        """The model a SageMaker inference runs on: ``route`` "invocations" with the request's
        TargetModel (:meth:`SageMakerFrontend.target_of`), or "invoke" with the name in the path."""
        model: str = await self._call("sagemaker-model", route, value)
        return model

    async def relay(self, method: str, data: bytes, metadata: tuple[tuple[str, Any], ...]) -> bytes:
        """A serialized request of gRPC ``method`` -> the model side's serialized reply;
        :class:`RelayedStatus` when it answered with a status."""
        reply: bytes = await self._call("rpc", method, data, metadata)
        return reply


__all__ = ["GONE", "RelayedStatus", "RemoteService", "capacity_index"]
