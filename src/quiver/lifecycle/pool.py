"""The load pool: the bounded threads (``--model-load-thread-count``) every blocking step of
the model life cycle runs on (repository scans, config reads, framework loads, unloads,
measurements), never the event loop.

A step is never abandoned half done: when the coroutine awaiting it is cancelled (the server
stops, a client goes away), the cancellation waits for the thread to finish, hands what it
produced to a ``discard`` coroutine (a load's models are unloaded, so ``finalize`` runs and
nothing is left holding memory no ledger counts), and only then propagates.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["LoadPool", "settle"]

T = TypeVar("T")


class LoadPool:
    def __init__(self, threads: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="quiver-load")

    async def run(
        self,
        fn: Callable[..., T],
        *args: Any,
        discard: Callable[[T], Awaitable[None]] | None = None,
    ) -> T:
        """``fn(*args)`` on a load thread. Cancelled meanwhile: waits for the thread, passes
        its result to ``discard``, then raises CancelledError.

        The thread hands its result straight to the future the caller awaits (one wake-up of
        the event loop, and the caller runs in the loop's next round), instead of through
        ``run_in_executor``'s future and a shield over it (two rounds more: 0.1 ms on a miss
        on a busy machine)."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[T] = loop.create_future()
        call = functools.partial(fn, *args)

        def work() -> T:
            try:
                result = call()
            except BaseException as exc:
                _hand_over(loop, answer, None, exc)
                raise
            _hand_over(loop, answer, result, None)
            return result

        running = self._executor.submit(work)
        try:
            return await answer
        except asyncio.CancelledError:
            if not answer.cancelled():
                raise  # the step itself raised CancelledError
            step = asyncio.wrap_future(running)
            await settle(step)
            if not step.cancelled() and step.exception() is None and discard is not None:
                await settle(asyncio.ensure_future(discard(step.result())))
            raise

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False)


def _hand_over(
    loop: asyncio.AbstractEventLoop, answer: asyncio.Future[T], result: T | None, error: BaseException | None
) -> None:
    """From the load thread: ``answer`` gets ``result`` (or ``error``) on the event loop."""
    with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
        loop.call_soon_threadsafe(_deliver, answer, result, error)


def _deliver(answer: asyncio.Future[T], result: T | None, error: BaseException | None) -> None:
    if answer.done():  # the caller was cancelled: it waits for the thread by itself
        return
    if error is not None:
        answer.set_exception(error)
    else:
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
