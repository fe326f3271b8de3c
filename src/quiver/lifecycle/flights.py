"""Single flight: one load of a model however many callers wait for it.

On-demand requests, SageMaker's ``POST /models`` and the repository API's load of a key all
join the load of a name under way, or start it. The load is a task the life cycle owns (it
goes on when a caller gives up or is cancelled; the server's stop cancels and awaits it); a
caller waits for it until a deadline on the lifecycle clock. A load that failed is forgotten
as it ends, so the next caller tries again. A load whose model is installed (READY) lands its
callers at once (:meth:`SingleFlight.land`): they look the model up and run their requests
before the load's own bookkeeping after it (statistics, its lock and pins released).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

from quiver.errors import UnavailableError
from quiver.lifecycle.clock import Clock

__all__ = ["SingleFlight"]

Spawn = Callable[[Coroutine[Any, Any, None], str], "asyncio.Task[None]"]


class SingleFlight:
    def __init__(self, spawn: Spawn, clock: Clock) -> None:
        self._spawn = spawn
        self._clock = clock
        self._flights: dict[str, asyncio.Task[None]] = {}
        # The callers waiting for each load, woken by the load itself as it ends (or as its
        # model is installed: land): they run in the event loop's next round, not two rounds
        # later through the task's callbacks. Woken with True; by their deadline, False.
        self._waiting: dict[asyncio.Task[None], list[asyncio.Future[bool]]] = {}

    def join(self, name: str, start: Callable[[], Coroutine[Any, Any, None]]) -> asyncio.Task[None]:
        """The load of ``name`` under way, or a new one started with ``start()``."""
        task = self._flights.get(name)
        if task is None or task.done():
            task = self._spawn(self._fly(name, start), f"quiver-load-{name}")
            self._flights[name] = task
            task.add_done_callback(functools.partial(self._landed, name))
        return task

    async def _fly(self, name: str, start: Callable[[], Coroutine[Any, Any, None]]) -> None:
        try:
            await start()
        finally:
            task = asyncio.current_task()
            if task is not None:
                # The task ends in this same step: a caller woken now that finds the model gone
                # again (unloaded meanwhile) must start a new load, not join this one.
                if self._flights.get(name) is task:
                    del self._flights[name]
                self._wake(task)

    def _wake(self, task: asyncio.Task[None]) -> None:
        for waiter in self._waiting.pop(task, ()):
            if not waiter.done():
                waiter.set_result(True)

    def land(self, name: str) -> None:
        """``name``'s model was installed: the callers waiting for its load go on now, before
        the load ends (they find the model READY; the caller's own look-up decides)."""
        task = self._flights.get(name)
        if task is not None and task in self._waiting:
            self._wake(task)

    def _landed(self, name: str, task: asyncio.Task[None]) -> None:
        if self._flights.get(name) is task:
            del self._flights[name]
        self._wake(task)  # ended before it ever ran (cancelled at once): nobody woke them
        if not task.cancelled():
            task.exception()  # retrieved: waiters that timed out must not leave it unobserved

    async def wait(self, task: asyncio.Task[None], deadline: float) -> None:
        """Until ``task`` ends (its error, if it failed), its model is installed (:meth:`land`:
        returns while the load finishes its bookkeeping) or ``deadline`` (seconds on the clock:
        TimeoutError). ``task`` is never cancelled by the wait."""
        if not task.done():
            woken: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            waiting = self._waiting.setdefault(task, [])
            waiting.append(woken)

            def expire() -> None:
                if not woken.done():
                    woken.set_result(False)

            timer = self._clock.call_at(int(deadline * 1e9), expire)
            try:
                landed = await woken
            finally:
                timer.cancel()
                if woken in waiting:
                    waiting.remove(woken)
            if not task.done():
                if landed:
                    return
                raise TimeoutError
        _raise_if_stopped(task)
        task.result()

    async def follow(self, name: str, start: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """:meth:`join` and wait for the end, however long it takes."""
        task = self.join(name, start)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            _raise_if_stopped(task)
            raise


def _raise_if_stopped(task: asyncio.Task[None]) -> None:
    """UnavailableError when ``task`` was cancelled by the server stopping rather than the
    caller being cancelled."""
    current = asyncio.current_task()
    if task.cancelled() and (current is None or not current.cancelling()):
        raise UnavailableError("the server is stopping: no more models are loaded")
