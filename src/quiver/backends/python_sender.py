"""The response sender of Triton's Python backend, where the model runs (in the server's
process or in a worker): Triton's rules and messages, and where its responses go.

``request.get_response_sender()`` returns an :class:`InferenceResponseSender`. A decoupled
model (``model_transaction_policy { decoupled: true }``) sends any number of responses
through it, from ``execute`` or from threads it starts, and ends with
``flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL``; its ``execute`` returns None. A model that is
not decoupled may use it too, to send its one response (and the final flag), returning None
for that request from ``execute``. Each send goes to ``deliver(response, final)``: the
server's stream of the request in-process, a ``response`` message in a worker.

:class:`BackgroundLoop` runs a decoupled model's ``async def execute`` without waiting for
it, so one instance runs several at once, as Triton does.

Worker-safe: the standard library, numpy (through pb_utils) and Quiver's plain modules only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import triton_python_backend_utils as pb_utils
from quiver.errors import format_exception
from quiver.streaming import StreamClosed

logger = logging.getLogger(__name__)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
#: Where sends go: (a pb_utils.InferenceResponse or None for a flag-only final, final).
Deliver = Callable[[Any, bool], None]
#: What ``execute`` must return for a decoupled model, said as Triton says it.
RETURN_NONE = "is using the decoupled mode and the execute function must return None."


def _closed_error() -> pb_utils.TritonModelException:
    return pb_utils.TritonModelException("Unable to send response. Response sender has been closed.")


class InferenceResponseSender:
    """Sends the responses of one request (``request.get_response_sender()``)."""

    __slots__ = ("_answer", "_closed", "_decoupled", "_deliver", "_is_cancelled", "_lock", "_sent")

    def __init__(self, decoupled: bool, deliver: Deliver, is_cancelled: Callable[[], bool]) -> None:
        self._decoupled = decoupled
        self._deliver = deliver
        self._is_cancelled = is_cancelled
        self._lock = threading.Lock()
        self._closed = False
        self._sent = 0
        self._answer: Any = None  # not decoupled: the one response, delivered with the final flag

    def send(self, response: Any = None, flags: int = 0) -> None:
        """Send ``response`` (None only with the final flag); ``flags`` is 0 or
        ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``."""
        if flags not in (0, FINAL):
            raise pb_utils.TritonModelException("Unable to send response. Unsupported flag provided.")
        if flags == 0 and response is None:
            raise pb_utils.TritonModelException(
                "Inference Response object must be provided when the response flags is set to zero."
            )
        if response is not None and not isinstance(response, pb_utils.InferenceResponse):
            raise pb_utils.TritonModelException(
                f"Unable to send response. Expected a pb_utils.InferenceResponse, found type "
                f"'{type(response).__name__}'."
            )
        final = flags == FINAL
        with self._lock:
            self._check(response is not None, final)
            if self._decoupled:
                try:
                    self._deliver(response, final)
                except StreamClosed:  # the server closed it: execute failed
                    self._closed = True
                    raise _closed_error() from None
            else:
                if response is not None:
                    self._answer = response
                if final:
                    self._deliver(self._answer, True)
            self._count(response is not None, final)

    def _check(self, has_response: bool, final: bool) -> None:
        if not self._decoupled:
            if has_response and self._sent > 0:
                raise pb_utils.TritonModelException(
                    "Unable to send response. Non-decoupled model cannot send more than one response."
                )
            if not has_response and final and self._sent == 0:
                raise pb_utils.TritonModelException(
                    "Unable to send response. Non-decoupled model cannot send complete final "
                    "before sending a response."
                )
        if self._closed:
            raise _closed_error()

    def _count(self, has_response: bool, final: bool) -> None:
        if final:
            self._closed = True
        if has_response:
            self._sent += 1

    def is_cancelled(self) -> bool:
        """Whether the client cancelled the request (or went away)."""
        return self._is_cancelled()

    # -- the backend's side ------------------------------------------------------------

    def returned(self) -> None:
        """``execute`` returned a response for this request of a model that is not
        decoupled: as sending it with the final flag (the same rules)."""
        with self._lock:
            self._check(True, True)
            self._count(True, True)

    def close(self) -> bool:
        """No more sends (execute failed: the server answers the request); whether it was open."""
        with self._lock:
            was_open = not self._closed
            self._closed = True
            return was_open

    @property
    def closed(self) -> bool:
        return self._closed


class BackgroundLoop:
    """An event loop on its own thread, for a decoupled model's ``async def execute`` (and an
    ``async def is_ready``): each call is started there and not waited for."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"quiver-{name}-async", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def submit(self, coroutine: Coroutine[Any, Any, Any], failed: Callable[[BaseException], None]) -> None:
        """Start ``coroutine``; ``failed(exception)`` if it raises, or returns something
        (a ValueError saying :data:`RETURN_NONE`)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)

        def done(finished: concurrent.futures.Future[Any]) -> None:
            if finished.cancelled():
                failed(asyncio.CancelledError())
                return
            error = finished.exception()
            if error is not None:
                failed(error)
            elif finished.result() is not None:
                failed(ValueError(RETURN_NONE))

        future.add_done_callback(done)

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coroutine`` here and wait for its result (from another thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def stop(self) -> None:
        """Cancel what still runs and end the thread."""
        loop = self._loop

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout=10)
            except Exception as exc:  # pragma: no cover - defensive
                logger.warning("stopping a Python model's async execute loop: %s", format_exception(exc))
            loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=10)
        if not loop.is_running():
            loop.close()


class ResponseIterator:
    """The responses of one decoupled BLS call."""

    def __init__(self, cancel: Callable[[], None], wait: Callable[[Callable[[], bool]], object] | None = None) -> None:
        self._cancel = cancel
        self._wait = wait  # a worker's: reads its channel until a response is there
        self._incoming: queue.SimpleQueue[tuple[pb_utils.InferenceResponse, bool]] = queue.SimpleQueue()
        self._seen: list[pb_utils.InferenceResponse] = []
        self._finished = False
        self._index = 0
        self.first: concurrent.futures.Future[None] = concurrent.futures.Future()

    def _put(self, response: pb_utils.InferenceResponse, last: bool) -> None:
        self._incoming.put((response, last))
        if not self.first.done():
            self.first.set_result(None)

    def __iter__(self) -> ResponseIterator:
        if self._finished and self._index >= len(self._seen):
            self._index = 0
        return self

    def __next__(self) -> pb_utils.InferenceResponse:
        if self._finished:
            if self._index < len(self._seen):
                self._index += 1
                return self._seen[self._index - 1]
            raise StopIteration
        if self._wait is not None:
            self._wait(lambda: not self._incoming.empty())
        response, last = self._incoming.get()
        self._seen.append(response)
        if last:
            self._finished = True
            self._index = len(self._seen)
        return response

    def cancel(self) -> None:
        """Cancel the call (the called model sees ``is_cancelled()``)."""
        if not self._finished:
            self._cancel()


def failure_message(exc: BaseException, model: str, where: str) -> str:
    """What a decoupled model's failed (background) execute answers its open requests with."""
    if isinstance(exc, ValueError) and str(exc) == RETURN_NONE:
        return f"Python model '{model}' {RETURN_NONE}"
    return f"{where}: execute() raised {format_exception(exc)}"


__all__ = [
    "FINAL",
    "RETURN_NONE",
    "BackgroundLoop",
    "Deliver",
    "InferenceResponseSender",
    "ResponseIterator",
    "failure_message",
]
