"""Whether the server is idle: no request came or went for a while.

Work that can wait runs then, off the requests' cores: configurations read ahead
(:mod:`quiver.lifecycle.read_ahead`) and evictions ahead of need (:mod:`quiver.lifecycle.ahead`).
The frontends tell :class:`Activity` of every request as it comes, whatever it asks (an
inference, health, metadata, the repository index, a ``/metrics`` scrape, a SageMaker ping:
each takes the event loop and a core the work that waits would take; through
``InferenceService.request_came``, so this package imports no frontend), and the manager of a
miss as it starts and of every inference as it ends. Each costs one clock read and one store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from quiver.lifecycle.clock import Clock

__all__ = ["IDLE_S", "Activity", "until"]

#: The server is idle when no request came or went for this long.
IDLE_S = 0.005


class Activity:
    """When a request last came or went, on ``clock`` (ns)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self.last = clock.now()
        self._waiting: set[asyncio.Future[None]] = set()

    def busy(self) -> None:
        """A request came or went."""
        self.last = self._clock.now()

    def poke(self) -> None:
        """Something a waiter's ``enough`` reads changed: the waiters look again now."""
        for waiter in list(self._waiting):
            if not waiter.done():
                waiter.set_result(None)

    async def idle(
        self, seconds: float = IDLE_S, deadline: int | None = None, enough: Callable[[], bool] | None = None
    ) -> bool:
        """Until no request came or went for ``seconds`` (True), or until the clock reaches
        ``deadline`` (ns), or ``enough()`` says to stop waiting (looked at first and after each
        :meth:`poke`), whichever comes first (False)."""
        wait = int(seconds * 1e9)
        while (due := self.last + wait) > (now := self._clock.now()):
            if (deadline is not None and now >= deadline) or (enough is not None and enough()):
                return False
            woken = until(self._clock, due if deadline is None else min(due, deadline))
            self._waiting.add(woken)
            try:
                await woken
            finally:
                self._waiting.discard(woken)
        return True


def until(clock: Clock, when: int) -> asyncio.Future[None]:
    """A future done when ``clock`` reaches ``when`` (ns)."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def fire() -> None:
        if not done.done():
            done.set_result(None)

    timer = clock.call_at(when, fire)
    done.add_done_callback(lambda _: timer.cancel())
    return done
