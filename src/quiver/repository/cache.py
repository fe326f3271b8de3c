"""The on-disk model cache: download, verify, extract safely, rename into place, evict LRU.

Layout under ``root``::

    .lock                      held (flock) by the process using the cache
    <name>/entry.json          a complete entry: key, version, bytes, and its file manifest
    <name>/content/            the model folder, or a Triton repository folder
    .tmp-*                     work in progress: never trusted, deleted at start
    <kept>/                    folders other parts keep in the same place (``keep``: the
                               backends' CACHE_FOLDERS), left alone

An entry appears under its final name only by an atomic ``rename`` of a folder that is
complete (downloaded, verified, extracted, manifest written), so a crash at any moment
leaves complete entries and ``.tmp-*`` names, which the next :meth:`DiskCache.start`
deletes. A folder without a readable manifest (or with one from before manifests listed
files) is deleted too. Folder names carry a random suffix, so a fresh copy of a key never
lands on a folder a loaded model still holds.

An entry is identified by storage location + key + version, the version being the
object's ETag and size (an archive) or a digest of every member's key, ETag and size (a
folder of objects). A fetch asks the storage for the current version each time (one HEAD
or LIST; an archive not on disk at all is fetched with one GET, whose answer names its
version, and its room in the cache is made once the GET has named its size), so a new upload under the same key is fetched anew and the old entry is dropped
as soon as nothing pins it; a fetch with ``check_later`` (on-demand reloads) takes an entry
this process has confirmed current at once and asks in the background, so a new version is
what the *next* fetch gets (:meth:`DiskCache.expire` makes the next one ask first). When the key has an entry on disk, that question is bounded by
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

Single flight: concurrent fetches of one key share one resolution and one download (a copy
confirmed current is checked and handed out without one). All disk and network work runs in
threads (``asyncio.to_thread``; the check of a copy's files on ``run``, the server's load
threads); the event loop only keeps the index. The byte budget counts extracted content (archives are deleted after
extraction) plus reservations for downloads in flight; entries that are not pinned are
evicted least recently used first. A model loaded from an entry must hold a
:class:`CacheLease` (from :meth:`DiskCache.acquire` or :meth:`DiskCache.pin`) so its files
are never evicted under it.

Pieces: the manifest (record and check of an entry's files) is
:mod:`quiver.repository.manifest`; the lease, stats, errors and index record are
:mod:`quiver.repository.cache_types`; resolving a key's version and filling an entry from the
store is :mod:`quiver.repository.cache_download`; asking the store whether a copy is current
(bounded, or in the background) is :mod:`quiver.repository.cache_checks`; the folder itself
(its lock, leftovers, reading entries, deleting) is :mod:`quiver.repository.cache_folder`.
Their public names are re-exported here.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from quiver.errors import (
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    QuiverError,
    UnavailableError,
)
from quiver.repository.archive import ExtractLimits
from quiver.repository.cache_checks import VersionChecks
from quiver.repository.cache_download import _build_content, _Built, _resolve
from quiver.repository.cache_folder import TMP_PREFIX, open_folder, remove, safe_name
from quiver.repository.cache_types import (
    CacheFullError,
    CacheLease,
    CacheStats,
    _Entry,
    _Flight,
    _os_error,
)
from quiver.repository.manifest import (
    MANIFEST,
    _rewrite_manifest,
    check_tree,
    record_tree,
)
from quiver.repository.names import check_key
from quiver.repository.storage import (
    OnStart,
    Storage,
    StoredObject,
    is_archive_key,
)

__all__ = ["CACHE_REVALIDATE", "DEFAULT_REVALIDATE_TIMEOUT", "CacheFullError", "CacheLease", "CacheStats"]
__all__ += ["DiskCache", "check_tree", "record_tree"]

logger = logging.getLogger(__name__)

#: Seconds a fetch of a key already on disk waits for the store's answer before serving the
#: cached entry (``--model-cache-revalidate-timeout``).
DEFAULT_REVALIDATE_TIMEOUT = 3.0
#: ``--model-cache-revalidate``: when an on-demand load of a cached key asks the store.
CACHE_REVALIDATE = ("background", "always")


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
        run: Callable[..., Awaitable[Any]] | None = None,
        keep: frozenset[str] = frozenset(),
    ) -> None:
        if max_bytes <= 0:
            raise InvalidArgumentError(f"model cache size must be positive, got {max_bytes}")
        self.root = Path(root).absolute()
        self.keep = keep
        self.max_bytes = max_bytes
        limits = limits or ExtractLimits()
        self.limits = replace(limits, max_bytes=min(limits.max_bytes, max_bytes))
        self.on_download = on_download
        self._run = run or asyncio.to_thread  # run(fn, *args): the check of a copy's files
        self.stats = CacheStats()
        self._checks = VersionChecks(revalidate_timeout, self.stats, self._outdated)
        self._entries: dict[str, _Entry] = {}  # folder name -> entry (stale ones until unpinned)
        # ident -> version -> the entry that may be handed out (looked up per fetch: no scan)
        self._live: dict[tuple[str, str], dict[str, _Entry]] = {}
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
        self._live.setdefault(entry.ident, {})[entry.version] = entry

    def _newest(self, ident: tuple[str, str]) -> _Entry | None:
        """The most recently used entry of ``ident`` that may be handed out, any version."""
        found = self._live.get(ident)
        return max(found.values(), key=lambda e: e.last_used) if found else None

    def _unlive(self, entry: _Entry) -> None:
        versions = self._live.get(entry.ident)
        if versions is not None and versions.get(entry.version) is entry:
            del versions[entry.version]
            if not versions:
                del self._live[entry.ident]

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
        self._lock_file, found = open_folder(self.root, self.keep)
        return found

    async def close(self) -> None:
        """Wait for background work (deletions, manifest updates) and release the folder lock;
        background version checks are cancelled."""
        await self._checks.close()
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

    async def acquire(self, key: str, storage: Storage, *, check_later: bool = False) -> CacheLease:
        """Fetch ``key`` and pin its entry until the returned lease is released.

        ``check_later``: an entry this process has confirmed current (and nothing has
        expired since) is handed out at once, and the store is asked for the current version
        in the background; a newer version (or the key gone) found there is what the next
        fetch of the key sees. Otherwise the store is asked first (bounded by
        ``revalidate_timeout`` when the key is on disk)."""
        return CacheLease(self, await self._get(key, storage, check_later=check_later))

    def expire(self, key: str) -> None:
        """The next fetch of ``key`` asks the store first, even with ``check_later`` (the
        repository API's unload: a new upload is served by the next load)."""
        for entry in self._entries.values():
            if entry.ident[1] == key.rstrip("/"):
                entry.current = False

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

    async def _get(self, key: str, storage: Storage, *, check_later: bool = False) -> _Entry:
        """The entry for ``key``, pinned once for the caller."""
        check_key(key)
        await self.start()
        ident = (storage.location, key.rstrip("/"))
        flight = self._flights.get(ident)
        cached = self._newest(ident) if flight is None and check_later else None
        if cached is not None and cached.current and await self._usable(cached) and cached.current:
            return self._hand_out_current(ident, cached, storage)  # no flight: nothing to share
        flight = self._flights.get(ident)
        if flight is None:
            flight = _Flight(
                asyncio.get_running_loop().create_task(self._resolve_and_fetch(ident, storage, check_later))
            )
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

    async def _resolve_and_fetch(self, ident: tuple[str, str], storage: Storage, check_later: bool = False) -> _Entry:
        key = ident[1]
        cached = self._newest(ident)
        if check_later and cached is not None and cached.current and await self._usable(cached):
            self._hand_out_current(ident, cached, storage, pin=False)
            return self._finish(ident, cached)
        cached = self._newest(ident)  # (the one checked may have been found damaged)
        if cached is None and is_archive_key(key):
            # Nothing on disk: one GET, whose answer names the version (no HEAD first).
            self.stats.misses += 1
            try:
                entry = await self._download(ident, None, None, storage)
            except NotFoundError:
                self._drop_versions(ident, keep=None)
                raise
            self._drop_versions(ident, keep=entry.version)
            return self._finish(ident, entry)
        try:
            if cached is None:
                version, objects = await asyncio.to_thread(_resolve, storage, key)
            else:
                version, objects = await self._checks.ask(storage, key)
        except NotFoundError:
            self._drop_versions(ident, keep=None)
            raise
        except UnavailableError as exc:
            if cached is None:
                raise
            return await self._serve_stale(ident, exc)
        hit = self._live.get(ident, {}).get(version)
        if hit is not None and await self._usable(hit):
            self._drop_versions(ident, keep=version)
            self.stats.hits += 1
            hit.current = True
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

    def _hand_out_current(self, ident: tuple[str, str], entry: _Entry, storage: Storage, *, pin: bool = True) -> _Entry:
        """A copy confirmed current, its files checked: handed out, the store asked later."""
        self.stats.hits += 1
        self.stats.checked_later += 1
        self._checks.due(ident, entry.version, storage)  # started by the lease (loaded)
        if pin:
            entry.pins += 1
            self._touch(entry)
        return entry

    def start_check(self, ident: tuple[str, str]) -> None:
        """Start the background check a ``check_later`` fetch of ``ident`` left due, if any
        (:meth:`CacheLease.loaded`: after the load, so the two do not compete for the CPU)."""
        self._checks.start(ident)

    def _outdated(self, ident: tuple[str, str]) -> None:
        """A background check found another version of ``ident``, or none: ask first next time."""
        for entry in self._entries.values():
            if entry.ident == ident:
                entry.current = False

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
            check = functools.partial(check_tree, deep=not entry.verified)
            problem, refreshed = await self._run(check, entry.path, entry.files)
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
            manifest = entry.manifest()
            self._spawn(lambda: _rewrite_manifest(self.root / entry.name, manifest))
        return True

    async def _download(
        self, ident: tuple[str, str], version: str | None, objects: list[StoredObject] | None, storage: Storage
    ) -> _Entry:
        """Download ``ident`` into a new entry: ``version`` and ``objects`` as the store
        listed them, or None for an archive fetched without asking first, whose room in the
        cache is made when the GET has named its size (before the body is read)."""
        key = ident[1]
        loop = asyncio.get_running_loop()
        reserved = 0

        def reserve(size: int) -> None:  # on the event loop
            nonlocal reserved
            if reserved:
                return  # a retry of the same version
            self._evict_for(size, key=key)
            self._reserved += size
            reserved = size

        on_start: OnStart | None = None
        if objects is not None:
            reserve(sum(o.size for o in objects))
        else:

            def on_start(obj: StoredObject) -> None:  # in the download's thread
                async def on_loop() -> None:
                    reserve(obj.size)

                asyncio.run_coroutine_threadsafe(on_loop(), loop).result()

        tmp = self.root / f"{TMP_PREFIX}{uuid.uuid4().hex}"
        built: _Built | None = None
        try:
            built = await asyncio.to_thread(self._build, tmp, key, objects, storage, on_start)
            self.stats.downloads += 1
            self.stats.bytes_downloaded += built.downloaded
            self.stats.download_ns += built.download_ns
            if self.on_download is not None:
                self.on_download(key, built.downloaded, built.download_ns)
        except BaseException:
            self.stats.download_failures += 1
            self._reserved -= reserved
            await asyncio.to_thread(remove, tmp)
            raise
        self._reserved -= reserved
        version = version or built.version
        digest = hashlib.sha256(repr((ident, version)).encode()).hexdigest()[:16]
        name = f"{safe_name(key)}-{digest}-{uuid.uuid4().hex[:8]}"
        entry = _Entry(ident, version, name, self.root, built.bytes, 0, built.files, verified=True, current=True)
        try:
            self._evict_for(built.bytes, key=key)
            await asyncio.to_thread(self._commit, tmp, entry)
        except BaseException:
            await asyncio.to_thread(remove, tmp)
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
        return _os_error(self.root, exc, doing)

    # -- blocking work (threads) -----------------------------------------------------------------

    def _build(
        self, tmp: Path, key: str, objects: list[StoredObject] | None, storage: Storage, on_start: OnStart | None
    ) -> _Built:
        try:
            return _build_content(tmp, key, objects, storage, self.limits, on_start)
        except OSError as exc:
            raise self._os_error(exc, f"cannot fetch '{key}'") from None

    def _commit(self, tmp: Path, entry: _Entry) -> None:
        """Write the manifest and rename the folder into place. No ``fsync``: after a crash
        a folder whose manifest did not reach the disk whole is unreadable and deleted at
        start, and the first fetch of every entry after start hashes all its files (a file
        that did not reach the disk whole is found there), so durability would buy nothing
        but a re-download, for 1-2 ms (and more on network disks) per download."""
        try:
            with open(tmp / MANIFEST, "w") as f:
                json.dump(entry.manifest(), f)
            os.rename(tmp, self.root / entry.name)
        except OSError as exc:
            raise self._os_error(exc, f"cannot store '{entry.ident[1]}'") from None

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
        for entry in [e for e in self._live.get(ident, {}).values() if e.version != keep]:
            self._forget(entry)  # (the others of ``ident`` are forgotten already)

    def _forget(self, entry: _Entry) -> None:
        """Never hand ``entry`` out again; delete it now, or when its last pin goes."""
        entry.stale = True
        self._unlive(entry)
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
        self._unlive(entry)
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
            remove(trash)

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
