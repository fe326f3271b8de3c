"""Races of the life cycle that only servers in subprocesses used to reach, driven in-process
with the fake backend (lifecycle_fakes) and the fake clock: a load that fails while requests
wait for it, an unload during a load, eviction while pinned, the server stopping while loads
are in flight."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from lifecycle_fakes import FakeClock, World, answer, install_fake_backend, serving, until

from quiver.errors import UnavailableError


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> World:
    return install_fake_backend(monkeypatch)


def test_a_load_that_fails_while_requests_wait_fails_them_all_and_the_next_tries_again(
    tmp_path: Path, world: World
) -> None:
    async def main() -> None:
        async with serving(tmp_path, world, 0, {"c": 1_000}) as (service, manager):
            world.gates["c"] = threading.Event()
            world.failing.add("c")
            waiting = [asyncio.ensure_future(answer(service, "c", float(i))) for i in range(5)]
            await until(lambda: "c" in world.started)
            assert manager.admission.in_use("c")  # the waiting requests pin it
            world.gates["c"].set()
            results = await asyncio.gather(*waiting, return_exceptions=True)
            assert all(isinstance(r, UnavailableError) and "failed to load on purpose" in r.message for r in results)
            assert world.loads == [] and not manager.admission.in_use("c")
            assert manager.multi_model.load_failures == 1  # one load for the five
            assert "failed to load on purpose" in manager.index()[0].reason
            world.failing.clear()
            assert await answer(service, "c", 9.0) == 9.0
            assert world.loads == ["c"]

    asyncio.run(main())


def test_an_unload_during_a_load_waits_for_it(tmp_path: Path, world: World) -> None:
    async def main() -> None:
        async with serving(tmp_path, world, 0, {"x": 1_000}, control_mode="explicit") as (_, manager):
            world.gates["x"] = threading.Event()
            loading = asyncio.ensure_future(manager.load("x"))
            await until(lambda: "x" in world.started)
            unloading = asyncio.ensure_future(manager.unload("x"))
            await asyncio.sleep(0.02)
            assert not unloading.done()  # it waits for the load's lock
            world.gates["x"].set()
            await loading  # the load finished, and said so
            await unloading
            assert not manager.is_ready("x") and world.bytes == 0 and world.unloads == ["x"]
            assert manager.index()[0].reason == "unloaded"

    asyncio.run(main())


def test_a_pinned_model_is_not_evicted_until_its_pin_is_released(tmp_path: Path, world: World) -> None:
    async def main() -> None:
        clock = FakeClock()
        sizes = {"a": 10_000, "b": 10_000}
        async with serving(tmp_path, world, 15_000, sizes, clock=clock) as (service, manager):
            await answer(service, "a")
            world.holds["a"] = asyncio.Event()
            busy = asyncio.ensure_future(answer(service, "a", 3.0))  # in flight on a
            await asyncio.sleep(0.01)
            waiting = asyncio.ensure_future(answer(service, "b", 4.0))
            await until(lambda: manager.admission.gate.waiting == 1)
            clock.advance(45)  # well within the load wait timeout: it still waits
            await asyncio.sleep(0.02)
            assert not waiting.done() and manager.is_ready("a") and world.unloads == []
            world.holds["a"].set()  # the request on a finishes: its pin goes, the load wakes
            assert await busy == 3.0
            assert await asyncio.wait_for(waiting, 5) == 4.0
            assert world.unloads == ["a"] and manager.multi_model.evictions == 1
            assert manager.multi_model.eviction_age_s.count == 1

    asyncio.run(main())


def test_stop_cancels_and_awaits_the_loads_in_flight(tmp_path: Path, world: World) -> None:
    """A load blocked in its thread when the server stops: stop waits for the thread, unloads
    what it made (no instance left holding memory the ledger does not count), the requests
    waiting for it learn the server is stopping, and no task is left (the harness checks)."""

    async def main() -> None:
        async with serving(tmp_path, world, 15_000, {"x": 10_000, "y": 1_000}) as (service, manager):
            world.gates["x"] = threading.Event()
            waiting = asyncio.ensure_future(answer(service, "x"))
            await until(lambda: "x" in world.started)
            stopping = asyncio.ensure_future(manager.stop())
            await asyncio.sleep(0.05)
            assert not stopping.done()  # the load's thread is still running
            world.gates["x"].set()
            await asyncio.wait_for(stopping, 5)
            with pytest.raises(UnavailableError, match="stopping"):
                await waiting
            assert world.loads == ["x"] and world.unloads == ["x"] and world.bytes == 0
            assert manager.memory == (0, 15_000) and not manager.is_ready("x")
            with pytest.raises(UnavailableError, match="stopping"):
                await answer(service, "y")  # no new load once stopped

    asyncio.run(main())
