"""Single flight: one load however many wait, waits that end on the fake clock, a failure for
every waiter and a fresh try for the next caller, the server's stop told apart from a caller's
cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest
from lifecycle_fakes import FakeClock

from quiver.errors import UnavailableError
from quiver.lifecycle.flights import SingleFlight


class Owner:
    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[None]] = []

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self.tasks.append(task)
        return task


def test_callers_share_one_load_and_each_waits_until_its_own_deadline() -> None:
    clock = FakeClock()
    owner = Owner()
    flights = SingleFlight(owner.spawn, clock)
    starts: list[int] = []

    async def main() -> None:
        gate = asyncio.Event()

        async def load() -> None:
            starts.append(1)
            await gate.wait()

        now = clock.now() / 1e9
        early = asyncio.ensure_future(flights.wait(flights.join("m", load), now + 10))
        late = asyncio.ensure_future(flights.wait(flights.join("m", load), now + 60))
        await asyncio.sleep(0)
        assert len(owner.tasks) == 1
        clock.advance(30)  # past the first caller's deadline only
        with pytest.raises(TimeoutError):
            await early
        assert not late.done() and not owner.tasks[0].done()  # the load goes on
        gate.set()
        await asyncio.wait_for(late, 1)
        assert starts == [1]

    asyncio.run(main())


def test_a_failed_load_fails_every_waiter_and_the_next_caller_tries_again() -> None:
    owner = Owner()
    flights = SingleFlight(owner.spawn, FakeClock())
    attempts: list[int] = []

    async def main() -> None:
        gate = asyncio.Event()

        async def load() -> None:
            attempts.append(1)
            await gate.wait()
            if len(attempts) == 1:
                raise UnavailableError("model 'm' failed to load: on purpose")

        waiters = [asyncio.ensure_future(flights.follow("m", load)) for _ in range(3)]
        await asyncio.sleep(0)
        gate.set()
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert all(isinstance(r, UnavailableError) and "on purpose" in r.message for r in results)
        await flights.follow("m", load)  # a new load, which succeeds
        assert attempts == [1, 1]

    asyncio.run(main())


def test_a_load_cancelled_by_the_server_stopping_is_unavailable_to_its_waiters() -> None:
    owner = Owner()
    flights = SingleFlight(owner.spawn, FakeClock())

    async def main() -> None:
        async def load() -> None:
            await asyncio.Event().wait()

        waiter = asyncio.ensure_future(flights.follow("m", load))
        timed = asyncio.ensure_future(flights.wait(flights.join("m", load), 1e9))
        await asyncio.sleep(0)
        owner.tasks[0].cancel()  # what the life cycle's stop does
        with pytest.raises(UnavailableError, match="stopping"):
            await waiter
        with pytest.raises(UnavailableError, match="stopping"):
            await timed
        # A caller cancelled itself: it is cancelled, and the load goes on.
        task = flights.join("n", load)
        caller = asyncio.ensure_future(flights.follow("n", load))
        await asyncio.sleep(0)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert not task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_callers_go_on_as_soon_as_the_model_lands_while_the_load_finishes() -> None:
    """land(name) (the model is installed, READY): the callers waiting for that load return at
    once, before the load's task ends; callers of other loads keep waiting, and a caller that
    joins afterwards waits for the next landing (or the end)."""
    clock = FakeClock()
    owner = Owner()
    flights = SingleFlight(owner.spawn, clock)

    async def main() -> None:
        installed, finish = asyncio.Event(), asyncio.Event()

        async def load() -> None:
            await installed.wait()
            flights.land("m")
            await finish.wait()

        async def other() -> None:
            await finish.wait()

        now = clock.now() / 1e9
        task = flights.join("m", load)
        waiting = [asyncio.ensure_future(flights.wait(task, now + 60)) for _ in range(2)]
        elsewhere = asyncio.ensure_future(flights.wait(flights.join("n", other), now + 60))
        await asyncio.sleep(0)
        flights.land("m")  # nothing installed yet for "n" or "m": "m" lands, "n" is not touched
        await asyncio.wait_for(asyncio.gather(*waiting), 1)
        assert not task.done() and not elsewhere.done()
        late = asyncio.ensure_future(flights.wait(flights.join("m", load), now + 60))
        installed.set()
        await asyncio.sleep(0.01)
        assert late.done()  # landed by the load itself
        finish.set()
        await asyncio.wait_for(elsewhere, 1)
        await asyncio.wait_for(task, 1)

    asyncio.run(main())
