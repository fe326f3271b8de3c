"""The lifecycle's view of the one clock (:mod:`quiver.clock`), and its unit of seconds.

Every duration and deadline in :mod:`quiver.lifecycle` (load and unload times, the load wait
timeout, last use for eviction) is read from one injected :class:`Clock`; nothing here calls
``time.monotonic`` itself, so a unit test drives time with :class:`quiver.clock.FakeClock`
(its ``call_at`` timers fire when the test advances it: a deadline passes without sleeping).
Scheduling reads the same clock.
"""

from __future__ import annotations

from quiver.clock import SYSTEM_CLOCK, Clock, MonotonicClock, Timer

__all__ = ["SYSTEM_CLOCK", "Clock", "MonotonicClock", "Timer", "seconds"]


def seconds(clock: Clock) -> float:
    """``clock``'s time in seconds (lifecycle keeps deadlines and last uses in seconds)."""
    return clock.now() / 1e9
