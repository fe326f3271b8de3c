"""DiskCache over LocalStorage: hits and misses, single flight, LRU with pins, versions, faults."""

from __future__ import annotations

import asyncio
import errno
import io
import os
import subprocess
import sys
import tarfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from quiver.errors import NotFoundError, UnavailableError
from quiver.repository.cache import CacheFullError, DiskCache, is_model_folder
from quiver.repository.storage import (
    Downloaded,
    LocalStorage,
    StoredObject,
    model_keys,
    storage_for,
)


def write_archive(path: Path, model: str, payload: bytes) -> Path:
    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        for name, data in [(f"{model}/config.pbtxt", f"name: '{model}'".encode()), (f"{model}/1/model.bin", payload)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


class CountingStorage(LocalStorage):
    """LocalStorage that counts downloads and can slow them down or lie, for fault tests."""

    def __init__(self, root: Path, delay: float = 0.0) -> None:
        super().__init__(root)
        self.downloads = 0
        self.delay = delay
        self.size_lie = 0
        self.fail_errno: int | None = None
        self.lock = threading.Lock()

    def stat(self, key: str) -> StoredObject:
        obj = super().stat(key)
        return StoredObject(obj.key, obj.size + self.size_lie, obj.etag, obj.modified)

    def download(self, key: str, dest: Path, *, etag: str | None = None) -> Downloaded:
        with self.lock:
            self.downloads += 1
        time.sleep(self.delay)
        if self.fail_errno is not None:
            dest.write_bytes(b"partial")
            raise OSError(self.fail_errno, os.strerror(self.fail_errno), str(dest))
        return super().download(key, dest, etag=etag)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "bucket"
    root.mkdir()
    for name in "abcd":
        write_archive(root / f"{name}.tar.gz", name, os.urandom(30_000))
    model = root / "plain" / "1"
    model.mkdir(parents=True)
    (model / "model.bin").write_bytes(b"w" * 1000)
    (root / "plain" / "config.pbtxt").write_text("name: 'plain'")
    return root


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-"))


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_miss_then_hit_and_layouts(repo: Path, tmp_path: Path) -> None:
    async def main() -> None:
        storage = CountingStorage(repo)
        cache = DiskCache(tmp_path / "cache", 10 << 20)
        path = await cache.fetch("a.tar.gz", storage)
        assert (path / "a" / "config.pbtxt").read_text() == "name: 'a'"
        assert not is_model_folder(path)  # the archive holds a repository
        assert await cache.fetch("a.tar.gz", storage) == path
        assert (cache.stats.misses, cache.stats.hits, storage.downloads) == (1, 1, 1)
        assert cache.stats.bytes_downloaded == (repo / "a.tar.gz").stat().st_size
        assert cache.stats.download_ns > 0
        plain = await cache.fetch("plain", storage)
        assert is_model_folder(plain) and (plain / "1" / "model.bin").read_bytes() == b"w" * 1000
        with pytest.raises(NotFoundError):
            await cache.fetch("missing.tar.gz", storage)
        with pytest.raises(NotFoundError):
            await cache.fetch("missing", storage)
        assert model_keys(storage.list()) == ["a.tar.gz", "b.tar.gz", "c.tar.gz", "d.tar.gz", "plain"]
        await cache.close()

    run(main())


def test_entries_survive_a_restart(repo: Path, tmp_path: Path) -> None:
    async def main() -> None:
        storage = CountingStorage(repo)
        cache = DiskCache(tmp_path / "cache", 10 << 20)
        first = await cache.fetch("a.tar.gz", storage)
        await cache.close()
        again = DiskCache(tmp_path / "cache", 10 << 20)
        assert await again.fetch("a.tar.gz", storage) == first
        assert (again.stats.hits, storage.downloads) == (1, 1)
        await again.close()

    run(main())


def test_single_flight(repo: Path, tmp_path: Path) -> None:
    async def main() -> None:
        storage = CountingStorage(repo, delay=0.2)
        cache = DiskCache(tmp_path / "cache", 10 << 20)
        paths = await asyncio.gather(*(cache.fetch("b.tar.gz", storage) for _ in range(10)))
        assert len(set(paths)) == 1 and storage.downloads == 1
        assert (cache.stats.misses, cache.stats.joined) == (1, 9)
        leases = await asyncio.gather(*(cache.acquire("b.tar.gz", storage) for _ in range(5)))
        assert cache.entries()[0][3] == 5
        for lease in leases:
            lease.release()
            lease.release()  # harmless
        assert cache.entries()[0][3] == 0
        await cache.close()

    run(main())


def test_event_loop_is_never_blocked(repo: Path, tmp_path: Path) -> None:
    async def main() -> None:
        storage = CountingStorage(repo, delay=0.3)
        cache = DiskCache(tmp_path / "cache", 10 << 20)
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        await cache.fetch("c.tar.gz", storage)
        task.cancel()
        assert ticks >= 15
        await cache.close()

    run(main())


def test_lru_eviction_respects_pins(repo: Path, tmp_path: Path) -> None:
    async def main() -> None:
        storage = CountingStorage(repo)
        cache = DiskCache(tmp_path / "cache", 80_000)  # room for two entries of ~30 kB, not three
        lease_a = await cache.acquire("a.tar.gz", storage)
        b = await cache.fetch("b.tar.gz", storage)
        async with lease_a as a:
            await cache.fetch("c.tar.gz", storage)  # a is older but pinned: b goes
            assert a.exists()
            assert [k for k, *_ in cache.entries()] == ["a.tar.gz", "c.tar.gz"]
            assert cache.stats.evictions == 1
            lease_c = await cache.acquire("c.tar.gz", storage)
            with pytest.raises(CacheFullError, match=r"cannot hold 'd.tar.gz'"):
                await cache.fetch("d.tar.gz", storage)
            lease_c.release()
        await cache.fetch("d.tar.gz", storage)  # now a is unpinned and least recently used
        assert [k for k, *_ in cache.entries()] == ["c.tar.gz", "d.tar.gz"]
        assert cache.bytes_used <= cache.max_bytes
        await cache.close()
        assert not b.exists()
        assert len([p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]) == 2
        assert leftovers(tmp_path / "cache") == []

    run(main())


def test_new_upload_is_fetched_anew_and_old_entry_dropped_when_unpinned(repo: Path, tmp_path: Path) -> None:
    async def main() -> None:
        storage = CountingStorage(repo)
        cache = DiskCache(tmp_path / "cache", 10 << 20)
        old = await cache.acquire("a.tar.gz", storage)
        write_archive(repo / "a.tar.gz", "a", b"new weights")
        os.utime(repo / "a.tar.gz", ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
        new = await cache.fetch("a.tar.gz", storage)
        assert new != old.path and (new / "a/1/model.bin").read_bytes() == b"new weights"
        assert old.path.exists()  # still in use
        old.release()
        await cache.close()
        assert not old.path.exists() and new.exists()
        assert storage.downloads == 2

    run(main())


def test_size_mismatch_leaves_no_entry(repo: Path, tmp_path: Path) -> None:
    async def main() -> None:
        storage = CountingStorage(repo)
        storage.size_lie = 1
        cache = DiskCache(tmp_path / "cache", 10 << 20)
        with pytest.raises(UnavailableError, match=r"expected"):
            await cache.fetch("a.tar.gz", storage)
        assert cache.entries() == [] and cache.stats.download_failures == 1
        assert leftovers(tmp_path / "cache") == [] and cache.bytes_reserved == 0
        storage.size_lie = 0
        await cache.fetch("a.tar.gz", storage)
        await cache.close()

    run(main())


def test_disk_full_mid_download_cleans_up(repo: Path, tmp_path: Path) -> None:
    async def main() -> None:
        storage = CountingStorage(repo)
        storage.fail_errno = errno.ENOSPC
        cache = DiskCache(tmp_path / "cache", 10 << 20)
        with pytest.raises(CacheFullError, match=r"disk full while fetching 'a.tar.gz'"):
            await cache.fetch("a.tar.gz", storage)
        assert leftovers(tmp_path / "cache") == [] and cache.entries() == []
        await cache.close()

    run(main())


def test_hostile_archive_leaves_no_entry(tmp_path: Path) -> None:
    root = tmp_path / "bucket"
    root.mkdir()
    (root / "bad.tar.gz").write_bytes(b"garbage")

    async def main() -> None:
        cache = DiskCache(tmp_path / "cache", 10 << 20)
        with pytest.raises(Exception, match=r"archive 'bad.tar.gz' is not a valid tar.gz"):
            await cache.fetch("bad.tar.gz", storage_for(str(root)))
        assert leftovers(tmp_path / "cache") == []
        await cache.close()

    run(main())


def test_leftovers_are_deleted_and_never_trusted(repo: Path, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    (root / ".tmp-1234").mkdir(parents=True)
    (root / ".tmp-1234" / "content").mkdir()
    (root / ".tmp-5678.download").write_bytes(b"half")
    (root / "a.tar.gz-0000").mkdir()  # a folder without a manifest
    (root / "junk").write_text("?")

    async def main() -> None:
        cache = DiskCache(root, 10 << 20)
        await cache.start()
        assert sorted(p.name for p in root.iterdir()) == [".lock"]
        second = DiskCache(root, 10 << 20)
        with pytest.raises(Exception, match=r"in use by another process"):
            await second.start()
        await cache.close()

    run(main())


CRASH_SCRIPT = """
import asyncio, sys, time
from pathlib import Path
from quiver.repository.cache import DiskCache
from quiver.repository.storage import LocalStorage

class Hanging(LocalStorage):
    def download(self, key, dest, *, etag=None):
        with open(dest, "wb") as f:
            f.write(b"first half")
            f.flush()
        print("downloading", flush=True)
        time.sleep(60)

asyncio.run(DiskCache(Path(sys.argv[2]), 10 << 20).fetch("a.tar.gz", Hanging(Path(sys.argv[1]))))
"""


def test_crash_mid_download(repo: Path, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    script = tmp_path / "crash.py"
    script.write_text(textwrap.dedent(CRASH_SCRIPT))
    child = subprocess.Popen(
        [sys.executable, str(script), str(repo), str(root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "downloading"
        assert leftovers(root)  # the half-written download is under a temporary name
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()

    async def main() -> None:
        storage = CountingStorage(repo)
        cache = DiskCache(root, 10 << 20)
        path = await cache.fetch("a.tar.gz", storage)
        assert storage.downloads == 1 and cache.stats.misses == 1
        assert (path / "a" / "config.pbtxt").exists()
        assert leftovers(root) == []
        await cache.close()

    run(main())


@pytest.mark.parametrize("kind", ["cve-2025-4517", "bomb"])
def test_hostile_archive_writes_nothing_outside_and_leaves_no_entry(tmp_path: Path, kind: str) -> None:
    """The CVE-2025-4517 chain (aimed three folders above the extraction folder, which is the
    cache's parent) and a decompression bomb, through the cache: INVALID_ARG naming the key,
    no entry, no leftover, nothing new beside the cache; the cache's limits reach extraction."""
    from quiver.errors import InvalidArgumentError
    from quiver.repository.archive import ExtractLimits
    from support.archives import cve_2025_4517_archive

    bucket = tmp_path / "bucket"
    bucket.mkdir()
    sentinel = tmp_path / "sentinel"
    root = sentinel / "cache"
    root.mkdir(parents=True)
    if kind == "bomb":
        with tarfile.open(bucket / "evil.tar.gz", "w:gz", compresslevel=9) as tar:
            info = tarfile.TarInfo("m/weights.bin")
            info.size = 8 << 20
            tar.addfile(info, io.BytesIO(bytes(info.size)))
        match = r"archive 'evil.tar.gz' expands more than 10 times"
    else:  # extraction happens in <cache>/.tmp-<32 hex>/content
        dest_len = len(str(root)) + len("/.tmp-") + 32 + len("/content")
        (bucket / "evil.tar.gz").write_bytes(cve_2025_4517_archive(dest_len))
        match = r"archive 'evil.tar.gz': member 'a/b/.*' passes through the symlink 'a'"
    write_archive(bucket / "good.tar.gz", "good", os.urandom(1 << 20))
    before = sorted(p.name for p in sentinel.iterdir())

    async def main() -> None:
        cache = DiskCache(root, 64 << 20, limits=ExtractLimits(max_ratio=10, ratio_floor=1 << 20, max_files=50))
        assert cache.limits == ExtractLimits(max_bytes=64 << 20, max_files=50, max_ratio=10, ratio_floor=1 << 20)
        storage = storage_for(str(bucket))
        with pytest.raises(InvalidArgumentError, match=match):
            await cache.fetch("evil.tar.gz", storage)
        assert leftovers(root) == [] and cache.entries() == []
        good = await cache.fetch("good.tar.gz", storage)  # the next correct request is served
        assert (good / "good" / "config.pbtxt").read_text() == "name: 'good'"
        await cache.close()

    run(main())
    assert sorted(p.name for p in sentinel.iterdir()) == before == ["cache"]
