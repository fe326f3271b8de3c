"""The miss path's own work: configurations prepared once per version of a model's files, and
repository listings that are incremental."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from lifecycle_fakes import CONFIG, World, answer, cfg, install_fake_backend, serving

from quiver.lifecycle import loader
from quiver.lifecycle.configs import ConfigCache, PreparedConfig
from quiver.lifecycle.memory import SizePredictor
from quiver.repository.local import LocalRepository, ModelSource


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> World:
    return install_fake_backend(monkeypatch)


def test_a_config_is_read_and_prepared_once_per_version_of_its_files(
    tmp_path: Path, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Room for one model: a and b evict each other on every request. Each is read once,
    however often it loads; a changed file is read again."""
    reads: list[str] = []
    real = loader._read_proto

    def counting(source: ModelSource, **kwargs: object) -> object:
        reads.append(source.name)
        return real(source, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(loader, "_read_proto", counting)

    async def main() -> None:
        async with serving(tmp_path, world, 12_000, {"a": 8_000, "b": 8_000}) as (service, manager):
            for _ in range(3):
                assert await answer(service, "a", 1.0) == 1.0
                assert await answer(service, "b", 2.0) == 2.0
            assert world.loads == ["a", "b"] * 3
            assert sorted(reads) == ["a", "b"]
            configs = manager.admission.configs
            assert configs.hits > 0
            config = tmp_path / "a" / "config.pbtxt"
            config.write_text(config.read_text() + "\n# edited\n")
            assert await answer(service, "a", 3.0) == 3.0
            assert sorted(reads) == ["a", "a", "b"]

    asyncio.run(main())


def test_a_model_counts_the_same_bytes_when_measured_and_when_it_reloads(tmp_path: Path, world: World) -> None:
    """Models that measure far below their files (allocator reuse) count for the overhead plus
    their file bytes, on their first load and when they reload at their known size alike, so
    the room holds as many models whether they load for the first time or again."""
    files = {"a": 8_000, "b": 8_000}
    world.actual = {"a": 100, "b": 100}
    predictor = SizePredictor(file_factor=1.5, overhead_bytes=1_000)

    async def main() -> None:
        async with serving(tmp_path, world, 15_000, files, predictor=predictor) as (service, manager):
            budget = manager.admission.budget
            assert budget is not None
            counted: dict[str, list[int]] = {"a": [], "b": []}
            for _ in range(2):
                for name in ("a", "b"):
                    assert await answer(service, name, 1.0) == 1.0
                    counted[name].append(budget.resident[name])
            assert world.loads == ["a", "b", "a", "b"]  # each load evicted the other
            for name, sizes in counted.items():
                assert sizes == [1_000 + files[name] + cfg(name)] * 2

    asyncio.run(main())


def test_the_config_cache_is_bounded_and_keyed_by_fingerprint(tmp_path: Path) -> None:
    cache = ConfigCache(capacity=2)
    sources = [ModelSource(n, tmp_path, tmp_path / n) for n in ("a", "b", "c")]
    for source in sources:
        cache.remember_read(source, "f1", False, loader.pb.ModelConfig(name=source.name))
    assert len(cache) == 2
    assert cache.read(sources[0], "f1", False) is None  # the least recently used went
    assert cache.read(sources[2], "f1", False) is not None
    assert cache.read(sources[2], "f2", False) is None  # other files: not the same entry
    assert cache.read(sources[2], "f1", True) is None  # strict reads differently
    assert cache.prepared(sources[2], "f1", False) is None
    with pytest.raises(ValueError):
        ConfigCache(capacity=0)
    assert PreparedConfig.__slots__  # frozen, shared by the loads


def test_the_repository_listing_is_incremental(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("m1", "m2", ".hidden"):
        (tmp_path / name).mkdir()
    (tmp_path / "notes.txt").write_text("not a model")
    repository = LocalRepository([tmp_path])
    listings: list[str] = []
    real = os.scandir

    def counting(path: object) -> object:
        listings.append(str(path))
        return real(path)  # type: ignore[call-overload]

    monkeypatch.setattr(os, "scandir", counting)
    models, clashes = repository.scan()
    assert sorted(models) == ["m1", "m2"] and clashes == {}
    assert models["m1"].path == tmp_path / "m1"
    repository.scan()
    assert len(listings) == 1  # unchanged folder: not listed again
    time.sleep(0.01)
    (tmp_path / "m3").mkdir()
    assert sorted(repository.scan()[0]) == ["m1", "m2", "m3"]
    (tmp_path / "m1").rmdir()
    assert sorted(repository.scan()[0]) == ["m2", "m3"]
    assert len(listings) == 3
    assert repository.has("m2") and not repository.has("m1") and not repository.has(".hidden")


def test_names_clashing_between_repositories_are_reported(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    for root in (one, two):
        (root / "same").mkdir(parents=True)
    (one / "only").mkdir()
    models, clashes = LocalRepository([one, two]).scan()
    assert sorted(models) == ["only"] and "more than one repository" in clashes["same"]


def test_an_s3_listing_serves_the_index_until_it_is_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index lists an S3 repository once per LISTING_TTL_S (or when asked to refresh);
    local archives are listed again only when their folder changed."""
    from quiver.lifecycle import sources as sources_module
    from quiver.lifecycle.pool import LoadPool
    from quiver.lifecycle.sources import LISTING_TTL_S, ModelSources
    from quiver.metrics.statistics import MultiModelStatistics
    from quiver.repository.storage import LocalStorage

    listed: list[str] = []
    real = sources_module._stored_keys

    def counting(store: object) -> list[str]:
        listed.append(type(store).__name__)
        if isinstance(store, LocalStorage):
            return real(store)
        return [f"s3model{len(listed)}.tar.gz"]

    monkeypatch.setattr(sources_module, "_stored_keys", counting)
    now = [1000.0]
    monkeypatch.setattr(sources_module.time, "monotonic", lambda: now[0])
    (tmp_path / "local.tar.gz").write_bytes(b"")
    pool = LoadPool(2)
    sources = ModelSources(
        [tmp_path],
        pool=pool,
        stats=MultiModelStatistics(),
        remote_repositories=["s3://bucket/models"],
        s3_options={"endpoint_url": "http://127.0.0.1:9", "region": "us-east-1"},
    )

    async def main() -> None:
        try:
            first = await sources.stored_keys()
            assert first == {"local.tar.gz", "s3model2.tar.gz"}
            assert await sources.stored_keys() == first  # nothing listed again
            assert listed == ["LocalStorage", "S3Storage"]
            now[0] += LISTING_TTL_S + 1
            assert "s3model3.tar.gz" in await sources.stored_keys()  # stale: listed again
            assert "s3model4.tar.gz" in await sources.stored_keys(refresh=True)
            assert listed.count("LocalStorage") == 1
            (tmp_path / "new.tar.gz").write_bytes(b"")
            os.utime(tmp_path, ns=(time.time_ns(), time.time_ns() + 10**9))
            assert "new.tar.gz" in await sources.stored_keys()
            assert listed.count("LocalStorage") == 2
        finally:
            await sources.close()

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()


def test_an_archive_is_inspected_once_per_folder_the_disk_cache_extracted_it_to(
    tmp_path: Path, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model addressed by key loads from the disk cache's folder of its download, whose
    files the cache checks at every fetch: reloaded from that folder, its files are not walked
    again; once a file in it changes, the cache fetches the archive into a new folder, which
    is walked."""
    import io
    import tarfile

    from quiver.lifecycle import admission as admission_module

    walked: list[Path] = []
    real = admission_module.fingerprint_and_size

    def counting(path: Path, *args: object) -> tuple[str, int]:
        walked.append(path)
        return real(path, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(admission_module, "fingerprint_and_size", counting)
    repo = tmp_path / "repo"
    repo.mkdir()
    content = io.BytesIO()
    with tarfile.open(fileobj=content, mode="w:gz") as tar:
        for name, data in (("k/config.pbtxt", CONFIG.format(name="k").encode()), ("k/1/weights", b"\0" * 4_000)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (repo / "k.tar.gz").write_bytes(content.getvalue())

    async def main() -> None:
        async with serving(repo, world, 40_000, {}, cache_dir=tmp_path / "cache") as (service, manager):
            assert await answer(service, "k.tar.gz", 1.0) == 1.0
            assert len(walked) == 1
            first = walked[0]
            await manager.unload("k.tar.gz")
            assert await answer(service, "k.tar.gz", 2.0) == 2.0
            assert walked == [first]  # the same folder, checked by the cache: not walked again
            await manager.unload("k.tar.gz")
            (first / "1" / "weights").write_bytes(b"\1" * 4_000)  # changed on disk
            assert await answer(service, "k.tar.gz", 3.0) == 3.0
            assert len(walked) == 2 and walked[1] != first

    asyncio.run(main())
