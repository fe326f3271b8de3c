"""BLS from a worker process: ``InferenceRequest.exec`` / ``async_exec`` (and their decoupled
forms) send the request to the server over the control channel, through its normal inference
path, and wait for the answer by reading the channel themselves (a thread of the default
executor reads for an awaiting coroutine). Worker-safe (see :mod:`quiver.backends.python_stub`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, Protocol

import triton_python_backend_utils as pb_utils
from quiver.backends.python_sender import ResponseIterator
from quiver.ipc import messages as msg


class _Worker(Protocol):
    """What BLS needs of :class:`quiver.backends.python_stub.Worker`."""

    def send(self, message: dict[str, Any]) -> None: ...

    def wait_for(self, ready: Callable[[], bool], timeout: float | None = None) -> bool: ...

    def bls(
        self,
        request: pb_utils.InferenceRequest,
        sink: Callable[[dict[str, Any] | None, bool], None] | None = None,
    ) -> tuple[int, concurrent.futures.Future[dict[str, Any]]]: ...

    def bls_result(self, response: dict[str, Any]) -> pb_utils.InferenceResponse: ...


class WorkerBls:
    """``InferenceRequest.exec`` / ``async_exec`` in a worker: the request goes to the server
    over the control channel and through its normal inference path."""

    def __init__(self, worker: _Worker) -> None:
        self._worker = worker

    def exec(self, request: pb_utils.InferenceRequest) -> pb_utils.InferenceResponse:
        _, future = self._worker.bls(request)
        timeout = request.timeout() / 1e6 if request.timeout() else None
        try:
            self._worker.wait_for(future.done, timeout)
            answer = future.result(0)
        except concurrent.futures.TimeoutError:
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(
                    f"BLS request to model '{request.model_name()}' timed out", pb_utils.TritonError.UNAVAILABLE
                )
            )
        return self._worker.bls_result(answer)

    async def _await(self, request: pb_utils.InferenceRequest) -> pb_utils.InferenceResponse:
        _, future = self._worker.bls(request)
        await self._arrival(future)
        return self._worker.bls_result(future.result(0))

    async def _arrival(self, future: concurrent.futures.Future[Any]) -> None:
        """Until ``future`` is done, a thread of the default executor reads the channel (this
        loop's thread cannot block in it)."""
        if not future.done():
            await asyncio.get_running_loop().run_in_executor(None, self._worker.wait_for, future.done)

    def async_exec(self, request: pb_utils.InferenceRequest) -> Any:
        return self._await(request)

    def exec_decoupled(self, request: pb_utils.InferenceRequest) -> ResponseIterator:
        """A decoupled BLS call: its responses as they come; ``cancel()`` tells the server."""
        worker = self._worker
        number = 0

        def cancel() -> None:
            worker.send({"op": msg.BLS_CANCEL, "id": number})

        iterator = ResponseIterator(cancel, worker.wait_for)

        def sink(response: dict[str, Any] | None, final: bool) -> None:
            iterator._put(pb_utils.InferenceResponse([]) if response is None else worker.bls_result(response), final)

        number, _ = worker.bls(request, sink)
        return iterator

    async def _first(self, iterator: ResponseIterator) -> ResponseIterator:
        await self._arrival(iterator.first)
        return iterator

    def async_exec_decoupled(self, request: pb_utils.InferenceRequest) -> Any:
        return self._first(self.exec_decoupled(request))


__all__ = ["WorkerBls"]
