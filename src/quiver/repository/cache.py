"""The on-disk model cache: download, verify, extract safely, rename into place, evict LRU.

Layout under ``root``::

    .lock                      held (flock) by the process using the cache
    <name>/entry.json          a complete entry: key, version, bytes, and its file manifest
    <name>/content/            the model folder, or a Triton repository folder
    .tmp-*                     work in progress: never trusted, deleted at start

An entry appears under its final name only by an atomic ``rename`` of a folder that is
complete (downloaded, verified, extracted, manifest written), so a crash at any moment
leaves complete entries and ``.tmp-*`` names, which the next :meth:`DiskCache.start`
deletes. A folder without a readable manifest (or with one from before manifests listed
files) is deleted too. Folder names carry a random suffix, so a fresh copy of a key never
lands on a folder a loaded model still holds.

An entry is identified by storage location + key + version, the version being the
object's ETag and size (an archive) or a digest of every member's key, ETag and size (a
folder of objects). A fetch asks the storage for the current version each time (one HEAD
or LIST), so a new upload under the same key is fetched anew and the old entry is dropped
as soon as nothing pins it. When the key has an entry on disk, that question is bounded by
``revalidate_timeout`` (one attempt, separate from the download's retries and timeouts):
a store that is down, hung or slow, or a new version that cannot be downloaded, leaves the
cached entry served with a warning (:attr:`CacheStats.stale_hits`). A key that is gone from
the store is :class:`NotFoundError` and its entries are dropped.

The manifest lists every file, folder and link of ``content/``: for a file its size and
SHA-256, and the ``(inode, mtime_ns, ctime_ns)`` it had when written. Before an entry is
handed out it is checked: on every fetch, the tree is walked and each file's ``lstat``
compared with the manifest (tens of microseconds for a model's handful of files); a file
whose stat differs is hashed and compared (same content: its new stat is recorded); the
first fetch of an entry after start-up hashes every file, since nothing watched the folder
while no process held it. An entry with a file missing, added, resized or changed is
dropped and fetched again (:attr:`CacheStats.damaged`); one still pinned by a loaded model
stays on disk for it (the model runs from memory) but is never handed out again, and the
next fetch downloads into a new entry. ``README.md`` quotes the measured costs.

A cache folder that cannot be written (read-only, no permission, disk or quota full) is a
:class:`CacheFullError` naming the folder, whichever step failed (creating the temporary
folder, downloading, extracting, writing the manifest, renaming); entries already on disk
keep being served.

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
import stat as stat_mod
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from quiver.errors import (
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    QuiverError,
    UnavailableError,
)
from quiver.repository.archive import ExtractLimits, copy_folder, extract_archive
from quiver.repository.names import check_key
from quiver.repository.storage import (
    LocalStorage,
    S3Storage,
    Storage,
    StoredObject,
    is_archive_key,
)

logger = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"
MANIFEST = "entry.json"
CONTENT = "content"
LOCK = ".lock"
#: The manifest layout this module writes; older ones (without the file list) are dropped.
MANIFEST_FORMAT = 2
#: Seconds a fetch of a key already on disk waits for the store's answer before serving the
#: cached entry (``--model-cache-revalidate-timeout``).
DEFAULT_REVALIDATE_TIMEOUT = 3.0
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_NOT_WRITABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
_HASH_CHUNK = 1 << 20


class CacheFullError(UnavailableError):
    """The cache cannot take the entry: it does not fit even after evicting every entry that
    is not pinned, or the cache folder cannot be written (disk or quota full, read-only, no
    permission). The message names the folder.

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
    stale_hits: int = 0  # served from cache because the store was unavailable or slow
    damaged: int = 0  # entries found changed or incomplete on disk, dropped and fetched again
    downloads: int = 0
    download_failures: int = 0
    bytes_downloaded: int = 0
    download_ns: int = 0
    evictions: int = 0
    evicted_bytes: int = 0


@dataclass(slots=True)
class _Record:
    """One path under an entry's ``content/`` as the manifest knows it."""

    kind: str  # "file", "dir" or "link"
    size: int = 0
    sha256: str = ""
    target: str = ""  # a link's target
    stat: tuple[int, int, int] = (0, 0, 0)  # a file's (inode, mtime_ns, ctime_ns)

    def to_json(self, path: str) -> dict[str, Any]:
        out: dict[str, Any] = {"path": path, "type": self.kind}
        if self.kind == "file":
            out.update(size=self.size, sha256=self.sha256, stat=list(self.stat))
        elif self.kind == "link":
            out["target"] = self.target
        return out

    @classmethod
    def from_json(cls, item: dict[str, Any]) -> tuple[str, _Record]:
        kind = str(item["type"])
        if kind == "file":
            ino, mtime, ctime = (int(v) for v in item["stat"])
            record = cls(kind, int(item["size"]), str(item["sha256"]), stat=(ino, mtime, ctime))
        elif kind == "link":
            record = cls(kind, target=str(item["target"]))
        elif kind == "dir":
            record = cls(kind)
        else:
            raise ValueError(kind)
        return str(item["path"]), record


@dataclass(slots=True, eq=False)
class _Entry:
    ident: tuple[str, str]  # (storage location, key)
    version: str
    name: str
    root: Path
    bytes: int
    last_used: int
    files: dict[str, _Record] = field(default_factory=dict)
    pins: int = 0
    stale: bool = False  # replaced, gone or damaged: never handed out again
    verified: bool = False  # hashed in full by this process

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


def _remove(path: Path) -> None:
    """Delete a file or folder tree; failures (a read-only folder) are logged, not raised."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("model cache: cannot delete %s: %s", path, exc)


# -- the manifest: what an entry's content is --------------------------------------------------


def _walk(content: Path) -> Iterator[tuple[str, os.stat_result]]:
    """(relative path, lstat) of everything under ``content``; links are not followed."""
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        with os.scandir(content / rel_dir if rel_dir else content) as entries:
            for entry in entries:
                rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                st = entry.stat(follow_symlinks=False)
                yield rel, st
                if stat_mod.S_ISDIR(st.st_mode):
                    stack.append(rel)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _file_stat(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def record_tree(content: Path) -> dict[str, _Record]:
    """The manifest of ``content``: every file hashed (blocking)."""
    records: dict[str, _Record] = {}
    for rel, st in _walk(content):
        if stat_mod.S_ISDIR(st.st_mode):
            records[rel] = _Record("dir")
        elif stat_mod.S_ISLNK(st.st_mode):
            records[rel] = _Record("link", target=os.readlink(content / rel))
        elif stat_mod.S_ISREG(st.st_mode):
            records[rel] = _Record("file", st.st_size, _sha256(content / rel), stat=_file_stat(st))
        else:
            raise InvalidArgumentError(f"'{rel}' is not a file, folder or link")
    return records


def check_tree(
    content: Path, records: dict[str, _Record], *, deep: bool
) -> tuple[str, dict[str, _Record]]:
    """Compare ``content`` with its manifest (blocking). Returns the first problem found
    ('' when none) and the file records whose stat changed while their content did not.

    Every path is ``lstat``-ed; a file is hashed when ``deep`` or when its size, inode,
    mtime or ctime differ from the manifest's."""
    refreshed: dict[str, _Record] = {}
    seen = 0
    try:
        for rel, st in _walk(content):
            record = records.get(rel)
            if record is None:
                return f"'{rel}' was added", {}
            seen += 1
            mode = st.st_mode
            if record.kind == "dir":
                if not stat_mod.S_ISDIR(mode):
                    return f"'{rel}' is no longer a folder", {}
            elif record.kind == "link":
                if not stat_mod.S_ISLNK(mode) or os.readlink(content / rel) != record.target:
                    return f"link '{rel}' was changed", {}
            elif not stat_mod.S_ISREG(mode):
                return f"'{rel}' is no longer a regular file", {}
            elif st.st_size != record.size:
                return f"'{rel}' is {st.st_size} bytes, the manifest says {record.size}", {}
            elif deep or _file_stat(st) != record.stat:
                if _sha256(content / rel) != record.sha256:
                    return f"the content of '{rel}' changed (SHA-256 differs)", {}
                if _file_stat(st) != record.stat:
                    refreshed[rel] = _Record("file", record.size, record.sha256, stat=_file_stat(st))
    except FileNotFoundError as exc:
        if not content.is_dir():
            return f"its folder {content} is gone", {}
        return f"'{exc.filename}' disappeared while being checked", {}
    except OSError as exc:
        return f"cannot read it: {exc}", {}
    if seen != len(records):
        missing = sorted(set(records) - {rel for rel, _ in _walk(content)})
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        return f"'{missing[0]}'{more} missing", {}
    return "", refreshed


class DiskCache:
    """Model files on local disk under a byte budget; see the module docstring.

    ``max_bytes`` bounds the extracted content of all entries plus downloads in flight.
    ``limits`` caps each extraction (its byte cap is never above ``max_bytes``: an entry
    larger than the whole cache could never be kept).
    ``on_download(key, bytes, duration_ns)`` is called on the event loop after each
    successful download, for a histogram. ``revalidate_timeout`` bounds the store's answer
    to "is this still the current version?" when the key has an entry on disk.
    """

    def __init__(
        self,
        root: Path | str,
        max_bytes: int,
        *,
        limits: ExtractLimits | None = None,
        on_download: Callable[[str, int, int], None] | None = None,
        revalidate_timeout: float = DEFAULT_REVALIDATE_TIMEOUT,
    ) -> None:
        if max_bytes <= 0:
            raise InvalidArgumentError(f"model cache size must be positive, got {max_bytes}")
        if not revalidate_timeout > 0:
            raise InvalidArgumentError(
                f"model cache revalidation timeout must be positive, got {revalidate_timeout}"
            )
        self.root = Path(root).absolute()
        self.max_bytes = max_bytes
        limits = limits or ExtractLimits()
        self.limits = replace(limits, max_bytes=min(limits.max_bytes, max_bytes))
        self.on_download = on_download
        self.revalidate_timeout = revalidate_timeout
        self.stats = CacheStats()
        self._entries: dict[str, _Entry] = {}  # folder name -> entry (stale ones until unpinned)
        self._live: dict[tuple[tuple[str, str], str], _Entry] = {}  # (ident, version) -> entry
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

    def _add(self, entry: _Entry) -> None:
        self._entries[entry.name] = entry
        self._live[(entry.ident, entry.version)] = entry

    def _newest(self, ident: tuple[str, str]) -> _Entry | None:
        """The most recently used entry of ``ident`` that may be handed out, any version."""
        found = [e for e in self._live.values() if e.ident == ident]
        return max(found, key=lambda e: e.last_used) if found else None

    # -- start and stop ----------------------------------------------------------------------

    async def start(self) -> None:
        """Lock the folder, delete leftovers of earlier runs, index the complete entries.

        Called by the first fetch if not called before. Raises :class:`InvalidArgumentError`
        if another process holds the folder, :class:`CacheFullError` if it cannot be written.
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
                self._add(entry)
            self._started = True
            logger.info(
                "model cache %s: %d entries, %d of %d bytes",
                self.root, len(found), self.bytes_used, self.max_bytes,
            )
            if self.bytes_used > self.max_bytes:
                self._evict_for(0)

    def _open(self) -> list[_Entry]:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            lock = open(self.root / LOCK, "wb")  # noqa: SIM115 - held until close()
        except OSError as exc:
            raise self._os_error(exc, "cannot open it") from None
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
                logger.warning(
                    "model cache: deleting %s, which is not a complete entry (or has no file "
                    "manifest)", child,
                )
                _remove(child)
                continue
            found.append(((child / MANIFEST).stat().st_mtime, entry))
        found.sort(key=lambda pair: pair[0])
        return [entry for _, entry in found]

    def _read_manifest(self, folder: Path) -> _Entry | None:
        try:
            data = json.loads((folder / MANIFEST).read_text())
            if data.get("format") != MANIFEST_FORMAT or not (folder / CONTENT).is_dir():
                return None
            files = dict(_Record.from_json(item) for item in data["files"])
            return _Entry(
                ident=(str(data["location"]), str(data["key"])),
                version=str(data["version"]),
                name=folder.name,
                root=self.root,
                bytes=int(data["bytes"]),
                last_used=0,
                files=files,
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    async def close(self) -> None:
        """Wait for background work (deletions, manifest updates) and release the folder lock."""
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
        """Pin the newest cached entry of ``key`` without asking the storage (nor checking
        its files); :class:`NotFoundError` if none is cached."""
        location = storage if isinstance(storage, str) else storage.location
        entry = self._newest((location, key))
        if entry is None:
            raise NotFoundError(f"'{key}' from {location} is not in the model cache")
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
        cached = self._newest(ident)
        try:
            if cached is None:
                version, objects = await asyncio.to_thread(_resolve, storage, key)
            else:
                version, objects = await self._revalidate(storage, key)
        except NotFoundError:
            self._drop_versions(ident, keep=None)
            raise
        except UnavailableError as exc:
            if cached is None:
                raise
            return await self._serve_stale(ident, exc)
        hit = self._live.get((ident, version))
        if hit is not None and await self._usable(hit):
            self._drop_versions(ident, keep=version)
            self.stats.hits += 1
            return self._finish(ident, hit)
        self.stats.misses += 1
        try:
            entry = await self._download(ident, version, objects, storage)
        except UnavailableError as exc:  # the store failed mid-way, or the folder is full
            if self._newest(ident) is None:
                raise
            return await self._serve_stale(ident, exc)
        self._drop_versions(ident, keep=version)
        return self._finish(ident, entry)

    async def _revalidate(self, storage: Storage, key: str) -> tuple[str, list[StoredObject]]:
        """The current version of ``key``, asked with one short attempt: UnavailableError
        when the store does not answer within ``revalidate_timeout``."""
        seconds = self.revalidate_timeout

        def ask() -> tuple[str, list[StoredObject]]:
            quick = storage.with_timeout(seconds) if isinstance(storage, S3Storage) else storage
            return _resolve(quick, key)

        try:
            return await asyncio.wait_for(asyncio.to_thread(ask), seconds)
        except TimeoutError:
            raise UnavailableError(
                f"{storage.location} did not answer within {seconds:g} s "
                "(--model-cache-revalidate-timeout)"
            ) from None

    async def _serve_stale(self, ident: tuple[str, str], why: UnavailableError) -> _Entry:
        """The newest intact entry of ``ident``, when the store cannot say or send what is
        current; ``why`` (with the damage found) when none is intact."""
        damage = ""
        while (entry := self._newest(ident)) is not None:
            if await self._usable(entry):
                logger.warning(
                    "serving '%s' from the model cache (%s, version %s): its current version "
                    "could not be checked or fetched: %s", ident[1], entry.path, entry.version,
                    why.message,
                )
                self.stats.stale_hits += 1
                return self._finish(ident, entry)
            damage = f"; the cached copy was damaged and is dropped ({entry.path})"
        raise UnavailableError(why.message + damage) from why

    async def _usable(self, entry: _Entry) -> bool:
        """Whether ``entry``'s files match its manifest (pinned while checked). A damaged
        entry is never handed out again (and deleted once nothing pins it)."""
        entry.pins += 1
        try:
            problem, refreshed = await asyncio.to_thread(
                check_tree, entry.path, entry.files, deep=not entry.verified
            )
        finally:
            self._unpin(entry)
        if entry.stale:
            return False
        if problem:
            self.stats.damaged += 1
            logger.warning(
                "model cache: the entry of '%s' in %s was changed or damaged: %s; %s",
                entry.ident[1], entry.path.parent, problem,
                "it is fetched again" if entry.pins == 0 else
                "the model loaded from it keeps it until unloaded; the next load fetches it again",
            )
            self._forget(entry)
            return False
        entry.verified = True
        if refreshed:
            entry.files.update(refreshed)
            manifest = self._manifest(entry)
            self._spawn(lambda: _rewrite_manifest(self.root / entry.name, manifest))
        return True

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
        digest = hashlib.sha256(repr((ident, version)).encode()).hexdigest()[:16]
        name = f"{_safe_name(key)}-{digest}-{uuid.uuid4().hex[:8]}"
        entry = _Entry(ident, version, name, self.root, built.bytes, 0, built.files, verified=True)
        try:
            self._evict_for(built.bytes, key=key)
            await asyncio.to_thread(self._commit, tmp, entry)
        except BaseException:
            await asyncio.to_thread(_remove, tmp)
            raise
        self._add(entry)
        logger.info(
            "model cache: fetched '%s' from %s (%d bytes in %.3fs, %d bytes on disk, "
            "%d files hashed in %.3fs)",
            key, storage.location, built.downloaded, built.download_ns / 1e9, built.bytes,
            sum(1 for r in built.files.values() if r.kind == "file"), built.hash_ns / 1e9,
        )
        return entry

    def _os_error(self, exc: OSError, doing: str) -> QuiverError:
        """A Quiver error for ``exc`` raised while working in the cache folder: a full or
        unwritable folder is a CacheFullError naming it."""
        # A file under the cache folder, or named relative to a folder descriptor in it (the
        # extraction writes with openat), or none (a write to an open file).
        filename = os.fsdecode(exc.filename) if exc.filename is not None else ""
        inside = not os.path.isabs(filename) or os.path.commonpath([filename, self.root]) == str(self.root)
        what = f"{exc.strerror or exc}" + (f" ({filename})" if filename else "")
        if exc.errno in _NO_SPACE:
            return CacheFullError(f"model cache folder {self.root} is full: {doing}: {what}")
        if exc.errno in _NOT_WRITABLE and inside:
            return CacheFullError(
                f"model cache folder {self.root} cannot be written (read-only or no permission): "
                f"{doing}: {what}"
            )
        return UnavailableError(f"model cache folder {self.root}: {doing}: {what}")

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
                    check_key(rel, what=f"object key in model '{key}'")
                    if files > self.limits.max_files:
                        raise InvalidArgumentError(f"model '{key}' has more than {self.limits.max_files} files")
                    dest = content / rel
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    _download_verified(storage, obj, dest)
                download_ns = time.monotonic_ns() - start
            hashed = time.monotonic_ns()
            records = record_tree(content)
            hash_ns = time.monotonic_ns() - hashed
        except OSError as exc:
            raise self._os_error(exc, f"cannot fetch '{key}'") from None
        size = sum(r.size for r in records.values())
        return _Built(sum(o.size for o in objects), download_ns, size, records, hash_ns)

    def _manifest(self, entry: _Entry) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "location": entry.ident[0],
            "key": entry.ident[1],
            "version": entry.version,
            "bytes": entry.bytes,
            "files": [record.to_json(path) for path, record in sorted(entry.files.items())],
        }

    def _commit(self, tmp: Path, entry: _Entry) -> None:
        try:
            with open(tmp / MANIFEST, "w") as f:
                json.dump(self._manifest(entry), f)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, self.root / entry.name)
        except OSError as exc:
            raise self._os_error(exc, f"cannot store '{entry.ident[1]}'") from None
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
            self._forget(entry)

    def _forget(self, entry: _Entry) -> None:
        """Never hand ``entry`` out again; delete it now, or when its last pin goes."""
        entry.stale = True
        if self._live.get((entry.ident, entry.version)) is entry:
            del self._live[(entry.ident, entry.version)]
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
        if self._entries.get(entry.name) is entry:
            del self._entries[entry.name]
        if self._live.get((entry.ident, entry.version)) is entry:
            del self._live[(entry.ident, entry.version)]
        folder = self.root / entry.name
        trash = self.root / f"{TMP_PREFIX}{uuid.uuid4().hex}"

        def work() -> None:
            try:
                os.rename(folder, trash)
            except FileNotFoundError:
                return
            except OSError as exc:
                logger.warning("model cache: cannot delete %s: %s", folder, exc)
                return
            _remove(trash)

        self._spawn(work)

    def _spawn(self, work: Callable[[], None]) -> None:
        """Run blocking ``work`` in a thread in the background (now, without a running loop)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            work()
            return
        task = loop.create_task(asyncio.to_thread(work))
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _rewrite_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Replace an entry's manifest (new stat fields of unchanged files); best effort."""
    new = folder / f".{MANIFEST}.{uuid.uuid4().hex}.new"
    try:
        with open(new, "w") as f:
            json.dump(manifest, f)
        os.replace(new, folder / MANIFEST)
    except OSError as exc:
        logger.debug("model cache: cannot update %s: %s", folder / MANIFEST, exc)
        with contextlib.suppress(OSError):
            new.unlink()


@dataclass(frozen=True, slots=True)
class _Built:
    downloaded: int
    download_ns: int
    bytes: int
    files: dict[str, _Record]
    hash_ns: int


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
