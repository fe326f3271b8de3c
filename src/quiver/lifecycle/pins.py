"""Pins: why a model may not be evicted now, as explicit counts.

A pin is taken and released in pairs (:meth:`Pins.pin` / :meth:`Pins.unpin`, or the
:meth:`Pins.holding` context manager); a model is pinned while its count is above zero. Who
pins (see :mod:`quiver.lifecycle.locks` for the full list): a load or unload waiting for or
holding the model's lock, a request waiting for the model's on-demand load, an ensemble load
needing it as a composing model. Requests in flight are counted by the model's scheduler
(``inflight``) and pin it too, by :meth:`quiver.lifecycle.admission.AdmissionControl.in_use`.

When a count drops to zero the model's idle event is set and ``on_release`` is called (the
budget gate's ``notify``: loads waiting for room look again). Pins live on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

__all__ = ["Pins"]


class Pins:
    def __init__(self, on_release: Callable[[], None] | None = None) -> None:
        self._counts: dict[str, int] = {}
        self._idle: dict[str, asyncio.Event] = {}
        self.on_release = on_release

    def pin(self, *names: str) -> None:
        for name in names:
            self._counts[name] = self._counts.get(name, 0) + 1

    def unpin(self, *names: str) -> None:
        released = False
        for name in names:
            left = self._counts[name] - 1  # KeyError: an unpin without its pin
            if left:
                self._counts[name] = left
                continue
            del self._counts[name]
            released = True
            event = self._idle.pop(name, None)
            if event is not None:
                event.set()
        if released and self.on_release is not None:
            self.on_release()

    @contextlib.contextmanager
    def holding(self, *names: str) -> Iterator[None]:
        self.pin(*names)
        try:
            yield
        finally:
            self.unpin(*names)

    def count(self, name: str) -> int:
        return self._counts.get(name, 0)

    def pinned(self, name: str) -> bool:
        return name in self._counts

    @property
    def names(self) -> frozenset[str]:
        """Every model pinned now."""
        return frozenset(self._counts)

    async def idle(self, name: str) -> None:
        """Until ``name`` is not pinned (at once when it is not)."""
        if name not in self._counts:
            return
        event = self._idle.get(name)
        if event is None:
            event = self._idle[name] = asyncio.Event()
        await event.wait()
