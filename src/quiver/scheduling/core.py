"""The scheduler core: what the four schedulers (direct, dynamic, sequence, ensemble) share.

A scheduler composes one :class:`SchedulerCore` and keeps only its policy (how batches form,
how sequences route, how an ensemble walks its DAG). The core owns

- admission: once the scheduler stops, or a worker crashed, new requests are refused, and
  every refusal counts as a ``REJECTED`` failure;
- in-flight accounting: requests accepted and not yet answered (with the statistics'
  ``pending`` gauge and a ``CANCELED`` failure for a caller that left), and an event that
  ``stop`` waits on when the count falls to zero;
- workers (batching schedulers): one task per instance, started at the first request, that
  asks the policy for its next batch and runs it; idle workers wait to be woken (a new request,
  a finished batch, the alarm), never by polling; a batch that raises fails its requests, a
  worker that crashes is logged once with its traceback and fails what is queued;
- the alarm: one timer at the earliest wake-up asked for, on the injected clock;
- the ordered stop: refuse; fail what is queued, or let the workers run it out; await the
  workers (cancelled, and awaited, if the stop itself is cancelled); cancel the alarm; wait
  until nothing is in flight.

:class:`InstancePool` lends instances one request at a time (the direct scheduler), and
:class:`Execution` runs requests on an instance and records what Triton's statistics count.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from types import TracebackType
from typing import Any, TypeVar

from quiver.backends.base import ExecuteResult, ModelInstance
from quiver.clock import Clock, Timer
from quiver.errors import InternalError, QuiverError, UnavailableError
from quiver.metrics.statistics import ModelStatistics
from quiver.types import InferenceRequest, InferenceResponse

logger = logging.getLogger(__name__)

B = TypeVar("B")
E = TypeVar("E", bound=QuiverError)

Worker = Callable[[int, ModelInstance], Coroutine[Any, Any, None]]
#: Makes the error to fail a request with (one instance per request: a raised exception
#: carries its traceback).
ErrorFactory = Callable[[], QuiverError]


def batch_rows(request: InferenceRequest, batching: bool) -> int:
    """The rows a request carries: its first input's batch dimension for a batching model."""
    return request.inputs[0].shape[0] if batching and request.inputs else 1


class Alarm:
    """One timer at the earliest time asked for; when it fires it calls ``callback`` once."""

    __slots__ = ("_callback", "_clock", "_timer", "_when")

    def __init__(self, clock: Clock, callback: Callable[[], None]) -> None:
        self._clock = clock
        self._callback = callback
        self._timer: Timer | None = None
        self._when = 0

    def at(self, when: int) -> None:
        """Fire at ``when`` (monotonic ns) unless already set to fire no later."""
        if self._timer is not None:
            if self._when <= when:
                return
            self._timer.cancel()
        self._when = when
        self._timer = self._clock.call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._when = 0
        self._callback()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._when = 0


class Admission:
    """One accepted request, counted in flight from :meth:`SchedulerCore.accept` to the end of
    its ``with`` block; a caller that leaves counts as ``CANCELED``, an error as
    ``error_reason`` (if given)."""

    __slots__ = ("_core", "_error_reason", "_start")

    def __init__(self, core: SchedulerCore, start: int, error_reason: str | None) -> None:
        self._core = core
        self._start = start
        self._error_reason = error_reason

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        core = self._core
        if kind is not None:
            if issubclass(kind, asyncio.CancelledError):
                core.stats.record_failure(core.clock.now() - self._start, "CANCELED")
            elif self._error_reason is not None and issubclass(kind, Exception):
                core.stats.record_failure(core.clock.now() - self._start, self._error_reason)
        core._inflight -= 1
        core.stats.pending -= 1
        if core._inflight == 0 and core._idle is not None:
            core._idle.set()


def _nothing(*_: object) -> None:
    pass


class SchedulerCore:
    """Admission, in-flight accounting, workers, the alarm and the ordered stop of one
    scheduler; ``what`` names it in messages (``model 'x'``, ``ensemble 'y'``)."""

    def __init__(self, what: str, stats: ModelStatistics, clock: Clock) -> None:
        self.what = what
        self.stats = stats
        self.clock = clock
        self.stopping = False
        self.alarm = Alarm(clock, self.wake_one)
        self._inflight = 0
        self._idle: asyncio.Event | None = None
        self._crash: str | None = None
        self._work: Worker | None = None
        self._instances: list[ModelInstance] = []
        self._worker_name = ""
        self._fail_queued: Callable[[ErrorFactory], None] = _nothing
        self._run_queued_at_stop = False
        self._workers: list[asyncio.Task[None]] = []
        self._waiting: deque[asyncio.Future[None]] = deque()

    # -- admission and in-flight accounting ---------------------------------------------

    @property
    def inflight(self) -> int:
        return self._inflight

    def open(self) -> None:
        """Check that requests are taken (refusing one counts it); start the workers."""
        if self.stopping or self._crash is not None:
            self.stats.record_failure(0, "REJECTED")
            if self._crash is not None:
                raise InternalError(self._crash)
            raise self._unloading()
        if self._work is not None and not self._workers:
            self._start_workers()

    def _unloading(self) -> UnavailableError:
        return UnavailableError(f"{self.what} is unloading")

    def reject(self, error: E) -> E:
        """Count ``error`` as a rejected request; returns it, to raise."""
        self.stats.record_failure(0, "REJECTED")
        return error

    def accept(self, start: int, error_reason: str | None = None) -> Admission:
        """``with core.accept(start):`` around the wait for the answer to a request accepted
        (arrived) at ``start``; it is in flight from this call."""
        self._inflight += 1
        self.stats.pending += 1
        return Admission(self, start, error_reason)

    # -- workers -------------------------------------------------------------------------

    def use_workers(
        self,
        instances: list[ModelInstance],
        *,
        name: str,
        next_batch: Callable[[int], Awaitable[B | None]],
        execute: Callable[[ModelInstance, B], Awaitable[None]],
        futures: Callable[[B], Iterable[asyncio.Future[Any]]],
        fail_queued: Callable[[ErrorFactory], None],
        finished: Callable[[B], None] = _nothing,
        on_alarm: Callable[[], None] | None = None,
        run_queued_at_stop: bool = False,
    ) -> None:
        """Serve with one worker per instance (started at the first request), tasks named
        ``name-<index>``; the alarm calls ``on_alarm`` (by default it wakes one worker).

        A worker takes ``next_batch(index)`` until it returns None (then it ends) and runs
        each with ``execute(instance, batch)``; if that raises, the batch's ``futures`` that
        are not answered yet fail; ``finished(batch)`` follows either way.
        ``fail_queued(error)`` fails every request still queued, each with its own
        ``error()``: after a worker crashed, and at stop, unless ``run_queued_at_stop``
        (then the workers run out the queue first; ``next_batch`` ends them when it is empty).
        """

        async def work(index: int, instance: ModelInstance) -> None:
            while True:
                batch = await next_batch(index)
                if batch is None:
                    return
                try:
                    await execute(instance, batch)
                except asyncio.CancelledError:
                    _fail(futures(batch), self._unloading)
                    raise
                except Exception:  # a bug here must not kill the worker and strand the queue
                    logger.exception("%s: batch execution failed", self.what)
                    _fail(futures(batch), lambda: InternalError(f"{self.what}: batch execution failed"))
                finally:
                    finished(batch)

        self._instances = instances
        self._worker_name = name
        if on_alarm is not None:
            self.alarm = Alarm(self.clock, on_alarm)
        self._work = work
        self._fail_queued = fail_queued
        self._run_queued_at_stop = run_queued_at_stop

    def _start_workers(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._work is not None
        for index, instance in enumerate(self._instances):
            task = loop.create_task(self._work(index, instance), name=f"{self._worker_name}-{index}")
            task.add_done_callback(self._worker_done)
            self._workers.append(task)

    def _worker_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        logger.error("%s: scheduler worker %s crashed", self.what, task.get_name(), exc_info=error)
        crash = self._crash = f"{self.what}: a scheduler worker crashed ({error!r}); load the model again"
        self._fail_queued(lambda: InternalError(crash))

    async def wait_for_work(self) -> None:
        """Wait, as an idle worker, until woken (by a request, a finished batch, the alarm)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        await waiter

    def wake_one(self) -> None:
        waiting = self._waiting
        while waiting:
            waiter = waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def wake_all(self) -> None:
        while self._waiting:
            self.wake_one()

    # -- stopping ------------------------------------------------------------------------

    async def stop(self) -> None:
        """Refuse new requests; fail the queued ones (or let the workers run them out first);
        await the workers; cancel the alarm; wait until nothing is in flight."""
        self.stopping = True
        if not self._run_queued_at_stop:
            self._fail_queued(self._unloading)
        try:
            if self._workers:
                self.wake_all()
                await _finish(self._workers)
        finally:
            self.alarm.cancel()
            self._fail_queued(self._unloading)
        if self._inflight:
            if self._idle is None:
                self._idle = asyncio.Event()
            await self._idle.wait()


async def _finish(tasks: list[asyncio.Task[None]]) -> None:
    """Await ``tasks``; if the wait is cancelled, cancel them and await them before leaving."""
    try:
        await asyncio.wait(tasks)
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        raise


def _fail(futures: Iterable[asyncio.Future[Any]], error: ErrorFactory) -> None:
    for future in futures:
        if not future.done():
            future.set_exception(error())


class CoreScheduler:
    """What the four schedulers answer alike from their core: the Scheduler protocol's
    in-flight count and stop. Everything else they do is their own policy."""

    _core: SchedulerCore

    @property
    def inflight(self) -> int:
        return self._core.inflight

    async def stop(self) -> None:
        await self._core.stop()


class InstancePool:
    """Instances lent one request at a time: the one holding the fewest (among equals, the next
    in turn after the last one lent, so requests one after another go round the instances, as
    Triton's do), to waiters in arrival order. An instance with ``slots`` > 1 (one whose batches run in a worker
    process that queues them, :class:`quiver.backends.python_worker.WorkerInstance`) is lent
    up to that many times at once: its next request is already there when the worker finishes
    one, instead of a round trip through the loop later; it still runs them one at a time.
    ``slots`` (an int of at least 1) may change as the instance runs: it is read at each lending.

    An instance freed while requests wait is handed to the first of them, which runs only when
    the event loop next gets to it; until then the instance is idle though lent. For an
    instance whose calls are over before ``run`` returns (``answers_at_once``: it runs on the
    event loop, see :class:`quiver.backends.base.ThreadedInstance`) that was a convoy: each
    request arriving meanwhile queued behind it, one waiting request ran per turn of the loop,
    and at high concurrency the line never emptied (every request paid a future, a wake-up and
    a turn of the loop of its own). Such an instance, freed, is lent to no one: every waiter is
    woken, in order, to take it as it runs (each call is over before the next waiter runs), and a
    request arriving in between takes it as well. A waiter that finds it taken (its calls went to
    the thread meanwhile) goes back to the head of the line, before those who came later."""

    def __init__(self, instances: list[ModelInstance]) -> None:
        self._instances = list(instances)
        self._lent = [0] * len(instances)
        self._index = {id(instance): index for index, instance in enumerate(instances)}
        self._counted = [hasattr(instance, "slots") for instance in instances]
        # a waiter gets the instance handed to it, or None: woken to take() one itself
        self._waiters: deque[asyncio.Future[ModelInstance | None]] = deque()
        self._returned = 0  # woken waiters that found nothing free and are back at the head, in order
        self._next = 0  # where the next look starts: ties go round the instances in turn

    def take(self) -> ModelInstance | None:
        """A free instance now, or None (then :meth:`acquire` waits for one)."""
        lent, counted, instances = self._lent, self._counted, self._instances
        if len(instances) == 1:  # the usual
            held = lent[0]
            if held < (instances[0].slots if counted[0] else 1):  # type: ignore[attr-defined]
                lent[0] = held + 1
                return instances[0]
            return None
        best, count, start = -1, len(instances), self._next
        for step in range(count):
            index = (start + step) % count
            held = lent[index]
            instance = instances[index]
            if held < (instance.slots if counted[index] else 1) and (best < 0 or held < lent[best]):  # type: ignore[attr-defined]
                best = index
                if not held:
                    break
        if best < 0:
            return None
        lent[best] += 1
        self._next = (best + 1) % count
        return instances[best]

    async def acquire(self) -> ModelInstance:
        instance = self.take()
        woken = False
        while instance is None:
            waiter: asyncio.Future[ModelInstance | None] = asyncio.get_running_loop().create_future()
            if woken:  # woken and too late: back to the head of the line, in the order woken
                self._waiters.insert(self._returned, waiter)
                self._returned += 1
            else:
                self._waiters.append(waiter)
            try:
                instance = await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled() and (handed := waiter.result()) is not None:
                    self.release(handed)  # handed over just as we were cancelled
                raise
            if instance is None:  # woken to take one
                instance = self.take()
                woken = True
        return instance

    def release(self, instance: ModelInstance) -> None:
        if len(self._lent) == 1:
            self._lent[0] -= 1
        else:
            self._lent[self._index[id(instance)]] -= 1
        waiters = self._waiters
        if waiters and getattr(instance, "answers_at_once", False):
            self._returned = 0
            while waiters:  # lent to no one: they take it in turn (see the class's doc)
                waiter = waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)
            return
        while waiters:
            waiter = waiters[0]
            if waiter.done():  # its caller left
                self._pop()
                continue
            lent = self.take()
            if lent is None:
                return
            self._pop()
            waiter.set_result(lent)

    def _pop(self) -> None:
        self._waiters.popleft()
        if self._returned:  # one of those back at the head went
            self._returned -= 1


def _slots(instance: ModelInstance) -> int:
    return max(1, int(getattr(instance, "slots", 1)))


def by_slot(instances: list[ModelInstance]) -> list[ModelInstance]:
    """Each instance once per request it may hold at once (its ``slots``), every instance's
    first slot before any instance's second."""
    return [
        instance for slot in range(max(_slots(i) for i in instances)) for instance in instances if _slots(instance) > slot
    ]


class Execution:
    """One run of requests on an instance, timed on the clock and recorded as one execution
    of ``rows`` rows; then each request's answer is recorded against its own arrival time."""

    __slots__ = ("dispatched", "done", "infer_ns", "input_ns", "output_ns", "results", "stats")

    def __init__(
        self, stats: ModelStatistics, dispatched: int, done: int, results: ExecuteResult, instance: ModelInstance
    ) -> None:
        self.stats = stats
        self.dispatched = dispatched
        self.done = done
        self.results = results
        timing = instance.timing
        self.input_ns, self.infer_ns, self.output_ns = timing.input_ns, timing.infer_ns, timing.output_ns
        if dispatched < timing.started_ns <= done:  # it waited in the instance's own queue first
            self.dispatched = timing.started_ns
        if not (self.input_ns or self.infer_ns or self.output_ns):
            self.infer_ns = done - self.dispatched  # the backend does not split its time

    @classmethod
    async def run(
        cls,
        instance: ModelInstance,
        requests: list[InferenceRequest],
        rows: int,
        stats: ModelStatistics,
        clock: Clock,
        dispatched: int | None = None,
    ) -> Execution:
        """Run ``requests`` (dispatched now, or at ``dispatched``) and record the execution."""
        if dispatched is None:
            dispatched = clock.now()
        results = await instance.run(requests)
        execution = cls(stats, dispatched, clock.now(), results, instance)
        stats.record_execution(rows, execution.input_ns, execution.infer_ns, execution.output_ns)
        for request, result in zip(requests, results, strict=False):
            if request.trace is not None:  # a sampled request: Triton's compute timestamps
                outputs = result.outputs if isinstance(result, InferenceResponse) else ()
                request.trace.compute(
                    execution.dispatched, execution.input_ns, execution.output_ns, execution.done, outputs
                )
        return execution

    def outcome(self, result: InferenceResponse | QuiverError, enqueued: int, rows: int = 1) -> InferenceResponse:
        """Record ``result`` of a request that arrived at ``enqueued``; return it, or raise it
        if it is an error."""
        if isinstance(result, QuiverError):
            self.stats.record_failure(self.done - enqueued, "BACKEND")
            raise result
        self.stats.record_success(
            self.done - enqueued,
            self.dispatched - enqueued,
            self.input_ns,
            self.infer_ns,
            self.output_ns,
            rows,
        )
        return result

    def answer(
        self,
        future: asyncio.Future[InferenceResponse],
        result: InferenceResponse | QuiverError,
        enqueued: int,
        rows: int = 1,
    ) -> None:
        """Record ``result`` and set it on ``future``, unless its caller already left."""
        if future.done():
            return
        try:
            future.set_result(self.outcome(result, enqueued, rows))
        except QuiverError as error:
            future.set_exception(error)
