"""Response senders in a worker process: each send is a ``response`` message on the control
channel (``flags`` FINAL on the last), for decoupled models and for models that are not
decoupled but answer through the sender; what ``execute`` returned is checked by Triton's
rules here, where the model runs. Worker-safe (see :mod:`quiver.backends.python_stub`).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any, Protocol

import triton_python_backend_utils as pb_utils
from quiver.backends.python_convert import _error_code
from quiver.backends.python_sender import (
    RETURN_NONE,
    BackgroundLoop,
    InferenceResponseSender,
    failure_message,
)
from quiver.ipc import messages as msg


class _Worker(Protocol):
    name: str
    where: str
    cancelled: set[str]
    background: BackgroundLoop | None

    def send(self, message: dict[str, Any]) -> None: ...

    def is_cancelled(self, request_id: str) -> bool: ...

    def _response(self, item: Any, index: int) -> dict[str, Any]: ...

    def _respond(self, ids: list[str], result: Any) -> None: ...


class WorkerSenders:
    """The senders of one batch (made when the model asks for one)."""

    __slots__ = ("_ids", "_worker", "decoupled", "senders", "used")

    def __init__(self, worker: _Worker, ids: list[str], decoupled: bool) -> None:
        self._worker = worker
        self._ids = ids
        self.decoupled = decoupled
        #: each request's sender, once the model asked for one (None: it asked for none yet)
        self.senders: list[InferenceResponseSender | None] | None = None
        #: Whether the model asked for a response sender (then it answers through them).
        self.used = False

    def get(self, index: int) -> InferenceResponseSender:
        """Request ``index``'s sender (made on the first call)."""
        senders = self.senders
        if senders is None:
            senders = self.senders = [None] * len(self._ids)
        sender = senders[index]
        if sender is None:
            request_id = self._ids[index]
            self.used = True
            sender = senders[index] = InferenceResponseSender(
                self.decoupled, self._deliver(index), partial(self._worker.is_cancelled, request_id)
            )
        return sender

    def is_cancelled(self, index: int) -> bool:
        """Whether request ``index`` was cancelled."""
        return self._worker.is_cancelled(self._ids[index])

    def factory(self, index: int) -> Callable[[], InferenceResponseSender]:
        return partial(self.get, index)

    def _deliver(self, index: int) -> Callable[[Any, bool], None]:
        worker = self._worker
        request_id = self._ids[index]

        def deliver(response: Any, final: bool) -> None:
            body = None if response is None else worker._response(response, index)
            worker.send({"op": msg.RESPONSE, "id": request_id, "response": body, "flags": msg.FINAL if final else 0})
            if final:
                worker.cancelled.discard(request_id)

        return deliver

    def _final_error(self, index: int, code: str, message: str) -> None:
        self._worker.send(
            {"op": msg.RESPONSE, "id": self._ids[index], "response": {"error": [code, message]}, "flags": msg.FINAL}
        )

    def fail(self, code: str, message: str) -> None:
        """``execute`` failed: every request not answered yet gets the error, final; no more
        sends."""
        for index, sender in enumerate(self.senders or [None] * len(self._ids)):
            if sender is None or sender.close():
                self._final_error(index, code, message)

    def in_background(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        """A decoupled model's ``async def execute``: started, not waited for."""
        worker = self._worker
        if worker.background is None:
            worker.background = BackgroundLoop(worker.name)

        def failed(exc: BaseException) -> None:
            self.fail(_error_code(exc).name, failure_message(exc, worker.name, worker.where))

        worker.background.submit(coroutine, failed)

    def respond(self, result: Any) -> None:
        """What ``execute`` returned, for a decoupled model or one whose requests have senders."""
        worker = self._worker
        if self.decoupled:
            if result is not None:
                self.fail(
                    "INTERNAL",
                    f"Failed to process the request(s) for model '{worker.name}', message: Python model "
                    f"'{worker.name}' {RETURN_NONE}",
                )
            return
        if result is not None and (not isinstance(result, list) or len(result) != len(self._ids)):
            worker._respond(self._ids, result)  # its own messages
            return
        items: list[Any] = [None] * len(self._ids) if result is None else result
        senders = self.senders or [None] * len(self._ids)
        try:
            for item, sender in zip(items, senders, strict=True):
                if item is not None and sender is not None:
                    sender.returned()
        except pb_utils.TritonModelException as exc:
            self.fail("INTERNAL", f"Failed to process the request(s) for model '{worker.name}', message: {exc}")
            return
        for index, item in enumerate(items):
            if item is not None:
                worker.send(
                    {"op": msg.RESPONSE, "id": self._ids[index], "response": worker._response(item, index), "flags": msg.FINAL}
                )
            elif senders[index] is None:
                self._final_error(
                    index,
                    "INTERNAL",
                    f"{worker.where}: execute() returned None for request {index} but sent no response "
                    "through its response sender (request.get_response_sender())",
                )


__all__ = ["WorkerSenders"]
