"""The in-process side of response senders: where a model's sends go, and what ``execute``
returned, turned into the scheduler's results.

The sender itself (Triton's rules and messages) is :mod:`quiver.backends.python_sender`'s,
shared with the worker processes. Here, in the server's process, a decoupled model's sends
go to its request's :class:`~quiver.streaming.ResponseStream`; a model that is not decoupled
answers through a future that :func:`resolve` waits for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

import triton_python_backend_utils as pb_utils
from quiver.backends.base import ExecuteResult
from quiver.backends.python_convert import _error_code
from quiver.backends.python_readiness import UserReadiness, call_is_ready
from quiver.backends.python_sender import BackgroundLoop, InferenceResponseSender, failure_message
from quiver.config import ModelConfig
from quiver.errors import InternalError, QuiverError, UnavailableError, error_for_code
from quiver.streaming import ResponseStream, StreamedResponse, StreamResponse
from quiver.types import InferenceRequest, InferenceResponse

logger = logging.getLogger(__name__)

#: pb_utils response -> Quiver's response or error, for one request.
Convert = Callable[[Any], "InferenceResponse | QuiverError"]


class Pending(InferenceResponse):
    """A result still to come: the model of a non-decoupled request returned None for it and
    sends its response through the sender (:func:`resolve` waits for it)."""

    __slots__ = ("answer",)
    answer: concurrent.futures.Future[InferenceResponse | QuiverError]


def batch_results(
    result: Any,
    requests: list[InferenceRequest],
    senders: list[InferenceResponseSender | None],
    answers: list[concurrent.futures.Future[InferenceResponse | QuiverError]],
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
                sender.returned()
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
        pending.answer = answers[i]
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


class Senders:
    """The response senders of one batch, made when the model asks for them."""

    __slots__ = ("_convert", "_decoupled", "_requests", "answers", "senders")

    def __init__(
        self, requests: list[InferenceRequest], decoupled: bool, convert: Callable[[int], Convert]
    ) -> None:
        self._requests = requests
        self._decoupled = decoupled
        self._convert = convert
        self.senders: list[InferenceResponseSender | None] = [None] * len(requests)
        #: Not decoupled: each request's answer, once its sender delivered it.
        self.answers: list[concurrent.futures.Future[InferenceResponse | QuiverError]] = []

    def factory(self, index: int) -> Callable[[], InferenceResponseSender]:
        """``get_response_sender()`` of request ``index``: the same sender every time."""

        def get() -> InferenceResponseSender:
            sender = self.senders[index]
            if sender is None:
                request = self._requests[index]
                sender = self.senders[index] = InferenceResponseSender(
                    self._decoupled, self._deliver(index), cancelled(request)
                )
            return sender

        return get

    def _deliver(self, index: int) -> Callable[[Any, bool], None]:
        convert = self._convert(index)
        request = self._requests[index]
        if self._decoupled:

            def to_stream(response: Any, final: bool) -> None:
                item = StreamResponse(final=final)
                if response is not None:
                    answer = convert(response)
                    if isinstance(answer, QuiverError):
                        item.error = answer
                    else:
                        item.response = answer
                if request.stream is not None:  # None: a warmup request; nobody reads
                    request.stream.put(item)

            return to_stream
        if not self.answers:
            self.answers = [concurrent.futures.Future() for _ in self._requests]
        future = self.answers[index]

        def to_future(response: Any, final: bool) -> None:
            future.set_result(convert(response))

        return to_future

    @property
    def used(self) -> bool:
        return any(sender is not None for sender in self.senders)

    def results(
        self, result: Any, model: str, returned: Callable[[Any, list[InferenceRequest]], ExecuteResult]
    ) -> ExecuteResult:
        """:func:`batch_results` for this batch."""
        return batch_results(result, self._requests, self.senders, self.answers, self._decoupled, model, returned)

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


class DecoupledInstance:
    """What an in-process Python instance adds for response senders, async execute in the
    background, and the model's own ``is_ready()``."""

    name: str
    #: Streams of requests being answered (weakly held: a finished one goes by itself).
    _open_streams: weakref.WeakSet[ResponseStream]
    _background: BackgroundLoop | None
    _readiness: UserReadiness | None
    _config: ModelConfig
    _where: str

    _response: Callable[[Any, InferenceRequest, int], InferenceResponse | QuiverError]

    def _track_streams(self, requests: list[InferenceRequest]) -> None:
        for request in requests:
            if request.stream is not None:
                self._open_streams.add(request.stream)

    def _end_streams(self) -> None:
        """The instance unloads: requests still streaming end with an error."""
        for stream in list(self._open_streams):
            if stream.finish(UnavailableError(f"{self._where} was unloaded while answering the request")):
                stream.cancellation.cancel()  # a model thread still sending may stop

    def _watch_readiness(self, model: Any) -> None:
        """Use the model's own ``is_ready()``, if it has one."""
        is_ready = getattr(model, "is_ready", None)
        if callable(is_ready):
            self._readiness = UserReadiness(
                lambda: asyncio.to_thread(call_is_ready, is_ready, self._run_in_background), self._where
            )

    async def user_ready(self) -> bool:
        """The model's own ``is_ready()`` (True when it has none)."""
        return True if self._readiness is None else await self._readiness.check()

    def _run_in_background(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coroutine`` on the instance's background loop and wait for its result."""
        if self._background is None:
            self._background = BackgroundLoop(self.name)
        return self._background.run(coroutine)

    def _converter(self, requests: list[InferenceRequest]) -> Callable[[int], Convert]:
        def convert(index: int) -> Convert:
            return lambda item: self._response(item, requests[index], index)

        return convert

    def _in_background(self, coroutine: Coroutine[Any, Any, Any], senders: Senders) -> None:
        """Start a decoupled model's async execute on the instance's background loop."""
        if self._background is None:
            self._background = BackgroundLoop(self.name)
        where = self._where

        def failed(exc: BaseException) -> None:
            message = failure_message(exc, self._config.name, where)
            logger.error("%s", message)
            senders.fail(error_for_code(_error_code(exc), message))

        self._background.submit(coroutine, failed)


def cancelled(request: InferenceRequest) -> Callable[[], bool]:
    """``is_cancelled()`` of the model's view of ``request``."""

    def check() -> bool:
        cancellation = request.cancellation
        return cancellation is not None and cancellation.cancelled

    return check
