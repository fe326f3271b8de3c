"""The lifecycle's clock: monotonic nanoseconds, and timers on the same time line.

Every duration and deadline in :mod:`quiver.lifecycle` (load and unload times, the load wait
timeout, last use for eviction) is read from one injected :class:`Clock`; nothing here calls
``time.monotonic`` itself, so a unit test drives time with a fake clock (its ``call_at``
timers fire when the test advances it: a deadline passes without sleeping).

The protocol is structurally the one the scheduling package's ``quiver.clock`` defines (issue
#12 gives lifecycle and scheduling one clock): once that module is on main, this one becomes a
re-export of it.
"""

from __future__ import annotations

import time
from asyncio import get_running_loop
from collections.abc import Callable
from typing import Protocol

__all__ = ["SYSTEM_CLOCK", "Clock", "MonotonicClock", "Timer", "seconds"]


class Timer(Protocol):
    def cancel(self) -> None:
        """Do not fire (no effect once fired)."""
        ...


class Clock(Protocol):
    def now(self) -> int:
        """Monotonic time in nanoseconds."""
        ...

    def call_at(self, when: int, callback: Callable[[], object]) -> Timer:
        """Call ``callback`` once ``now()`` reaches ``when`` (soon if it has)."""
        ...


class MonotonicClock:
    """``time.monotonic_ns``, with timers on the running event loop."""

    now = staticmethod(time.monotonic_ns)

    def call_at(self, when: int, callback: Callable[[], object]) -> Timer:
        delay = max(0.0, (when - time.monotonic_ns()) / 1e9)
        return get_running_loop().call_later(delay, callback)


SYSTEM_CLOCK: Clock = MonotonicClock()


def seconds(clock: Clock) -> float:
    """``clock``'s time in seconds (lifecycle keeps deadlines and last uses in seconds)."""
    return clock.now() / 1e9
