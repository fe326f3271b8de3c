"""The server's side of what a Python model in a worker process asks beyond its batches: the
open streams of decoupled models, BLS calls, and the model's ``is_ready()``.

A request to a decoupled model that runs in a worker is answered by ``response`` messages
carrying its id, any number of them, the last with ``flags`` FINAL (a flag-only final has no
``response``). They go to the request's :class:`~quiver.streaming.ResponseStream` until then;
a client that cancels sends the worker ``cancel`` (the model's ``is_cancelled()``); a worker
that dies ends every open stream with the error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from quiver.backends.base import SERVER
from quiver.backends.python_bls_stream import not_decoupled_call
from quiver.backends.python_readiness import UserReadiness, WorkerReadiness
from quiver.errors import QuiverError, UnavailableError, UnsupportedError
from quiver.ipc import messages as msg
from quiver.ipc import tensors
from quiver.ipc.shm import PoolFullError
from quiver.streaming import Cancellation, StreamClosed, StreamResponse
from quiver.types import DataType, InferenceRequest, InferenceResponse, RequestedOutput, Tensor


class WorkerStreams:
    """Request id -> the request whose stream receives that id's responses."""

    def __init__(self) -> None:
        self._open: dict[str, InferenceRequest] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._open

    def open(self, request_id: str, request: InferenceRequest, cancel: Callable[[str], None]) -> None:
        """Route ``request_id``'s responses to ``request``'s stream; ``cancel(request_id)``
        (on the event loop) when its client cancels."""
        self._open[request_id] = request
        cancellation = request.cancellation
        if cancellation is not None:
            loop = asyncio.get_running_loop()

            def cancelled() -> None:
                if request_id in self._open:
                    with contextlib.suppress(RuntimeError):  # the loop is gone
                        loop.call_soon_threadsafe(cancel, request_id)

            cancellation.add_callback(cancelled)

    def close(self, request_id: str) -> None:
        """Forget ``request_id`` (a request taken back before it was sent)."""
        self._open.pop(request_id, None)

    def deliver(self, request_id: str, answer: InferenceResponse | QuiverError | None, final: bool) -> bool:
        """Send ``answer`` (None: a flag-only final) on ``request_id``'s stream; False when the
        id has none (a request answered once, the usual way)."""
        request = self._open.get(request_id)
        if request is None:
            return False
        if final:
            del self._open[request_id]
        item = StreamResponse(final=final)
        if isinstance(answer, QuiverError):
            item.error = answer
        else:
            item.response = answer
        if request.stream is not None:
            with contextlib.suppress(StreamClosed):  # closed by the server already
                request.stream.put(item)
        return True

    def fail_all(self, error: QuiverError) -> None:
        """The worker is gone: every open stream ends with ``error``."""
        requests, self._open = list(self._open.values()), {}
        for request in requests:
            if request.stream is not None:
                request.stream.finish(error)




class BlsStreams:
    """Decoupled BLS calls a worker's model makes: each response of the called model goes
    back as a ``bls_response`` with flags (the last FINAL); ``bls_cancel`` cancels one."""

    def __init__(self) -> None:
        self._running: dict[int, Cancellation] = {}

    def cancel(self, number: int) -> None:
        cancellation = self._running.get(number)
        if cancellation is not None:
            cancellation.cancel()

    async def run(
        self,
        number: int,
        request: InferenceRequest,
        reply: Callable[[dict[str, Any] | None, bool], None],
        encode: Callable[[InferenceResponse], dict[str, Any]],
    ) -> None:
        """Run ``request`` through the server's streaming entry; ``reply(response, final)``
        for each answer (``encode`` writes a response's tensors for the worker)."""
        infer_stream = SERVER.infer_stream
        cancellation = request.cancellation = Cancellation()
        self._running[number] = cancellation
        try:
            if infer_stream is None:
                raise UnavailableError("BLS requests can only run inside a running Quiver server")
            final = False
            async for item in infer_stream(request):
                final = item.final
                if item.error is not None:
                    reply({"error": [item.error.code.name, item.error.message]}, final)
                elif item.response is not None:
                    try:
                        reply(encode(item.response), final)
                    except QuiverError as exc:
                        reply({"error": [exc.code.name, exc.message]}, final)
                else:
                    reply(None, final)
            if not final:  # pragma: no cover - streams always end with a final item
                reply(None, True)
        except QuiverError as exc:
            reply({"error": [exc.code.name, exc.message]}, True)
        except asyncio.CancelledError:
            reply({"error": ["CANCELLED", "the BLS request was cancelled"]}, True)
            raise
        finally:
            self._running.pop(number, None)



class WorkerStreamsMixin:
    """What a :class:`~quiver.backends.python_worker.WorkerInstance` adds beyond its batches:
    cancelling an open request of a decoupled model, BLS calls (both kinds), and the model's
    ``is_ready()``."""

    _where: str
    _worker: Any
    _streams: WorkerStreams
    _bls_streams: BlsStreams
    _readiness: UserReadiness | None
    _ready_answers: WorkerReadiness
    _ready_worker: Callable[[], Awaitable[Any]]
    _traces: dict[str, Any]

    def _end_streams(self, error: QuiverError) -> None:
        """End every open stream with ``error`` (on the server's loop, from any thread)."""
        loop = SERVER.loop
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is not None and loop is not running and loop.is_running():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._streams.fail_all, error)
                return
        self._streams.fail_all(error)

    async def user_ready(self) -> bool:
        """The model's own ``is_ready()`` (True when it has none)."""
        return True if self._readiness is None else await self._readiness.check()

    async def _ask_ready(self) -> bool:
        worker = await self._ready_worker()
        if isinstance(worker, QuiverError):
            return False
        assert worker.achannel is not None
        return await self._ready_answers.ask(worker.achannel.send)

    def _cancel(self, request_id: str) -> None:
        worker = self._worker
        if worker is not None and worker.achannel is not None and request_id in self._streams:
            worker.achannel.send({"op": msg.CANCEL, "ids": [request_id]})

    async def _bls_stream(self, worker: Any, number: int, fields: dict[str, Any]) -> None:
        def reply(response: dict[str, Any] | None, final: bool) -> None:
            if worker.achannel is not None:
                flags = msg.FINAL if final else 0
                worker.achannel.send({"op": msg.BLS_RESPONSE, "id": number, "response": response, "flags": flags})

        def encode(response: InferenceResponse) -> dict[str, Any]:
            blocks: list[tuple[str, int]] = []
            try:
                return {
                    "tensors": [tensors.write(worker.arena, t.name, t.datatype.value, t.data, blocks) for t in response.outputs],
                    "parameters": json.dumps(response.parameters, default=str),
                }
            except PoolFullError as exc:
                worker.arena.free_many(blocks)
                raise UnavailableError(f"a BLS response does not fit the shared-memory pool: {exc}") from None

        try:
            request = self._bls_request(worker, fields)
        except (ValueError, KeyError, TypeError) as exc:
            reply({"error": ["INVALID_ARG", f"BLS request from {self._where}: {exc}"]}, True)
            return
        await self._bls_streams.run(number, request, reply, encode)

    async def _bls(self, worker: Any, message: dict[str, Any]) -> None:
        """Run a BLS request from the model through the server; answer with the response."""
        number = message["id"]
        answer: dict[str, Any]
        if message["request"].get("decoupled"):
            await self._bls_stream(worker, number, message["request"])
            return
        try:
            request = self._bls_request(worker, message["request"])
            parent = self._traces.get(str(message["request"].get("trace")))
            if parent is not None:
                request.trace = parent.spawn()
            infer, decoupled = SERVER.infer, SERVER.decoupled
            if infer is None:
                raise UnavailableError("BLS requests can only run inside a running Quiver server")
            if decoupled is not None and decoupled(request.model_name, request.model_version):
                raise UnsupportedError(not_decoupled_call(request.model_name))
            response = await infer(request)
            blocks: list[tuple[str, int]] = []
            try:
                descriptors = [tensors.write(worker.arena, t.name, t.datatype.value, t.data, blocks) for t in response.outputs]
            except PoolFullError as exc:
                worker.arena.free_many(blocks)
                raise UnavailableError(f"BLS response from model '{request.model_name}' does not fit the shared-memory pool: {exc}") from None
            answer = {"tensors": descriptors}
        except QuiverError as exc:
            answer = {"error": [exc.code.name, exc.message]}
        except (ValueError, KeyError, TypeError) as exc:
            answer = {"error": ["INVALID_ARG", f"BLS request from {self._where}: {exc}"]}
        if worker.achannel is not None:
            worker.achannel.send({"op": msg.BLS_RESPONSE, "id": number, "response": answer})

    @staticmethod
    def _bls_request(worker: Any, fields: dict[str, Any]) -> InferenceRequest:
        inputs = []
        for descriptor in fields["tensors"]:
            name, datatype, shape, array = tensors.read(worker.mapper, descriptor)
            if datatype != "BYTES":
                array = np.array(array)  # the worker may reuse its block once answered
            inputs.append(Tensor(name, DataType(datatype), shape, array))
        parameters: dict[str, Any] = json.loads(fields.get("parameters") or "{}")
        correlation_id = fields.get("correlation_id") or 0
        if correlation_id:
            parameters["sequence_id"] = correlation_id
            parameters["sequence_start"] = bool(fields["flags"] & 1)
            parameters["sequence_end"] = bool(fields["flags"] & 2)
        if fields.get("timeout"):
            parameters["timeout"] = int(fields["timeout"])
        version = int(fields.get("model_version", -1))
        names = fields.get("requested_output_names") or []
        return InferenceRequest(
            model_name=str(fields["model_name"]),
            model_version="" if version < 0 else str(version),
            inputs=inputs,
            outputs=[RequestedOutput(str(n)) for n in names] if names else None,
            id=str(fields.get("request_id", "")),
            parameters=parameters,
        )


__all__ = ["BlsStreams", "WorkerStreams", "WorkerStreamsMixin"]
