"""What the disk cache hands out and counts: :class:`CacheLease` (a pin on one entry),
:class:`CacheStats`, :class:`CacheFullError`, and the in-memory index record of an entry."""

from __future__ import annotations

import asyncio
import errno
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from quiver.errors import (
    QuiverError,
    UnavailableError,
)
from quiver.repository.manifest import MANIFEST, MANIFEST_FORMAT, _Record

if TYPE_CHECKING:
    from quiver.repository.cache import DiskCache


CONTENT = "content"
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_NOT_WRITABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


class CacheFullError(UnavailableError):
    """The cache cannot take the entry: it does not fit even after evicting every entry that
    is not pinned, or the cache folder cannot be written (disk or quota full, read-only, no
    permission). The message names the folder.

    The SageMaker routes answer this with 507 (the status that tells SageMaker to make room).
    """


def _os_error(root: Path, exc: OSError, doing: str) -> QuiverError:
    """A Quiver error for ``exc`` raised while working in the cache folder ``root``: a full or
    unwritable folder is a CacheFullError naming it."""
    # A file under the cache folder, or named relative to a folder descriptor in it (the
    # extraction writes with openat), or none (a write to an open file).
    filename = os.fsdecode(exc.filename) if exc.filename is not None else ""
    inside = not os.path.isabs(filename) or os.path.commonpath([filename, root]) == str(root)
    what = f"{exc.strerror or exc}" + (f" ({filename})" if filename else "")
    if exc.errno in _NO_SPACE:
        return CacheFullError(f"model cache folder {root} is full: {doing}: {what}")
    if exc.errno in _NOT_WRITABLE and inside:
        return CacheFullError(
            f"model cache folder {root} cannot be written (read-only or no permission): "
            f"{doing}: {what}"
        )
    return UnavailableError(f"model cache folder {root}: {doing}: {what}")


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
    checked_later: int = 0  # served from cache at once, the store asked in the background
    outdated: int = 0  # background checks that found a newer version (or the key gone)
    damaged: int = 0  # entries found changed or incomplete on disk, dropped and fetched again
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
    files: dict[str, _Record] = field(default_factory=dict)
    pins: int = 0
    stale: bool = False  # replaced, gone or damaged: never handed out again
    verified: bool = False  # hashed in full by this process
    current: bool = False  # confirmed the store's current version by this process, since unchanged

    @property
    def path(self) -> Path:
        return self.root / self.name / CONTENT

    @classmethod
    def read(cls, folder: Path, root: Path) -> _Entry | None:
        """The entry whose manifest is in ``folder``; None when it is not a complete entry."""
        try:
            data = json.loads((folder / MANIFEST).read_text())
            if data.get("format") != MANIFEST_FORMAT or not (folder / CONTENT).is_dir():
                return None
            files = dict(_Record.from_json(item) for item in data["files"])
            return cls(
                ident=(str(data["location"]), str(data["key"])),
                version=str(data["version"]),
                name=folder.name,
                root=root,
                bytes=int(data["bytes"]),
                last_used=0,
                files=files,
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def manifest(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "location": self.ident[0],
            "key": self.ident[1],
            "version": self.version,
            "bytes": self.bytes,
            "files": [record.to_json(path) for path, record in sorted(self.files.items())],
        }


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
        self._ident = entry.ident

    @property
    def released(self) -> bool:
        return self._entry is None

    def loaded(self) -> None:
        """The model is loaded from the files (or failed to): a background check of the
        copy's version (``check_later``) may start now, off the load's critical path."""
        self._cache.start_check(self._ident)

    def release(self) -> None:
        entry, self._entry = self._entry, None
        if entry is not None:
            self._cache._unpin(entry)
            self._cache.start_check(self._ident)

    def __enter__(self) -> Path:
        return self.path

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    async def __aenter__(self) -> Path:
        return self.path

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"CacheLease({self.key!r}, {str(self.path)!r}, released={self.released})"
