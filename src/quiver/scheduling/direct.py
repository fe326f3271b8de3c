"""The default scheduler: each request goes to the next free instance, FIFO."""

from __future__ import annotations

from quiver.backends.base import ModelInstance
from quiver.clock import SYSTEM_CLOCK, Clock
from quiver.errors import InternalError
from quiver.metrics.statistics import ModelStatistics
from quiver.scheduling.core import CoreScheduler, Execution, InstancePool, SchedulerCore, batch_rows
from quiver.types import InferenceRequest, InferenceResponse


class DirectScheduler(CoreScheduler):
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
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not instances:
            raise InternalError(f"model '{model}' has no instances to schedule on")
        self._core = SchedulerCore(f"model '{model}'", stats if stats is not None else ModelStatistics(), clock)
        self._pool = InstancePool(instances)
        self._batching = batching

    async def enqueue(self, request: InferenceRequest) -> InferenceResponse:
        core = self._core
        core.open()
        start = core.clock.now()
        rows = batch_rows(request, self._batching)
        with core.accept(start, error_reason="OTHER"):
            pool = self._pool
            instance = pool.take()  # no coroutine when one is free
            if instance is None:
                instance = await pool.acquire()
            try:
                execution = await Execution.run(instance, [request], rows, core.stats, core.clock)
            finally:
                pool.release(instance)
        return execution.outcome(execution.results[0], start, rows)
