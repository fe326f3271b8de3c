"""The one clock: the fake clock fires timers in time order, and the system clock's timers
run on the event loop."""

from __future__ import annotations

import asyncio

import pytest

from quiver.clock import SYSTEM_CLOCK, FakeClock


def test_fake_clock_fires_due_timers_in_time_order_each_at_its_time() -> None:
    clock = FakeClock(start=1_000)
    fired: list[tuple[str, int]] = []

    def record(name: str) -> None:
        fired.append((name, clock.now()))

    clock.call_at(1_300, lambda: record("c"))
    clock.call_at(1_100, lambda: record("a"))
    clock.call_at(1_200, lambda: record("b1"))
    clock.call_at(1_200, lambda: record("b2"))  # same time: in the order set
    late = clock.call_at(5_000, lambda: record("late"))

    clock.advance(250)
    assert fired == [("a", 1_100), ("b1", 1_200), ("b2", 1_200)]
    assert clock.now() == 1_250
    assert clock.pending == [1_300, 5_000]

    late.cancel()
    clock.advance(10_000)
    assert fired[-1] == ("c", 1_300)
    assert len(fired) == 4 and clock.now() == 11_250 and clock.pending == []


def test_fake_clock_timer_set_by_a_timer_fires_in_the_same_advance() -> None:
    clock = FakeClock()
    fired: list[int] = []
    clock.call_at(10, lambda: clock.call_at(20, lambda: fired.append(clock.now())))
    clock.advance(30)
    assert fired == [20]


def test_fake_clock_does_not_go_back() -> None:
    with pytest.raises(ValueError, match="does not go back"):
        FakeClock().advance(-1)


def test_system_clock_timers_run_on_the_loop_and_can_be_cancelled() -> None:
    async def main() -> None:
        fired: list[str] = []
        done = asyncio.Event()
        start = SYSTEM_CLOCK.now()
        SYSTEM_CLOCK.call_at(start + 50_000_000, lambda: fired.append("cancelled")).cancel()
        SYSTEM_CLOCK.call_at(start + 1_000_000, done.set)
        SYSTEM_CLOCK.call_at(start - 1, lambda: fired.append("past"))  # due already: at once
        await asyncio.wait_for(done.wait(), 5)
        assert fired == ["past"]
        assert SYSTEM_CLOCK.now() - start >= 1_000_000

    asyncio.run(main())
