"""Requests answered zero, one or many times: Triton's decoupled transaction policy.

A model whose configuration sets ``model_transaction_policy { decoupled: true }`` answers a
request through a :class:`ResponseStream` instead of a return value: any number of responses,
each a result or an error, from any thread, the last one (possibly without a response: a
flag-only final) carrying the final flag. Nothing may be sent after it.

A request also carries a :class:`Cancellation`: a client that cancels its call or goes
away sets it, the model sees it (``request.is_cancelled()``), and whoever waits for the
request's responses stops waiting.

This module knows no transport and no backend: frontends read streams through
:meth:`quiver.service.InferenceService.infer_stream`, backends write to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from quiver.errors import InternalError, QuiverError
from quiver.types import InferenceResponse


@dataclass(slots=True)
class StreamResponse:
    """One answer on a stream: a response, or an error, or neither (a flag-only final)."""

    response: InferenceResponse | None = None
    error: QuiverError | None = None
    final: bool = False


class StreamedResponse(InferenceResponse):
    """What a backend returns for a request it answered through its stream (the scheduler's
    accounting sees a success; the answers are on the stream)."""

    __slots__ = ()


class StreamClosed(Exception):
    """A response was sent after the final flag."""


class Cancellation:
    """A thread-safe flag a request carries: set once, when its client cancels or leaves."""

    __slots__ = ("_callbacks", "_cancelled", "_lock")

    def __init__(self) -> None:
        self._cancelled = False
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def add_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the cancelling thread) when cancelled; at once if it is."""
        with self._lock:
            if not self._cancelled:
                self._callbacks.append(callback)
                return
        callback()


class ResponseStream:
    """The responses of one request, in the order sent, until the final flag.

    Created on the event loop that reads it; :meth:`put` may be called from any thread.
    Responses wait in an unbounded queue until read.
    """

    __slots__ = ("__weakref__", "_lock", "_loop", "_queue", "_thread", "cancellation", "closed", "sent")

    def __init__(self, cancellation: Cancellation | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._queue: asyncio.Queue[StreamResponse] = asyncio.Queue()
        self._lock = threading.Lock()
        self.cancellation = cancellation if cancellation is not None else Cancellation()
        self.closed = False  # the final flag was sent
        self.sent = 0  # responses (not flag-only finals) sent

    def put(self, item: StreamResponse) -> None:
        """Send ``item``; StreamClosed once the final flag went out."""
        with self._lock:
            if self.closed:
                raise StreamClosed("the response stream has been closed")
            if item.final:
                self.closed = True
            if item.response is not None or item.error is not None:
                self.sent += 1
            if self.cancellation.cancelled and not item.final:
                return  # nobody reads: a model that sends after a cancellation costs nothing
            if threading.get_ident() == self._thread:
                self._queue.put_nowait(item)
            else:
                # In the lock: two threads' responses reach the queue in the order they were sent.
                with contextlib.suppress(RuntimeError):  # the loop is gone: nobody reads
                    self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def finish(self, error: QuiverError | None = None) -> bool:
        """Close the stream with ``error`` (or a flag-only final) unless it is closed; whether
        it was open."""
        try:
            self.put(StreamResponse(error=error, final=True))
        except StreamClosed:
            return False
        return True

    def executed(self, running: asyncio.Future[InferenceResponse]) -> None:
        """The scheduler finished the request's execution: an error (the model raised, or the
        request never ran) closes the stream unless the model closed it; a response the
        backend returned instead of streaming it goes out as the final one."""
        if running.cancelled():
            self.finish()
            return
        error = running.exception()
        if error is not None:
            self.finish(error if isinstance(error, QuiverError) else InternalError(f"execution failed: {error!r}"))
            return
        response = running.result()
        if not isinstance(response, StreamedResponse):
            with contextlib.suppress(StreamClosed):
                self.put(StreamResponse(response=response, final=True))

    async def responses(self) -> AsyncIterator[StreamResponse]:
        """Every item sent, until (and with) the final one."""
        while True:
            item = await self._queue.get()
            yield item
            if item.final:
                return


__all__ = [
    "Cancellation",
    "ResponseStream",
    "StreamClosed",
    "StreamResponse",
    "StreamedResponse",
]
