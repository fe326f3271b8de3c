"""The on-disk model cache: download, verify, extract safely, rename into place, evict LRU.

Layout under ``root``::

    .lock                      held (flock) by the process using the cache
    <name>/entry.json          a complete entry: key, version, bytes
    <name>/content/            the model folder, or a Triton repository folder
    .tmp-*                     work in progress: never trusted, deleted at start

An entry appears under its final name only by an atomic ``rename`` of a folder that is
complete (downloaded, verified, extracted, manifest written), so a crash at any moment
leaves complete entries and ``.tmp-*`` names, which the next :meth:`DiskCache.start`
deletes. A folder without a readable manifest is deleted too.

An entry is identified by storage location + key + version, the version being the
object's ETag and size (an archive) or a digest of every member's key, ETag and size (a
folder of objects). A fetch asks the storage for the current version each time (one HEAD
or LIST), so a new upload under the same key is fetched anew and the old entry is dropped
as soon as nothing pins it. If the store is unavailable and an entry for the key exists,
that entry is served (with a warning); a key that is gone from the store is
:class:`NotFoundError` and its entries are dropped.

Single flight: concurrent fetches of one key share one resolution and one download. All
disk and network work runs in threads (``asyncio.to_thread``); the event loop only keeps
the index. The byte budget counts extracted content (archives are deleted after
extraction) plus reservations for downloads in flight; entries that are not pinned are
evicted least recently used first. A model loaded from an entry must hold a
:class:`CacheLease` (from :meth:`DiskCache.acquire` or :meth:`DiskCache.pin`) so its files
are never evicted under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import IO

from quiver.errors import InternalError, InvalidArgumentError, NotFoundError, UnavailableError
from quiver.repository.archive import ExtractLimits, copy_folder, extract_archive
from quiver.repository.storage import (
    LocalStorage,
    Storage,
    StoredObject,
    check_key,
    is_archive_key,
)

logger = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"
MANIFEST = "entry.json"
CONTENT = "content"
LOCK = ".lock"
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


class CacheFullError(UnavailableError):
    """The entry does not fit even after evicting every entry that is not pinned.

    The SageMaker routes answer this with 507 (the status that tells SageMaker to make room).
    """


@dataclass(slots=True)
class CacheStats:
    """Counters for metrics; plain attributes, read them any time.

    ``hits``/``misses`` count resolutions (N concurrent fetches of one key that share one
    download count one miss and N-1 ``joined``). ``download_ns`` is the total time spent
    downloading (extraction excluded); ``on_download`` of :class:`DiskCache` gives each one.
    """

    hits: int = 0
    misses: int = 0
    joined: int = 0
    stale_hits: int = 0  # served from cache because the store was unavailable
    downloads: int = 0
    download_failures: int = 0
    bytes_downloaded: int = 0
    download_ns: int = 0
    evictions: int = 0
    evicted_bytes: int = 0


@dataclass(slots=True, eq=False)
class _Entry:
    ident: tuple[str, str]  # (storage location, key)
    version: str
    name: str
    root: Path
    bytes: int
    last_used: int
    pins: int = 0
    stale: bool = False

    @property
    def path(self) -> Path:
        return self.root / self.name / CONTENT


@dataclass(slots=True, eq=False)
class _Flight:
    task: asyncio.Task[_Entry]
    waiters: int = 1


class CacheLease:
    """A pin on one cache entry: its files stay on disk until :meth:`release`.

    Usable as a (sync or async) context manager; releasing twice is harmless.
    """

    def __init__(self, cache: DiskCache, entry: _Entry) -> None:
        self._cache = cache
        self._entry: _Entry | None = entry
        self.path = entry.path
        self.key = entry.ident[1]
        self.version = entry.version

    @property
    def released(self) -> bool:
        return self._entry is None

    def release(self) -> None:
        entry, self._entry = self._entry, None
        if entry is not None:
            self._cache._unpin(entry)

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    async def __aenter__(self) -> Path:
        return self.path

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"CacheLease({self.key!r}, {str(self.path)!r}, released={self.released})"


def is_model_folder(path: Path) -> bool:
    """True when ``path`` is one model's folder (config.pbtxt or a numeric version folder),
    False when it is a repository of model folders (SageMaker archives hold either)."""
    if (path / "config.pbtxt").is_file():
        return True
    return any(p.name.isdigit() and p.is_dir() for p in path.iterdir())


def _safe_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", key).lstrip(".")[:80] or "model"


def _tree_bytes(path: Path) -> int:
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


class DiskCache:
    """Model files on local disk under a byte budget; see the module docstring.

    ``max_bytes`` bounds the extracted content of all entries plus downloads in flight.
    ``limits`` caps each extraction (its byte cap is never above ``max_bytes``: an entry
    larger than the whole cache could never be kept).
    ``on_download(key, bytes, duration_ns)`` is called on the event loop after each
    successful download, for a histogram.
    """

    def __init__(
        self,
        root: Path | str,
        max_bytes: int,
        *,
        limits: ExtractLimits | None = None,
        on_download: Callable[[str, int, int], None] | None = None,
    ) -> None:
        if max_bytes <= 0:
            raise InvalidArgumentError(f"model cache size must be positive, got {max_bytes}")
        self.root = Path(root).absolute()
        self.max_bytes = max_bytes
        limits = limits or ExtractLimits()
        self.limits = replace(limits, max_bytes=min(limits.max_bytes, max_bytes))
        self.on_download = on_download
        self.stats = CacheStats()
        self._entries: dict[tuple[tuple[str, str], str], _Entry] = {}
        self._flights: dict[tuple[str, str], _Flight] = {}
        self._reserved = 0
        self._tick = 0
        self._lock_file: IO[bytes] | None = None
        self._started = False
        self._start_lock: asyncio.Lock | None = None
        self._background: set[asyncio.Task[None]] = set()

    # -- state -------------------------------------------------------------------------------

    @property
    def bytes_used(self) -> int:
        """Bytes of extracted content in the cache (entries awaiting deletion included)."""
        return sum(e.bytes for e in self._entries.values())

    @property
    def bytes_reserved(self) -> int:
        """Bytes reserved by downloads in flight."""
        return self._reserved

    def entries(self) -> list[tuple[str, str, int, int]]:
        """(key, version, bytes, pins) of every entry, least recently used first."""
        ordered = sorted(self._entries.values(), key=lambda e: e.last_used)
        return [(e.ident[1], e.version, e.bytes, e.pins) for e in ordered]

    def _touch(self, entry: _Entry) -> None:
        self._tick += 1
        entry.last_used = self._tick

    # -- start and stop ----------------------------------------------------------------------

    async def start(self) -> None:
        """Lock the folder, delete leftovers of earlier runs, index the complete entries.

        Called by the first fetch if not called before. Raises :class:`InvalidArgumentError`
        if another process holds the folder.
        """
        if self._started:
            return
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._started:
                return
            found = await asyncio.to_thread(self._open)
            for entry in found:
                self._touch(entry)
                self._entries[(entry.ident, entry.version)] = entry
            self._started = True
            logger.info(
                "model cache %s: %d entries, %d of %d bytes",
                self.root, len(found), self.bytes_used, self.max_bytes,
            )
            if self.bytes_used > self.max_bytes:
                self._evict_for(0)

    def _open(self) -> list[_Entry]:
        self.root.mkdir(parents=True, exist_ok=True)
        lock = open(self.root / LOCK, "wb")  # noqa: SIM115 - held until close()
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise InvalidArgumentError(
                f"model cache folder '{self.root}' is in use by another process"
            ) from None
        self._lock_file = lock
        found: list[tuple[float, _Entry]] = []
        for child in sorted(self.root.iterdir()):
            if child.name == LOCK:
                continue
            if child.name.startswith(TMP_PREFIX):
                logger.info("model cache: deleting leftover %s", child)
                _remove(child)
                continue
            entry = self._read_manifest(child)
            if entry is None:
                logger.warning("model cache: deleting %s, which is not a complete entry", child)
                _remove(child)
                continue
            found.append(((child / MANIFEST).stat().st_mtime, entry))
        found.sort(key=lambda pair: pair[0])
        return [entry for _, entry in found]

    def _read_manifest(self, folder: Path) -> _Entry | None:
        try:
            data = json.loads((folder / MANIFEST).read_text())
            if not (folder / CONTENT).is_dir():
                return None
            return _Entry(
                ident=(str(data["location"]), str(data["key"])),
                version=str(data["version"]),
                name=folder.name,
                root=self.root,
                bytes=int(data["bytes"]),
                last_used=0,
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    async def close(self) -> None:
        """Wait for background deletions and release the folder lock."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None
        self._started = False

    # -- fetching ------------------------------------------------------------------------------

    async def fetch(self, key: str, storage: Storage) -> Path:
        """The local folder for ``key`` (downloaded and extracted on a miss). Not pinned:
        use :meth:`acquire` when the files must stay while in use."""
        entry = await self._get(key, storage)
        path = entry.path
        self._unpin(entry)
        return path

    async def acquire(self, key: str, storage: Storage) -> CacheLease:
        """Fetch ``key`` and pin its entry until the returned lease is released."""
        return CacheLease(self, await self._get(key, storage))

    def pin(self, key: str, storage: Storage | str) -> CacheLease:
        """Pin the newest cached entry of ``key`` without asking the storage;
        :class:`NotFoundError` if none is cached."""
        location = storage if isinstance(storage, str) else storage.location
        candidates = [
            e for e in self._entries.values() if e.ident == (location, key) and not e.stale
        ]
        if not candidates:
            raise NotFoundError(f"'{key}' from {location} is not in the model cache")
        entry = max(candidates, key=lambda e: e.last_used)
        entry.pins += 1
        self._touch(entry)
        return CacheLease(self, entry)

    async def _get(self, key: str, storage: Storage) -> _Entry:
        """The entry for ``key``, pinned once for the caller."""
        check_key(key)
        await self.start()
        ident = (storage.location, key.rstrip("/"))
        flight = self._flights.get(ident)
        if flight is None:
            flight = _Flight(asyncio.get_running_loop().create_task(self._resolve_and_fetch(ident, storage)))
            self._flights[ident] = flight
            task = flight.task
            task.add_done_callback(lambda t: self._flight_done(ident, t))
        else:
            flight.waiters += 1
            self.stats.joined += 1
        try:
            return await asyncio.shield(flight.task)
        except asyncio.CancelledError:
            if flight.task.done() and not flight.task.cancelled() and flight.task.exception() is None:
                self._unpin(flight.task.result())  # it was pinned for us when it finished
            else:
                flight.waiters -= 1
            raise

    def _flight_done(self, ident: tuple[str, str], task: asyncio.Task[_Entry]) -> None:
        flight = self._flights.get(ident)
        if flight is not None and flight.task is task:
            del self._flights[ident]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter sees it, none may be left to

    def _finish(self, ident: tuple[str, str], entry: _Entry) -> _Entry:
        """Pin ``entry`` once per waiter (in the same step the result is set)."""
        flight = self._flights[ident]
        entry.pins += flight.waiters
        self._touch(entry)
        return entry

    async def _resolve_and_fetch(self, ident: tuple[str, str], storage: Storage) -> _Entry:
        key = ident[1]
        try:
            version, objects = await asyncio.to_thread(_resolve, storage, key)
        except NotFoundError:
            self._drop_versions(ident, keep=None)
            raise
        except UnavailableError as exc:
            cached = [e for e in self._entries.values() if e.ident == ident and not e.stale]
            if not cached:
                raise
            entry = max(cached, key=lambda e: e.last_used)
            logger.warning("serving '%s' from the model cache: the store is unavailable: %s", key, exc)
            self.stats.stale_hits += 1
            return self._finish(ident, entry)
        self._drop_versions(ident, keep=version)
        hit = self._entries.get((ident, version))
        if hit is not None:
            self.stats.hits += 1
            return self._finish(ident, hit)
        self.stats.misses += 1
        entry = await self._download(ident, version, objects, storage)
        return self._finish(ident, entry)

    async def _download(
        self, ident: tuple[str, str], version: str, objects: list[StoredObject], storage: Storage
    ) -> _Entry:
        key = ident[1]
        need = sum(o.size for o in objects)
        self._evict_for(need, key=key)
        self._reserved += need
        tmp = self.root / f"{TMP_PREFIX}{uuid.uuid4().hex}"
        built: _Built | None = None
        try:
            built = await asyncio.to_thread(self._build, tmp, key, objects, storage)
            self.stats.downloads += 1
            self.stats.bytes_downloaded += built.downloaded
            self.stats.download_ns += built.download_ns
            if self.on_download is not None:
                self.on_download(key, built.downloaded, built.download_ns)
        except BaseException:
            self.stats.download_failures += 1
            self._reserved -= need
            await asyncio.to_thread(_remove, tmp)
            raise
        self._reserved -= need
        try:
            self._evict_for(built.bytes, key=key)
            name = f"{_safe_name(key)}-{hashlib.sha256(repr((ident, version)).encode()).hexdigest()[:16]}"
            await asyncio.to_thread(self._commit, tmp, name, ident, version, built.bytes)
        except BaseException:
            await asyncio.to_thread(_remove, tmp)
            raise
        entry = _Entry(ident, version, name, self.root, built.bytes, 0)
        self._entries[(ident, version)] = entry
        logger.info(
            "model cache: fetched '%s' from %s (%d bytes in %.3fs, %d bytes on disk)",
            key, storage.location, built.downloaded, built.download_ns / 1e9, built.bytes,
        )
        return entry

    # -- blocking work (threads) -----------------------------------------------------------------

    def _build(self, tmp: Path, key: str, objects: list[StoredObject], storage: Storage) -> _Built:
        content = tmp / CONTENT
        try:
            content.mkdir(parents=True)
            start = time.monotonic_ns()
            if is_archive_key(key):
                (obj,) = objects
                part = tmp / "archive.tar.gz"
                _download_verified(storage, obj, part)
                download_ns = time.monotonic_ns() - start
                extract_archive(part, content, limits=self.limits, name=key)
                part.unlink()
            elif isinstance(storage, LocalStorage):
                copy_folder(storage.root / key, content, limits=self.limits)
                download_ns = time.monotonic_ns() - start
            else:
                for files, obj in enumerate(objects, 1):
                    rel = obj.key[len(key) + 1 :]
                    check_key(rel)
                    if files > self.limits.max_files:
                        raise InvalidArgumentError(f"model '{key}' has more than {self.limits.max_files} files")
                    dest = content / rel
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    _download_verified(storage, obj, dest)
                download_ns = time.monotonic_ns() - start
            return _Built(sum(o.size for o in objects), download_ns, _tree_bytes(content))
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise CacheFullError(
                    f"disk full while fetching '{key}' into the model cache {self.root}: {exc}"
                ) from None
            raise UnavailableError(f"cannot fetch '{key}' into the model cache {self.root}: {exc}") from exc

    def _commit(self, tmp: Path, name: str, ident: tuple[str, str], version: str, size: int) -> None:
        manifest = {"location": ident[0], "key": ident[1], "version": version, "bytes": size}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        final = self.root / name
        if final.exists():  # a same-version entry deleted from the index but not yet from disk
            _remove(final)
        os.rename(tmp, final)
        with contextlib.suppress(OSError):
            dir_fd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    # -- eviction ------------------------------------------------------------------------------

    def _evict_for(self, need: int, *, key: str | None = None) -> None:
        """Evict unpinned entries, least recently used first, until ``need`` more bytes fit."""
        used = self.bytes_used + self._reserved
        if used + need <= self.max_bytes:
            return
        victims: list[_Entry] = []
        for entry in sorted(self._entries.values(), key=lambda e: e.last_used):
            if used + need <= self.max_bytes:
                break
            if entry.pins == 0:
                victims.append(entry)
                used -= entry.bytes
        if used + need > self.max_bytes:
            pinned = sum(e.bytes for e in self._entries.values() if e.pins)
            raise CacheFullError(
                f"model cache {self.root} cannot hold '{key}': it needs {need} bytes, the cache "
                f"holds {self.max_bytes}, {pinned} are used by models in use and {self._reserved} "
                f"by downloads in flight"
            )
        for entry in victims:
            logger.info("model cache: evicting '%s' (%d bytes)", entry.ident[1], entry.bytes)
            self.stats.evictions += 1
            self.stats.evicted_bytes += entry.bytes
            self._delete(entry)

    def _drop_versions(self, ident: tuple[str, str], keep: str | None) -> None:
        for entry in [e for e in self._entries.values() if e.ident == ident and e.version != keep]:
            entry.stale = True
            if entry.pins == 0:
                self._delete(entry)

    def _unpin(self, entry: _Entry) -> None:
        if entry.pins <= 0:
            raise InternalError(f"model cache: unbalanced unpin of '{entry.ident[1]}'")
        entry.pins -= 1
        if entry.pins == 0 and entry.stale:
            self._delete(entry)

    def _delete(self, entry: _Entry) -> None:
        """Forget ``entry`` now; rename its folder to a temporary name, then delete it, in a thread."""
        self._entries.pop((entry.ident, entry.version), None)
        folder = self.root / entry.name
        trash = self.root / f"{TMP_PREFIX}{uuid.uuid4().hex}"

        def work() -> None:
            with contextlib.suppress(FileNotFoundError):
                os.rename(folder, trash)
            _remove(trash)

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            work()
            return
        task = loop.create_task(asyncio.to_thread(work))
        self._background.add(task)
        task.add_done_callback(self._background.discard)


@dataclass(frozen=True, slots=True)
class _Built:
    downloaded: int
    download_ns: int
    bytes: int


def _resolve(storage: Storage, key: str) -> tuple[str, list[StoredObject]]:
    """The current version of ``key`` and the objects to fetch (blocking)."""
    if is_archive_key(key):
        obj = storage.stat(key)
        return f"{obj.etag}:{obj.size}", [obj]
    objects = storage.list(key + "/")
    if not objects:
        raise NotFoundError(f"model '{key}' not found in {storage.location}")
    digest = hashlib.sha256()
    for obj in objects:
        digest.update(f"{obj.key}\0{obj.size}\0{obj.etag}\n".encode())
    return f"tree:{digest.hexdigest()[:32]}:{sum(o.size for o in objects)}", objects


def _download_verified(storage: Storage, obj: StoredObject, dest: Path) -> None:
    """Download ``obj`` to ``dest`` and check its size (and MD5 when the ETag is one)."""
    got = storage.download(obj.key, dest, etag=obj.etag or None)
    on_disk = dest.stat().st_size
    if got.object.size != obj.size or on_disk != obj.size:
        raise UnavailableError(
            f"'{obj.key}' from {storage.location}: got {on_disk} bytes, expected {obj.size}"
        )
    if obj.md5 is not None and got.md5 != obj.md5:
        raise UnavailableError(
            f"'{obj.key}' from {storage.location}: content MD5 {got.md5} does not match "
            f"ETag {obj.md5}"
        )
