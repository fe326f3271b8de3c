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
        its result to ``discard``, then raises CancelledError."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, functools.partial(fn, *args))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            await settle(future)
            if not future.cancelled() and future.exception() is None and discard is not None:
                await settle(asyncio.ensure_future(discard(future.result())))
            raise

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False)


async def settle(future: asyncio.Future[Any]) -> None:
    """Until ``future`` is done, however often the caller is cancelled meanwhile."""
    while not future.done():
        try:
            await asyncio.wait({future})
        except asyncio.CancelledError:
            continue
    if not future.cancelled():
        future.exception()  # retrieved: a failure here is the cancelled caller's, not logged twice
