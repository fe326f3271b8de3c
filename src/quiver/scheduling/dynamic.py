"""DynamicBatcher: Triton's dynamic batching over a model's instances.

Each instance has a worker task (:class:`~quiver.scheduling.core.SchedulerCore` runs them). A
free worker forms the next batch from the :class:`~quiver.scheduling.queue.BatchQueue`
(waiting for ``max_queue_delay`` or a queue timeout on the core's alarm, never polling), runs
it on its instance, and answers each request's future. With ``preserve_ordering``, a batch's
answers wait for every earlier batch's. At stop, the workers run out what is queued.

An instance that queues requests itself (a Python model's worker process, its ``slots``) gets
a worker task per slot only where that cannot change what the batcher does: each batch is one
request (``max_batch_size`` 0 or 1: nothing to gain by waiting to batch) and no queue policy
acts on waiting requests (:attr:`BatchQueue.policy_free`, as Triton prefetches). Elsewhere one
batch runs per instance at a time, so batches form from every request that waited meanwhile.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from tritonclient.grpc import model_config_pb2 as pb

from quiver.backends.base import ModelInstance
from quiver.clock import SYSTEM_CLOCK, Clock
from quiver.errors import InternalError, InvalidArgumentError, QuiverError, UnavailableError
from quiver.metrics.statistics import ModelStatistics
from quiver.scheduling.core import CoreScheduler, ErrorFactory, Execution, SchedulerCore, by_slot
from quiver.scheduling.queue import BatchQueue, PendingRequest, QueuePolicy
from quiver.streaming import Cancellation
from quiver.types import InferenceRequest, InferenceResponse


def _policy(proto: Any) -> QueuePolicy:
    return QueuePolicy(
        max_queue_size=int(proto.max_queue_size),
        default_timeout_ns=int(proto.default_timeout_microseconds) * 1000,
        allow_timeout_override=bool(proto.allow_timeout_override),
        delay_on_timeout=proto.timeout_action == pb.ModelQueuePolicy.DELAY,
    )


def queue_from_config(config: pb.ModelDynamicBatching, max_batch_size: int, model: str) -> BatchQueue:
    """The BatchQueue a ``dynamic_batching`` section describes; errors name the field."""
    levels = int(config.priority_levels)
    default_level = int(config.default_priority_level)
    if levels and not 1 <= default_level <= levels:
        raise InvalidArgumentError(
            f"model '{model}': dynamic_batching.default_priority_level must be in 1..{levels}, "
            f"got {default_level}"
        )
    for key in config.priority_queue_policy:
        if not 1 <= key <= max(levels, 1):
            raise InvalidArgumentError(
                f"model '{model}': dynamic_batching.priority_queue_policy has level {key}, "
                f"outside 1..{max(levels, 1)}"
            )
    for size in config.preferred_batch_size:
        if size < 1 or (max_batch_size and size > max_batch_size):
            raise InvalidArgumentError(
                f"model '{model}': dynamic_batching.preferred_batch_size {size} must be in "
                f"1..max_batch_size ({max_batch_size})"
            )
    default = _policy(config.default_queue_policy)
    policies = [
        _policy(config.priority_queue_policy[level]) if level in config.priority_queue_policy else default
        for level in range(1, max(levels, 1) + 1)
    ]
    return BatchQueue(
        max_batch_size=max_batch_size,
        preferred_batch_sizes=tuple(config.preferred_batch_size),
        max_queue_delay_ns=int(config.max_queue_delay_microseconds) * 1000,
        policies=policies,
    )


class DynamicBatcher(CoreScheduler):
    queueing = True

    def __init__(
        self,
        model: str,
        instances: list[ModelInstance],
        stats: ModelStatistics,
        queue: BatchQueue,
        *,
        priority_levels: int = 0,
        default_priority_level: int = 0,
        preserve_ordering: bool = False,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not instances:
            raise InternalError(f"model '{model}' has no instances to schedule on")
        self._model = model
        self._queue = queue
        self._levels = priority_levels
        self._default_level = (default_priority_level or 1) - 1
        self._batching = queue.max_batch_size > 0
        self._preserve_ordering = preserve_ordering
        self._order: deque[asyncio.Future[None]] = deque()  # preserve_ordering: batches in dispatch order
        self._core = core = SchedulerCore(f"model '{model}'", stats, clock)
        #: Whether instances that queue requests themselves get a worker task per slot: a batch
        #: may then wait in the instance, where a caller that leaves must still reach it.
        self._ahead = queue.max_batch_size <= 1 and queue.policy_free and not priority_levels
        core.use_workers(
            by_slot(instances) if self._ahead else instances,
            name=f"quiver-batcher-{model}",
            next_batch=self._next_batch,
            execute=self._execute,
            futures=lambda batch: (p.future for p in batch),
            fail_queued=self._fail_queued,
            run_queued_at_stop=True,
        )

    # -- requests ----------------------------------------------------------------------

    async def enqueue(self, request: InferenceRequest) -> InferenceResponse:
        core = self._core
        core.open()
        params = request.parameters
        level = self._default_level
        priority = params.get("priority", 0)
        if priority:
            if type(priority) is not int or priority < 0 or priority > max(self._levels, 1):
                raise core.reject(
                    InvalidArgumentError(
                        f"model '{self._model}': priority {priority!r} is out of range; it has "
                        f"{max(self._levels, 1)} priority level(s)"
                    )
                )
            level = priority - 1 if self._levels else 0
        timeout = params.get("timeout")
        if timeout is not None and (type(timeout) is not int or timeout < 0):
            raise core.reject(
                InvalidArgumentError(
                    f"model '{self._model}': 'timeout' must be a non-negative integer of microseconds"
                )
            )
        inputs = request.inputs
        if self._batching and inputs:
            rows = inputs[0].shape[0]
            signature: tuple[Any, ...] = tuple((t.name, t.datatype, t.shape[1:]) for t in inputs)
        else:
            rows = 1
            signature = ()
        now = core.clock.now()
        future: asyncio.Future[InferenceResponse] = asyncio.get_running_loop().create_future()
        pending = PendingRequest(request, future, rows, signature, now, level=level)
        try:
            self._queue.push(pending, timeout)
        except QuiverError as error:
            raise core.reject(error) from None
        with core.accept(now):
            core.wake_one()
            try:
                return await future
            except asyncio.CancelledError:
                if not future.done():
                    future.cancel()
                raise

    # -- workers -----------------------------------------------------------------------

    async def _next_batch(self, index: int) -> list[PendingRequest] | None:
        core = self._core
        queue = self._queue
        while True:
            now = core.clock.now()
            for pending in queue.expire(now):
                if not pending.future.done():  # a caller that left was counted as CANCELED
                    core.stats.record_failure(now - pending.enqueued_ns, "REJECTED")
                    pending.future.set_exception(
                        UnavailableError(
                            f"model '{self._model}': request timed out in the queue after "
                            f"{(now - pending.enqueued_ns) // 1000} us"
                        )
                    )
            batch, wake_at = queue.form(now)
            if batch:
                if len(queue):
                    core.wake_one()  # more may be formable for another free instance
                return batch
            if core.stopping and not len(queue):
                return None
            for when in (wake_at, queue.next_deadline()):
                if when:
                    core.alarm.at(when)
            await core.wait_for_work()

    async def _execute(self, instance: ModelInstance, batch: list[PendingRequest]) -> None:
        live = [p for p in batch if not p.gone]  # a caller may have left since forming
        if not live:
            return
        turn: asyncio.Future[None] | None = None
        previous: asyncio.Future[None] | None = None
        if self._preserve_ordering:
            previous = self._order[-1] if self._order else None
            turn = asyncio.get_running_loop().create_future()
            self._order.append(turn)
        try:
            core = self._core
            rows = sum(p.rows for p in live)
            if self._ahead:
                for pending in live:  # a caller that leaves while it waits in the instance cancels it there
                    request = pending.request
                    if request.cancellation is None:
                        request.cancellation = Cancellation()
            execution = await Execution.run(instance, [p.request for p in live], rows, core.stats, core.clock)
            if previous is not None:
                await asyncio.shield(previous)
            for pending, result in zip(live, execution.results, strict=True):
                execution.answer(pending.future, result, pending.enqueued_ns, pending.rows)
        finally:
            if turn is not None:
                turn.set_result(None)
                self._order.remove(turn)

    def _fail_queued(self, error: ErrorFactory) -> None:
        for pending in self._queue.drain():
            if not pending.future.done():
                pending.future.set_exception(error())
