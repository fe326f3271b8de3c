"""One model instance's own thread, and the cheapest hand-off of a call to it and back.

``loop.run_in_executor`` on a ``ThreadPoolExecutor`` costs, besides the two wake-ups any
hand-off needs, a ``concurrent.futures.Future`` (a ``Condition`` and its lock), a work item,
an idle-semaphore round per call and a chain of callbacks between the two futures, all of it
Python code run under the GIL on every request. :meth:`InstanceThread.call` queues the call
on a ``queue.SimpleQueue`` (C) and the thread resolves an asyncio future with one
``call_soon_threadsafe``: the same two wake-ups and little else.

It is still an ``Executor`` (``submit``, ``shutdown``) for what runs on the instance's thread
outside the request path (loading, warm-up, release).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

_T = TypeVar("_T")


def _resolve(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class InstanceThread(Executor):
    """A single worker thread, started on first use, that runs what is queued in order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._shutdown = False

    def _put(self, work: Callable[[], None]) -> None:
        thread = self._thread
        if thread is None or self._shutdown:
            with self._lock:
                if self._shutdown:
                    raise RuntimeError(f"instance thread {self.name} is shut down")
                if self._thread is None:
                    self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                    self._thread.start()
        self._queue.put(work)

    def _work(self) -> None:
        get = self._queue.get
        while True:
            work = get()
            if work is None:
                return
            work()

    def call(self, fn: Callable[[Any], _T], arg: Any) -> asyncio.Future[_T]:
        """``fn(arg)`` on this thread; its result (or exception) on the running loop's future.
        Cancelling the future does not stop ``fn``."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()

        def work() -> None:
            try:
                answer: tuple[Callable[[asyncio.Future[Any], Any], None], Any] = (_resolve, fn(arg))
            except BaseException as exc:  # handed to the awaiting task, as run_in_executor does
                answer = (_fail, exc)
            # RuntimeError: the loop closed meanwhile, nobody waits any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(answer[0], future, answer[1])

        self._put(work)
        return future

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        done: Future[_T] = Future()

        def work() -> None:
            if not done.set_running_or_notify_cancel():
                return
            try:
                done.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                done.set_exception(exc)

        self._put(work)
        return done

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more work after what is queued (which still runs: ``cancel_futures`` changes
        nothing); with ``wait``, until the thread has ended."""
        with self._lock:
            if self._shutdown:
                thread = self._thread
            else:
                self._shutdown = True
                thread = self._thread
                if thread is not None:
                    self._queue.put(None)
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()


__all__ = ["InstanceThread"]
