"""Configurations read ahead (lifecycle/read_ahead.py): the local model folders' configurations
parsed while the server is idle, so a model's first miss finds its configuration read."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from lifecycle_fakes import FakeClock, World, answer, install_fake_backend, serving, until

from quiver.backends.base import _registry
from quiver.lifecycle import loader
from quiver.lifecycle import read_ahead as read_ahead_module
from quiver.lifecycle.configs import ConfigCache
from quiver.lifecycle.memory import MemoryMeter
from quiver.lifecycle.pool import LoadPool
from quiver.lifecycle.read_ahead import IDLE_S, ReadAhead
from quiver.lifecycle.sources import fingerprint
from quiver.repository.local import LocalRepository, ModelSource

CONFIG = 'name: "{name}"\nbackend: "fakemem"\nmax_batch_size: 0\n'


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> World:
    return install_fake_backend(monkeypatch)


def folders(repo: Path, names: list[str]) -> list[ModelSource]:
    for name in names:
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name))
    found = [LocalRepository([repo]).find(name) for name in names]
    assert all(s is not None for s in found)
    return [s for s in found if s is not None]


def test_configurations_are_read_only_while_the_server_is_idle_and_up_to_half_the_cache(
    tmp_path: Path,
) -> None:
    """Nothing is read until no request came or went for IDLE_S; then each folder's
    configuration is read under its files' fingerprint, a broken one skipped, until the cache
    holds half its capacity."""
    sources = folders(tmp_path, ["a", "b", "c", "d", "e"])
    (tmp_path / "b" / "config.pbtxt").write_text("not { a configuration")
    configs = ConfigCache(capacity=6)
    clock = FakeClock()
    pool = LoadPool(1)

    async def main() -> None:
        ahead = ReadAhead(configs=configs, pool=pool, meter=MemoryMeter(gpu=None), clock=clock, strict=False)
        running = asyncio.ensure_future(ahead.run(sources))
        await asyncio.sleep(0.05)
        assert len(configs) == 0  # the start counts as activity: not idle yet
        clock.advance(IDLE_S / 2)
        ahead.busy()  # a request came
        clock.advance(IDLE_S / 2 + 1e-6)
        await asyncio.sleep(0.05)
        assert len(configs) == 0  # idle only IDLE_S / 2 since that request
        clock.advance(IDLE_S)
        await asyncio.wait_for(running, 5)
        assert ahead.read == 3 and len(configs) == 3  # a, c, d: b is broken, then the cache is half full
        for source in (sources[0], sources[2], sources[3]):
            assert configs.read(source, fingerprint(source.path), False) is not None

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()


def test_a_first_miss_finds_its_configuration_read_ahead(
    tmp_path: Path, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In on_demand mode the manager reads ahead the folders the index does not know; a model's
    first load then parses nothing, and a configuration changed since is read again."""
    reads: list[str] = []
    real = loader._read_proto

    def counting(source: ModelSource, **kwargs: object) -> object:
        reads.append(source.name)
        return real(source, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(loader, "_read_proto", counting)

    async def main() -> None:
        sizes = {"a": 4_000, "b": 4_000, "c": 4_000}
        async with serving(tmp_path, world, 40_000, sizes, read_ahead=True) as (service, _manager):
            await until(lambda: sorted(reads) == ["a", "b", "c"])
            assert await answer(service, "a", 1.0) == 1.0
            assert await answer(service, "b", 2.0) == 2.0
            assert sorted(reads) == ["a", "b", "c"]  # nothing parsed by the loads
            config = tmp_path / "c" / "config.pbtxt"
            config.write_text(config.read_text() + "\n# edited\n")
            assert await answer(service, "c", 3.0) == 3.0
            assert sorted(reads) == ["a", "b", "c", "c"]

    asyncio.run(main())


def test_a_configuration_completed_without_the_model_files_is_prepared_ahead(
    tmp_path: Path, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A configuration whose framework is imported and completes it without opening the model
    is prepared ahead too (what a load starts with); one its framework would have to open the
    model for is only read; folders read before their framework was imported are prepared
    once every folder was read."""
    backend = _registry.loaded["fakemem"]
    monkeypatch.setattr(backend, "completes_without_files", lambda config, strict: config.name != "c", raising=False)
    sources = folders(tmp_path, ["a", "b", "c"])
    imported: list[str] = []
    real = loader.imported_backend

    def later(name: str) -> object:
        imported.append(name)
        return real(name) if len(imported) > len(sources) else None  # imported after the first pass

    monkeypatch.setattr(loader, "imported_backend", later)
    configs = ConfigCache()
    pool = LoadPool(1)

    async def main() -> None:
        clock = FakeClock()
        ahead = ReadAhead(configs=configs, pool=pool, meter=MemoryMeter(gpu=None), clock=clock, strict=False)
        clock.advance(IDLE_S)
        await asyncio.wait_for(ahead.run(sources), 5)
        assert ahead.read == 6 and ahead.prepared == 2  # a, b, c read, then again: a and b prepared
        for source in sources:
            found = configs.prepared(source, fingerprint(source.path), False)
            assert (found is not None) == (source.name != "c")

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()


def test_a_read_stops_when_a_request_comes_and_is_done_again_later(tmp_path: Path) -> None:
    """A request arriving while a folder is read ahead stops the read before the walk or
    before the configuration is parsed (BUSY: nothing kept); the folder is read at the next
    lull, not skipped."""
    from quiver.lifecycle.read_ahead import BUSY, read_config

    (source,) = folders(tmp_path, ["a"])
    configs = ConfigCache()
    assert read_config(source, configs, False, idle=lambda: False) == BUSY
    answers = iter([True, False])
    assert read_config(source, configs, False, idle=lambda: next(answers)) == BUSY  # after the walk
    assert len(configs) == 0
    clock = FakeClock()
    pool = LoadPool(1)
    asked: list[bool] = []

    async def main() -> None:
        ahead = ReadAhead(configs=configs, pool=pool, meter=MemoryMeter(gpu=None), clock=clock, strict=False)
        real = read_ahead_module.read_config

        def first_busy(*args: object) -> str:
            asked.append(True)
            if len(asked) == 1:
                ahead.busy()  # a request came while the first round read
            return real(*args)  # type: ignore[arg-type]

        read_ahead_module.read_config = first_busy  # type: ignore[assignment]
        try:
            clock.advance(IDLE_S + 1e-6)
            running = asyncio.ensure_future(ahead.run([source]))
            await until(lambda: len(asked) == 1)
            await asyncio.sleep(0.05)
            assert len(configs) == 0 and not running.done()  # waits for the next lull
            clock.advance(2 * IDLE_S + 1e-6)  # twice as long: a request came during the last trip
            await asyncio.wait_for(running, 5)
        finally:
            read_ahead_module.read_config = real
        # stopped once, then read (and read once more at the end: its framework, never
        # imported here, might have been since)
        assert len(asked) == 3 and ahead.read == 2 and len(configs) == 1

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()


def test_after_a_trip_a_request_came_during_the_next_waits_for_a_longer_lull(tmp_path: Path) -> None:
    """A request arriving while a folder is read (the lull was only a gap between requests)
    doubles the lull the next trip waits for; a trip starting after a lull at least twice as
    long as the one it waited for halves it back towards IDLE_S. A stream of requests with
    gaps just over IDLE_S (a client reading /metrics between misses) then meets a trip or two,
    not one per gap (#19: a repository of 10,000 folders is read ahead for seconds of lulls,
    and its misses met a trip in most gaps)."""
    sources = folders(tmp_path, ["a", "b", "c", "d"])
    configs = ConfigCache()
    clock = FakeClock()
    pool = LoadPool(1)
    trips: list[tuple[str, float]] = []  # (folder, the lull its trip waited for)

    async def main() -> None:
        ahead = ReadAhead(configs=configs, pool=pool, meter=MemoryMeter(gpu=None), clock=clock, strict=False)
        real = read_ahead_module.read_config

        def colliding(source: ModelSource, *args: object) -> str:
            trips.append((source.name, ahead.lull))
            done = real(source, *args)  # type: ignore[arg-type]
            if len(trips) <= 2:
                ahead.busy()  # a request came as the trip ended: a gap, not a lull
            return done

        read_ahead_module.read_config = colliding  # type: ignore[assignment]
        try:
            assert ahead.lull == IDLE_S
            clock.advance(IDLE_S + 1e-6)
            running = asyncio.ensure_future(ahead.run(sources[:3]))
            await until(lambda: len(trips) == 1)
            await until(lambda: ahead.lull == 2 * IDLE_S)
            clock.advance(IDLE_S + 1e-6)  # a gap as long as the first: no trip now
            await asyncio.sleep(0.05)
            assert len(trips) == 1
            clock.advance(IDLE_S)
            await until(lambda: len(trips) == 2)
            await until(lambda: ahead.lull == 4 * IDLE_S)
            clock.advance(3 * IDLE_S)
            await asyncio.sleep(0.05)
            assert len(trips) == 2
            clock.advance(IDLE_S + 1e-6)  # a lull of 4 * IDLE_S: not twice the one waited for
            await asyncio.wait_for(running, 5)
            assert ahead.lull == 4 * IDLE_S
            clock.advance(4 * IDLE_S)  # now a lull of 8 * IDLE_S: halved at each trip's start
            await asyncio.wait_for(ahead.run(sources[3:]), 5)
        finally:
            read_ahead_module.read_config = real
        assert [name for name, _ in trips[:3]] == ["a", "b", "c"] and trips[-2][0] == "d"
        assert [lull / IDLE_S for _, lull in trips[:3]] == [1, 2, 4]
        assert [lull / IDLE_S for _, lull in trips[-2:]] == [2, 1]  # d, then d again (prepared)
        assert ahead.lull == IDLE_S and len(configs) == 4

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()


def test_the_lull_waited_for_is_at_most_max_lull(tmp_path: Path) -> None:
    """However many trips requests came during, the next waits for MAX_LULL_S at most."""
    from quiver.lifecycle.read_ahead import MAX_LULL_S

    (source,) = folders(tmp_path, ["a"])
    clock = FakeClock()
    pool = LoadPool(1)

    async def main() -> None:
        ahead = ReadAhead(configs=ConfigCache(), pool=pool, meter=MemoryMeter(gpu=None), clock=clock, strict=False)
        ahead.lull = MAX_LULL_S
        real = read_ahead_module.read_config

        def colliding(*args: object) -> str:
            done = real(*args)  # type: ignore[arg-type]
            ahead.busy()  # a request came as the trip ended
            return done

        read_ahead_module.read_config = colliding  # type: ignore[assignment]
        try:
            clock.advance(MAX_LULL_S + 1e-6)
            running = asyncio.ensure_future(ahead.run([source]))
            await until(lambda: ahead.read >= 1)
            assert ahead.lull == MAX_LULL_S
            clock.advance(MAX_LULL_S + 1e-6)
            await asyncio.wait_for(running, 5)
        finally:
            read_ahead_module.read_config = real

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()


def test_a_request_arriving_after_the_parse_leaves_the_configuration_read_not_prepared(
    tmp_path: Path, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The preparation (auto-complete, validation) is a step of its own: a request that came
    during the parse stops the trip before it (the miss waits for the parse only); the
    configuration is kept as read, and prepared at the next pass."""
    from quiver.lifecycle.read_ahead import read_config

    backend = _registry.loaded["fakemem"]
    monkeypatch.setattr(backend, "completes_without_files", lambda config, strict: True, raising=False)
    (source,) = folders(tmp_path, ["a"])
    configs = ConfigCache()
    answers = iter([True, True, False])
    assert read_config(source, configs, False, idle=lambda: next(answers)) == "read"
    assert configs.read(source, fingerprint(source.path), False) is not None
    assert configs.prepared(source, fingerprint(source.path), False) is None
    assert read_config(source, configs, False, idle=lambda: True) == "prepared"
    assert configs.prepared(source, fingerprint(source.path), False) is not None
