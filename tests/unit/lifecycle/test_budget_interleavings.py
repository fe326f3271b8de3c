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
import contextlib
import random
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

import quiver.lifecycle.manager as manager_module
from quiver.backends.base import ExecuteResult, ExecutionTiming, InstanceSpec, ModelFiles, _registry
from quiver.config import ModelConfig
from quiver.errors import InternalError, UnavailableError
from quiver.lifecycle import frameworks
from quiver.lifecycle.budget import MemoryBudget, OutOfMemoryError
from quiver.lifecycle.manager import ModelRepositoryManager
from quiver.lifecycle.memory import MemoryMeter, SizePredictor, file_bytes
from quiver.service import InferenceService
from quiver.types import DataType, InferenceRequest, InferenceResponse, Tensor

CONFIG = """
name: "{name}"
backend: "fakemem"
max_batch_size: 0
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
"""


ENSEMBLE = """
name: "{name}"
platform: "ensemble"
max_batch_size: 0
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
ensemble_scheduling {{
  step [
    {{ model_name: "{first}" model_version: -1 input_map {{ key: "INPUT0" value: "INPUT0" }}
      output_map {{ key: "OUTPUT0" value: "mid" }} }},
    {{ model_name: "{second}" model_version: -1 input_map {{ key: "INPUT0" value: "mid" }}
      output_map {{ key: "OUTPUT0" value: "OUTPUT0" }} }}
  ]
}}
"""


def write_ensemble(repo: Path, name: str, first: str, second: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(ENSEMBLE.format(name=name, first=first, second=second))


class World:
    """The fake process: the bytes fake models hold (its RSS), how their loads behave, and
    holds that keep requests in flight (pins)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lock = threading.Lock()
        self.bytes = 0  # held by models
        self.outside = 0  # held by the process itself (a framework's runtime)
        self.peak = 0
        self.actual: dict[str, int] = {}  # bytes a load really takes (default: its file size)
        self.overrun: set[str] = set()  # models allowed to hold more than their reservation
        self.gates: dict[str, threading.Event] = {}  # a load (or unload) blocks until set
        self.unload_gates: dict[str, threading.Event] = {}
        self.started: dict[str, threading.Event] = {}
        self.delay: dict[str, float] = {}
        self.failing: set[str] = set()
        self.holds: dict[str, asyncio.Event] = {}
        self.loads: list[str] = []
        self.budget: MemoryBudget | None = None

    def rss(self) -> int:
        with self.lock:
            return self.bytes + self.outside

    def alloc(self, name: str, size: int) -> None:
        with self.lock:
            self.bytes += size
            self.peak = max(self.peak, self.bytes)
            if name not in self.overrun:
                assert self.budget is not None
                # What the models really hold is covered by what the ledger commits.
                assert self.bytes <= self.budget.used <= self.limit, (self.bytes, self.budget.used)

    def free(self, size: int) -> None:
        with self.lock:
            self.bytes -= size


class FakeInstance:
    def __init__(self, world: World, name: str, size: int) -> None:
        self.world = world
        self.model = name
        self.size = size
        self.name = f"{name}_0"
        self.timing = ExecutionTiming()

    async def run(self, requests: list[InferenceRequest]) -> ExecuteResult:
        hold = self.world.holds.get(self.model)
        if hold is not None:
            await hold.wait()
        return [
            InferenceResponse(self.model, "", [Tensor("OUTPUT0", DataType.FP32, (1,), r.inputs[0].data)], r.id)
            for r in requests
        ]

    def unload(self) -> None:
        gate = self.world.unload_gates.get(self.model)
        if gate is not None:
            assert gate.wait(10)
        self.world.free(self.size)


class FakeBackend:
    name = "fakemem"

    def __init__(self, world: World) -> None:
        self.world = world

    def auto_complete(self, config: object, files: ModelFiles, strict: bool) -> None:
        return None

    def create_instance(self, config: ModelConfig, files: ModelFiles, spec: InstanceSpec) -> FakeInstance:
        world, name = self.world, config.name
        world.started.setdefault(name, threading.Event()).set()
        gate = world.gates.get(name)
        if gate is not None:
            assert gate.wait(10)
        delay = world.delay.get(name)
        if delay:
            threading.Event().wait(delay)
        if name in world.failing:
            raise InternalError(f"model '{name}' failed to load on purpose")
        size = world.actual.get(name, file_bytes(files.model_dir))  # default: as predicted
        world.alloc(name, size)
        world.loads.append(name)
        return FakeInstance(world, name, size)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def cfg(name: str) -> int:
    """The bytes of a model's config.pbtxt, which its predicted size includes."""
    return len(CONFIG.format(name=name).encode())


def request(name: str, value: float) -> InferenceRequest:
    return InferenceRequest(name, "", [Tensor("INPUT0", DataType.FP32, (1,), np.array([value], np.float32))])


async def answer(service: InferenceService, name: str, value: float = 1.0) -> float:
    response = await service.infer(request(name, value))
    return float(response.outputs[0].data[0])


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> World:
    world = World(0)
    monkeypatch.setitem(_registry.loaded, "fakemem", FakeBackend(world))
    monkeypatch.setattr(manager_module, "release_free_memory", lambda: None)
    return world


@contextlib.asynccontextmanager
async def serving(
    tmp_path: Path, world: World, limit: int, sizes: dict[str, int], *, clock: FakeClock | None = None
) -> AsyncIterator[tuple[InferenceService, ModelRepositoryManager]]:
    for name, size in sizes.items():
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.pbtxt").write_text(CONFIG.format(name=name))
        (tmp_path / name / "1" / "weights").write_bytes(b"\0" * size)
    manager = ModelRepositoryManager(
        [tmp_path], control_mode="on_demand", memory_limit_bytes=limit, load_threads=8
    )
    manager._meter = MemoryMeter(rss=world.rss, gpu=None, trim=False)
    manager._predictor = SizePredictor(file_factor=1.0, overhead_bytes=0)
    if clock is not None:
        manager._gate.clock = clock
    world.limit = limit
    world.budget = manager._budget
    service = InferenceService(manager)
    manager.bind(service.infer)
    await manager.start()
    try:
        yield service, manager
        budget = manager._budget
        assert budget is not None
        assert budget.peak <= limit
        assert budget.reserved == {} and budget.releasing == frozenset()
        assert budget.resident == {m.name: m.size_bytes for m in manager.ready_models if m.instances}
    finally:
        for gate in [*world.gates.values(), *world.unload_gates.values()]:
            gate.set()
        for hold in world.holds.values():
            hold.set()
        await manager.stop()


async def until(condition: object, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("policy", ["lru", "gds"])
def test_random_loads_unloads_and_evictions_hold_the_budget(
    tmp_path: Path, world: World, seed: int, policy: str
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
        async with serving(tmp_path, world, 26_000, sizes) as (service, manager):
            manager._policy = manager._policy if policy == "lru" else manager_module.GreedyDualSizePolicy()
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
            assert manager._gate.waiting == 1
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
            await until(lambda: manager._gate.waiting == 1)
            clock.now += 59
            manager._gate.notify()
            await asyncio.sleep(0.02)
            assert not waiting.done()
            clock.now += 2  # past --model-load-wait-timeout (60 s)
            manager._gate.notify()
            with pytest.raises(OutOfMemoryError, match="waited 60 s"):
                await asyncio.wait_for(waiting, 2)
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
            await until(lambda: manager._gate.waiting == 1)  # c's reservation holds the room
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
            await until(lambda: manager._gate.waiting == 1)
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
            budget = manager._budget
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
            assert manager._budget is not None and manager._budget.resident == {"b": 10_000 + cfg("b")}
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
            await until(lambda: manager._gate.waiting == 1)
            assert manager.is_ready("p") and manager.is_ready("q")  # neither was evicted
            world.holds["q"].set()
            assert await flowing == 3.0
            assert await asyncio.wait_for(waiting, 5) == 4.0
            assert manager.is_ready("r") and not (manager.is_ready("p") and manager.is_ready("q"))

    asyncio.run(main())
