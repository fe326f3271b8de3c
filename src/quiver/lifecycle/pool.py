"""The load pool: the bounded threads (``--model-load-thread-count``) every blocking step of
the model life cycle runs on (repository scans, config reads, framework loads, unloads,
measurements), never the event loop.

A step is never abandoned half done: when the coroutine awaiting it is cancelled (the server
stops, a client goes away), the cancellation waits for the thread to finish, hands what it
produced to a ``discard`` coroutine (a load's models are unloaded, so ``finalize`` runs and
nothing is left holding memory no ledger counts), and only then propagates.

The hand-off is the one :mod:`quiver.backends.instance_thread` uses for inference: a step is
queued on a ``queue.SimpleQueue`` (C) that the threads take from, and the thread hands its
result straight to the future the caller awaits with one ``call_soon_threadsafe``. A
``ThreadPoolExecutor`` costs besides a ``concurrent.futures.Future`` (a ``Condition`` and its
lock), a work item and an idle-semaphore round, all Python code run under the GIL: 0.11 ms
from a step's submission to its start against 0.07 ms with the queue, with that code out of
the CPU's caches (as it is on a miss; medians of 60, this 2-core machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["LoadPool", "settle"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _Step:
    """One step's end, for a caller cancelled while it runs: whether it finished, what it
    gave, and the future to wake when it does (set by the cancelled caller)."""

    __slots__ = ("error", "finished", "lock", "result", "waiter")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.finished = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None


class LoadPool:
    def __init__(self, threads: int) -> None:
        self._max = max(1, threads)
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for a step (or about to)
        self._shutdown = False

    def _put(self, work: Callable[[], None]) -> None:
        with self._lock:
            if self._shutdown:
                raise RuntimeError("the load pool is shut down")
            if self._idle:
                self._idle -= 1  # a waiting thread takes it
            elif len(self._threads) < self._max:
                thread = threading.Thread(
                    target=self._work, name=f"quiver-load_{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        self._queue.put(work)

    def _work(self) -> None:
        get = self._queue.get
        while True:
            work = get()
            if work is None:
                return
            work()
            with self._lock:
                self._idle += 1

    async def run(
        self,
        fn: Callable[..., T],
        *args: Any,
        discard: Callable[[T], Awaitable[None]] | None = None,
        arrived: Callable[[T], None] | None = None,
    ) -> T:
        """``fn(*args)`` on a load thread. Cancelled meanwhile: waits for the thread, passes
        its result to ``discard``, then raises CancelledError.

        The thread hands its result straight to the future the caller awaits (one wake-up of
        the event loop, and the caller runs in the loop's next round). ``arrived``: called
        with the result on the event loop as it arrives, before the caller is woken (not when
        the step raised or the caller was cancelled): what it does is a round of the event
        loop earlier, and the tasks it wakes run before the caller."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[T] = loop.create_future()
        call = functools.partial(fn, *args) if args else fn
        step = _Step()

        def work() -> None:
            result: Any = None
            error: BaseException | None = None
            try:
                result = call()
            except BaseException as exc:  # handed to the awaiting task, as run_in_executor does
                error = exc
            with step.lock:
                step.finished, step.result, step.error = True, result, error
                waiter = step.waiter
            _hand_over(loop, answer, result, error, arrived)
            if waiter is not None:
                _hand_over(loop, waiter, None, None)

        self._put(work)
        try:
            return await answer
        except asyncio.CancelledError:
            if not answer.cancelled():
                raise  # the step itself raised CancelledError
            with step.lock:
                if not step.finished:
                    step.waiter = loop.create_future()
                waiter = step.waiter
            if waiter is not None:
                await settle(waiter)
            if step.error is None and discard is not None:
                await settle(asyncio.ensure_future(discard(step.result)))
            raise

    def post(self, fn: Callable[[], object]) -> None:
        """``fn()`` on a load thread, nobody waiting for it (an error is logged)."""

        def work() -> None:
            try:
                fn()
            except Exception:
                logger.exception("a background step on a load thread failed")

        with contextlib.suppress(RuntimeError):  # shut down: nothing more runs
            self._put(work)

    def shutdown(self) -> None:
        """No more steps after those queued (which still run); the threads end after them."""
        with self._lock:
            if self._shutdown:
                return
            self._shutdown = True
            threads = len(self._threads)
        for _ in range(threads):
            self._queue.put(None)


def _hand_over(
    loop: asyncio.AbstractEventLoop,
    answer: asyncio.Future[T],
    result: T | None,
    error: BaseException | None,
    arrived: Callable[[T], None] | None = None,
) -> None:
    """From the load thread: ``answer`` gets ``result`` (or ``error``) on the event loop,
    ``arrived(result)`` first."""
    with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
        loop.call_soon_threadsafe(_deliver, answer, result, error, arrived)


def _deliver(
    answer: asyncio.Future[T],
    result: T | None,
    error: BaseException | None,
    arrived: Callable[[T], None] | None = None,
) -> None:
    if answer.done():  # the caller was cancelled: it waits for the thread by itself
        return
    if error is not None:
        answer.set_exception(error)
        return
    if arrived is not None:
        try:
            arrived(result)  # type: ignore[arg-type]
        except Exception:  # the caller goes on with the result as without it
            logger.exception("handling a load step's result as it arrived failed")
        if answer.done():  # cancelled by what ``arrived`` ran
            return
    answer.set_result(result)  # type: ignore[arg-type]


async def settle(future: asyncio.Future[Any]) -> None:
    """Until ``future`` is done, however often the caller is cancelled meanwhile."""
    while not future.done():
        try:
            await asyncio.wait({future})
        except asyncio.CancelledError:
            continue
    if not future.cancelled():
        future.exception()  # retrieved: a failure here is the cancelled caller's, not logged twice
