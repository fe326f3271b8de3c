"""Shared-memory pools: named segments in ``/dev/shm``, allocated by one side, mapped by the other.

Each side of a channel owns an :class:`Arena` it alone allocates from and frees into, so no
allocator state is shared between processes (no cross-process locks): the server writes request
tensors into its arena, the worker writes response tensors into its own; the reader maps the
other side's segments by name (:class:`Mapper`) and tells the owner when it is done with a
block (a ``release`` message). An arena starts with one segment of ``default_bytes`` and adds a
segment of at least ``growth_bytes`` whenever a block does not fit, up to ``max_bytes`` in
all; past that :class:`PoolFullError` names the sizes and the settings that raise them.

Segment names are ``<prefix><owner tag>_<n>``: the owner tag names the server's process and the
worker, so the server can remove every segment of a worker that died without saying goodbye
(:func:`unlink_prefixed`). Segments are files under ``/dev/shm`` opened ``O_EXCL|O_NOFOLLOW``
with mode 0600.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any, NamedTuple

SHM_DIR = "/dev/shm"
ALIGN = 64
#: Freed blocks an arena keeps whole, per size, for the next block of that size.
SPARE_BLOCKS = 8


class PoolFullError(Exception):
    """A block does not fit in the pool, even grown to its largest."""


class Block(NamedTuple):
    segment: str
    offset: int
    size: int


#: A Block from a (segment, offset, size) tuple, without NamedTuple's Python-level __new__.
_block: Callable[[tuple[str, int, int]], Block] = partial(tuple.__new__, Block)


class Segment:
    """One mapped shared-memory segment."""

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        if "/" in name or not name:
            raise ValueError(f"invalid shared-memory name '{name}'")
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        if create:
            flags |= os.O_CREAT | os.O_EXCL
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            if create:
                unlink(name)
            raise
        os.close(fd)
        self.name = name
        self.size = size
        self.view = memoryview(self.map)

    def close(self) -> None:
        try:
            self.view.release()
            self.map.close()
        except BufferError:
            # numpy arrays still look at the segment: the mapping stays until they are gone
            # (the name is unlinked all the same, so the memory returns with the last view).
            pass


def unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))


def unlink_prefixed(prefix: str) -> int:
    """Remove every segment whose name starts with ``prefix``; how many there were."""
    count = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if name.startswith(prefix):
            unlink(name)
            count += 1
    return count


def _round(size: int) -> int:
    return (size + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    """The pool one side allocates from: segments ``<prefix>_<n>``, first-fit free lists."""

    def __init__(self, prefix: str, default_bytes: int, growth_bytes: int, max_bytes: int) -> None:
        self.prefix = prefix
        self.default_bytes = _round(max(default_bytes, ALIGN))
        self.growth_bytes = _round(max(growth_bytes, ALIGN))
        self.max_bytes = max(max_bytes, self.default_bytes)
        self._lock = threading.Lock()
        self._segments: dict[str, Segment] = {}
        self._maps: dict[str, mmap.mmap] = {}  # segment -> its mapping (what put() writes into)
        self._free: dict[str, list[tuple[int, int]]] = {}  # segment -> sorted (offset, size)
        self._used: dict[str, dict[int, int]] = {}  # segment -> offset -> size
        self._spare: dict[int, list[tuple[str, int]]] = {}  # size -> freed blocks kept whole
        self._count = 0
        self.total_bytes = 0

    def _grow(self, at_least: int) -> Segment:
        size = self.default_bytes if not self._segments else max(self.growth_bytes, _round(at_least))
        size = max(size, _round(at_least))
        if self.total_bytes + size > self.max_bytes:
            raise PoolFullError(
                f"the shared-memory pool needs {at_least} more bytes but holds {self.total_bytes} "
                f"of at most {self.max_bytes} bytes (--backend-config=python,shm-max-byte-size)"
            )
        name = f"{self.prefix}_{self._count}"
        self._count += 1
        segment = Segment(name, size, create=True)
        self._segments[name] = segment
        self._maps[name] = segment.map
        self._free[name] = [(0, size)]
        self._used[name] = {}
        self.total_bytes += size
        return segment

    def alloc(self, nbytes: int) -> tuple[Block, memoryview]:
        """A block of ``nbytes`` and a writable view of it; PoolFullError when it cannot fit."""
        size = (max(nbytes, 1) + ALIGN - 1) // ALIGN * ALIGN
        with self._lock:
            name, offset = self._place(size)
            segment = self._segments[name]
        return _block((name, offset, nbytes)), segment.view[offset : offset + nbytes]

    def store(self, data: Any, nbytes: int) -> Block:
        """A block holding a copy of ``data``, a C-contiguous buffer of ``nbytes`` bytes (bytes,
        a numpy array): one copy. PoolFullError when it cannot fit; ValueError (or TypeError,
        BufferError) when ``data`` is not such a buffer, and nothing is kept."""
        segment, offset = self.put(data, nbytes)
        return _block((segment, offset, nbytes))

    def put(self, data: Any, nbytes: int) -> tuple[str, int]:
        """:meth:`store` without the Block: ``(segment, offset)`` (the hot path's form, as
        :meth:`free_many` takes it)."""
        size = (nbytes + ALIGN - 1) // ALIGN * ALIGN or ALIGN
        with self._lock:
            spare = self._spare.get(size)
            if spare:  # the usual: the block of this size freed last
                found = spare.pop()
                name, offset = found
                self._used[name][offset] = size
            else:
                found = self._place(size)
                name, offset = found
            segment = self._maps[name]
        try:
            segment[offset : offset + nbytes] = data
        except BaseException:
            self.free(name, offset)
            raise
        return found

    def _place(self, size: int) -> tuple[str, int]:
        """Take ``size`` bytes (a multiple of ALIGN): a spare block of that size, else the first
        free range that holds them, else (the spare blocks given back first) a new segment.
        Under the lock."""
        spare = self._spare.get(size)
        if spare:
            found = spare.pop()
            self._used[found[0]][found[1]] = size
            return found
        for name, free in self._free.items():
            for index, (offset, length) in enumerate(free):
                if length >= size:  # first fit: cut it from the front of this range
                    if length == size:
                        del free[index]
                    else:
                        free[index] = (offset + size, length - size)
                    self._used[name][offset] = size
                    return name, offset
        if any(self._spare.values()):  # room kept aside for other sizes: give it back, and look again
            spares, self._spare = self._spare, {}
            for spare_size, blocks in spares.items():
                for name, offset in blocks:
                    self._give_back(name, offset, spare_size)
            return self._place(size)
        name = self._grow(size).name
        free = self._free[name]
        offset, length = free[0]
        if length == size:
            del free[0]
        else:
            free[0] = (offset + size, length - size)
        self._used[name][offset] = size
        return name, offset

    def free(self, segment: str, offset: int) -> None:
        """Give a block back (unknown blocks are ignored: a release may repeat). It is kept
        aside whole for the next block of its size (the usual: one call's tensors are the
        next call's size), up to SPARE_BLOCKS of a size, else merged into the free ranges."""
        self.free_many(((segment, offset),))

    def free_many(self, blocks: Iterable[Sequence[Any]]) -> None:
        """:meth:`free` of each ``(segment, offset)`` in ``blocks``, under one lock."""
        with self._lock:
            all_used, all_spare = self._used, self._spare
            for segment, offset in blocks:
                used = all_used.get(segment)
                size = None if used is None else used.pop(offset, None)
                if size is None:
                    continue
                spare = all_spare.get(size)
                if spare is None:
                    all_spare[size] = [(segment, offset)]
                elif len(spare) < SPARE_BLOCKS:
                    spare.append((segment, offset))
                else:
                    self._give_back(segment, offset, size)

    def _give_back(self, segment: str, offset: int, size: int) -> None:
        """Into the free ranges, merged with its free neighbours (under the lock)."""
        free = self._free[segment]
        index = bisect.bisect_left(free, (offset, 0))
        free.insert(index, (offset, size))
        if index + 1 < len(free) and free[index][0] + free[index][1] == free[index + 1][0]:
            free[index] = (offset, free[index][1] + free[index + 1][1])
            del free[index + 1]
        if index > 0 and free[index - 1][0] + free[index - 1][1] == free[index][0]:
            free[index - 1] = (free[index - 1][0], free[index - 1][1] + free[index][1])
            del free[index]

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(sum(used.values()) for used in self._used.values())

    def close(self) -> None:
        """Unmap and unlink every segment."""
        with self._lock:
            for segment in self._segments.values():
                segment.close()
                unlink(segment.name)
            self._segments.clear()
            self._maps.clear()
            self._free.clear()
            self._used.clear()
            self._spare.clear()
            self.total_bytes = 0


class Mapper:
    """The other side's segments, mapped by name on first use (read and write views)."""

    def __init__(self, allowed_prefix: str) -> None:
        self._prefix = allowed_prefix
        self._segments: dict[str, Segment] = {}
        self._lock = threading.Lock()

    def view(self, segment: str, offset: int, size: int) -> memoryview:
        found = self._segments.get(segment)
        if found is None:
            if not segment.startswith(self._prefix):
                raise ValueError(f"shared-memory segment '{segment}' is not one of this channel's")
            with self._lock:
                found = self._segments.get(segment)
                if found is None:
                    found = Segment(segment, 0, create=False)
                    self._segments[segment] = found
        if offset < 0 or size < 0 or offset + size > found.size:
            raise ValueError(
                f"block [{offset}, {offset + size}) is outside segment '{segment}' of {found.size} bytes"
            )
        return found.view[offset : offset + size]

    def close(self) -> None:
        with self._lock:
            for segment in self._segments.values():
                segment.close()
            self._segments.clear()
