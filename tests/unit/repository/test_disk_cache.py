"""DiskCache over LocalStorage: hits and misses, single flight, LRU with pins, versions, faults,
revalidation bounded in time, damaged entries, unwritable and full cache folders."""

from __future__ import annotations

import asyncio
import errno
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from quiver.backends.base import CACHE_FOLDERS
from quiver.errors import InvalidArgumentError, NotFoundError, UnavailableError
from quiver.lifecycle.dependencies import is_model_folder
from quiver.repository.cache import CacheFullError, DiskCache
from quiver.repository.storage import (
    Downloaded,
    LocalStorage,
    OnStart,
    StoredObject,
    model_keys,
    storage_for,
)
from support.faults import file_size_limit, read_only


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

    def download(
        self, key: str, dest: Path, *, etag: str | None = None, on_start: OnStart | None = None
    ) -> Downloaded:
        with self.lock:
            self.downloads += 1
        time.sleep(self.delay)
        if self.fail_errno is not None:
            dest.write_bytes(b"partial")
            raise OSError(self.fail_errno, os.strerror(self.fail_errno), str(dest))
        got = super().download(key, dest, etag=etag, on_start=on_start)
        if self.size_lie:  # the store announced a size it did not send
            obj = got.object
            return Downloaded(StoredObject(obj.key, obj.size + self.size_lie, obj.etag, obj.modified), got.md5)
        return got


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
        with pytest.raises(CacheFullError, match=r"model cache folder .*/cache is full: cannot fetch 'a.tar.gz'"):
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


def test_the_folders_other_parts_keep_there_are_left_alone(repo: Path, tmp_path: Path) -> None:
    """The server's disk cache shares its folder with the backends' (unpacked Python
    environments, the Python worker's modules, ONNX Runtime's optimized graphs): it starts
    without deleting them, and still deletes what is neither an entry nor theirs."""
    root = tmp_path / "cache"
    for name in CACHE_FOLDERS:
        (root / name / "inside").mkdir(parents=True)
    (root / "junk").mkdir()

    async def main() -> None:
        cache = DiskCache(root, 10 << 20, keep=CACHE_FOLDERS)
        await cache.start()
        assert sorted(p.name for p in root.iterdir()) == sorted([".lock", *CACHE_FOLDERS])
        assert all((root / name / "inside").is_dir() for name in CACHE_FOLDERS)
        await cache.fetch("a.tar.gz", CountingStorage(repo))
        await cache.close()

    run(main())


CRASH_SCRIPT = """
import asyncio, sys, time
from pathlib import Path
from quiver.repository.cache import DiskCache
from quiver.repository.storage import LocalStorage

class Hanging(LocalStorage):
    def download(self, key, dest, *, etag=None, on_start=None):
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
# -- graceful degradation: a slow or down store, damaged entries, an unwritable folder ------------


class SlowStorage(CountingStorage):
    """Answers stat/list after ``stall`` seconds, or fails as a store that is down."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.stall = 0.0
        self.down = False

    def stat(self, key: str) -> StoredObject:
        self._answer()
        return super().stat(key)

    def list(self, prefix: str = "") -> list[StoredObject]:
        self._answer()
        return super().list(prefix)

    def download(
        self, key: str, dest: Path, *, etag: str | None = None, on_start: OnStart | None = None
    ) -> Downloaded:
        self._answer()
        return super().download(key, dest, etag=etag, on_start=on_start)

    def _answer(self) -> None:
        time.sleep(self.stall)
        if self.down:
            raise UnavailableError("the store is down (test)")


def test_a_hung_store_is_answered_from_the_cache_within_the_timeout(
    repo: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        storage = SlowStorage(repo)
        cache = DiskCache(tmp_path / "cache", 10 << 20, revalidate_timeout=0.3)
        first = await cache.fetch("a.tar.gz", storage)
        storage.stall = 2.0
        started = time.monotonic()
        assert await cache.fetch("a.tar.gz", storage) == first
        assert time.monotonic() - started < 1.5
        assert cache.stats.stale_hits == 1 and storage.downloads == 1
        # A key never cached waits for the store as long as the store takes (no fallback).
        storage.stall, storage.down = 0.0, True
        with pytest.raises(UnavailableError, match="the store is down"):
            await cache.fetch("b.tar.gz", storage)
        await cache.close()

    with caplog.at_level("WARNING", logger="quiver.repository.cache"):
        run(main())
    assert "serving 'a.tar.gz' from the model cache" in caplog.text
    assert "did not answer within 0.3 s" in caplog.text


def test_a_down_store_serves_folders_too_and_a_gone_key_drops_its_entry(repo: Path, tmp_path: Path) -> None:
    async def main() -> None:
        storage = SlowStorage(repo)
        cache = DiskCache(tmp_path / "cache", 10 << 20)
        plain = await cache.fetch("plain", storage)
        storage.down = True
        assert await cache.fetch("plain", storage) == plain
        assert cache.stats.stale_hits == 1
        storage.down = False
        (repo / "plain" / "1" / "model.bin").unlink()
        (repo / "plain" / "config.pbtxt").unlink()
        with pytest.raises(NotFoundError):
            await cache.fetch("plain", storage)
        assert cache.entries() == []
        await cache.close()
        assert not plain.exists()

    run(main())


def test_a_new_version_that_cannot_be_downloaded_leaves_the_old_one_served(repo: Path, tmp_path: Path) -> None:
    async def main() -> None:
        storage = CountingStorage(repo)
        cache = DiskCache(tmp_path / "cache", 10 << 20)
        old = await cache.fetch("a.tar.gz", storage)
        write_archive(repo / "a.tar.gz", "a", b"new weights")
        storage.size_lie = 1  # the download of the new version fails its size check
        assert await cache.fetch("a.tar.gz", storage) == old
        assert cache.stats.stale_hits == 1 and cache.stats.download_failures == 1
        storage.size_lie = 0
        new = await cache.fetch("a.tar.gz", storage)
        assert new != old and (new / "a/1/model.bin").read_bytes() == b"new weights"
        await cache.close()
        assert not old.exists()

    run(main())


def _damage_remove(path: Path) -> None:
    (path / "a/1/model.bin").unlink()


def _damage_rewrite_same_size(path: Path) -> None:
    target = path / "a/1/model.bin"
    st = target.stat()
    data = bytearray(target.read_bytes())
    data[0] ^= 0xFF
    target.write_bytes(bytes(data))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back: ctime still moves


def _damage_add_version(path: Path) -> None:
    (path / "a/2").mkdir()
    (path / "a/2/model.bin").write_bytes(b"x")


def _damage_folder_gone(path: Path) -> None:
    shutil.rmtree(path)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_damage_remove, "'a/1/model.bin' missing"),
        (_damage_rewrite_same_size, "the content of 'a/1/model.bin' changed"),
        (_damage_add_version, "'a/2' was added"),
        (_damage_folder_gone, "is gone"),
    ],
)
def test_a_damaged_entry_is_fetched_again(
    repo: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: object, reason: str
) -> None:
    async def main() -> None:
        storage = CountingStorage(repo)
        cache = DiskCache(tmp_path / "cache", 10 << 20)
        first = await cache.fetch("a.tar.gz", storage)
        damage(first)  # type: ignore[operator]
        again = await cache.fetch("a.tar.gz", storage)
        assert again != first and storage.downloads == 2 and cache.stats.damaged == 1
        assert (again / "a/1/model.bin").read_bytes() == (await _expected(repo))
        assert len(cache.entries()) == 1
        await cache.close()
        assert not first.exists()

    with caplog.at_level("WARNING", logger="quiver.repository.cache"):
        run(main())
    assert reason in caplog.text and "fetched again" in caplog.text


async def _expected(repo: Path) -> bytes:
    with tarfile.open(repo / "a.tar.gz") as tar:
        member = tar.extractfile("a/1/model.bin")
        assert member is not None
        return member.read()


def test_a_damaged_entry_pinned_by_a_model_stays_for_it_and_is_not_handed_out(repo: Path, tmp_path: Path) -> None:
    async def main() -> None:
        storage = CountingStorage(repo)
        cache = DiskCache(tmp_path / "cache", 10 << 20)
        lease = await cache.acquire("a.tar.gz", storage)
        (lease.path / "a/config.pbtxt").unlink()
        second = await cache.acquire("a.tar.gz", storage)
        assert second.path != lease.path and storage.downloads == 2
        assert lease.path.exists()  # the loaded model keeps its (damaged) folder
        assert [pins for *_, pins in cache.entries()] == [1, 1]
        lease.release()
        second.release()
        assert len(cache.entries()) == 1
        assert await cache.fetch("a.tar.gz", storage) == second.path
        await cache.close()
        assert not lease.path.exists()

    run(main())


def test_after_a_restart_files_are_hashed_once_and_a_benign_change_is_kept(repo: Path, tmp_path: Path) -> None:
    async def main() -> None:
        storage = CountingStorage(repo)
        cache = DiskCache(tmp_path / "cache", 10 << 20)
        path = await cache.fetch("a.tar.gz", storage)
        await cache.close()
        target = path / "a/1/model.bin"
        target.write_bytes(target.read_bytes())  # same bytes, new mtime and ctime
        manifest = (path.parent / "entry.json").read_text()
        again = DiskCache(tmp_path / "cache", 10 << 20)
        assert await again.fetch("a.tar.gz", storage) == path
        assert (storage.downloads, again.stats.hits, again.stats.damaged) == (1, 1, 0)
        await again.close()  # waits for the manifest update
        assert (path.parent / "entry.json").read_text() != manifest  # the new stat recorded
        data = json.loads((path.parent / "entry.json").read_text())
        record = next(f for f in data["files"] if f["path"] == "a/1/model.bin")
        st = target.stat()
        assert record["stat"] == [st.st_ino, st.st_mtime_ns, st.st_ctime_ns]

    run(main())


def test_entries_without_a_file_manifest_are_not_trusted(repo: Path, tmp_path: Path) -> None:
    async def main() -> None:
        storage = CountingStorage(repo)
        cache = DiskCache(tmp_path / "cache", 10 << 20)
        path = await cache.fetch("a.tar.gz", storage)
        await cache.close()
        manifest = path.parent / "entry.json"
        data = json.loads(manifest.read_text())
        del data["files"], data["format"]  # as an older Quiver wrote it
        manifest.write_text(json.dumps(data))
        again = DiskCache(tmp_path / "cache", 10 << 20)
        assert await again.fetch("a.tar.gz", storage) != path
        assert storage.downloads == 2
        await again.close()

    run(main())


def test_a_read_only_cache_folder_is_a_clear_error_and_cached_entries_still_serve(
    repo: Path, tmp_path: Path
) -> None:
    root = tmp_path / "cache"

    async def main() -> None:
        storage = CountingStorage(repo)
        cache = DiskCache(root, 10 << 20)
        a = await cache.fetch("a.tar.gz", storage)
        with read_only(root):
            with pytest.raises(CacheFullError, match=rf"model cache folder {root} cannot be written .*'b.tar.gz'"):
                await cache.fetch("b.tar.gz", storage)
            assert await cache.fetch("a.tar.gz", storage) == a
            write_archive(repo / "a.tar.gz", "a", b"v2")  # a new version cannot be stored: the old serves
            assert await cache.fetch("a.tar.gz", storage) == a
        assert (await cache.fetch("b.tar.gz", storage)).exists()
        assert await cache.fetch("a.tar.gz", storage) != a
        await cache.close()
        assert leftovers(root) == []

    run(main())


def test_a_cache_folder_that_cannot_be_created_is_a_clear_error(repo: Path, tmp_path: Path) -> None:
    parent = tmp_path / "parent"
    parent.mkdir()

    async def main() -> None:
        cache = DiskCache(parent / "cache", 10 << 20)
        refused = pytest.raises(CacheFullError, match=rf"model cache folder {parent / 'cache'} cannot be written")
        with read_only(parent), refused:
            await cache.fetch("a.tar.gz", CountingStorage(repo))
        assert (await cache.fetch("a.tar.gz", CountingStorage(repo))).exists()
        await cache.close()

    run(main())


def test_a_file_size_limit_mid_download_is_a_full_cache(repo: Path, tmp_path: Path) -> None:
    write_archive(repo / "big.tar.gz", "big", os.urandom(3 << 20))

    async def main() -> None:
        storage = CountingStorage(repo)
        cache = DiskCache(tmp_path / "cache", 64 << 20)
        full = pytest.raises(CacheFullError, match=r"model cache folder .* is full: cannot fetch 'big.tar.gz'")
        with file_size_limit(os.getpid(), 1 << 20), full:
            await cache.fetch("big.tar.gz", storage)
        assert leftovers(tmp_path / "cache") == [] and cache.bytes_reserved == 0
        assert (await cache.fetch("big.tar.gz", storage)).exists()
        await cache.close()

    run(main())


def test_object_keys_the_filesystem_refuses_are_invalid(tmp_path: Path) -> None:
    async def main() -> None:
        cache = DiskCache(tmp_path / "cache", 10 << 20)
        storage = CountingStorage(tmp_path)
        for key in ("x" * 300 + ".tar.gz", "a\x00b.tar.gz", "../up.tar.gz"):
            with pytest.raises(InvalidArgumentError, match="invalid storage key"):
                await cache.fetch(key, storage)
        await cache.close()

    run(main())


class GatedStorage(CountingStorage):
    """Answers stat/list only while ``gate`` is set (a store that hangs until the test says)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.gate.set()

    def stat(self, key: str) -> StoredObject:
        self.gate.wait()
        return super().stat(key)

    def list(self, prefix: str = "") -> list[StoredObject]:
        self.gate.wait()
        return super().list(prefix)


async def _until(condition: object, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_check_later_serves_a_confirmed_copy_at_once_and_the_next_fetch_gets_a_new_upload(
    repo: Path, tmp_path: Path
) -> None:
    async def main() -> None:
        storage = GatedStorage(repo)
        cache = DiskCache(tmp_path / "cache", 10 << 20)
        first = await cache.fetch("a.tar.gz", storage)  # asked the store: confirmed current
        storage.gate.clear()  # the store hangs: a fetch that asked first would wait for it
        lease = await asyncio.wait_for(cache.acquire("a.tar.gz", storage, check_later=True), 5)
        assert lease.path == first and cache.stats.checked_later == 1 and cache.stats.stale_hits == 0
        write_archive(repo / "a.tar.gz", "a", b"new weights")
        os.utime(repo / "a.tar.gz", ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
        storage.gate.set()
        lease.loaded()  # the model is loaded: the background check starts, learns of the new version
        await _until(lambda: cache.stats.outdated == 1)
        new = await cache.acquire("a.tar.gz", storage, check_later=True)
        assert new.path != first and (new.path / "a/1/model.bin").read_bytes() == b"new weights"
        assert lease.path.exists()  # the old copy stays while a model holds it
        lease.release()
        new.release()
        await cache.close()
        assert storage.downloads == 2

    run(main())


def test_a_confirmed_copy_is_checked_and_handed_out_to_concurrent_callers_and_a_damaged_one_is_fetched_again(
    repo: Path, tmp_path: Path
) -> None:
    """A copy confirmed current is handed out without a flight of its own (its files checked
    on the ``run`` given: the server's load threads): callers arriving together each get it
    pinned, and it stays while any holds it. One whose files changed is fetched again."""
    ran: list[str] = []

    async def on_thread(fn: Any, *args: Any) -> Any:
        ran.append(getattr(getattr(fn, "func", fn), "__name__", "?"))
        return await asyncio.to_thread(fn, *args)

    async def main() -> None:
        storage = GatedStorage(repo)
        cache = DiskCache(tmp_path / "cache", 10 << 20, run=on_thread)
        first = await cache.fetch("a.tar.gz", storage)
        storage.gate.clear()  # nothing may ask the store meanwhile
        leases = await asyncio.wait_for(
            asyncio.gather(*(cache.acquire("a.tar.gz", storage, check_later=True) for _ in range(3))), 5
        )
        assert {lease.path for lease in leases} == {first} and cache.stats.checked_later == 3
        assert ran and set(ran) == {"check_tree"}
        assert cache.entries()[0][3] == 3  # pinned once per caller
        for lease in leases:
            lease.release()
        assert cache.entries()[0][3] == 0
        (first / "a" / "1" / "model.bin").write_bytes(b"changed on disk")
        storage.gate.set()
        again = await asyncio.wait_for(cache.acquire("a.tar.gz", storage, check_later=True), 5)
        assert again.path != first and cache.stats.damaged == 1 and storage.downloads == 2
        assert (again.path / "a/1/model.bin").read_bytes() != b"changed on disk"
        again.release()
        await cache.close()

    run(main())


def test_check_later_asks_first_for_a_copy_not_confirmed_by_this_process_or_expired(repo: Path, tmp_path: Path) -> None:
    async def main() -> None:
        storage = GatedStorage(repo)
        earlier = DiskCache(tmp_path / "cache", 10 << 20)
        await earlier.fetch("a.tar.gz", storage)
        await earlier.close()
        cache = DiskCache(tmp_path / "cache", 10 << 20, revalidate_timeout=0.3)
        storage.gate.clear()
        # On disk from before the start: asked first (the hung store times out: stale hit).
        (await cache.acquire("a.tar.gz", storage, check_later=True)).release()
        assert (cache.stats.stale_hits, cache.stats.checked_later) == (1, 0)
        storage.gate.set()
        (await cache.acquire("a.tar.gz", storage)).release()  # confirmed now
        (await cache.acquire("a.tar.gz", storage, check_later=True)).release()
        assert cache.stats.checked_later == 1
        cache.expire("a.tar.gz")  # e.g. unloaded through the repository API
        storage.gate.clear()
        (await cache.acquire("a.tar.gz", storage, check_later=True)).release()
        assert (cache.stats.stale_hits, cache.stats.checked_later) == (2, 1)
        storage.gate.set()
        await cache.close()

    run(main())


def test_a_key_found_gone_in_the_background_is_not_found_at_the_next_fetch(repo: Path, tmp_path: Path) -> None:
    async def main() -> None:
        storage = GatedStorage(repo)
        cache = DiskCache(tmp_path / "cache", 10 << 20)
        first = await cache.fetch("a.tar.gz", storage)
        (repo / "a.tar.gz").unlink()
        lease = await cache.acquire("a.tar.gz", storage, check_later=True)
        assert lease.path == first
        await asyncio.sleep(0.05)
        assert cache.stats.outdated == 0  # nothing asked before the model is loaded
        lease.loaded()
        await _until(lambda: cache.stats.outdated == 1)
        with pytest.raises(NotFoundError):
            await cache.acquire("a.tar.gz", storage, check_later=True)
        lease.release()
        await cache.close()
        assert cache.entries() == [] and not first.exists()

    run(main())


class Recording(CountingStorage):
    """Counts stat calls and records the cache's reserved bytes once a download has started."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.stats = 0
        self.cache: DiskCache | None = None
        self.reserved_at_start: list[int] = []

    def stat(self, key: str) -> StoredObject:
        self.stats += 1
        return super().stat(key)

    def download(
        self, key: str, dest: Path, *, etag: str | None = None, on_start: OnStart | None = None
    ) -> Downloaded:
        def started(obj: StoredObject) -> None:
            if on_start is not None:
                on_start(obj)
            assert self.cache is not None
            self.reserved_at_start.append(self.cache.bytes_reserved)

        return super().download(key, dest, etag=etag, on_start=started)


def test_an_archive_not_on_disk_is_fetched_with_one_get_and_its_room_reserved_before_the_body(
    repo: Path, tmp_path: Path
) -> None:
    async def main() -> None:
        storage = Recording(repo)
        cache = storage.cache = DiskCache(tmp_path / "cache", 10 << 20)
        path = await cache.fetch("a.tar.gz", storage)
        size = (repo / "a.tar.gz").stat().st_size
        assert storage.stats == 0  # no HEAD first: the GET named the version
        assert storage.reserved_at_start == [size] and cache.bytes_reserved == 0
        ((key, version, _, _),) = cache.entries()
        assert key == "a.tar.gz" and version == f"{storage.stat('a.tar.gz').etag}:{size}"
        # Fetched again: the store is asked for the version, which matches: no download.
        assert await cache.fetch("a.tar.gz", storage) == path
        assert (storage.downloads, cache.stats.hits, cache.stats.misses) == (1, 1, 1)
        with pytest.raises(NotFoundError):
            await cache.fetch("missing.tar.gz", storage)
        assert leftovers(tmp_path / "cache") == [] and cache.bytes_reserved == 0
        await cache.close()

    run(main())
