"""Evictions ahead of need: after a load, room for the next misses is made off their path.

A miss that finds its room free loads at once; one that must first unload a victim waits for
the unload. So after each load, once the requests that waited for it are answered, when fewer
bytes are free than the next misses likely need, the policy's victims among models not in
use are unloaded in the background (``--model-evict-ahead``, on by default). The ledger stays
honest throughout: the room is reserved under :data:`AHEAD` (never a model's name), a victim
counts until its unload has finished, and the reservation is given back at the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quiver.errors import UnavailableError
from quiver.lifecycle.budget import Admission, OutOfMemoryError
from quiver.lifecycle.clock import seconds

if TYPE_CHECKING:
    from quiver.lifecycle.admission import AdmissionControl, Unloader
    from quiver.lifecycle.pins import Pins
    from quiver.lifecycle.table import ModelTable

__all__ = ["AHEAD", "AHEAD_DELAY_S", "AHEAD_LOADS", "AHEAD_LULL_S", "AHEAD_SHARE", "RoomAhead"]

#: The reservation evictions ahead of need are made under: not a model name (model names are
#: checked and cannot hold a NUL), so it never meets a model's reservation or claims.
AHEAD = "\0ahead"

#: How long an eviction ahead of need waits, at most, for the requests that waited for the
#: load that set it off to be answered and for a lull between requests (a model in steady use,
#: or steady traffic, would otherwise hold it back).
AHEAD_DELAY_S = 0.1
#: The lull between requests evictions ahead of need wait for (when the next miss has room):
#: long enough for an answer just written to reach a client on the same machine (0.2 ms at
#: the median, 1.1 ms at p99 on the busy 2-core machine of the benchmarks), short enough to
#: come between requests that arrive one after another.
AHEAD_LULL_S = 0.001
#: Misses evictions ahead of need keep room for (when that is at most AHEAD_SHARE of the limit).
AHEAD_LOADS = 2
AHEAD_SHARE = 0.1


class RoomAhead:
    """The evictions ahead of need of one :class:`AdmissionControl` (its budget, policy and
    candidates), one run at a time."""

    def __init__(self, admission: AdmissionControl, pins: Pins, table: ModelTable) -> None:
        self._admission = admission
        self._pins = pins
        self._table = table
        self._running = False
        self._again: str | None = None  # a load finished while evictions ahead ran

    def bytes(self) -> int:
        """The free bytes evictions ahead of need keep: room for the next :data:`AHEAD_LOADS`
        misses (the size of the last model loaded each), so that a miss arriving while the
        previous one's victims still unload finds room too, as long as that is at most
        :data:`AHEAD_SHARE` of the limit; else room for one."""
        budget = self._admission.budget
        if budget is None:
            return 0
        size = self._admission.last_size
        return size * AHEAD_LOADS if size * AHEAD_LOADS <= budget.limit_bytes * AHEAD_SHARE else size

    def short(self) -> bool:
        """Whether evictions ahead of need have anything to do now (:meth:`make`)."""
        budget = self._admission.budget
        return budget is not None and self._admission.evict_ahead and budget.available < self.bytes()

    def urgent(self) -> bool:
        """Whether the next miss would find no room (evictions ahead of need wait for no lull)."""
        budget = self._admission.budget
        return budget is not None and budget.available < self._admission.last_size

    async def answered(self, loaded: str, deadline: float) -> None:
        """Until the requests that waited for ``loaded``'s load are answered (its pins gone, no
        request in flight on it) and then no request came or went for :data:`AHEAD_LULL_S`
        (unless :meth:`urgent`), or until ``deadline`` (seconds on the clock).
        UnavailableError: the server stops.

        The requests that waited for the load are answered first: their first inference and
        their responses do not share the event loop and the cores with what comes after it.
        Then the answers go out: on a busy machine an unload (the framework freeing a session,
        a heap trim, the bookkeeping and its log line), or the load's own bookkeeping, takes
        the core a client on the same machine (or a frontend worker) needs to take its answer;
        a miss's answer reached its client 0.9 ms later than a hit's while evictions ahead ran
        right after it."""
        admission = self._admission
        while self._pins.pinned(loaded) or any(m.scheduler.inflight for m in self._table.loaded(loaded)):
            if not await admission.gate.wait(deadline):
                break
        if not self.urgent():
            await admission.activity.idle(AHEAD_LULL_S, int(deadline * 1e9), self.urgent)

    async def make(self, loaded: str, unloader: Unloader) -> None:
        """Evict ahead of need, off any request's path: after ``loaded`` loaded, the requests
        that waited for it are answered and no request came or went for :data:`AHEAD_LULL_S`
        (unless the next miss would find no room; at most :data:`AHEAD_DELAY_S` later), when
        fewer bytes are free than :meth:`bytes`, reserve that many under :data:`AHEAD` (the
        policy picks victims among models not in use, never ``loaded``), unload the victims,
        then give the reservation back, so the next misses find their room free instead of
        waiting for an unload. One at a time (a load that finishes meanwhile has the running
        one look again when done); nothing when the budget is off, when ``evict_ahead`` is
        off, or when nothing but models in use could go."""
        budget = self._admission.budget
        if budget is None or not self.short():
            return
        if self._running:
            self._again = loaded
            self._admission.activity.poke()  # one waiting for a lull looks at the room again
            return
        self._running = True
        try:
            while True:
                await self._make(loaded, unloader)
                again, self._again = self._again, None
                if again is None or budget.available >= self.bytes():
                    return
                loaded = again
        finally:
            self._running = False

    async def _make(self, loaded: str, unloader: Unloader) -> None:
        admission = self._admission
        budget = admission.budget
        assert budget is not None
        try:
            await self.answered(loaded, seconds(admission.clock) + AHEAD_DELAY_S)
        except UnavailableError:
            return  # the server stops
        want = self.bytes()
        if budget.available >= want:
            return
        try:
            # never the model just loaded, nor one loaded while this waited (the next round's)
            candidates = [c for c in admission.candidates(loaded) if c.name not in (AHEAD, self._again)]
            decision = budget.admit(AHEAD, want, admission.policy, candidates)
        except OutOfMemoryError:
            return
        if not isinstance(decision, Admission):
            return  # only models in use or loads under way stand in the way: the next miss waits as usual
        try:
            await admission.evict_claimed(decision, AHEAD, unloader)
        finally:
            budget.cancel(AHEAD)
