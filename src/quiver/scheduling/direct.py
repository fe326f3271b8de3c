"""The default scheduler: each request goes to the next free instance, FIFO."""

from __future__ import annotations

import asyncio
from collections import deque

from quiver.backends.base import ModelInstance
from quiver.errors import InternalError, QuiverError, UnavailableError
from quiver.types import InferenceRequest, InferenceResponse


class DirectScheduler:
    """Dispatches single requests to free instances; waits in arrival order when all are busy."""

    def __init__(self, model: str, instances: list[ModelInstance]) -> None:
        if not instances:
            raise InternalError(f"model '{model}' has no instances to schedule on")
        self._model = model
        self._free: deque[ModelInstance] = deque(instances)
        self._waiters: deque[asyncio.Future[ModelInstance]] = deque()
        self._inflight = 0
        self._stopping = False
        self._idle: asyncio.Event | None = None

    @property
    def inflight(self) -> int:
        return self._inflight

    async def _acquire(self) -> ModelInstance:
        if self._free:
            return self._free.popleft()
        waiter: asyncio.Future[ModelInstance] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release(waiter.result())  # handed over just as we were cancelled
            raise

    def _release(self, instance: ModelInstance) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(instance)
                return
        self._free.append(instance)

    async def enqueue(self, request: InferenceRequest) -> InferenceResponse:
        if self._stopping:
            raise UnavailableError(f"model '{self._model}' is unloading")
        self._inflight += 1
        try:
            instance = await self._acquire()
            try:
                result = (await instance.run([request]))[0]
            finally:
                self._release(instance)
        finally:
            self._inflight -= 1
            if self._inflight == 0 and self._idle is not None:
                self._idle.set()
        if isinstance(result, QuiverError):
            raise result
        return result

    async def stop(self) -> None:
        self._stopping = True
        if self._inflight:
            self._idle = asyncio.Event()
            await self._idle.wait()
