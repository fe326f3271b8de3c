"""The manifest of a cache entry: what its ``content/`` folder is, file by file.

The manifest (``entry.json``, layout :data:`MANIFEST_FORMAT`) lists every file, folder and
link of ``content/``: for a file its size and SHA-256, and the ``(inode, mtime_ns,
ctime_ns)`` it had when written. :func:`record_tree` makes it; :func:`check_tree` compares a
folder with it (see :mod:`quiver.repository.cache` for when each runs and what it costs).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat as stat_mod
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quiver.errors import (
    InvalidArgumentError,
)

logger = logging.getLogger(__name__)

MANIFEST = "entry.json"
#: The manifest layout this module writes; older ones (without the file list) are dropped.
MANIFEST_FORMAT = 2
_HASH_CHUNK = 1 << 20


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
                    refreshed[rel] = _Record(
                        "file", record.size, record.sha256, stat=_file_stat(st)
                    )
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
