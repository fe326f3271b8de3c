"""Waiting for a Python worker's answer without sleeping (``spin-microseconds``): the server's
side. A sleeping event loop's wake-up costs more than a small model's whole ``execute``, so an
idle loop may read the worker's pipe for a moment instead, but only when that costs no other
request anything and the worker has been answering within the spin.
"""

from __future__ import annotations

import asyncio
import time

from quiver.ipc.channel import AsyncChannel
from quiver.ipc.inbox import spare_core

#: A batch sent this long after the previous one finished finds the loop idle (spinning for its
#: answer then costs no other request anything).
_IDLE_GAP_S = 50e-6
#: After a spin that timed out, how long until the next try.
_SPIN_RETRY_S = 1.0


class AnswerSpin:
    """Spins of up to ``seconds`` for one worker instance's answers."""

    __slots__ = ("_last_done", "_round_trip", "_slow_since", "_spin")

    def __init__(self, seconds: float) -> None:
        self._spin = seconds
        self._round_trip = 0.0  # recent round trips of spun batches (seconds, smoothed)
        self._slow_since = 0.0
        self._last_done = 0.0

    def wait(self, channel: AsyncChannel, done: asyncio.Future[None]) -> None:
        """Read ``channel`` until ``done`` or the spin is over, if it should spin now: when
        the worker answers quickly (its recent round trips fit the spin), the loop has been
        idle between batches (one caller at a time: a busy loop would rather serve others
        meanwhile) and the machine has a core to spare."""
        now = time.perf_counter()
        if now - self._last_done <= _IDLE_GAP_S:
            return
        if self._round_trip >= self._spin:
            if now - self._slow_since < _SPIN_RETRY_S:
                return
            self._round_trip = 0.0  # try again: the model may be quick now
        if not spare_core():
            return
        began = time.perf_counter()
        until = began + self._spin
        poll = channel.poll
        while not done.done():
            now = time.perf_counter()
            if now >= until:
                self._round_trip = self._spin * 2  # too slow to wait for: stop until it is quick again
                self._slow_since = now
                return
            poll()
        self._round_trip = (self._round_trip + time.perf_counter() - began) / 2

    def finished(self) -> None:
        """A batch of this instance is done (the next one sent soon after finds the loop busy)."""
        self._last_done = time.perf_counter()


__all__ = ["AnswerSpin"]
