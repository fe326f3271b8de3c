"""A Python model's own ``is_ready()``, as Triton's Python backend calls it.

Model readiness (``/v2/models/{m}/ready``, gRPC ``ModelReady``) asks every instance whose
``TritonPythonModel`` defines ``is_ready``: it must return a boolean (or an ``async def``
may); False, an exception, another type, or no answer within five seconds all mean not
ready. One call per instance runs at a time: checks that arrive meanwhile share its answer
(within their own five seconds). The call runs on its own thread, not behind ``execute``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from typing import Any

from quiver.backends.base import format_exception

logger = logging.getLogger(__name__)

#: Triton's ``kUserModelReadinessTimeoutMs``.
READY_TIMEOUT_S = 5.0


class UserReadiness:
    """The ``is_ready`` of one instance's model object."""

    def __init__(self, method: Callable[[], Any], run_coroutine: Callable[[Any], Any], where: str) -> None:
        self._method = method
        self._run_coroutine = run_coroutine  # an async is_ready's coroutine -> its result
        self._where = where
        self._inflight: asyncio.Future[bool] | None = None

    def _call(self) -> bool:
        result = self._method()
        if inspect.iscoroutine(result):
            result = self._run_coroutine(result)
        if not isinstance(result, bool):
            raise TypeError("is_ready() must return a boolean value")
        return result

    async def check(self) -> bool:
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.ensure_future(asyncio.to_thread(self._call))
        try:
            return await asyncio.wait_for(asyncio.shield(self._inflight), READY_TIMEOUT_S)
        except TimeoutError:
            logger.warning("%s: Timed out waiting for user-defined is_ready() response", self._where)
            return False
        except Exception as exc:
            logger.warning("%s: user-defined is_ready() failed: %s", self._where, format_exception(exc))
            return False


__all__ = ["READY_TIMEOUT_S", "UserReadiness"]
