"""The response sender of Triton's Python backend, and what follows from it.

``request.get_response_sender()`` returns an :class:`InferenceResponseSender`. A decoupled
model (``model_transaction_policy { decoupled: true }``) sends any number of responses
through it, from ``execute`` or from threads it starts, and ends with
``flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL``; its ``execute`` returns None. A model that is
not decoupled may use it too, to send its one response (then the final flag), returning None
(or None for that request) from ``execute``. Triton's rules, with its messages, are
:meth:`InferenceResponseSender._check`'s.

:func:`batch_results` turns what ``execute`` returned into the scheduler's results for both
kinds, and :class:`BackgroundLoop` runs a decoupled model's ``async def execute`` without
waiting for it: several run at once on one instance, as in Triton.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import triton_python_backend_utils as pb_utils
from quiver.backends.base import ExecuteResult, format_exception
from quiver.errors import InternalError, QuiverError
from quiver.streaming import StreamClosed, StreamedResponse, StreamResponse
from quiver.types import InferenceRequest, InferenceResponse

logger = logging.getLogger(__name__)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
#: pb_utils response -> Quiver's response or error, for one request.
Convert = Callable[[Any], "InferenceResponse | QuiverError"]


class InferenceResponseSender:
    """Sends the responses of one request (``request.get_response_sender()``)."""

    __slots__ = ("_answer", "_closed", "_convert", "_decoupled", "_lock", "_one", "_request", "_sent")

    def __init__(self, request: InferenceRequest, decoupled: bool, convert: Convert) -> None:
        self._request = request
        self._decoupled = decoupled
        self._convert = convert
        self._lock = threading.Lock()
        self._closed = False
        self._sent = 0
        self._answer: InferenceResponse | QuiverError | None = None
        #: Not decoupled: the one answer, once the final flag is sent.
        self._one: concurrent.futures.Future[InferenceResponse | QuiverError] | None = (
            None if decoupled else concurrent.futures.Future()
        )

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
            answer = self._convert(response) if response is not None else None
            if self._decoupled:
                stream = self._request.stream
                assert stream is not None
                item = StreamResponse(final=final)
                if isinstance(answer, QuiverError):
                    item.error = answer
                else:
                    item.response = answer
                try:
                    stream.put(item)
                except StreamClosed:  # closed by the server: execute failed
                    self._closed = True
                    raise pb_utils.TritonModelException(
                        "Unable to send response. Response sender has been closed."
                    ) from None
            elif answer is not None:
                self._answer = answer
            self._count(response is not None, final)
            if final and self._one is not None:
                self._one.set_result(self._answer if self._answer is not None else _no_answer())

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
            raise pb_utils.TritonModelException(
                "Unable to send response. Response sender has been closed."
            )

    def _count(self, has_response: bool, final: bool) -> None:
        if final:
            self._closed = True
        if has_response:
            self._sent += 1

    def is_cancelled(self) -> bool:
        """Whether the client cancelled the request (or went away)."""
        cancellation = self._request.cancellation
        return cancellation is not None and cancellation.cancelled

    # -- the backend's side ------------------------------------------------------------

    def returned(self, response: Any) -> None:
        """``execute`` returned ``response`` for this request of a model that is not
        decoupled: as sending it with the final flag (the same rules)."""
        with self._lock:
            self._check(True, True)
            self._count(True, True)

    def close(self) -> None:
        """No more sends (execute failed: the server answered the request)."""
        with self._lock:
            self._closed = True

    @property
    def answer(self) -> concurrent.futures.Future[InferenceResponse | QuiverError]:
        assert self._one is not None
        return self._one


def _no_answer() -> QuiverError:
    return InternalError("the model sent the final flag without a response")


class Pending(InferenceResponse):
    """A result still to come: the model of a non-decoupled request returned None for it and
    sends its response through the sender (:func:`resolve` waits for it)."""

    __slots__ = ("answer",)
    answer: concurrent.futures.Future[InferenceResponse | QuiverError]


def batch_results(
    result: Any,
    requests: list[InferenceRequest],
    senders: list[InferenceResponseSender | None],
    decoupled: bool,
    model: str,
    returned: Callable[[Any, list[InferenceRequest]], ExecuteResult],
) -> ExecuteResult:
    """The scheduler's results for what ``execute`` returned; ``returned`` converts a list of
    responses the usual way (a model that is not decoupled and used no sender)."""
    count = len(requests)
    if decoupled:
        if result is not None:
            for sender in senders:
                if sender is not None:
                    sender.close()
            message = (
                f"Failed to process the request(s) for model '{model}', message: Python model "
                f"'{model}' is using the decoupled mode and the execute function must return None."
            )
            return [InternalError(message) for _ in range(count)]
        return [StreamedResponse("", "", []) for _ in range(count)]
    if result is not None and not isinstance(result, list):
        return returned(result, requests)  # its own message
    if result is not None and len(result) != count:
        return returned(result, requests)
    items: list[Any] = [None] * count if result is None else result
    if all(sender is None for sender in senders) and result is not None:
        return returned(result, requests)
    # Returned responses first, as sending them with the final flag (Triton's order).
    try:
        for item, sender in zip(items, senders, strict=True):
            if item is not None and sender is not None:
                sender.returned(item)
    except pb_utils.TritonModelException as exc:
        return [
            InternalError(f"Failed to process the request(s) for model '{model}', message: {exc}")
            for _ in range(count)
        ]
    direct = [i for i, item in enumerate(items) if item is not None]
    converted = returned([items[i] for i in direct], [requests[i] for i in direct]) if direct else []
    results: ExecuteResult = [InternalError("") for _ in range(count)]
    for i, answer in zip(direct, converted, strict=True):
        results[i] = answer
    for i, item in enumerate(items):
        if item is not None:
            continue
        sender = senders[i]
        if sender is None:
            results[i] = InternalError(
                f"model '{model}': execute() returned None for request {i} but sent no response "
                "through its response sender (request.get_response_sender())"
            )
            continue
        pending = Pending("", "", [])
        pending.answer = sender.answer
        results[i] = pending
    return results


async def resolve(results: ExecuteResult) -> ExecuteResult:
    """``results`` with every :class:`Pending` replaced by the response its model sends."""
    if not any(isinstance(result, Pending) for result in results):
        return results
    resolved: ExecuteResult = []
    for result in results:
        if isinstance(result, Pending):
            resolved.append(await asyncio.wrap_future(result.answer))
        else:
            resolved.append(result)
    return resolved


class BackgroundLoop:
    """An event loop on its own thread, for a decoupled model's ``async def execute``: each
    call is started there and not waited for, so one instance runs several at once."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"quiver-{name}-async", daemon=True)
        self._thread.start()
        self._running: set[concurrent.futures.Future[Any]] = set()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def submit(self, coroutine: Coroutine[Any, Any, Any], failed: Callable[[BaseException], None]) -> None:
        """Start ``coroutine``; ``failed(exception)`` if it raises or returns something."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        self._running.add(future)

        def done(finished: concurrent.futures.Future[Any]) -> None:
            self._running.discard(finished)
            if finished.cancelled():
                failed(asyncio.CancelledError())
                return
            error = finished.exception()
            if error is not None:
                failed(error)
            elif finished.result() is not None:
                failed(ValueError("the execute function must return None"))

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


class Senders:
    """The response senders of one batch, made when the model asks for them."""

    __slots__ = ("_convert", "_decoupled", "_requests", "senders")

    def __init__(
        self, requests: list[InferenceRequest], decoupled: bool, convert: Callable[[int], Convert]
    ) -> None:
        self._requests = requests
        self._decoupled = decoupled
        self._convert = convert
        self.senders: list[InferenceResponseSender | None] = [None] * len(requests)

    def factory(self, index: int) -> Callable[[], InferenceResponseSender]:
        """``get_response_sender()`` of request ``index``: the same sender every time."""

        def get() -> InferenceResponseSender:
            sender = self.senders[index]
            if sender is None:
                sender = self.senders[index] = InferenceResponseSender(
                    self._requests[index], self._decoupled, self._convert(index)
                )
            return sender

        return get

    @property
    def used(self) -> bool:
        return any(sender is not None for sender in self.senders)

    def close(self) -> None:
        for sender in self.senders:
            if sender is not None:
                sender.close()

    def fail(self, error: QuiverError) -> None:
        """A decoupled model's async execute failed: every request whose sender is open gets
        ``error`` as its final response; no more sends."""
        for index, request in enumerate(self._requests):
            sender = self.senders[index]
            if sender is not None:
                sender.close()
            if request.stream is not None:
                request.stream.finish(error)


def cancelled(request: InferenceRequest) -> Callable[[], bool]:
    """``is_cancelled()`` of the model's view of ``request``."""

    def check() -> bool:
        cancellation = request.cancellation
        return cancellation is not None and cancellation.cancelled

    return check
