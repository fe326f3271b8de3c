"""The one clock: monotonic nanoseconds, and timers on the same time line.

Code that measures durations or waits for a deadline takes a :class:`Clock` instead of calling
``time.monotonic*`` itself, so a unit test can drive time with :class:`FakeClock` (no sleeps,
no flakiness). :data:`SYSTEM_CLOCK` is the real one: ``time.monotonic_ns`` and timers on the
running event loop.

Scheduling uses it today (durations in statistics, batch delays, queue and sequence idle
timeouts); lifecycle is meant to adopt it next.
"""

from __future__ import annotations

import heapq
import itertools
import time
from asyncio import get_running_loop
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None:
        """Do not fire (no effect once fired)."""
        ...


class Clock(Protocol):
    def now(self) -> int:
        """Monotonic time in nanoseconds."""
        ...

    def call_at(self, when: int, callback: Callable[[], object]) -> Timer:
        """Call ``callback`` once ``now()`` reaches ``when`` (at once if it has)."""
        ...


class MonotonicClock:
    """``time.monotonic_ns``, with timers on the running event loop."""

    now = staticmethod(time.monotonic_ns)

    def call_at(self, when: int, callback: Callable[[], object]) -> Timer:
        delay = max(0.0, (when - time.monotonic_ns()) / 1e9)
        return get_running_loop().call_later(delay, callback)


SYSTEM_CLOCK: Clock = MonotonicClock()


class _FakeTimer:
    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """A clock that moves only when told to; for tests.

    :meth:`advance` fires the timers that fall due, in time order (timers due at the same
    time in the order they were set), each seeing ``now()`` at its own due time.
    """

    def __init__(self, start: int = 0) -> None:
        self._now = start
        self._timers: list[tuple[int, int, _FakeTimer, Callable[[], object]]] = []
        self._order = itertools.count()

    def now(self) -> int:
        return self._now

    def call_at(self, when: int, callback: Callable[[], object]) -> Timer:
        timer = _FakeTimer()
        heapq.heappush(self._timers, (when, next(self._order), timer, callback))
        return timer

    @property
    def pending(self) -> list[int]:
        """Due times of the timers set and not yet fired or cancelled, earliest first."""
        return sorted(when for when, _, timer, _ in self._timers if not timer.cancelled)

    def advance(self, ns: int) -> None:
        """Move time forward by ``ns`` nanoseconds, firing what falls due on the way."""
        if ns < 0:
            raise ValueError("a monotonic clock does not go back")
        target = self._now + ns
        while self._timers and self._timers[0][0] <= target:
            when, _, timer, callback = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self._now = max(self._now, when)
            timer.cancelled = True  # fired: a later cancel() is a no-op
            callback()
        self._now = target
