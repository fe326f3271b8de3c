"""Fakes for the lifecycle's unit tests: a clock that moves only when told to, and a fake
process with a fake backend (it implements the Backend protocol: loads that take controllable
time and hold a chosen number of bytes of a fake RSS, and can fail or block on purpose), with
:func:`serving` to run the real ModelRepositoryManager and InferenceService over them.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from quiver import clock
from quiver.backends.base import ExecuteResult, ExecutionTiming, InstanceSpec, ModelFiles, _registry
from quiver.config import ModelConfig
from quiver.errors import InternalError
from quiver.lifecycle import lifecycle as lifecycle_module
from quiver.lifecycle.budget import MemoryBudget
from quiver.lifecycle.manager import ModelRepositoryManager
from quiver.lifecycle.memory import MemoryMeter, SizePredictor, file_bytes
from quiver.service import InferenceService
from quiver.types import DataType, InferenceRequest, InferenceResponse, Tensor

SECOND = 1_000_000_000


class FakeClock(clock.FakeClock):
    """The shared fake clock, started at 1000 s and moved in seconds (as lifecycle counts)."""

    def __init__(self, start: int = 1000 * SECOND) -> None:
        super().__init__(start)

    def advance(self, seconds: float) -> None:  # type: ignore[override]
        super().advance(int(seconds * SECOND))


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


def write_model(repo: Path, name: str, size: int) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name))
    (repo / name / "1" / "weights").write_bytes(b"\0" * size)


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
        self.unloads: list[str] = []
        self.budget: MemoryBudget | None = None

    def rss(self) -> int:
        with self.lock:
            return self.bytes + self.outside

    def alloc(self, name: str, size: int) -> None:
        with self.lock:
            self.bytes += size
            self.peak = max(self.peak, self.bytes)
            if name not in self.overrun and self.budget is not None:
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
        self.world.unloads.append(self.model)


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


def install_fake_backend(monkeypatch: pytest.MonkeyPatch) -> World:
    world = World(0)
    monkeypatch.setitem(_registry.loaded, "fakemem", FakeBackend(world))
    monkeypatch.setattr(lifecycle_module, "release_free_memory", lambda: None)
    return world


def cfg(name: str) -> int:
    """The bytes of a model's config.pbtxt, which its predicted size includes."""
    return len(CONFIG.format(name=name).encode())


def request(name: str, value: float) -> InferenceRequest:
    return InferenceRequest(name, "", [Tensor("INPUT0", DataType.FP32, (1,), np.array([value], np.float32))])


async def answer(service: InferenceService, name: str, value: float = 1.0) -> float:
    response = await service.infer(request(name, value))
    return float(response.outputs[0].data[0])


@contextlib.asynccontextmanager
async def serving(
    tmp_path: Path,
    world: World,
    limit: int,
    sizes: dict[str, int],
    *,
    clock: FakeClock | None = None,
    **options: Any,
) -> AsyncIterator[tuple[InferenceService, ModelRepositoryManager]]:
    """The real manager (on-demand, a memory budget of ``limit`` bytes unless 0) and service
    over the fake backend; at the end, the ledger is checked and the manager stopped, and no
    task it started is left. The eviction policy is LRU unless ``eviction_policy`` names
    another, and nothing is evicted ahead of need unless ``evict_ahead=True``: the scenarios
    name their victims by recency, and which are resident when; configurations are not read
    ahead unless ``read_ahead=True`` (the scenarios count trips and reads)."""
    options.setdefault("eviction_policy", "lru")
    options.setdefault("evict_ahead", False)
    options.setdefault("read_ahead", False)
    for name, size in sizes.items():
        write_model(tmp_path, name, size)
    manager = ModelRepositoryManager(
        [tmp_path],
        control_mode=options.pop("control_mode", "on_demand"),
        memory_limit_bytes=limit,
        load_threads=8,
        meter=options.pop("meter", None) or MemoryMeter(rss=world.rss, gpu=None, trim=False),
        predictor=options.pop("predictor", None) or SizePredictor(file_factor=1.0, overhead_bytes=0),
        **({"clock": clock} if clock is not None else {}),
        **options,
    )
    world.limit = limit
    world.budget = manager.admission.budget
    service = InferenceService(manager)
    manager.bind(service.infer)
    before = asyncio.all_tasks()
    await manager.start()
    try:
        yield service, manager
        budget = manager.admission.budget
        if budget is not None:
            # evictions ahead of need still under way finish first (they hold a reservation)
            await until(lambda: not any(t.get_name() == "quiver-evict-ahead" for t in asyncio.all_tasks()))
            assert budget.peak <= limit
            assert budget.reserved == {} and budget.releasing == frozenset()
            assert budget.resident == {m.name: m.size_bytes for m in manager.ready_models if m.instances}
    finally:
        for gate in [*world.gates.values(), *world.unload_gates.values()]:
            gate.set()
        for hold in world.holds.values():
            hold.set()
        await manager.stop()
    await asyncio.sleep(0)
    left = [t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()]
    assert not left, f"tasks left running after stop: {left}"


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)
