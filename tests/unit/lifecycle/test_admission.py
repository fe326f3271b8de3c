"""What admission counts as in use (never evicted): models with an operation, a pin or a
request in flight; the composing models of an ensemble in use or whose parts are being loaded
or unloaded; an archive namespace as a whole."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from lifecycle_fakes import FakeClock

from quiver.lifecycle.admission import AdmissionControl
from quiver.lifecycle.dependencies import DependencyGraph, Namespace
from quiver.lifecycle.loader import LoadOutcome
from quiver.lifecycle.locks import ModelLocks
from quiver.lifecycle.model import Model
from quiver.lifecycle.pins import Pins
from quiver.lifecycle.pool import LoadPool
from quiver.lifecycle.table import ModelTable
from quiver.repository.local import ModelSource


class FakeScheduler:
    def __init__(self) -> None:
        self.inflight = 0


class Parts:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.table = ModelTable(self.clock)
        self.graph = DependencyGraph()
        self.locks = ModelLocks(self.graph)
        self.pins = Pins()
        self.pool = LoadPool(1)
        self.admission = AdmissionControl(
            table=self.table, graph=self.graph, locks=self.locks, pins=self.pins, pool=self.pool, clock=self.clock
        )

    def load(self, name: str, size: int = 10, composing: list[str] | None = None) -> Model:
        fake: Any = None
        model = Model(name, 1, fake, FakeScheduler(), [], size_bytes=size)
        self.table.install(name, LoadOutcome(None, [model], {}))
        if composing is not None:
            self.graph.set_composing(name, composing)
        return model

    def pinned(self, loading: str = "new") -> set[str]:
        return {c.name for c in self.admission.candidates(loading) if c.pinned}


@pytest.fixture
def parts() -> Any:
    made = Parts()
    yield made
    made.pool.shutdown()


def test_operations_pins_and_requests_in_flight(parts: Parts) -> None:
    for name in ("a", "b", "c", "d"):
        parts.load(name)
    assert parts.pinned() == set()
    parts.pins.pin("b")  # a request waits for b's (re)load
    model = parts.table.latest("c")
    assert model is not None
    model.scheduler.inflight = 1

    async def main() -> None:
        async with parts.locks.hold("a"):  # a is being unloaded
            assert parts.pinned() == {"a", "b", "c"}
            assert "a" not in {c.name for c in parts.admission.candidates("a")}  # never its own candidate
        assert parts.pinned() == {"b", "c"}

    asyncio.run(main())


def test_composing_models_of_an_ensemble_in_flight(parts: Parts) -> None:
    parts.load("pre")
    parts.load("net")
    pipe = parts.load("pipe", 0, ["pre", "net"])
    assert parts.pinned() == set()
    pipe.scheduler.inflight = 1
    assert parts.pinned() == {"pipe", "pre", "net"}


def test_an_ensembles_parts_are_pinned_while_one_of_them_is_loaded_or_unloaded(parts: Parts) -> None:
    """Evicting pre while net reloads would unload pipe, whose lock the reload must not
    wait for (it needs net): pre is pinned. Through nesting too."""
    for name in ("pre", "net", "post", "x"):
        parts.load(name)
    parts.load("pipe", 0, ["pre", "net"])
    parts.load("outer", 0, ["pipe", "post"])

    async def main() -> None:
        async with parts.locks.hold("net"):
            # pipe needs net: its composing models are pinned; outer needs net through pipe.
            assert parts.pinned("net") == {"pre", "pipe", "post"}
        async with parts.locks.hold("x"):
            assert parts.pinned("x") == set()

    asyncio.run(main())


def test_an_archive_namespace_is_in_use_as_a_whole(parts: Parts) -> None:
    parts.load("k.tar.gz", 0, ["k.tar.gz::pre"])
    member = parts.load("k.tar.gz::pre")
    parts.load("other")
    source = ModelSource("k.tar.gz::pre", Path("/x"), Path("/x/pre"), archive="k.tar.gz")
    parts.graph.add_namespace(Namespace("k.tar.gz", "k.tar.gz", {"k.tar.gz::pre": source}))
    assert parts.pinned() == set()
    member.scheduler.inflight = 1
    assert parts.pinned() == {"k.tar.gz", "k.tar.gz::pre"}
