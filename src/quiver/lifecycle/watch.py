"""Which local model folders changed since they were last walked (inotify, Linux).

A miss walks its model folder (:func:`~quiver.lifecycle.sources.fingerprint_and_size`: a
listing per folder and a ``stat`` per file) to know whether its files changed since their
configuration was read and their size measured, and finds the folder first (a ``stat`` per
repository). On a busy machine, after the server was idle, those system calls' code is out of
the CPU's caches: 0.3 ms of a 3.5 ms miss. :class:`FolderWatch` keeps, for each folder it
walked, what the walk found, as long as the kernel has told of no change in it since: every
folder of it is watched (``inotify``) *before* it is read, and so is each repository (a
model folder added, removed or renamed). A miss reads the changes the kernel has queued
(:meth:`FolderWatch.read_changes`, on the event loop as its request arrives), then asks
:meth:`FolderWatch.unchanged` and loads from what the walk found, without walking again.

Only where the kernel sees every change: the repositories' filesystems must be local ones
(:data:`LOCAL_FILESYSTEMS`: a network filesystem's changes made on another machine raise no
event), a folder holding a symbolic link to a file (whose target can change out of sight) is
never kept, and a folder the kernel would not watch (the user's watches are used up) is walked
on every miss, as everywhere else (not Linux, no ``inotify``). A lost event (the kernel's
queue overflowed) forgets every folder. Thread-safe: folders are walked on load threads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import struct
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from quiver.repository.local import ModelSource

__all__ = ["LOCAL_FILESYSTEMS", "FolderWatch"]

logger = logging.getLogger(__name__)

#: Filesystems whose every change raises an inotify event in this kernel (local ones).
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "ramfs", "overlay", "zfs", "f2fs"})

_IN_MODIFY, _IN_ATTRIB, _IN_CLOSE_WRITE = 0x2, 0x4, 0x8
_IN_MOVED_FROM, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x40, 0x80, 0x100, 0x200
_IN_DELETE_SELF, _IN_MOVE_SELF = 0x400, 0x800
_IN_Q_OVERFLOW, _IN_IGNORED = 0x4000, 0x8000
_CHILDREN = _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE
_SELF = _IN_DELETE_SELF | _IN_MOVE_SELF
#: A model folder: anything that changes a file's size or times, or the folder's entries.
_FOLDER_MASK = _IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE | _CHILDREN | _SELF
#: A repository: model folders added, removed or renamed.
_ROOT_MASK = _CHILDREN | _SELF
_EVENT = struct.Struct("iIII")

Walk = tuple[ModelSource, str, int]


def _inotify() -> tuple[Callable[..., int], Callable[..., int]] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.inotify_init1, libc.inotify_add_watch
    except (OSError, AttributeError):
        return None


def filesystem_of(path: Path, mounts: str | None = None) -> str:
    """The type of the filesystem ``path`` is on (``/proc/self/mountinfo``), ``""`` unknown."""
    try:
        text = mounts if mounts is not None else Path("/proc/self/mountinfo").read_text()
        target = os.path.realpath(path)
    except OSError:
        return ""
    best, kind = "", ""
    for line in text.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, line.split(" - ", 1)[1].split()[0]
    return kind


class FolderWatch:
    """What the last walk of each local model folder found (its folder, fingerprint and file
    bytes), kept while the kernel tells of no change in it (see the module notes)."""

    def __init__(self, roots: Iterable[Path], *, mounts: str | None = None) -> None:
        self._lock = threading.Lock()
        self._fd = -1
        self._add: Callable[..., int] | None = None
        self._names: dict[int, set[str]] = {}  # watch -> the model folders it is part of
        self._roots: dict[int, Path] = {}  # watch -> repository
        self._kept: dict[str, Walk] = {}
        self._changes: dict[str, int] = {}  # name -> changes seen (a walk under way compares)
        roots = [Path(r) for r in roots]
        calls = _inotify()
        if calls is None or not roots:
            return
        kinds = {root: filesystem_of(root, mounts) for root in roots}
        if not all(kind in LOCAL_FILESYSTEMS for kind in kinds.values()):
            logger.debug("model folders are walked on every miss: repositories on %s", kinds)
            return
        init, self._add = calls
        fd = init(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            logger.debug("no inotify instance (%s): model folders are walked on every miss", os.strerror(ctypes.get_errno()))
            return
        self._fd = fd
        for root in roots:
            wd = self._watch(str(root), _ROOT_MASK)
            if wd < 0:  # a repository unwatched: additions to it go unseen, so nothing is kept
                self.close()
                return
            self._roots[wd] = root

    @property
    def active(self) -> bool:
        return self._fd >= 0

    def read_changes(self) -> None:
        """Read every change the kernel has queued (non-blocking: one ``read`` when there is
        none). A miss reads them on the event loop, as its request arrived (its core's system
        call code warm from reading the request: a ``read`` there costs a microsecond or two,
        0.04 ms on a load thread after the server was idle), before it asks
        :meth:`unchanged` from a load thread: every change made before the request is seen."""
        if self._fd >= 0:
            self._drain()

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = -1
            self._kept.clear()

    def _watch(self, folder: str, mask: int) -> int:
        assert self._add is not None
        return self._add(self._fd, os.fsencode(folder), mask)

    def walk(self, source: ModelSource, walk: Callable[..., tuple[str, int]]) -> tuple[str, int]:
        """Blocking: ``walk(source.path, observer)`` (:func:`fingerprint_and_size`), every folder
        watched before it is read; what it found is kept unless a change came meanwhile, a
        folder could not be watched or a symbolic link was met."""
        if self._fd < 0 or source.archive or source.aliases:
            return walk(source.path)
        name = source.name
        self._drain()
        with self._lock:
            before = self._changes.get(name, 0)
            self._kept.pop(name, None)
        observer = _Observer(self, name)
        fingerprint, size = walk(source.path, observer)
        self._drain()
        with self._lock:
            if observer.keep and self._changes.get(name, 0) == before and self._fd >= 0:
                self._kept[name] = (source, fingerprint, size)
        return fingerprint, size

    def unchanged(self, name: str) -> Walk | None:
        """What the last walk of ``name``'s folder found, when the kernel has told of no change
        in it (nor in its repository's entry for it) in the changes read so far
        (:meth:`read_changes`)."""
        if self._fd < 0:
            return None
        with self._lock:
            return self._kept.get(name)

    def forget(self, name: str) -> None:
        with self._lock:
            self._kept.pop(name, None)

    def _changed(self, name: str) -> None:  # the lock held
        self._kept.pop(name, None)
        self._changes[name] = self._changes.get(name, 0) + 1

    def _drain(self) -> None:
        """Read every event queued (non-blocking)."""
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return
            except OSError:  # closed meanwhile
                return
            if not data:
                return
            with self._lock:
                self._apply(data)

    def _apply(self, data: bytes) -> None:  # the lock held
        offset = 0
        while offset + _EVENT.size <= len(data):
            wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
            child = data[offset + _EVENT.size : offset + _EVENT.size + length].rstrip(b"\0")
            offset += _EVENT.size + length
            if mask & _IN_Q_OVERFLOW:
                for name in list(self._kept):
                    self._changed(name)
                continue
            if wd in self._roots:
                if child:
                    self._changed(os.fsdecode(child))
                elif mask & (_SELF | _IN_IGNORED):  # the repository itself went: keep nothing
                    for name in list(self._kept):
                        self._changed(name)
                continue
            for name in self._names.get(wd, ()):
                self._changed(name)
            if mask & _IN_IGNORED:
                self._names.pop(wd, None)


class _Observer:
    """Told of each folder a walk reads (watched first) and of each symbolic link it meets."""

    def __init__(self, watch: FolderWatch, name: str) -> None:
        self._watch = watch
        self._name = name
        self.keep = True

    def folder(self, path: str) -> None:
        watch = self._watch
        wd = watch._watch(path, _FOLDER_MASK) if watch.active else -1
        if wd < 0:
            self.keep = False
            return
        with watch._lock:
            watch._names.setdefault(wd, set()).add(self._name)

    def link(self, path: str) -> None:
        self.keep = False
