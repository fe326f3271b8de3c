"""The disk cache's folder (blocking): holding its lock, deleting what earlier runs left, reading
the complete entries on it, naming new entries and deleting files and trees. The layout is in
:mod:`quiver.repository.cache`'s docstring."""

from __future__ import annotations

import fcntl
import logging
import re
import shutil
from pathlib import Path
from typing import IO

from quiver.errors import InvalidArgumentError
from quiver.repository.cache_types import _Entry, _os_error
from quiver.repository.manifest import MANIFEST

logger = logging.getLogger("quiver.repository.cache")

TMP_PREFIX = ".tmp-"
LOCK = ".lock"


def safe_name(key: str) -> str:
    """A folder-name stem for ``key`` (entries also carry a digest and a random suffix)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", key).lstrip(".")[:80] or "model"


def remove(path: Path) -> None:
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


def open_folder(root: Path, keep: frozenset[str] = frozenset()) -> tuple[IO[bytes], list[_Entry]]:
    """Create and lock ``root`` (held while the returned file is open), delete leftovers of
    earlier runs and folders that are not complete entries (but those named in ``keep``,
    which other parts keep there); the complete entries, least recently written first. :class:`InvalidArgumentError` when another process holds it,
    :class:`~quiver.repository.cache_types.CacheFullError` when it cannot be written."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / LOCK, "wb")  # noqa: SIM115 - held by the cache until it closes
    except OSError as exc:
        raise _os_error(root, exc, "cannot open it") from None
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise InvalidArgumentError(f"model cache folder '{root}' is in use by another process") from None
    found: list[tuple[float, _Entry]] = []
    for child in sorted(root.iterdir()):
        if child.name == LOCK or child.name in keep:
            continue
        if child.name.startswith(TMP_PREFIX):
            logger.info("model cache: deleting leftover %s", child)
            remove(child)
            continue
        entry = _Entry.read(child, root)
        if entry is None:
            logger.warning(
                "model cache: deleting %s, which is not a complete entry (or has no file manifest)", child
            )
            remove(child)
            continue
        found.append(((child / MANIFEST).stat().st_mtime, entry))
    found.sort(key=lambda pair: pair[0])
    return lock, [entry for _, entry in found]


__all__ = ["LOCK", "TMP_PREFIX", "open_folder", "remove", "safe_name"]
