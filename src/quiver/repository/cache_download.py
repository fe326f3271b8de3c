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


def _build_content(
    tmp: Path, key: str, objects: list[StoredObject], storage: Storage, limits: ExtractLimits
) -> _Built:
    """Fill ``tmp/content`` with ``key``'s objects (downloaded, extracted or copied) and
    record its manifest (blocking); ``OSError`` passes through for the cache to name."""
    content = tmp / CONTENT
    content.mkdir(parents=True)
    start = time.monotonic_ns()
    if is_archive_key(key):
        (obj,) = objects
        part = tmp / "archive.tar.gz"
        _download_verified(storage, obj, part)
        download_ns = time.monotonic_ns() - start
        extract_archive(part, content, limits=limits, name=key)
        part.unlink()
    elif isinstance(storage, LocalStorage):
        copy_folder(storage.root / key, content, limits=limits)
        download_ns = time.monotonic_ns() - start
    else:
        for files, obj in enumerate(objects, 1):
            rel = obj.key[len(key) + 1 :]
            check_key(rel, what=f"object key in model '{key}'")
            if files > limits.max_files:
                raise InvalidArgumentError(f"model '{key}' has more than {limits.max_files} files")
            dest = content / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            _download_verified(storage, obj, dest)
        download_ns = time.monotonic_ns() - start
    hashed = time.monotonic_ns()
    records = record_tree(content)
    hash_ns = time.monotonic_ns() - hashed
    size = sum(r.size for r in records.values())
    return _Built(sum(o.size for o in objects), download_ns, size, records, hash_ns)
