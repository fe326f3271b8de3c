""":func:`copy_folder` copies a local model folder under the rules of
:mod:`quiver.repository.archive` and through the same no-follow writer
(:mod:`quiver.repository.nofollow`): every entry is opened relative to its folder with
``O_NOFOLLOW`` and judged by ``fstat`` of the open descriptor (a swap made between listing
and opening is seen); a file symlink that resolves inside the folder without passing through
another link is copied as the file it names; other links, folder symlinks and special files
are refused.
"""

from __future__ import annotations

import errno
import os
import stat as stat_mod
from collections.abc import Iterator
from pathlib import Path

from quiver.errors import InvalidArgumentError
from quiver.repository.limits import ExtractLimits, ExtractResult
from quiver.repository.nofollow import (
    _DIR_FLAGS,
    _READ_FLAGS,
    CHUNK,
    _open_root,
    _Parts,
    _show,
    _Tree,
)


def copy_folder(src: Path, dest: Path, *, limits: ExtractLimits | None = None) -> ExtractResult:
    """Copy the model folder ``src`` into the folder ``dest`` (created if missing, else empty),
    under the same caps (bytes of file content, entries).

    ``src`` itself may be a link (a repository of links is the operator's choice); below it,
    file symlinks that resolve inside ``src`` without passing through another link are
    copied as the files they name; links that leave ``src``, folder symlinks and special
    files are refused (as archives' are).
    """
    limits = limits or ExtractLimits()
    label = f"folder '{src}'"
    src_real = os.path.realpath(src)
    dest.mkdir(parents=True, exist_ok=True)
    top = os.open(src_real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    tree: _Tree | None = None
    try:
        tree = _Tree(_open_root(dest, label), label, len(os.fsencode(os.path.abspath(dest))))
        return _Copy(top, src_real, tree, limits).run()
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise InvalidArgumentError(
                f"{label}: an entry was replaced by a link while copying"
            ) from None
        raise
    finally:
        os.close(top)
        if tree is not None:
            tree.close()
            os.close(tree.root)


class _Copy:
    def __init__(self, top: int, src_real: str, tree: _Tree, limits: ExtractLimits) -> None:
        self.top = top
        self.src_real = src_real
        self.tree = tree
        self.limits = limits
        self.files = 0
        self.bytes = 0

    def run(self) -> ExtractResult:
        stack: list[tuple[int, _Parts]] = [(os.dup(self.top), ())]
        try:
            while stack:
                fd, rel = stack.pop()
                try:
                    for entry in sorted(os.listdir(fd)):
                        child = self.entry(fd, rel, entry)
                        if child is not None:
                            stack.append(child)
                finally:
                    os.close(fd)
        finally:
            for fd, _ in stack:
                os.close(fd)
        return ExtractResult(self.files, self.bytes)

    def entry(self, folder: int, rel: _Parts, entry: str) -> tuple[int, _Parts] | None:
        """Copy one entry of ``folder``; a folder's open descriptor and path to walk next."""
        tree = self.tree
        parts = (*rel, entry)
        shown = _show(parts)
        self.files += 1
        if self.files > self.limits.max_files:
            raise InvalidArgumentError(
                f"{tree.label} has more than {self.limits.max_files} entries (stopped at '{shown}')"
            )
        tree.check_name(shown)
        st = os.stat(entry, dir_fd=folder, follow_symlinks=False)
        if stat_mod.S_ISLNK(st.st_mode):
            fd = self.open_link_target(folder, rel, entry)
        elif stat_mod.S_ISDIR(st.st_mode):
            fd = os.open(entry, _DIR_FLAGS, dir_fd=folder)
            if not stat_mod.S_ISDIR(os.fstat(fd).st_mode):  # pragma: no cover - O_DIRECTORY
                os.close(fd)
                raise tree.refuse(f"'{shown}' changed while copying")
            tree.mkdir(parts, shown)
            return fd, parts
        elif stat_mod.S_ISREG(st.st_mode):
            fd = os.open(entry, _READ_FLAGS, dir_fd=folder)
        else:
            raise tree.refuse(f"'{shown}' is not a regular file")
        try:
            opened = os.fstat(fd)
            if stat_mod.S_ISDIR(opened.st_mode):
                raise tree.refuse(f"'{shown}' is a folder symlink")
            if not stat_mod.S_ISREG(opened.st_mode):
                raise tree.refuse(f"'{shown}' is not a regular file")
            if self.bytes + opened.st_size > self.limits.max_bytes:
                raise InvalidArgumentError(
                    f"{tree.label} is larger than the cap of {self.limits.max_bytes} bytes (at '{shown}')"
                )

            def chunks() -> Iterator[bytes]:
                left = self.limits.max_bytes - self.bytes
                while chunk := os.read(fd, min(CHUNK, left + 1)):
                    left -= len(chunk)
                    if left < 0:
                        raise InvalidArgumentError(
                            f"{tree.label} is larger than the cap of {self.limits.max_bytes} bytes "
                            f"(at '{shown}')"
                        )
                    yield chunk

            self.bytes += tree.write(parts, shown, opened.st_mode, opened.st_mtime, chunks())
        finally:
            os.close(fd)
        return None

    def open_link_target(self, folder: int, rel: _Parts, entry: str) -> int:
        """Open, without following links, the file the link ``rel/entry`` names inside the
        folder; refuse a link that leaves it or passes through another link."""
        tree = self.tree
        shown = _show((*rel, entry))
        target = os.readlink(entry, dir_fd=folder)
        where = list(rel)
        if os.path.isabs(target):  # inside only when it names the folder by its real path
            if not target.startswith(self.src_real.rstrip("/") + "/"):
                raise tree.refuse(f"link '{shown}' points outside the folder")
            where, target = [], target[len(self.src_real.rstrip("/")) + 1 :]
        visited: list[_Parts] = []
        for part in target.split("/"):
            if part in ("", "."):
                continue
            if part == "..":
                if not where:
                    raise tree.refuse(f"link '{shown}' points outside the folder")
                where.pop()
            else:
                where.append(part)
                visited.append(tuple(where))
        # Every component the kernel would visit must be no link; the last one is opened.
        for path in visited:
            if path == tuple(where):
                continue
            st = self.lstat(path, shown)
            if st is not None and stat_mod.S_ISLNK(st.st_mode):
                raise tree.refuse(f"link '{shown}' passes through another link, '{_show(path)}'")
        if not where:
            raise tree.refuse(f"'{shown}' is a folder symlink")
        parent = self.open_src_dir(tuple(where[:-1]), shown)
        try:
            return os.open(where[-1], _READ_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise tree.refuse(
                    f"link '{shown}' names another link, '{_show(tuple(where))}'"
                ) from None
            if exc.errno == errno.ENOENT:
                raise tree.refuse(f"link '{shown}' names nothing ('{target}')") from None
            raise
        finally:
            os.close(parent)

    def open_src_dir(self, parts: _Parts, shown: str) -> int:
        fd = os.dup(self.top)
        try:
            for part in parts:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                raise self.tree.refuse(
                    f"link '{shown}' passes through a link or names nothing ('{_show(parts)}')"
                ) from None
            raise
        return fd

    def lstat(self, parts: _Parts, shown: str) -> os.stat_result | None:
        try:
            parent = self.open_src_dir(parts[:-1], shown)
        except InvalidArgumentError:
            return None
        try:
            return os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return None
        finally:
            os.close(parent)
