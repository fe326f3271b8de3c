"""The memory budget: a ledger of model bytes that never goes over its limit, and the gate
through which loads wait for room.

:class:`MemoryBudget` is the ledger. It is pure (no I/O, no asyncio) and keeps one invariant
at every step, whatever the order of loads, evictions, unloads and reloads:

    committed = resident + retiring + reserved <= limit

- **resident**: the measured bytes of each loaded model (keyed by the manager's name for a
  loaded unit);
- **retiring**: the bytes of a reloaded model's old versions, from the moment the new ones are
  READY until the old ones have finished unloading;
- **reserved**: the bytes granted to each load under way.

The life of a reservation:

1. :meth:`MemoryBudget.admit` decides and reserves in one step (on the event loop, so no other
   decision interleaves). If the predicted size fits in the free bytes, it is reserved whole.
   Otherwise the eviction policy picks *victims* among the resident models that are not pinned,
   not loading and not already claimed; the load is granted the free bytes now and **claims**
   the victims for the rest (its *shortfall*). A victim stays resident, and counted, until its
   unload has finished; then :meth:`release` moves its bytes straight to the claiming load's
   reservation (up to the shortfall; any excess becomes free). Claimed bytes are never free in
   between, so no other load can take them, and the committed total never grows. If the
   victims that are not in use cannot cover the load (pinned models, other loads, models
   another load is evicting hold the rest), nothing changes and :class:`Blocked` says why: the
   caller waits for something to change and asks again. Only a model that could not fit even
   in an empty budget is refused at once (:class:`OutOfMemoryError`).
2. The load starts once its shortfall is zero (its victims are gone).
3. :meth:`commit` turns the reservation into the measured size. A measured size at or below
   the reservation frees the difference. **A model that measures larger than its reservation**
   must first :meth:`grow` its reservation by the excess, through the same decision as a load
   (free bytes, then victims not in use, then waiting for pins); :meth:`commit` refuses a size
   above the reservation. If the excess cannot be had (it could never fit, or the wait timed
   out), the manager unloads the new model and fails the load with "not enough memory"; the
   measurement is remembered, so the next load of that model is predicted at its real size.
   The ledger therefore never shows more than the limit, at the price of one honest caveat:
   while the excess is being sought, the process really holds it (the model is in memory but
   not yet READY). Predictions are conservative (files x 1.1 + 2 MiB, or the last
   measurement) to keep that rare and short.
4. A load that fails, or is cancelled, gives its reservation back with :meth:`cancel` (its
   claims are dropped: victims not yet unloaded stay loaded and may be chosen again).
5. An unload, for whatever reason (eviction, the repository API, a removed archive), calls
   :meth:`release` after it has finished, never when the model merely left service.

:class:`BudgetGate` is the asynchronous side: :meth:`BudgetGate.reserve` asks the ledger and,
while :class:`Blocked`, waits for the next change (a pin released, an unload or a load
finished: anything that calls :meth:`BudgetGate.notify`, which the ledger does by itself when
bytes come free) until a deadline; no polling. The clock is injectable.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from quiver.errors import UnavailableError
from quiver.lifecycle.clock import SYSTEM_CLOCK, Clock, seconds
from quiver.lifecycle.eviction import Candidate, EvictionPolicy

__all__ = ["Admission", "Blocked", "BudgetGate", "Candidates", "MemoryBudget", "OutOfMemoryError"]

logger = logging.getLogger(__name__)

#: The models a decision may evict: a sequence, or a callable that makes one (asked only when
#: the free bytes do not suffice: listing what is in use costs with hundreds of models loaded).
Candidates = Sequence[Candidate] | Callable[[], Sequence[Candidate]]


class OutOfMemoryError(UnavailableError):
    """A model cannot fit in the memory budget (it is larger than the whole budget, or the
    room did not come free within the load wait timeout).

    UNAVAILABLE on the v2 protocols; the SageMaker routes answer 507 for it."""


@dataclass(frozen=True, slots=True)
class Admission:
    """A granted reservation: the models to unload for it (claimed for this load), and the
    bytes still to come from them (0 when it fitted in the free bytes)."""

    victims: list[str]
    shortfall: int = 0


@dataclass(frozen=True, slots=True)
class Blocked:
    """Not now: the room is held by models in use, other loads or other evictions."""

    reason: str


class MemoryBudget:
    """Model bytes under ``limit_bytes``: resident, retiring and reserved (see the module notes).

    Every method is atomic (a lock; on the event loop each call is one step). ``listener`` is
    called after any change that may have freed bytes (release, cancel, a commit below the
    reservation, an old version retired): the manager wakes waiting loads with it.
    """

    def __init__(self, limit_bytes: int, *, listener: Callable[[], None] | None = None) -> None:
        if limit_bytes <= 0:
            raise ValueError("limit_bytes must be positive")
        self.limit_bytes = int(limit_bytes)
        self._resident: dict[str, int] = {}
        self._retiring: dict[str, int] = {}
        self._reserved: dict[str, int] = {}
        self._shortfall: dict[str, int] = {}
        self._claims: dict[str, str] = {}  # victim -> the load it is unloaded for
        self._total = 0  # resident + retiring + reserved, kept as they change (read on every load)
        self._listener = listener
        self._lock = threading.RLock()
        self.peak = 0  # the highest committed total seen (never above the limit)

    # -- reading

    @property
    def resident(self) -> dict[str, int]:
        with self._lock:
            return dict(self._resident)

    @property
    def reserved(self) -> dict[str, int]:
        """Bytes granted to each load under way (claimed bytes arrive as victims unload)."""
        with self._lock:
            return dict(self._reserved)

    @property
    def retiring(self) -> dict[str, int]:
        with self._lock:
            return dict(self._retiring)

    @property
    def releasing(self) -> frozenset[str]:
        """Models claimed by a load: chosen for eviction, still resident until unloaded."""
        with self._lock:
            return frozenset(self._claims)

    @property
    def used(self) -> int:
        """The committed total: resident + retiring + reserved bytes (never above the limit)."""
        with self._lock:
            return self._committed()

    @property
    def reserved_bytes(self) -> int:
        with self._lock:
            return sum(self._reserved.values())

    @property
    def available(self) -> int:
        """Bytes no one holds or claims."""
        with self._lock:
            return self.limit_bytes - self._committed()

    def fits(self, size: int) -> bool:
        return size <= self.available

    def size_of(self, name: str) -> int | None:
        """Resident bytes of ``name``, else ``None``."""
        with self._lock:
            return self._resident.get(name)

    def reservation(self, name: str) -> int:
        """Bytes granted to the load of ``name`` so far (0 without one)."""
        with self._lock:
            return self._reserved.get(name, 0)

    def shortfall(self, name: str) -> int:
        """Bytes the load of ``name`` still waits for from its victims."""
        with self._lock:
            return self._shortfall.get(name, 0)

    def claimant(self, victim: str) -> str | None:
        """The load ``victim`` is being unloaded for, if any."""
        with self._lock:
            return self._claims.get(victim)

    def _committed(self) -> int:
        return self._total

    # -- deciding

    def admit(self, name: str, predicted: int, policy: EvictionPolicy, candidates: Candidates) -> Admission | Blocked:
        """Reserve ``predicted`` bytes for a load of ``name``: from the free bytes, and by
        claiming victims the policy chooses among ``candidates`` not in use (a sequence, or a
        callable asked for one only when the free bytes do not suffice). :class:`Blocked`
        (nothing changed) when only models in use or other loads stand in the way;
        :class:`OutOfMemoryError` when it could never fit; ``ValueError`` when ``name``
        already has a reservation (single flight is the caller's)."""
        predicted = max(0, int(predicted))
        with self._lock:
            if name in self._reserved:
                raise ValueError(f"model '{name}' already has a memory reservation")
            return self._decide(name, predicted, policy, candidates, granted=0)

    def grow(self, name: str, extra: int, policy: EvictionPolicy, candidates: Candidates) -> Admission | Blocked:
        """Add ``extra`` bytes to the reservation of ``name`` (it measured larger than
        predicted), deciding as :meth:`admit` does."""
        extra = max(0, int(extra))
        with self._lock:
            if name not in self._reserved:
                raise ValueError(f"model '{name}' has no memory reservation to grow")
            if self._shortfall.get(name):
                raise ValueError(f"model '{name}' still waits for its victims")
            return self._decide(name, extra, policy, candidates, granted=self._reserved[name])

    def _decide(
        self,
        name: str,
        need: int,
        policy: EvictionPolicy,
        candidates: Candidates,
        *,
        granted: int,
    ) -> Admission | Blocked:
        # What the load of `name` can never get: its own loaded versions stay until it is READY.
        own = self._resident.get(name, 0) + self._retiring.get(name, 0)
        if granted + need > self.limit_bytes - own:
            raise OutOfMemoryError(self._too_big(name, granted + need, own))
        free = self.limit_bytes - self._committed()
        if need <= free:
            self._grant(name, need, 0, [])
            return Admission([])
        if callable(candidates):
            candidates = candidates()
        resident, claims, reserved = self._resident, self._claims, self._reserved
        offered = []
        for c in candidates:  # at their committed sizes (a copy only when that differs)
            size = resident.get(c.name)
            if size is not None and c.name not in claims and c.name not in reserved and c.name != name:
                offered.append(c if c.size_bytes == size else replace(c, size_bytes=size))
        evictable = sum(c.size_bytes for c in offered if not c.pinned)
        if free + evictable < need:
            return Blocked(self._no_room(name, need, free, offered))
        victims = policy.victims(offered, need, free)
        claimed = sum(self._resident[v] for v in victims)
        if not victims or free + claimed < need:  # a policy that would not choose: wait
            return Blocked(self._no_room(name, need, free, offered))
        self._grant(name, free, need - free, victims)
        return Admission(victims, need - free)

    def _grant(self, name: str, now: int, later: int, victims: list[str]) -> None:
        self._reserved[name] = self._reserved.get(name, 0) + now
        self._total += now
        if later:
            self._shortfall[name] = self._shortfall.get(name, 0) + later
        for victim in victims:
            self._claims[victim] = name
        self._check()

    # -- finishing

    def commit(self, name: str, measured: int) -> None:
        """The load of ``name`` is READY at ``measured`` bytes, at most its reservation (grow
        it first). A previous resident size (a reload's old versions) becomes retiring until
        :meth:`retired`."""
        measured = max(0, int(measured))
        with self._lock:
            granted = self._reserved.get(name)
            if granted is None:
                raise ValueError(f"model '{name}' has no memory reservation to commit")
            if self._shortfall.get(name):
                raise ValueError(f"model '{name}' still waits for its victims")
            if measured > granted:
                raise ValueError(
                    f"model '{name}' measured {measured} bytes, above its reservation of "
                    f"{granted}: grow the reservation first"
                )
            del self._reserved[name]
            # Victims it claimed beyond its need (its shortfall is covered) stay resident: the
            # claims go, so no eviction in flight unloads them for a load that is done.
            self._drop_claims(name)
            old = self._resident.get(name)
            if old is not None:
                self._retiring[name] = self._retiring.get(name, 0) + old
            self._resident[name] = measured
            self._total += measured - granted  # the old resident bytes now retire
            self._check()
        self._changed()

    def retired(self, name: str) -> int:
        """The old versions of a reloaded ``name`` finished unloading; returns the bytes freed."""
        with self._lock:
            freed = self._retiring.pop(name, 0)
            self._total -= freed
        if freed:
            self._changed()
        return freed

    def release(self, name: str) -> int:
        """``name`` finished unloading: its resident bytes go to the load that claimed it (up
        to that load's shortfall), the rest becomes free. Returns the bytes freed."""
        with self._lock:
            size = self._resident.pop(name, 0)
            self._total -= size
            claimant = self._claims.pop(name, None)
            moved = 0
            if claimant is not None and claimant in self._reserved:
                moved = min(size, self._shortfall.get(claimant, 0))
                if moved:
                    self._reserved[claimant] += moved
                    self._total += moved
                    self._shortfall[claimant] -= moved
                    if not self._shortfall[claimant]:
                        del self._shortfall[claimant]
            self._check()
        self._changed()
        return size - moved

    def cancel(self, name: str) -> int:
        """The load of ``name`` failed or stopped: drop its reservation and its claims (their
        victims stay resident until someone unloads them). Returns the bytes freed."""
        with self._lock:
            freed = self._reserved.pop(name, 0)
            self._total -= freed
            self._shortfall.pop(name, None)
            self._drop_claims(name)
        self._changed()
        return freed

    def _drop_claims(self, name: str) -> None:
        for victim in [v for v, c in self._claims.items() if c == name]:
            del self._claims[victim]

    # -- helpers

    def _check(self) -> None:
        committed = self._committed()
        self.peak = max(self.peak, committed)
        if committed > self.limit_bytes:  # unreachable by construction; loud if it ever is not
            logger.error(
                "memory budget exceeded: %d bytes committed over a limit of %d (resident %s, "
                "retiring %s, reserved %s)",
                committed,
                self.limit_bytes,
                self._resident,
                self._retiring,
                self._reserved,
            )

    def _changed(self) -> None:
        if self._listener is not None:
            self._listener()

    def _too_big(self, name: str, need: int, own: int) -> str:
        kept = f" while its loaded versions keep their {own} bytes" if own else ""
        return (
            f"not enough memory to load model '{name}': it needs about {need} bytes{kept}, "
            f"more than the model memory limit of {self.limit_bytes} bytes"
        )

    def _no_room(self, name: str, need: int, free: int, offered: Sequence[Candidate]) -> str:
        evictable = sum(c.size_bytes for c in offered if not c.pinned)
        pinned = sum(c.size_bytes for c in offered if c.pinned)
        return (
            f"not enough memory to load model '{name}': it needs about {need} bytes; "
            f"{max(0, free)} bytes are free, {evictable} more could be freed by evicting models "
            f"not in use, {pinned} are held by models in use and {sum(self._reserved.values())} "
            f"by loads under way, under the model memory limit of {self.limit_bytes} bytes"
        )


class BudgetGate:
    """Loads wait here for room in a :class:`MemoryBudget`.

    :meth:`notify` wakes every waiter (call it when a pin is released, a load or an unload
    finished; the budget calls it on its own changes). :meth:`wait` sleeps until the next
    notification or a deadline, in seconds on ``clock`` (injectable: a fake clock's timer
    ends the wait when the test moves it past the deadline).
    """

    def __init__(self, budget: MemoryBudget | None = None, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.budget = budget
        self.clock = clock
        self._event: asyncio.Event | None = None
        self.waiting = 0
        self.closed = False

    def close(self) -> None:
        """The server stops: waiters fail now rather than at their deadlines."""
        self.closed = True
        self.notify()

    def notify(self) -> None:
        event = self._event
        if event is not None:
            self._event = None
            event.set()

    def now(self) -> float:
        """The clock's time in seconds."""
        return seconds(self.clock)

    async def wait(self, deadline: float) -> bool:
        """Until the next :meth:`notify` (True) or ``deadline`` (False). Raises
        UnavailableError once the gate is closed."""
        if self.closed:
            raise UnavailableError("the server is stopping: no more models are loaded")
        if deadline <= self.now():
            return False
        if self._event is None:
            self._event = asyncio.Event()
        event = self._event
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            self.notify()  # the others wake too, look again and wait on

        timer = self.clock.call_at(int(deadline * 1e9), expire)
        self.waiting += 1
        try:
            await event.wait()
        finally:
            self.waiting -= 1
            timer.cancel()
        if self.closed:
            raise UnavailableError("the server is stopping: no more models are loaded")
        return not expired

    async def reserve(
        self,
        name: str,
        need: int,
        policy: EvictionPolicy,
        candidates: Callable[[], Sequence[Candidate]],
        *,
        timeout: float,
        grow: bool = False,
        wait: bool = True,
    ) -> Admission:
        """Admit (or grow) ``name`` by ``need`` bytes, waiting while :class:`Blocked`, up to
        ``timeout`` seconds; then :class:`OutOfMemoryError` with the last reason. Without
        ``wait`` (no eviction: the platform unloads), Blocked is OutOfMemoryError at once."""
        budget = self.budget
        assert budget is not None
        decide = budget.grow if grow else budget.admit
        deadline = self.now() + timeout
        while True:
            decision = decide(name, need, policy, candidates)
            if isinstance(decision, Admission):
                return decision
            if not wait:
                raise OutOfMemoryError(
                    f"{decision.reason}; models are not unloaded to make room "
                    "(--model-eviction-policy=none): unload one and try again"
                )
            if not await self.wait(deadline):
                raise OutOfMemoryError(
                    f"{decision.reason}; waited {timeout:g} s (--model-load-wait-timeout) for "
                    "models in use and loads under way to make room"
                )

    async def covered(self, name: str, deadline: float) -> None:
        """Until the load of ``name`` has every byte it claimed (its victims unloaded)."""
        budget = self.budget
        assert budget is not None
        while budget.shortfall(name):
            if not await self.wait(deadline):
                raise OutOfMemoryError(
                    f"not enough memory to load model '{name}': the models evicted for it did "
                    "not finish unloading in time"
                )
