"""The no-follow writer both extraction and folder copies write through (:class:`_Tree`).

Every path component is opened relative to the open folder above it with
``O_DIRECTORY | O_NOFOLLOW`` (``openat``), created with ``mkdir(dir_fd=...)`` when missing;
files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW``; hard links are made with ``linkat``
on the open folders; symlinks are recorded and created last, once they are known to resolve
inside the tree without passing through another link. The rules themselves (names, types,
duplicates, links, modes) are listed in :mod:`quiver.repository.archive`'s docstring. Also
the small helpers the two callers share: member names as components, descriptor copies,
file modes and the empty-destination check.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat as stat_mod
from collections.abc import Iterator
from pathlib import Path

from quiver.errors import InternalError, InvalidArgumentError

NAME_MAX = 255
MAX_DEPTH = 128  # folders a member may be nested in (each is opened on its own)
PATH_ROOM = 128  # bytes of PATH_MAX kept free for the cache's longer final folder name
CHUNK = 1 << 20

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NO_HARD_LINKS = frozenset(
    {errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP}
)

_Parts = tuple[str, ...]
_DIR, _FILE, _SYMLINK, _HARDLINK = "folder", "file", "symlink", "hard link"


class _Refused(Exception):
    """A refusal found where the archive's name is not known; becomes InvalidArgumentError."""


# -- names -------------------------------------------------------------------------------------


def _has_dotdot(name: str) -> bool:
    return ".." in name.replace("\\", "/").split("/")


def _is_absolute(name: str) -> bool:
    return name.startswith(("/", "\\")) or os.path.isabs(name) or (len(name) > 1 and name[1] == ":")


def _parts(name: str) -> _Parts:
    """``name``'s components, without empty and ``.`` ones (``./a//b/`` is ``('a', 'b')``)."""
    return tuple(p for p in name.split("/") if p not in ("", "."))


def _show(parts: _Parts) -> str:
    return "/".join(parts) or "."


# -- writing under one folder ------------------------------------------------------------------


class _Node:
    """One name in the tree an extraction makes: its kind and, for a folder, its children."""

    __slots__ = ("children", "kind")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.children: dict[str, _Node] = {}


class _Tree:
    """Writes folders, files and links under the open folder ``root``, never following a link.

    Keeps a tree of what this writer made (or will make, for deferred symlinks), so the rules
    on links are decided from the archive's own members in time linear in a name's length;
    and the open descriptors along the last folder it walked (at most MAX_DEPTH), so the next
    walk starts from the deepest folder the two share (one ``openat`` per member when files
    come folder by folder, as tools write them).
    """

    def __init__(self, root: int, label: str, path_len: int) -> None:
        self.root = root
        self.label = label
        self.name_max = _pathconf(root, "PC_NAME_MAX", NAME_MAX)
        # Every file must stay openable by path, also once the cache renames the folder.
        self.path_left = _pathconf(root, "PC_PATH_MAX", 4096) - PATH_ROOM - path_len - 1
        self.top = _Node(_DIR)
        self.symlinks: list[tuple[_Parts, str, str]] = []  # (parts, target, member name)
        self.chain: list[int] = []  # descriptors of chain_parts[:1], chain_parts[:2], ...
        self.chain_parts: _Parts = ()

    def refuse(self, message: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{self.label}: {message}")

    def close(self) -> None:
        for fd in self.chain:
            os.close(fd)
        self.chain.clear()
        self.chain_parts = ()

    # -- checks

    def check_name(self, name: str) -> _Parts:
        if "\0" in name:
            raise self.refuse(f"member {name!r} has a NUL byte in its name")
        if _is_absolute(name):
            raise self.refuse(f"member '{_cut(name)}' has an absolute path")
        if _has_dotdot(name):
            raise self.refuse(f"member '{_cut(name)}' contains '..'")
        parts = _parts(name)
        encoded = os.fsencode("/".join(parts))
        if len(encoded) > self.path_left:
            raise self.refuse(
                f"member '{_cut(name)}' has a name longer than the model cache's folder allows "
                f"({self.path_left} bytes)"
            )
        if len(parts) > MAX_DEPTH:
            raise self.refuse(f"member '{_cut(name)}' is nested more than {MAX_DEPTH} folders deep")
        if max(map(len, encoded.split(b"/"))) > self.name_max:
            raise self.refuse(
                f"member '{_cut(name)}' has a name component longer than {self.name_max} bytes"
            )
        return parts

    def lookup(self, parts: _Parts) -> _Node | None:
        node: _Node | None = self.top
        for part in parts:
            if node is None:
                return None
            node = node.children.get(part)
        return node

    def parent(self, parts: _Parts, name: str) -> _Node:
        """The node of the folder holding ``parts``: every folder above it must be a folder of
        the archive, never a link or a file (missing ones are recorded as folders)."""
        node = self.top
        for i, part in enumerate(parts[:-1]):
            child = node.children.get(part)
            if child is None:
                child = node.children[part] = _Node(_DIR)
            elif child.kind == _SYMLINK:
                raise self.refuse(
                    f"member '{_cut(name)}' passes through the symlink '{_show(parts[: i + 1])}'"
                )
            elif child.kind != _DIR:
                raise self.refuse(
                    f"member '{_cut(name)}' is under '{_show(parts[: i + 1])}', which is a {child.kind}"
                )
            node = child
        return node

    def claim(self, parts: _Parts, kind: str, name: str) -> str | None:
        """Record ``parts`` as ``kind``; the kind it had (a file replaced by a file, a folder
        named again); refuses every other replacement."""
        folder = self.parent(parts, name)
        old = folder.children.get(parts[-1])
        if old is None:
            folder.children[parts[-1]] = _Node(kind)
            return None
        if not (old.kind == kind and kind in (_DIR, _FILE)):
            raise self.refuse(
                f"member '{_cut(name)}' ({kind}) would replace the {old.kind} of the same name"
            )
        return old.kind

    # -- disk

    def open_dir(self, parts: _Parts, name: str, *, create: bool = True) -> int:
        """A new descriptor of the folder ``parts``, each component opened without following
        a link, created when missing (``create``)."""
        shared = 0
        for mine, last in zip(parts, self.chain_parts, strict=False):
            if mine != last:
                break
            shared += 1
        while len(self.chain) > shared:
            os.close(self.chain.pop())
        try:
            for part in parts[shared:]:
                fd = self.chain[-1] if self.chain else self.root
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(part, 0o755, dir_fd=fd)
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                self.chain.append(child)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EEXIST):
                raise self.refuse(
                    f"member '{_cut(name)}': '{_show(parts)}' is not a folder of the archive ({exc.strerror})"
                ) from None
            raise
        finally:
            self.chain_parts = parts[: len(self.chain)]
        return os.dup(self.chain[-1] if self.chain else self.root)

    def mkdir(self, parts: _Parts, name: str) -> None:
        self.claim(parts, _DIR, name)
        os.close(self.open_dir(parts, name))

    def write(
        self, parts: _Parts, name: str, mode: int, mtime: float | None, chunks: Iterator[bytes]
    ) -> int:
        """Create the file ``parts`` from ``chunks``; the bytes written."""
        old = self.claim(parts, _FILE, name)
        folder = self.open_dir(parts[:-1], name)
        try:
            if old is not None:
                os.unlink(parts[-1], dir_fd=folder)
            try:
                fd = os.open(parts[-1], _NEW_FILE_FLAGS, _file_mode(mode), dir_fd=folder)
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ELOOP, errno.EISDIR):
                    raise self.refuse(
                        f"member '{_cut(name)}': a file cannot be created there ({exc.strerror})"
                    ) from None
                raise
        finally:
            os.close(folder)
        written = 0
        try:
            for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                written += len(chunk)
            if mtime is not None:
                with contextlib.suppress(OSError, OverflowError, ValueError):
                    os.utime(fd, (mtime, mtime))
        finally:
            os.close(fd)
        return written

    def hard_link(self, parts: _Parts, target: _Parts, name: str) -> int:
        """Link ``parts`` to the regular file ``target`` made earlier; the bytes copied when the
        file system refuses hard links (0 when linked)."""
        node = self.lookup(target)
        if node is None or node.kind != _FILE:
            raise self.refuse(
                f"hard link '{_cut(name)}' must name a regular file extracted before it; "
                f"'{_show(target)}' is "
                + (f"a {node.kind}" if node else "not in the archive before it")
            )
        self.claim(parts, _HARDLINK, name)
        source = self.open_dir(target[:-1], name, create=False)
        try:
            folder = self.open_dir(parts[:-1], name)
            try:
                try:
                    os.link(
                        target[-1],
                        parts[-1],
                        src_dir_fd=source,
                        dst_dir_fd=folder,
                        follow_symlinks=False,
                    )
                    return 0
                except OSError as exc:
                    if exc.errno not in _NO_HARD_LINKS:
                        raise
                src = os.open(target[-1], _READ_FLAGS, dir_fd=source)
                try:
                    st = os.fstat(src)
                    if not stat_mod.S_ISREG(st.st_mode):
                        raise self.refuse(
                            f"hard link '{_cut(name)}': '{_show(target)}' is not a regular file"
                        )
                    dst = os.open(
                        parts[-1], _NEW_FILE_FLAGS, stat_mod.S_IMODE(st.st_mode), dir_fd=folder
                    )
                    try:
                        return _copy_fd(src, dst, st.st_size)
                    finally:
                        os.close(dst)
                finally:
                    os.close(src)
            finally:
                os.close(folder)
        finally:
            os.close(source)

    def defer_symlink(self, parts: _Parts, target: str, name: str) -> None:
        """Check what can be checked now and make the link once every member is written."""
        if not target or "\0" in target:
            raise self.refuse(f"symlink {_cut(name)!r} has an empty target or a NUL byte in it")
        if _is_absolute(target):
            raise self.refuse(
                f"symlink '{_cut(name)}' points outside the archive ('{_cut(target)}' is absolute)"
            )
        if len(os.fsencode(target)) >= 4096:
            raise self.refuse(f"symlink '{_cut(name)}' has a target longer than PATH_MAX")
        self.claim(parts, _SYMLINK, name)
        self.symlinks.append((parts, target, name))

    def resolve_symlink(self, parts: _Parts, target: str, name: str) -> None:
        """Refuse a link whose target, resolved lexically from its folder, climbs above the
        archive, goes through anything but folders of the archive, or names a symlink member.

        Every folder it goes through is one this extraction made (so the kernel's ``..`` is
        the lexical one, and no name of a file system that ignores case can stand for a link);
        only its last component may be missing (a dangling link stays inside).
        """
        names = list(parts[:-1])
        nodes: list[_Node | None] = [self.top]
        for part in parts[:-1]:
            nodes.append(nodes[-1].children.get(part) if nodes[-1] is not None else None)
        steps = [p for p in target.split("/") if p not in ("", ".")]
        shown = f"symlink '{_cut(name)}' -> '{_cut(target)}'"
        for i, part in enumerate(steps):
            if part == "..":
                if not names:
                    raise self.refuse(
                        f"symlink '{_cut(name)}' points outside the archive ('{_cut(target)}')"
                    )
                names.pop()
                nodes.pop()
                continue
            above = nodes[-1]
            node = above.children.get(part) if above is not None else None
            names.append(part)
            nodes.append(node)
            if node is not None and node.kind == _SYMLINK:
                raise self.refuse(f"{shown} passes through another link, '{_show(tuple(names))}'")
            if i < len(steps) - 1 and (node is None or node.kind != _DIR):
                what = f"a {node.kind}" if node is not None else "not in the archive"
                raise self.refuse(f"{shown} goes through '{_show(tuple(names))}', which is {what}")

    def make_symlinks(self) -> None:
        for parts, target, name in self.symlinks:
            self.resolve_symlink(parts, target, name)
        for parts, target, name in self.symlinks:
            folder = self.open_dir(parts[:-1], name)
            try:
                os.symlink(target, parts[-1], dir_fd=folder)
            except FileExistsError:
                raise self.refuse(f"symlink '{_cut(name)}': the name is taken") from None
            finally:
                os.close(folder)


def _pathconf(fd: int, name: str, default: int) -> int:
    try:
        return os.pathconf(fd, name)
    except (OSError, ValueError):
        return default


def _cut(name: str) -> str:
    return name if len(name) <= 200 else f"{name[:200]}..."


def _file_mode(mode: int) -> int:
    return 0o755 if mode & 0o100 else 0o644


def _copy_fd(src: int, dst: int, limit: int) -> int:
    copied = 0
    while copied < limit:
        chunk = os.read(src, min(CHUNK, limit - copied))
        if not chunk:
            break
        view = memoryview(chunk)
        while view:
            view = view[os.write(dst, view) :]
        copied += len(chunk)
    return copied


def _open_root(dest: Path, label: str) -> int:
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    if os.listdir(fd):
        os.close(fd)
        raise InternalError(f"{label}: the destination folder {dest} is not empty")
    return fd
