"""The default scheduler: each request goes to the next free instance, FIFO."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from quiver.backends.base import ModelInstance
from quiver.errors import InternalError, QuiverError, UnavailableError
from quiver.metrics.statistics import ModelStatistics
from quiver.types import InferenceRequest, InferenceResponse

Clock = Callable[[], int]


class DirectScheduler:
    """Dispatches single requests to free instances; waits in arrival order when all are busy.

    Records queue and compute time per request and per execution in ``stats``.
    """

    queueing = False

    def __init__(
        self,
        model: str,
        instances: list[ModelInstance],
        stats: ModelStatistics | None = None,
        *,
        batching: bool = False,
        clock: Clock = time.monotonic_ns,
    ) -> None:
        if not instances:
            raise InternalError(f"model '{model}' has no instances to schedule on")
        self._model = model
        self._free: deque[ModelInstance] = deque(instances)
        self._waiters: deque[asyncio.Future[ModelInstance]] = deque()
        self._stats = stats if stats is not None else ModelStatistics()
        self._batching = batching
        self._clock = clock
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
            self._stats.record_failure(0, "REJECTED")
            raise UnavailableError(f"model '{self._model}' is unloading")
        clock = self._clock
        stats = self._stats
        start = clock()
        self._inflight += 1
        stats.pending += 1
        try:
            instance = await self._acquire()
            try:
                dispatched = clock()
                result = (await instance.run([request]))[0]
                done = clock()
            finally:
                self._release(instance)
        except asyncio.CancelledError:
            stats.record_failure(clock() - start, "CANCELED")
            raise
        except BaseException:
            stats.record_failure(clock() - start, "OTHER")
            raise
        finally:
            self._inflight -= 1
            stats.pending -= 1
            if self._inflight == 0 and self._idle is not None:
                self._idle.set()
        timing = instance.timing
        input_ns, infer_ns, output_ns = timing.input_ns, timing.infer_ns, timing.output_ns
        if not (input_ns or infer_ns or output_ns):
            infer_ns = done - dispatched
        rows = request.inputs[0].shape[0] if self._batching and request.inputs else 1
        stats.record_execution(rows, input_ns, infer_ns, output_ns)
        if isinstance(result, QuiverError):
            stats.record_failure(done - start)
            raise result
        stats.record_success(done - start, dispatched - start, input_ns, infer_ns, output_ns, rows)
        return result

    async def stop(self) -> None:
        self._stopping = True
        if self._inflight:
            if self._idle is None:
                self._idle = asyncio.Event()
            await self._idle.wait()
