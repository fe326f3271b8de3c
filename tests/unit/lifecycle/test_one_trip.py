"""A miss in one trip to a load thread (lifecycle/trip.py): a model folder that fits in the
free bytes is found, inspected and loaded on one load thread; the rest loads the usual way;
every guarantee of the usual way holds for it."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lifecycle_fakes import FakeClock, World, answer, install_fake_backend, serving, until

from quiver.errors import QuiverError, UnavailableError
from quiver.lifecycle.ahead import AHEAD_LULL_S
from quiver.lifecycle.memory import MemoryMeter
from quiver.lifecycle.model import ModelState
from quiver.lifecycle.pool import LoadPool


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> World:
    return install_fake_backend(monkeypatch)


@pytest.fixture
def trips(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of what each trip to a load thread ran, in order."""
    names: list[str] = []
    real = LoadPool.run

    async def counting(self: LoadPool, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        inner = fn.func if isinstance(fn, functools.partial) else fn
        names.append(getattr(inner, "__name__", "?"))
        return await real(self, fn, *args, **kwargs)

    monkeypatch.setattr(LoadPool, "run", counting)
    return names


def state(manager: Any, name: str) -> ModelState | None:
    return next((s.state for s in manager.index() if s.name == name), None)


def test_a_miss_with_room_is_found_inspected_and_loaded_in_one_trip(
    tmp_path: Path, world: World, trips: list[str]
) -> None:
    """The first model of a framework primes it first (the usual way); after it, a miss that
    fits in the free bytes takes one trip, shows LOADING while it loads, is measured and
    committed like any load, and requests that arrive meanwhile wait for that one load."""

    async def main() -> None:
        sizes = {"a": 4_000, "b": 4_000, "c": 4_000}
        async with serving(tmp_path, world, 20_000, sizes) as (service, manager):
            budget = manager.admission.budget
            assert budget is not None
            assert await answer(service, "a", 1.0) == 1.0
            assert "prime" in trips or len(trips) > 1  # the usual way for the first
            del trips[:]
            assert await answer(service, "b", 2.0) == 2.0
            assert trips == ["find_and_load"]
            assert budget.resident["b"] == manager.get("b").size_bytes >= 4_000
            del trips[:]
            world.gates["c"] = threading.Event()
            first = asyncio.ensure_future(answer(service, "c", 3.0))
            second = asyncio.ensure_future(answer(service, "c", 4.0))
            await until(lambda: "c" in world.started)
            await until(lambda: state(manager, "c") is ModelState.LOADING)
            assert budget.reservation("c") > 0  # reserved before it loads
            world.gates["c"].set()
            assert await first == 3.0 and await second == 4.0
            assert trips == ["find_and_load"] and world.loads.count("c") == 1
            assert state(manager, "c") is ModelState.READY

    asyncio.run(main())


def test_a_miss_that_needs_room_stops_after_the_inspection_and_evicts_first(
    tmp_path: Path, world: World, trips: list[str]
) -> None:
    """No room in the free bytes: the trip only finds and inspects; the load reserves by
    evicting a model not in use and loads once its victim has unloaded, on a second trip."""

    async def main() -> None:
        sizes = {"a": 8_000, "b": 8_000, "c": 8_000}
        async with serving(tmp_path, world, 17_000, sizes) as (service, manager):
            await answer(service, "a")
            await answer(service, "b")
            del trips[:]
            assert await answer(service, "c", 5.0) == 5.0
            assert trips[0] == "find_and_load" and "measure" in trips[1:]
            assert world.unloads == ["a"] and world.loads[-1] == "c"  # its victim went first
            assert manager.is_ready("b") and manager.is_ready("c") and not manager.is_ready("a")

    asyncio.run(main())


def test_a_load_that_fails_in_the_trip_gives_its_reservation_back(
    tmp_path: Path, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load failing in the trip (the backend's error, or an error of the measurement itself)
    is reported as any failed load is, its reservation is given back at once, and the next
    request tries again."""
    raising: set[str] = set()
    real = MemoryMeter.measure

    def measure(self: MemoryMeter, load: Callable[[], Any], **kwargs: Any) -> Any:
        if raising:
            raise RuntimeError("the heap could not be read")
        return real(self, load, **kwargs)

    monkeypatch.setattr(MemoryMeter, "measure", measure)

    async def main() -> None:
        sizes = {"a": 4_000, "b": 4_000}
        async with serving(tmp_path, world, 20_000, sizes) as (service, manager):
            budget = manager.admission.budget
            assert budget is not None
            await answer(service, "a")
            world.failing.add("b")
            with pytest.raises(UnavailableError, match=r"model 'b' failed to load: .*failed to load on purpose"):
                await answer(service, "b")
            assert budget.reserved == {} and state(manager, "b") is ModelState.UNAVAILABLE
            world.failing.clear()
            raising.add("b")
            with pytest.raises(UnavailableError, match=r"model 'b' failed to load: .*RuntimeError: the heap could not"):
                await answer(service, "b")
            assert budget.reserved == {} and state(manager, "b") is ModelState.UNAVAILABLE
            raising.clear()
            assert await answer(service, "b", 6.0) == 6.0
            assert budget.resident.keys() == {"a", "b"}

    asyncio.run(main())


def test_stopping_during_a_trip_unloads_what_it_loaded_and_gives_the_bytes_back(
    tmp_path: Path, world: World, trips: list[str]
) -> None:
    async def main() -> None:
        async with serving(tmp_path, world, 20_000, {"a": 4_000, "b": 4_000}) as (service, manager):
            budget = manager.admission.budget
            assert budget is not None
            await answer(service, "a")
            await manager.unload("a")  # the framework stays primed: b loads in one trip
            world.gates["b"] = threading.Event()
            waiting = asyncio.ensure_future(answer(service, "b"))
            await until(lambda: "b" in world.started)
            assert trips[-1] == "find_and_load" and budget.reservation("b") > 0
            stopping = asyncio.ensure_future(manager.stop())
            await asyncio.sleep(0.05)
            assert not stopping.done()  # the trip's thread is still loading
            world.gates["b"].set()
            await asyncio.wait_for(stopping, 5)
            with pytest.raises(UnavailableError, match="stopping"):
                await waiting
            assert world.loads == ["a", "b"] and sorted(world.unloads) == ["a", "b"] and world.bytes == 0
            assert budget.reserved == {} and manager.memory == (0, 20_000)

    asyncio.run(main())


def test_the_index_shows_loading_only_while_a_trip_can_load(tmp_path: Path, world: World) -> None:
    """A miss shows LOADING from the start of its trip; a name with no folder (nor key), or a
    trip that fails before loading, leaves the index as it was."""

    async def main() -> None:
        async with serving(tmp_path, world, 20_000, {"a": 4_000, "b": 4_000}) as (service, manager):
            await answer(service, "a")
            with pytest.raises(QuiverError):
                await answer(service, "nope")
            assert state(manager, "nope") is None
            config = tmp_path / "b" / "config.pbtxt"
            config.write_text("this is { not a configuration")
            with pytest.raises(QuiverError):
                await answer(service, "b")
            assert state(manager, "b") is not ModelState.LOADING
            await manager.unload("a")
            before = [s for s in manager.index() if s.name == "a"]
            assert before and before[0].state is ModelState.UNAVAILABLE
            world.gates["a"] = threading.Event()
            waiting = asyncio.ensure_future(answer(service, "a", 2.0))
            await until(lambda: state(manager, "a") is ModelState.LOADING)
            world.gates["a"].set()
            assert await waiting == 2.0 and state(manager, "a") is ModelState.READY

    asyncio.run(main())


def test_the_requests_waiting_for_a_trip_run_before_its_bookkeeping(tmp_path: Path, world: World) -> None:
    """A model a trip loaded within its reservation is committed and installed as the trip's
    result reaches the event loop: the requests that waited for it find it READY and its size
    committed, and run before the load's own bookkeeping (its loading time, its lock)."""

    async def main() -> None:
        async with serving(tmp_path, world, 20_000, {"a": 4_000, "b": 4_000}) as (service, manager):
            budget = manager.admission.budget
            assert budget is not None
            await answer(service, "a")  # primes the framework: b loads in one trip
            await until(lambda: not manager._locks.busy("a"))
            loads_timed = manager.multi_model.loading_time_us.count
            model = await manager.acquire("b")
            assert model.name == "b" and budget.resident["b"] == model.size_bytes and budget.reserved == {}
            assert manager.multi_model.loading_time_us.count == loads_timed  # the load's task: not yet
            assert manager._locks.busy("b")
            await until(lambda: not manager._locks.busy("b"))
            assert manager.multi_model.loading_time_us.count == loads_timed + 1
            manager.request_done(model)

    asyncio.run(main())


def test_the_rest_of_a_miss_waits_for_its_answer_and_a_lull(tmp_path: Path, world: World) -> None:
    """Once its request is answered, the rest of a miss's load (its statistics, its lock)
    waits for a lull between requests: with the clock standing still it has not run; once no
    request came or went for AHEAD_LULL_S it does."""

    async def main() -> None:
        clock = FakeClock()
        async with serving(tmp_path, world, 20_000, {"a": 4_000, "b": 4_000}, clock=clock) as (service, manager):
            await answer(service, "a")  # primes the framework: b loads in one trip
            clock.advance(AHEAD_LULL_S)
            await until(lambda: not manager._locks.busy("a"))
            timed = manager.multi_model.loading_time_us.count
            assert await answer(service, "b", 2.0) == 2.0
            await asyncio.sleep(0.05)
            assert manager._locks.busy("b") and manager.multi_model.loading_time_us.count == timed
            clock.advance(AHEAD_LULL_S)
            await until(lambda: not manager._locks.busy("b"))
            assert manager.multi_model.loading_time_us.count == timed + 1

    asyncio.run(main())


def test_a_landed_loads_time_ends_at_its_install_not_after_the_wait_that_follows(
    tmp_path: Path, world: World
) -> None:
    """``quiver_model_loading_time_us`` is the load's, not the wait for the answers and a lull
    that the rest of the load makes after the install."""
    from quiver.lifecycle.lifecycle import LANDED_TAIL_S

    async def main() -> None:
        clock = FakeClock()  # still while the model loads: the load itself takes no time
        async with serving(tmp_path, world, 20_000, {"a": 4_000, "b": 4_000}, clock=clock) as (service, manager):
            await answer(service, "a")
            clock.advance(AHEAD_LULL_S)
            await until(lambda: not manager._locks.busy("a"))
            timing = manager.multi_model.loading_time_us
            count, total = timing.count, timing.total
            world.holds["b"] = asyncio.Event()  # b's request stays in flight
            request = asyncio.ensure_future(answer(service, "b", 2.0))
            await until(lambda: "b" in world.loads)
            await asyncio.sleep(0.05)
            clock.advance(LANDED_TAIL_S)  # the rest of the load waits this long at most
            await until(lambda: not manager._locks.busy("b"))
            world.holds["b"].set()
            assert await request == 2.0
            assert timing.count == count + 1
            assert timing.total - total < LANDED_TAIL_S * 1e6 / 2, timing.total - total

    asyncio.run(main())


def test_an_install_that_fails_as_the_trip_arrives_leaves_the_budget_right(tmp_path: Path, world: World) -> None:
    """The trip's model was committed to the budget as it arrived; the install then failed:
    the task must not settle it a second time, and unloading it gives its bytes back."""

    async def main() -> None:
        async with serving(tmp_path, world, 20_000, {"a": 4_000, "b": 4_000}) as (service, manager):
            budget = manager.admission.budget
            assert budget is not None
            await answer(service, "a")
            await until(lambda: not manager._locks.busy("a"))
            lifecycle = manager._lifecycle
            real = lifecycle._install
            calls: list[str] = []

            def failing_once(name: str, *args: Any, **kwargs: Any) -> Any:
                calls.append(name)
                if calls.count("b") == 1 and name == "b":
                    raise RuntimeError("an install that failed")
                return real(name, *args, **kwargs)

            lifecycle._install = failing_once  # type: ignore[method-assign]
            try:
                assert await answer(service, "b", 2.0) == 2.0  # the task installs it
            finally:
                lifecycle._install = real  # type: ignore[method-assign]
            await until(lambda: not manager._locks.busy("b"))
            assert calls.count("b") == 2
            assert "b" in budget.resident and budget.reserved == {}
            await manager.unload("b")
            assert "b" not in budget.resident and budget.reserved == {}
            assert getattr(budget, "_retiring", {}) == {}

    asyncio.run(main())


def test_a_failure_in_the_rest_of_a_load_is_logged_and_the_model_serves(
    tmp_path: Path, world: World, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        async with serving(tmp_path, world, 20_000, {"a": 4_000, "b": 4_000}) as (service, manager):
            await answer(service, "a")
            await until(lambda: not manager._locks.busy("a"))
            ahead = manager.admission.ahead

            async def broken(loaded: str, deadline: float) -> None:
                raise RuntimeError("a bookkeeping bug")

            ahead.answered = broken  # type: ignore[method-assign]
            try:
                assert await answer(service, "b", 2.0) == 2.0
                await until(lambda: not manager._locks.busy("b"))
            finally:
                del ahead.answered
            assert await answer(service, "b", 3.0) == 3.0
            assert manager.multi_model.loading_time_us.count >= 2

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    assert any("bookkeeping after loading model 'b'" in record.getMessage() for record in caplog.records)
