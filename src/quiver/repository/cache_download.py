"""The store side of a cache fetch (blocking): a key's current version and objects, and
downloads checked against what the store listed (size, and MD5 when the ETag is one)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

from quiver.errors import (
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from quiver.repository.archive import ExtractLimits, copy_folder, extract_archive
from quiver.repository.cache_types import CONTENT
from quiver.repository.manifest import _Record, record_tree
from quiver.repository.names import check_key
from quiver.repository.storage import (
    LocalStorage,
    OnStart,
    Storage,
    StoredObject,
    is_archive_key,
)


@dataclass(frozen=True, slots=True)
class _Built:
    downloaded: int
    download_ns: int
    bytes: int
    files: dict[str, _Record]
    hash_ns: int
    version: str  # as the download found it (an archive fetched without asking first)


def archive_version(obj: StoredObject) -> str:
    """An archive's version: its ETag and size."""
    return f"{obj.etag}:{obj.size}"


def _resolve(storage: Storage, key: str) -> tuple[str, list[StoredObject]]:
    """The current version of ``key`` and the objects to fetch (blocking)."""
    if is_archive_key(key):
        obj = storage.stat(key)
        return archive_version(obj), [obj]
    objects = storage.list(key + "/")
    if not objects:
        raise NotFoundError(f"model '{key}' not found in {storage.location}")
    digest = hashlib.sha256()
    for obj in objects:
        digest.update(f"{obj.key}\0{obj.size}\0{obj.etag}\n".encode())
    return f"tree:{digest.hexdigest()[:32]}:{sum(o.size for o in objects)}", objects


def _download_verified(
    storage: Storage, key: str, listed: StoredObject | None, dest: Path, on_start: OnStart | None = None
) -> StoredObject:
    """Download ``key`` to ``dest`` and check its size (and MD5 when the ETag is one) against
    ``listed``, or, for an object not asked about first (None), against what the download
    itself announced; the object as downloaded."""
    got = storage.download(key, dest, etag=(listed.etag or None) if listed else None, on_start=on_start)
    obj = listed or got.object
    on_disk = dest.stat().st_size
    if got.object.size != obj.size or on_disk != obj.size:
        raise UnavailableError(
            f"'{key}' from {storage.location}: got {on_disk} bytes, expected {obj.size}"
        )
    if obj.md5 is not None and got.md5 != obj.md5:
        raise UnavailableError(
            f"'{key}' from {storage.location}: content MD5 {got.md5} does not match "
            f"ETag {obj.md5}"
        )
    return got.object


def _build_content(
    tmp: Path,
    key: str,
    objects: list[StoredObject] | None,
    storage: Storage,
    limits: ExtractLimits,
    on_start: OnStart | None = None,
) -> _Built:
    """Fill ``tmp/content`` with ``key``'s objects (downloaded, extracted or copied) and
    record its manifest (blocking); ``OSError`` passes through for the cache to name.
    ``objects`` None: an archive fetched without asking the store first (its one GET names
    the version; ``on_start`` is called with it before the body is read)."""
    content = tmp / CONTENT
    content.mkdir(parents=True)
    start = time.monotonic_ns()
    fetched = list(objects or ())
    version = ""
    if is_archive_key(key):
        listed = fetched[0] if fetched else None
        part = tmp / "archive.tar.gz"
        got = _download_verified(storage, key, listed, part, on_start)
        fetched = [listed or got]
        version = archive_version(fetched[0])
        download_ns = time.monotonic_ns() - start
        extract_archive(part, content, limits=limits, name=key)
        part.unlink()
    elif isinstance(storage, LocalStorage):
        copy_folder(storage.root / key, content, limits=limits)
        download_ns = time.monotonic_ns() - start
    else:
        for files, obj in enumerate(fetched, 1):
            rel = obj.key[len(key) + 1 :]
            check_key(rel, what=f"object key in model '{key}'")
            if files > limits.max_files:
                raise InvalidArgumentError(f"model '{key}' has more than {limits.max_files} files")
            dest = content / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            _download_verified(storage, obj.key, obj, dest)
        download_ns = time.monotonic_ns() - start
    hashed = time.monotonic_ns()
    records = record_tree(content)
    hash_ns = time.monotonic_ns() - hashed
    size = sum(r.size for r in records.values())
    return _Built(sum(o.size for o in fetched), download_ns, size, records, hash_ns, version)
