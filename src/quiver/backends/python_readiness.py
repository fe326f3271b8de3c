"""A Python model's own ``is_ready()``, as Triton's Python backend calls it.

Model readiness (``/v2/models/{m}/ready``, gRPC ``ModelReady``) asks every instance whose
``TritonPythonModel`` defines ``is_ready``: it must return a boolean (or an ``async def``
may); False, an exception, another type, or no answer within five seconds all mean not
ready. One call per instance runs at a time: checks that arrive meanwhile share its answer
(within their own five seconds). The call runs on a thread of its own, not behind
``execute``; in a worker process, the server asks the worker (``is_ready`` messages).

:func:`call_is_ready` is worker-safe.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from quiver.errors import format_exception

logger = logging.getLogger(__name__)

#: Triton's ``kUserModelReadinessTimeoutMs``.
READY_TIMEOUT_S = 5.0


def call_is_ready(method: Callable[[], Any], run_coroutine: Callable[[Any], Any]) -> bool:
    """Call the model's ``is_ready`` (an ``async def``'s coroutine through ``run_coroutine``);
    TypeError when it answers other than a boolean."""
    result = method()
    if inspect.iscoroutine(result):
        result = run_coroutine(result)
    if not isinstance(result, bool):
        raise TypeError("is_ready() must return a boolean value")
    return result


class UserReadiness:
    """The ``is_ready`` of one instance's model: ``call()`` answers it (or raises)."""

    def __init__(self, call: Callable[[], Awaitable[bool]], where: str) -> None:
        self._call = call
        self._where = where
        self._inflight: asyncio.Future[bool] | None = None

    async def check(self) -> bool:
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.ensure_future(self._call())
        try:
            return await asyncio.wait_for(asyncio.shield(self._inflight), READY_TIMEOUT_S)
        except TimeoutError:
            logger.warning("%s: Timed out waiting for user-defined is_ready() response", self._where)
            return False
        except Exception as exc:
            logger.warning("%s: user-defined is_ready() failed: %s", self._where, format_exception(exc))
            return False


class WorkerReadiness:
    """The server's side of ``is_ready`` messages to one worker."""

    def __init__(self) -> None:
        self._waiting: dict[int, asyncio.Future[bool]] = {}
        self._next = 0

    async def ask(self, send: Callable[[dict[str, Any]], None]) -> bool:
        """Send ``is_ready`` and wait for the answer (RuntimeError with the model's error)."""
        self._next += 1
        number = self._next
        answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting[number] = answer
        try:
            send({"op": "is_ready", "id": number})
            return await answer
        finally:
            self._waiting.pop(number, None)

    def answered(self, message: dict[str, Any]) -> None:
        answer = self._waiting.get(int(message["id"]))
        if answer is None or answer.done():
            return
        if message.get("error"):
            answer.set_exception(RuntimeError(str(message["error"])))
        else:
            answer.set_result(bool(message.get("ready")))


__all__ = ["READY_TIMEOUT_S", "UserReadiness", "WorkerReadiness", "call_is_ready"]
