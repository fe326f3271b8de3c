"""DynamicBatcher: Triton's dynamic batching over a model's instances.

Each instance has a worker task. A free worker forms the next batch from the
:class:`~quiver.scheduling.queue.BatchQueue` (waiting for ``max_queue_delay`` or a queue
timeout with a timer, never polling), runs it on its instance, and answers each request's
future. With ``preserve_ordering``, a batch's answers wait for every earlier batch's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tritonclient.grpc import model_config_pb2 as pb

from quiver.backends.base import ModelInstance
from quiver.errors import InternalError, InvalidArgumentError, QuiverError, UnavailableError
from quiver.metrics.statistics import ModelStatistics
from quiver.scheduling.queue import BatchQueue, PendingRequest, QueuePolicy
from quiver.types import InferenceRequest, InferenceResponse

logger = logging.getLogger(__name__)

Clock = Callable[[], int]


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


class DynamicBatcher:
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
        clock: Clock = time.monotonic_ns,
    ) -> None:
        if not instances:
            raise InternalError(f"model '{model}' has no instances to schedule on")
        self._model = model
        self._instances = instances
        self._stats = stats
        self._queue = queue
        self._levels = priority_levels
        self._default_level = (default_priority_level or 1) - 1
        self._batching = queue.max_batch_size > 0
        self._preserve_ordering = preserve_ordering
        self._clock = clock
        self._inflight = 0
        self._stopping = False
        self._idle_workers: deque[asyncio.Future[None]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0
        self._order: deque[asyncio.Future[None]] = deque()  # preserve_ordering: batches in dispatch order
        self._workers: list[asyncio.Task[None]] = []
        self._idle: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # bound by the first request

    @property
    def inflight(self) -> int:
        return self._inflight

    def _start(self) -> asyncio.AbstractEventLoop:
        """Start one worker per instance on the running loop (at the first request)."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._workers = [
            loop.create_task(self._work(instance), name=f"quiver-batcher-{self._model}-{index}")
            for index, instance in enumerate(self._instances)
        ]
        return loop

    # -- requests ----------------------------------------------------------------------

    async def enqueue(self, request: InferenceRequest) -> InferenceResponse:
        if self._stopping:
            self._stats.record_failure(0, "REJECTED")
            raise UnavailableError(f"model '{self._model}' is unloading")
        loop = self._loop or self._start()
        params = request.parameters
        level = self._default_level
        priority = params.get("priority", 0)
        if priority:
            if type(priority) is not int or priority < 0 or priority > max(self._levels, 1):
                self._stats.record_failure(0, "REJECTED")
                raise InvalidArgumentError(
                    f"model '{self._model}': priority {priority!r} is out of range; it has "
                    f"{max(self._levels, 1)} priority level(s)"
                )
            level = priority - 1 if self._levels else 0
        timeout = params.get("timeout")
        if timeout is not None and (type(timeout) is not int or timeout < 0):
            self._stats.record_failure(0, "REJECTED")
            raise InvalidArgumentError(
                f"model '{self._model}': 'timeout' must be a non-negative integer of microseconds"
            )
        inputs = request.inputs
        if self._batching and inputs:
            rows = inputs[0].shape[0]
            signature: tuple[Any, ...] = tuple((t.name, t.datatype, t.shape[1:]) for t in inputs)
        else:
            rows = 1
            signature = ()
        now = self._clock()
        future: asyncio.Future[InferenceResponse] = loop.create_future()
        pending = PendingRequest(request, future, rows, signature, now, level=level)
        try:
            self._queue.push(pending, timeout)
        except QuiverError:
            self._stats.record_failure(0, "REJECTED")
            raise
        self._inflight += 1
        self._stats.pending += 1
        self._wake_one()
        try:
            return await future
        except asyncio.CancelledError:
            if not future.done():
                future.cancel()
            self._stats.record_failure(self._clock() - now, "CANCELED")
            raise
        finally:
            self._inflight -= 1
            self._stats.pending -= 1
            if self._inflight == 0 and self._idle is not None:
                self._idle.set()

    def _wake_one(self) -> None:
        while self._idle_workers:
            waiter = self._idle_workers.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _wake_at(self, when: int) -> None:
        """Wake a worker at ``when`` (monotonic ns) unless an earlier timer is set."""
        if self._timer is not None and self._timer_at <= when:
            return
        if self._timer is not None:
            self._timer.cancel()
        assert self._loop is not None
        delay = max(0.0, (when - self._clock()) / 1e9)
        self._timer_at = when
        self._timer = self._loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = 0
        self._wake_one()

    # -- workers -----------------------------------------------------------------------

    async def _next_batch(self) -> list[PendingRequest] | None:
        queue = self._queue
        loop = asyncio.get_running_loop()
        while True:
            now = self._clock()
            for pending in queue.expire(now):
                if not pending.future.done():  # a caller that left was counted as CANCELED
                    self._stats.record_failure(now - pending.enqueued_ns, "REJECTED")
                    pending.future.set_exception(
                        UnavailableError(
                            f"model '{self._model}': request timed out in the queue after "
                            f"{(now - pending.enqueued_ns) // 1000} us"
                        )
                    )
            batch, wake_at = queue.form(now)
            if batch:
                if len(queue):
                    self._wake_one()  # more may be formable for another free instance
                return batch
            if self._stopping and not len(queue):
                return None
            deadline = queue.next_deadline()
            for when in (wake_at, deadline):
                if when:
                    self._wake_at(when)
            waiter: asyncio.Future[None] = loop.create_future()
            self._idle_workers.append(waiter)
            await waiter

    async def _work(self, instance: ModelInstance) -> None:
        while True:
            batch = await self._next_batch()
            if batch is None:
                return
            try:
                await self._execute(instance, batch)
            except Exception:  # a bug here must not kill the worker and strand the queue
                logger.exception("model '%s': batch execution failed", self._model)
                for pending in batch:
                    if not pending.future.done():
                        pending.future.set_exception(
                            InternalError(f"model '{self._model}': batch execution failed")
                        )

    async def _execute(self, instance: ModelInstance, batch: list[PendingRequest]) -> None:
        clock = self._clock
        stats = self._stats
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
            dispatched = clock()
            results = await instance.run([p.request for p in live])
            done = clock()
            timing = instance.timing
            input_ns, infer_ns, output_ns = timing.input_ns, timing.infer_ns, timing.output_ns
            if not (input_ns or infer_ns or output_ns):
                infer_ns = done - dispatched
            rows = sum(p.rows for p in live)
            stats.record_execution(rows, input_ns, infer_ns, output_ns)
            if previous is not None:
                await asyncio.shield(previous)
            for pending, result in zip(live, results, strict=True):
                if pending.future.done():
                    continue
                if isinstance(result, QuiverError):
                    stats.record_failure(done - pending.enqueued_ns, "BACKEND")
                    pending.future.set_exception(result)
                else:
                    stats.record_success(
                        done - pending.enqueued_ns,
                        dispatched - pending.enqueued_ns,
                        input_ns,
                        infer_ns,
                        output_ns,
                        pending.rows,
                    )
                    pending.future.set_result(result)
        finally:
            if turn is not None:
                turn.set_result(None)
                self._order.remove(turn)

    # -- stopping ----------------------------------------------------------------------

    async def stop(self) -> None:
        """Refuse new requests, run what is queued, wait for the workers to finish."""
        self._stopping = True
        while self._idle_workers:
            self._wake_one()
        if self._workers:
            await asyncio.gather(*self._workers, return_exceptions=True)
        if self._timer is not None:
            self._timer.cancel()
        for pending in self._queue.drain():
            if not pending.future.done():
                pending.future.set_exception(UnavailableError(f"model '{self._model}' is unloading"))
