"""``ModelStreamInfer``: many requests in, each answered zero, one or many times.

As Triton's stream handler does:

- requests of one stream run concurrently (up to :data:`STREAM_WINDOW` at once, counting
  those whose answers wait for the writer: the reader waits past that, so a client that does
  not read its answers stops being read);
- a request to a model that is not decoupled is answered once, and those answers go out in
  the order their requests came; a decoupled model's responses go out as they are sent, in
  order within their request;
- every response carries the parameter ``triton_final_response`` (true on a request's last
  one); the flag-only final of a decoupled model is sent only to a client that asked with the
  request parameter ``triton_enable_empty_final_response: true``;
- a failed request or response is answered with ``error_message`` (and the request's id,
  model and version), and the stream goes on;
- a client that cancels the call or goes away cancels its requests: queued ones leave their
  queue, running ones see ``is_cancelled()``, and their responses are dropped;
- with the header ``triton_grpc_error: true`` (Triton's opt-in), the first error instead ends
  the stream with its gRPC status (:class:`StreamAborted`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc
from tritonclient.grpc import service_pb2 as pb

from quiver.errors import InvalidArgumentError
from quiver.frontends.offload import OFFLOAD_NS, in_worker
from quiver.frontends.status import grpc_error, grpc_status
from quiver.protocol.v2_grpc import encode_cost, encode_infer_response
from quiver.service import InferenceService
from quiver.streaming import StreamResponse
from quiver.types import InferenceRequest

#: Requests of one stream decoded, running or with answers queued for the writer at once; the
#: reader waits past this.
STREAM_WINDOW = 64
#: The request parameter by which a client asks for decoupled models' flag-only finals.
EMPTY_FINAL = "triton_enable_empty_final_response"


class StreamAborted(Exception):
    """The first error of a stream opened with ``triton_grpc_error: true``: the call ends with
    this status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _Released:
    """Queued after a request's last answer (see :data:`STREAM_WINDOW`)."""


RELEASED = _Released()


class StreamServicer(Protocol):
    service: InferenceService

    def _enter(self) -> None: ...

    def _leave(self) -> None: ...

    async def decode(self, data: bytes, context: Any = None) -> InferenceRequest:
        """A serialized ModelInferRequest -> the request (INVALID_ARGUMENT when malformed),
        with the call's forwarded headers and, when sampled, a trace the stream releases."""
        ...


def _release_trace(request: InferenceRequest | None) -> None:
    """The request's trace, if it was sampled, ends once its last answer is queued."""
    trace = request.trace if request is not None else None
    if trace is not None:
        request.trace = None  # type: ignore[union-attr]
        trace.capture("INFER_RESPONSE_COMPLETE")
        trace.release()


def _wants_empty_final(request: InferenceRequest) -> bool:
    value = request.parameters.pop(EMPTY_FINAL, False)
    if not isinstance(value, bool):
        raise InvalidArgumentError(
            f"invalid value type for '{EMPTY_FINAL}' parameter, expected bool_param."
        )
    return value


def _error(exc: Exception, request: InferenceRequest | None) -> bytes:
    model = request.model_name if request is not None else ""
    where = f"gRPC ModelStreamInfer on model '{model}'" if model else "gRPC ModelStreamInfer"
    _, message = grpc_error(exc, model=model, where=where)
    failed = pb.ModelStreamInferResponse(error_message=message)
    if request is not None:
        answer = failed.infer_response
        answer.id = request.id
        answer.model_name = request.model_name
        answer.model_version = request.model_version
        answer.parameters["triton_final_response"].bool_param = True
    serialized: bytes = failed.SerializeToString()
    return serialized


def _message(item: StreamResponse, request: InferenceRequest, empty_final: bool) -> bytes | None:
    """One stream item as a serialized ModelStreamInferResponse (None: not sent)."""
    if item.error is not None:
        message = pb.ModelStreamInferResponse(error_message=item.error.message)
        answer = message.infer_response
        answer.id = request.id
        answer.model_name = request.model_name
        answer.model_version = request.model_version
    elif item.response is None:
        if not empty_final:
            return None
        message = pb.ModelStreamInferResponse()
        answer = message.infer_response
        answer.id = request.id
        answer.model_name = request.model_name
        answer.model_version = request.model_version
    else:
        message = pb.ModelStreamInferResponse()
        message.infer_response.CopyFrom(encode_infer_response(item.response))
    message.infer_response.parameters["triton_final_response"].bool_param = item.final
    serialized: bytes = message.SerializeToString()
    return serialized


async def _encoded(item: StreamResponse, request: InferenceRequest, empty_final: bool) -> bytes | None:
    if item.response is not None and encode_cost(item.response) >= OFFLOAD_NS:
        return await in_worker(_message, item, request, empty_final)
    return _message(item, request, empty_final)


async def serve_stream(
    servicer: StreamServicer,
    request_iterator: AsyncIterator[bytes],
    *,
    abort_on_error: bool = False,
    context: Any = None,
) -> AsyncIterator[bytes]:
    """The ModelStreamInfer call: serialized requests in, serialized responses out; with
    ``abort_on_error``, the first error raises :class:`StreamAborted` instead."""
    loop = asyncio.get_running_loop()
    out: asyncio.Queue[bytes | StreamAborted | _Released | None] = asyncio.Queue()
    window = asyncio.Semaphore(STREAM_WINDOW)
    tasks: set[asyncio.Task[None]] = set()
    reading = True
    service = servicer.service

    def request_done(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        out.put_nowait(RELEASED)  # after its answers: its place comes back once they are taken
        servicer._leave()
        if not reading and not tasks:
            out.put_nowait(None)

    async def answer(data: bytes, before: asyncio.Future[None] | None, turn: asyncio.Future[None]) -> None:
        """One request: its answers onto ``out`` (in its turn, unless decoupled)."""
        request: InferenceRequest | None = None
        answers: list[bytes | StreamAborted] = []
        try:
            request = await servicer.decode(data, context)
            empty_final = _wants_empty_final(request)
            decoupled, items = await service.open_stream(request)
            if decoupled:
                turn.set_result(None)  # answers as they come: later requests need not wait
                async for item in items:
                    if abort_on_error and item.error is not None:
                        out.put_nowait(StreamAborted(grpc_status(item.error.code), item.error.message))
                        return
                    encoded = await _encoded(item, request, empty_final)
                    if encoded is not None:
                        out.put_nowait(encoded)
                _release_trace(request)
                return
            async for item in items:
                if abort_on_error and item.error is not None:
                    answers.append(StreamAborted(grpc_status(item.error.code), item.error.message))
                    continue
                encoded = await _encoded(item, request, False)
                if encoded is not None:
                    answers.append(encoded)
        except asyncio.CancelledError:
            if not turn.done():
                turn.set_result(None)  # the stream is going away: nobody waits for order
            raise
        except Exception as exc:
            if abort_on_error:
                model = request.model_name if request is not None else ""
                answers.append(StreamAborted(*grpc_error(exc, model=model, where="gRPC ModelStreamInfer")))
            else:
                answers.append(_error(exc, request))
        if not turn.done() and before is not None and answers:
            await before
        for answered in answers:
            out.put_nowait(answered)
        if not turn.done():
            turn.set_result(None)
        _release_trace(request)

    async def read() -> None:
        nonlocal reading
        before: asyncio.Future[None] | None = None
        try:
            async for data in request_iterator:
                await window.acquire()
                servicer._enter()
                turn: asyncio.Future[None] = loop.create_future()
                task = asyncio.create_task(answer(data, before, turn))
                tasks.add(task)
                task.add_done_callback(request_done)
                before = turn
        finally:
            reading = False
            if not tasks:
                out.put_nowait(None)

    reader = asyncio.create_task(read())
    try:
        while (message := await out.get()) is not None:
            if isinstance(message, _Released):
                window.release()
                continue
            if isinstance(message, StreamAborted):
                raise message
            yield message
        await reader  # raises what ended the reading, if it failed
    finally:
        reader.cancel()
        for task in list(tasks):
            task.cancel()  # the client went away: its requests are cancelled


__all__ = ["EMPTY_FINAL", "STREAM_WINDOW", "StreamAborted", "StreamServicer", "serve_stream"]
