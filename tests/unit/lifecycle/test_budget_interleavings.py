"""The real ModelRepositoryManager under a memory budget, driven through interleavings with a fake
backend (it implements the Backend protocol: loads that take controllable time and hold a
chosen number of bytes of a fake RSS) and a fake clock for the load wait timeout.

After every ledger change the committed total stays under the limit (the ledger's peak), and
at every allocation the bytes the fake models really hold stay under the ledger's committed
total (so under the limit), except for a model that measures larger than predicted, which is
documented to overshoot until its excess is reserved or it is unloaded.
"""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

import pytest
from lifecycle_fakes import (
    CONFIG,
    FakeClock,
    World,
    answer,
    cfg,
    install_fake_backend,
    serving,
    until,
    write_ensemble,
)

from quiver.errors import UnavailableError
from quiver.lifecycle import admission, frameworks
from quiver.lifecycle.budget import OutOfMemoryError
from quiver.lifecycle.memory import MemoryMeter


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> World:
    return install_fake_backend(monkeypatch)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize(
    ("policy", "ahead"), [("lru", False), ("gds", False), ("tinylfu", False), ("tinylfu", True)]
)
def test_random_loads_unloads_and_evictions_hold_the_budget(
    tmp_path: Path, world: World, seed: int, policy: str, ahead: bool
) -> None:
    """About 2.6 of 6 models fit; 24 clients on a uniform mix of them and of an ensemble of
    two, loads of random length, and a client unloading random models through the repository
    API: every request is answered right, and the budget holds at every step."""
    rng = random.Random(seed)
    sizes = {f"m{i}": rng.randint(8_000, 12_000) for i in range(6)}
    for name in sizes:
        world.delay[name] = rng.random() * 0.004

    write_ensemble(tmp_path, "e", "m0", "m1")  # its two steps pin both while in flight
    names = [*sizes, "e"]

    async def main() -> None:
        async with serving(
            tmp_path, world, 26_000, sizes, eviction_policy=policy, evict_ahead=ahead
        ) as (service, manager):
            stop = asyncio.Event()

            async def client(k: int) -> int:
                mine = random.Random(seed * 100 + k)
                done = 0
                for _ in range(12):
                    value = mine.random()
                    assert await answer(service, mine.choice(names), value) == pytest.approx(value)
                    done += 1
                    await asyncio.sleep(mine.random() * 0.002)
                return done

            async def unloader() -> int:
                count = 0
                while not stop.is_set():
                    await manager.unload(f"m{rng.randrange(6)}")
                    count += 1
                    await asyncio.sleep(0.003)
                return count

            unloads = asyncio.ensure_future(unloader())
            done = await asyncio.gather(*(client(k) for k in range(24)))
            stop.set()
            assert sum(done) == 24 * 12 and await unloads > 0
            assert len(world.loads) > 6  # models were evicted and loaded again

    asyncio.run(main())
    assert world.peak <= 26_000


def test_a_load_waits_for_a_pinned_model_and_evicts_it_once_released(tmp_path: Path, world: World) -> None:
    async def main() -> None:
        async with serving(tmp_path, world, 15_000, {"a": 10_000, "b": 10_000}) as (service, manager):
            await answer(service, "a")
            world.holds["a"] = asyncio.Event()
            busy = asyncio.ensure_future(answer(service, "a", 3.0))  # in flight: a is pinned
            await asyncio.sleep(0.01)
            waiting = asyncio.ensure_future(answer(service, "b", 4.0))
            await asyncio.sleep(0.05)
            assert not waiting.done() and manager.is_ready("a")  # waits, neither fails nor evicts
            assert manager.admission.gate.waiting == 1
            world.holds["a"].set()  # the request finishes: its pin is released, the load wakes
            assert await busy == 3.0
            assert await asyncio.wait_for(waiting, 5) == 4.0
            assert not manager.is_ready("a")
            assert "evicted to make room for model 'b'" in manager.index()[0].reason

    asyncio.run(main())


def test_a_model_larger_than_the_budget_fails_at_once(tmp_path: Path, world: World) -> None:
    async def main() -> None:
        clock = FakeClock()  # never moves: a load that waited would hang
        async with serving(tmp_path, world, 15_000, {"big": 20_000}, clock=clock) as (service, _):
            with pytest.raises(OutOfMemoryError, match=r"needs about 20\d\d\d bytes, more than the model memory limit") as caught:
                await asyncio.wait_for(answer(service, "big"), 2)
            assert isinstance(caught.value, UnavailableError)

    asyncio.run(main())


def test_a_load_fails_when_the_wait_times_out_on_the_fake_clock(tmp_path: Path, world: World) -> None:
    async def main() -> None:
        clock = FakeClock()
        async with serving(tmp_path, world, 15_000, {"a": 10_000, "b": 10_000}, clock=clock) as (service, manager):
            await answer(service, "a")
            world.holds["a"] = asyncio.Event()
            busy = asyncio.ensure_future(answer(service, "a"))
            await asyncio.sleep(0.01)
            waiting = asyncio.ensure_future(answer(service, "b"))
            await until(lambda: manager.admission.gate.waiting == 1)
            clock.advance(59)
            await asyncio.sleep(0.02)
            assert not waiting.done()
            clock.advance(2)  # past --model-load-wait-timeout (60 s): both timers fire
            # The request's wait for the load and the load's wait for room end together: the
            # request learns one or the other; the load fails, which the index shows.
            with pytest.raises(UnavailableError, match=r"still loading after 60 s|waited 60 s"):
                await asyncio.wait_for(waiting, 2)
            await until(lambda: any("waited 60 s" in s.reason for s in manager.index() if s.name == "b"))
            world.holds["a"].set()
            await busy
            assert manager.is_ready("a") and not manager.is_ready("b")

    asyncio.run(main())


def test_a_failed_load_gives_its_room_to_the_loads_waiting(tmp_path: Path, world: World) -> None:
    async def main() -> None:
        async with serving(tmp_path, world, 15_000, {"c": 10_000, "d": 10_000}) as (service, manager):
            world.gates["c"] = threading.Event()
            world.failing.add("c")
            failing = asyncio.ensure_future(answer(service, "c"))
            await until(lambda: "c" in world.started)
            waiting = asyncio.ensure_future(answer(service, "d", 2.0))
            await until(lambda: manager.admission.gate.waiting == 1)  # c's reservation holds the room
            world.gates["c"].set()
            with pytest.raises(UnavailableError, match="failed to load on purpose"):
                await failing
            assert await asyncio.wait_for(waiting, 5) == 2.0
            world.failing.clear()
            assert await answer(service, "c", 5.0) == 5.0  # the next request tries again

    asyncio.run(main())


def test_bytes_are_released_only_when_a_repository_unload_finished(tmp_path: Path, world: World) -> None:
    async def main() -> None:
        async with serving(tmp_path, world, 15_000, {"a": 10_000, "b": 10_000}) as (service, manager):
            await answer(service, "a")
            world.unload_gates["a"] = threading.Event()
            unloading = asyncio.ensure_future(manager.unload("a"))
            await asyncio.sleep(0.02)
            assert not manager.is_ready("a")  # out of service at once...
            assert manager.memory == (10_000 + cfg("a"), 15_000)  # ...but its bytes count until unloaded
            waiting = asyncio.ensure_future(answer(service, "b", 7.0))
            await until(lambda: manager.admission.gate.waiting == 1)
            world.unload_gates["a"].set()  # the unload finishes and wakes the load
            await unloading
            assert await asyncio.wait_for(waiting, 5) == 7.0
            assert manager.memory == (10_000 + cfg("b"), 15_000)

    asyncio.run(main())


def test_a_repository_unload_during_a_load(tmp_path: Path, world: World) -> None:
    async def main() -> None:
        async with serving(tmp_path, world, 15_000, {"x": 10_000}) as (service, manager):
            world.gates["x"] = threading.Event()
            loading = asyncio.ensure_future(answer(service, "x", 2.0))
            await until(lambda: "x" in world.started)
            assert manager.memory_reserved == 10_000 + cfg("x")
            unloading = asyncio.ensure_future(manager.unload("x"))  # waits for the load
            await asyncio.sleep(0.02)
            world.gates["x"].set()
            # The request that waited is served: before the unload, or, when the unload got
            # the model first, by loading it again on demand like any miss.
            assert await loading == 2.0
            await unloading
            held = 10_000 + cfg("x") if manager.is_ready("x") else 0
            assert manager.memory == (held, 15_000) and world.bytes == held
            await manager.unload("x")
            assert manager.memory == (0, 15_000) and world.bytes == 0

    asyncio.run(main())


def test_a_model_measuring_larger_than_predicted(tmp_path: Path, world: World) -> None:
    sizes = {"a": 10_000, "b": 8_000, "c": 5_000, "huge": 5_000}
    world.actual.update(b=12_000, c=9_000, huge=40_000)
    world.overrun.update({"b", "c", "huge"})

    async def main() -> None:
        async with serving(tmp_path, world, 25_000, sizes) as (service, manager):
            budget = manager.admission.budget
            assert budget is not None
            await answer(service, "a")
            await answer(service, "b")  # 4,000 more than predicted: taken from the free bytes
            assert budget.resident == {"a": 10_000 + cfg("a"), "b": 12_000}
            await answer(service, "c")  # 4,000 more again: only by evicting a (LRU)
            assert budget.resident == {"b": 12_000, "c": 9_000}
            with pytest.raises(OutOfMemoryError, match=r"measured 40000 bytes when loaded, more than the 5\d\d\d bytes predicted"):
                await answer(service, "huge")
            # Unloaded again (b was evicted for its predicted size before it loaded).
            assert not manager.is_ready("huge") and budget.resident == {"c": 9_000} and world.bytes == 9_000
            with pytest.raises(OutOfMemoryError, match="needs about 40000 bytes"):
                await answer(service, "huge")  # predicted at its measured size now: at once

    asyncio.run(main())


def test_a_model_measured_by_the_heap_larger_than_predicted(
    tmp_path: Path, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A framework measured by the C heap's growth instead of RSS (as ONNX Runtime and torch
    are): the heap reading is what is committed (RSS, which measures only the framework's
    priming here, never moves), and a model measuring larger than its reservation still
    cannot take the ledger past the limit: its excess is reserved by evicting before it is
    served, or it is refused and unloaded."""
    monkeypatch.setattr(admission, "HEAP_ALLOCATING", frozenset({"fakemem"}))
    meter = MemoryMeter(rss=lambda: 0, heap=world.rss, gpu=None, trim=False)
    sizes = {"a": 10_000, "b": 8_000, "c": 5_000, "huge": 5_000}
    world.actual.update(a=10_000, b=12_000, c=9_000, huge=40_000)
    world.overrun.update({"b", "c", "huge"})

    async def main() -> None:
        async with serving(tmp_path, world, 25_000, sizes, meter=meter) as (service, manager):
            budget = manager.admission.budget
            assert budget is not None
            await answer(service, "a")
            await answer(service, "b")
            assert budget.resident == {"a": 10_000 + cfg("a"), "b": 12_000}
            await answer(service, "c")  # its excess only by evicting a (LRU)
            assert budget.resident == {"b": 12_000, "c": 9_000}
            assert budget.peak <= 25_000
            with pytest.raises(OutOfMemoryError, match="measured 40000 bytes when loaded"):
                await answer(service, "huge")
            assert not manager.is_ready("huge") and world.bytes == 9_000
            assert budget.peak <= 25_000
            assert manager.admission.framework_bytes == {"fakemem": 0}  # primed once, by RSS

    asyncio.run(main())


@pytest.mark.parametrize("policy", ["lru", "tinylfu"])
def test_a_model_measuring_larger_than_predicted_with_eviction_ahead(
    tmp_path: Path, world: World, policy: str
) -> None:
    """Unloads run in the background while models that measure larger than predicted load
    one after another: a model's excess is reserved before it is READY (the world checks at
    every allocation that what models really hold is within the ledger, and the ledger within
    the limit), and a model whose excess can never fit is refused and unloaded. (Loads of
    such models at the same time would each hold their excess while seeking it: the ledger's
    documented caveat.)"""
    sizes = {f"m{i}": 4_000 for i in range(6)} | {"huge": 5_000}
    world.actual.update({f"m{i}": 6_000 for i in range(0, 6, 2)} | {"huge": 40_000})
    world.overrun.update({"m0", "m2", "m4", "huge"})

    async def main() -> None:
        async with serving(
            tmp_path, world, 20_000, sizes, eviction_policy=policy, evict_ahead=True
        ) as (service, manager):
            budget = manager.admission.budget
            assert budget is not None
            rng = random.Random(5)
            for _ in range(24):
                assert await answer(service, f"m{rng.randrange(6)}", 2.0) == 2.0
                assert budget.used <= 20_000
            with pytest.raises(OutOfMemoryError, match="measured 40000 bytes when loaded"):
                await answer(service, "huge")
            assert not manager.is_ready("huge")
            await until(lambda: not any(t.get_name() == "quiver-evict-ahead" for t in asyncio.all_tasks()))
            assert world.bytes == sum(budget.resident.values()) <= 20_000

    asyncio.run(main())
    assert world.peak <= 20_000 + 40_000 - 5_000  # only the refused model's excess, while it was sought


def test_eviction_ahead_frees_room_for_the_next_miss_off_its_path(tmp_path: Path, world: World) -> None:
    """Room for two: after the second load, the first is unloaded in the background (the
    next miss finds its room free and evicts nothing); a model in use is never taken."""

    async def main() -> None:
        sizes = {"a": 8_000, "b": 8_000, "c": 8_000}
        async with serving(tmp_path, world, 17_000, sizes, evict_ahead=True) as (service, manager):
            budget = manager.admission.budget
            assert budget is not None
            await answer(service, "a")
            assert manager.is_ready("a")  # nothing else to evict: a stays
            world.holds["a"] = asyncio.Event()
            busy = asyncio.ensure_future(answer(service, "a"))  # in flight: a is in use
            await asyncio.sleep(0.01)
            await answer(service, "b")
            await asyncio.sleep(0.05)
            assert manager.is_ready("a") and manager.is_ready("b")  # a in use: not evicted ahead
            world.holds["a"].set()
            await busy
            await answer(service, "c")  # evicts a on its path (nothing was free)
            # ...then b goes ahead of the next miss (its bytes free once its unload finished)
            await until(lambda: budget.available >= 8_000)
            assert not manager.is_ready("b") and manager.is_ready("c")
            unloads = len(world.unloads)
            await answer(service, "a")  # finds its room free
            assert world.unloads[unloads:] in ([], ["c"])  # only an eviction ahead, after it loaded
            assert "evicted to make room for the next load" in {s.reason for s in manager.index()}
            await until(lambda: not any(t.get_name() == "quiver-evict-ahead" for t in asyncio.all_tasks()))

    asyncio.run(main())


def test_a_frameworks_one_time_cost_is_measured_once_and_charged_to_no_model(
    tmp_path: Path, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    primed: list[int] = []

    def first_use() -> None:
        primed.append(1)
        world.outside += 7_000  # the runtime's own state, kept for the process

    monkeypatch.setitem(frameworks._FIRST_USE, "fakemem", first_use)

    async def main() -> None:
        async with serving(tmp_path, world, 15_000, {"a": 10_000, "b": 10_000}) as (service, manager):
            await answer(service, "a")
            await answer(service, "b")
            assert primed == [1]
            assert manager.framework_bytes == {"fakemem": 7_000}
            assert manager.admission.budget is not None and manager.admission.budget.resident == {"b": 10_000 + cfg("b")}
            assert manager.memory == (10_000 + cfg("b"), 15_000)

    asyncio.run(main())


def test_the_composing_models_of_an_ensemble_in_flight_are_pinned(tmp_path: Path, world: World) -> None:
    write_ensemble(tmp_path, "e", "p", "q")

    async def main() -> None:
        sizes = {"p": 10_000, "q": 10_000, "r": 10_000}
        async with serving(tmp_path, world, 25_000, sizes) as (service, manager):
            assert await answer(service, "e", 2.0) == 2.0  # loads p and q
            world.holds["q"] = asyncio.Event()
            flowing = asyncio.ensure_future(answer(service, "e", 3.0))
            await asyncio.sleep(0.02)  # p has run; e is in flight, waiting on q
            waiting = asyncio.ensure_future(answer(service, "r", 4.0))
            await until(lambda: manager.admission.gate.waiting == 1)
            assert manager.is_ready("p") and manager.is_ready("q")  # neither was evicted
            world.holds["q"].set()
            assert await flowing == 3.0
            assert await asyncio.wait_for(waiting, 5) == 4.0
            assert manager.is_ready("r") and not (manager.is_ready("p") and manager.is_ready("q"))

    asyncio.run(main())


def test_eviction_ahead_waits_until_the_request_that_waited_for_the_load_is_answered(
    tmp_path: Path, world: World
) -> None:
    """The victims of an eviction ahead of need unload after the request that made the load
    has its answer, not while it runs (the clock never moves: only the answer lets it go)."""

    async def main() -> None:
        sizes = {"a": 8_000, "b": 8_000}
        async with serving(tmp_path, world, 17_000, sizes, evict_ahead=True, clock=FakeClock()) as (
            service,
            manager,
        ):
            await answer(service, "a")
            world.holds["b"] = asyncio.Event()
            first = asyncio.ensure_future(answer(service, "b", 5.0))  # loads b, then stays in flight
            await until(lambda: manager.is_ready("b"))
            await asyncio.sleep(0.05)
            assert manager.is_ready("a") and world.unloads == []  # nothing unloads while b answers
            world.holds["b"].set()
            assert await first == 5.0
            reason = "evicted to make room for the next load"  # then a goes, ahead of the next miss
            await until(lambda: reason in {s.reason for s in manager.index() if s.name == "a"})
            assert world.unloads == ["a"] and manager.is_ready("b")
            await until(lambda: not any(t.get_name() == "quiver-evict-ahead" for t in asyncio.all_tasks()))

    asyncio.run(main())


def test_eviction_ahead_keeps_room_for_two_small_misses(tmp_path: Path, world: World) -> None:
    """Models of about a twenty-fourth of the limit: after a run of misses, room for two more is free
    (a miss arriving while the previous one's victims unload finds room too); a model in use
    is never taken and the ledger never passes the limit."""

    async def main() -> None:
        sizes = {f"m{i:02d}": 4_000 for i in range(30)}
        async with serving(tmp_path, world, 100_000, sizes, evict_ahead=True, eviction_policy="tinylfu") as (
            service,
            manager,
        ):
            budget = manager.admission.budget
            assert budget is not None
            for name in sizes:
                assert await answer(service, name, 3.0) == 3.0
                assert budget.used <= 100_000
            # The last load's evictions ahead are set off by the rest of its load, after its
            # request was answered and a lull: both done once no load or eviction ahead runs.
            await until(
                lambda: not any(t.get_name().startswith(("quiver-load", "quiver-evict-ahead")) for t in asyncio.all_tasks())
            )
            size = budget.resident["m29"]
            assert manager.admission.ahead_bytes() == 2 * size
            assert budget.available >= 2 * size
            assert len(manager.ready_models) <= 100_000 // size - 2
            assert manager.is_ready("m29")  # the model just loaded is never the victim

    asyncio.run(main())
    assert world.peak <= 100_000


def test_eviction_ahead_waits_for_a_lull_unless_the_next_miss_would_find_no_room(
    tmp_path: Path, world: World
) -> None:
    """Evictions ahead of need start once no request came or went for AHEAD_LULL_S, so a miss's
    answer goes out before the unloads take the cores: with the clock standing still, nothing
    is evicted ahead while the next miss still finds room, and the victim goes once the clock
    has moved on. A miss that leaves no room for the next one has them start at once."""
    from quiver.lifecycle.ahead import AHEAD_LULL_S

    async def main() -> None:
        clock = FakeClock()
        names = [f"m{i:02d}" for i in range(26)]
        size = len(CONFIG.format(name="m00").encode()) + 4_000  # what each counts: its files
        limit = 25 * size  # 24 loaded leave room for one; two are kept ahead (8% of the limit)
        async with serving(
            tmp_path, world, limit, dict.fromkeys(names, 4_000), evict_ahead=True, clock=clock
        ) as (service, manager):
            budget = manager.admission.budget
            assert budget is not None
            for name in names[:24]:
                assert await answer(service, name, 2.0) == 2.0
            assert manager.admission.last_size == size and manager.admission.ahead_bytes() == 2 * size
            await asyncio.sleep(0.05)
            assert budget.available == size and world.unloads == []  # room for one: a lull first
            clock.advance(AHEAD_LULL_S)
            await until(lambda: budget.available >= 2 * size)
            assert world.unloads == ["m00"]
            assert await answer(service, names[24], 2.0) == 2.0
            await asyncio.sleep(0.05)
            assert budget.available == size and world.unloads == ["m00"]  # waits for a lull again
            assert await answer(service, names[25], 2.0) == 2.0  # no room left for the next miss:
            await until(lambda: len(world.unloads) == 3)  # the victims go now, the clock still
            assert budget.available >= 2 * size and manager.is_ready("m24") and manager.is_ready("m25")
            assert budget.peak <= limit

    asyncio.run(main())
