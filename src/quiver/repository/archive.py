"""Safe extraction of model archives (``.tar.gz``) and copies of model folders.

An archive comes from a bucket anyone with write access can fill, or from a client's
``POST /models``, so extraction trusts nothing in it, and does not trust Python's ``tarfile``
to write it either: ``tarfile``'s ``'data'`` filter judges links with ``os.path.realpath``,
which a chain of symlinks longer than PATH_MAX fools (CVE-2025-4517, and its family
CVE-2025-4138, CVE-2025-4330, CVE-2025-8194, CVE-2024-12718, on Python 3.11.7 among others).
``tarfile`` here only *parses* the stream; every byte is written by this module, and no link
is ever followed while writing, whatever the Python version:

- every path component is opened relative to the open folder above it, with
  ``O_DIRECTORY | O_NOFOLLOW`` (``openat``), created with ``mkdir(dir_fd=...)`` when
  missing; files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW``. The destination must be
  an empty folder (the disk cache makes a fresh one).
- member names: absolute names, ``..`` components (even when the path would stay inside: no
  model tool makes such an archive), NUL bytes, components longer than NAME_MAX (255 bytes),
  names too long to be opened by path in the cache (PATH_MAX less 128 bytes of room for the
  cache's rename of the folder) and names nested more than 128 folders deep are refused.
- types: folders and regular files are written; devices, FIFOs, sparse files and unknown
  types are refused (models never need them).
- duplicate names: a regular file replaces a regular file of the same name (unlink, then a
  new file: the last copy wins, as with ``tar``, and never by writing through a link); any
  other replacement (a folder, a link, a file by a folder) is refused.
- symbolic links are refused unless they resolve inside the archive without passing through
  another link: the target is relative (and shorter than PATH_MAX); resolved lexically from
  the link's folder it never climbs above the archive's top; every component it goes
  through is a folder of the archive (not a link, not a file, not a name the archive does
  not have: on a file system that ignores case ``a`` could be the link ``A``); and its last
  component is no symlink member (it may be missing: a dangling link stays inside). The
  folders holding a link are folders of the archive too, and no member may be written under
  a symlink member (``link/evil``). Symlinks are created last, after every folder and file,
  so while content is written the tree holds no link at all; ``O_NOFOLLOW`` is the second
  line. Together these make the kernel's resolution the lexical one, so a link cannot lead
  outside. Inner links are what tools produce (``huggingface`` snapshots:
  ``snapshots/<rev>/config.json -> ../../blobs/<hash>``).
- hard links must name a regular file member extracted before them (by its name in the
  archive, no ``..``, not a link); they are made with ``linkat`` on the open folders, which
  never follows a link (a copy where the file system refuses hard links).
- modes: files get ``0o644``, plus ``0o111`` when the member's owner may execute; folders
  ``0o755`` (both under the umask). No setuid, setgid or sticky bit, no group or other write.
  Member modification times are kept; owners are not.
- limits, checked while streaming, before the bytes reach the disk (:class:`ExtractLimits`):
  *expanded bytes* are the decompressed tar stream, counted by a reader around the gzip
  stream, so headers and padding count as much as file content (a bomb of empty members with
  large PAX headers is stopped like a bomb of zeros). A member's declared size is checked
  before its file is created; the count is checked after every read, so a header chain is
  stopped as it is read. The caps: total expanded bytes (``max_bytes``); the expansion ratio,
  expanded bytes over the archive's compressed size, once past ``ratio_floor`` (small test
  models of zeros still load); the number of members (``max_files``); metadata headers
  (PAX, GNU long names) larger than 1 MiB or chained more than 8 deep, refused before
  ``tarfile`` reads them into memory.

Extraction streams (``tarfile`` stream mode, 1 MiB copies): no member is read into memory
whole, and ``tarfile``'s list of parsed members is cleared as it goes. Every refusal is an
:class:`InvalidArgumentError` naming the archive and the member (400 on the v2 and SageMaker
routes). The destination is left partly written on error; callers extract into a temporary
folder and delete it (see :mod:`quiver.repository.cache`).

:func:`copy_folder` copies a local model folder under the same rules: every entry is opened
relative to its folder with ``O_NOFOLLOW`` and judged by ``fstat`` of the open descriptor (a
swap made between listing and opening is seen); a file symlink that resolves inside the
folder without passing through another link is copied as the file it names; other links,
folder symlinks and special files are refused.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import io
import os
import stat as stat_mod
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from quiver.errors import InternalError, InvalidArgumentError

DEFAULT_MAX_BYTES = 64 << 30  # the disk cache lowers it to its own size (see cache.py)
DEFAULT_MAX_FILES = 100_000
DEFAULT_MAX_RATIO = 100.0  # Apache POI's zip-bomb threshold (minimum inflate ratio 0.01)
DEFAULT_RATIO_FLOOR = 64 << 20  # the ratio applies once this many bytes are expanded
MAX_HEADER_BYTES = 1 << 20  # PAX / GNU long-name headers larger than this are refused
MAX_META_HEADERS = 8  # metadata headers in a row before one member (tarfile recurses on each)
NAME_MAX = 255
MAX_DEPTH = 128  # folders a member may be nested in (each is opened on its own)
PATH_ROOM = 128  # bytes of PATH_MAX kept free for the cache's longer final folder name
CHUNK = 1 << 20

_META_TYPES = frozenset(
    {tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE}
    | {tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK}
)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP})
_META_DEPTH = "_quiver_meta_depth"  # attribute on the TarFile: metadata headers in a row

_Parts = tuple[str, ...]
_DIR, _FILE, _SYMLINK, _HARDLINK = "folder", "file", "symlink", "hard link"


@dataclass(frozen=True, slots=True)
class ExtractLimits:
    """Caps on one extraction or copy; see the module docstring.

    ``max_bytes``: expanded bytes (the decompressed tar stream; a folder's file bytes).
    ``max_files``: members (folders and links included). ``max_ratio``: expanded bytes over
    the compressed archive's bytes, enforced once more than ``ratio_floor`` bytes are
    expanded; 0 turns it off.
    """

    max_bytes: int = DEFAULT_MAX_BYTES
    max_files: int = DEFAULT_MAX_FILES
    max_ratio: float = DEFAULT_MAX_RATIO
    ratio_floor: int = DEFAULT_RATIO_FLOOR


@dataclass(frozen=True, slots=True)
class ExtractResult:
    """What an extraction or copy produced: files (all members, folders included) and bytes
    of file content written."""

    files: int
    bytes: int


class _Refused(Exception):
    """A refusal found where the archive's name is not known; becomes InvalidArgumentError."""


class _GuardedTarInfo(tarfile.TarInfo):
    """Refuses, before ``tarfile`` processes them: metadata headers it would read into memory
    whole (larger than MAX_HEADER_BYTES), long chains of them (it recurses on each), and GNU
    sparse members in every format (their maps are read block by block into memory)."""

    def _proc_member(self, archive: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _META_TYPES:
            if self.size > MAX_HEADER_BYTES:
                raise _Refused(
                    f"metadata header of member '{self.name}' is {self.size} bytes, "
                    f"more than {MAX_HEADER_BYTES}"
                )
            depth = getattr(archive, _META_DEPTH, 0) + 1
            if depth > MAX_META_HEADERS:
                raise _Refused(f"more than {MAX_META_HEADERS} metadata headers in a row at '{self.name}'")
            setattr(archive, _META_DEPTH, depth)
        elif self.type == tarfile.GNUTYPE_SPARSE:
            raise _Refused(f"member '{self.name}' is a sparse file, which models never need")
        return super()._proc_member(archive)  # type: ignore[misc, no-any-return]

    def _sparse(self, *args: object) -> None:
        raise _Refused("a member is a sparse file (GNU PAX sparse headers), which models never need")

    _proc_gnusparse_00 = _proc_gnusparse_01 = _proc_gnusparse_10 = _sparse


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
            raise self.refuse(f"member '{_cut(name)}' has a name component longer than {self.name_max} bytes")
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
                raise self.refuse(f"member '{_cut(name)}' passes through the symlink '{_show(parts[: i + 1])}'")
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
            raise self.refuse(f"member '{_cut(name)}' ({kind}) would replace the {old.kind} of the same name")
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

    def write(self, parts: _Parts, name: str, mode: int, mtime: float | None, chunks: Iterator[bytes]) -> int:
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
                    raise self.refuse(f"member '{_cut(name)}': a file cannot be created there ({exc.strerror})") from None
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
                f"'{_show(target)}' is " + (f"a {node.kind}" if node else "not in the archive before it")
            )
        self.claim(parts, _HARDLINK, name)
        source = self.open_dir(target[:-1], name, create=False)
        try:
            folder = self.open_dir(parts[:-1], name)
            try:
                try:
                    os.link(target[-1], parts[-1], src_dir_fd=source, dst_dir_fd=folder, follow_symlinks=False)
                    return 0
                except OSError as exc:
                    if exc.errno not in _NO_HARD_LINKS:
                        raise
                src = os.open(target[-1], _READ_FLAGS, dir_fd=source)
                try:
                    st = os.fstat(src)
                    if not stat_mod.S_ISREG(st.st_mode):
                        raise self.refuse(f"hard link '{_cut(name)}': '{_show(target)}' is not a regular file")
                    dst = os.open(parts[-1], _NEW_FILE_FLAGS, stat_mod.S_IMODE(st.st_mode), dir_fd=folder)
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
            raise self.refuse(f"symlink '{_cut(name)}' points outside the archive ('{_cut(target)}' is absolute)")
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
                    raise self.refuse(f"symlink '{_cut(name)}' points outside the archive ('{_cut(target)}')")
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


# -- archives ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Budget:
    """Expanded bytes against the caps; ``member`` names where the stream is, for messages."""

    label: str
    limits: ExtractLimits
    compressed: int
    member: str = "(none yet)"
    count: int = 0
    ratio_cap: int = field(init=False)

    def __post_init__(self) -> None:
        ratio = self.limits.max_ratio
        self.ratio_cap = (
            max(self.limits.ratio_floor, int(ratio * self.compressed)) if ratio > 0 else 1 << 62
        )

    def check(self, total: int, declared: int = 0) -> None:
        if total > self.limits.max_bytes:
            what = f"member '{self.member}' of {declared} bytes" if declared else f"at member '{self.member}'"
            raise InvalidArgumentError(
                f"{self.label} expands past the cap of {self.limits.max_bytes} bytes "
                f"({what} after {total - declared} bytes)"
            )
        if total > self.ratio_cap:
            what = f"member '{self.member}' of {declared} bytes" if declared else f"at member '{self.member}'"
            raise InvalidArgumentError(
                f"{self.label} expands more than {self.limits.max_ratio:g} times its "
                f"{self.compressed} compressed bytes (past {self.ratio_cap} bytes: {what} "
                f"after {total - declared} bytes)"
            )


class _CountingReader:
    """The decompressed tar stream, counted and checked against the budget on every read
    (what ``tarfile``'s stream mode needs of a file: ``read``; the rest is never called)."""

    def __init__(self, raw: gzip.GzipFile, budget: _Budget) -> None:
        self.raw = raw
        self.budget = budget

    def read(self, size: int = -1, /) -> bytes:
        data = self.raw.read(size)
        self.budget.count += len(data)
        self.budget.check(self.budget.count)
        return data

    def write(self, b: bytes, /) -> int:
        raise io.UnsupportedOperation("write")

    def tell(self) -> int:
        return self.budget.count

    def seek(self, pos: int, /) -> int:
        raise io.UnsupportedOperation("seek")

    def close(self) -> None:
        pass


def extract_archive(
    archive: Path, dest: Path, *, limits: ExtractLimits | None = None, name: str | None = None
) -> ExtractResult:
    """Extract the ``.tar.gz`` file ``archive`` into the existing, empty folder ``dest``.

    ``name`` is what error messages call the archive (its storage key); the file name by
    default. Raises :class:`InvalidArgumentError` for an archive that is not a tar.gz, is
    empty, or holds a member refused by the rules in this module's docstring; ``OSError``
    (a full disk) passes through.
    """
    limits = limits or ExtractLimits()
    label = f"archive '{name or archive.name}'"
    files = 0
    written = 0
    with open(archive, "rb") as raw:
        budget = _Budget(label, limits, os.fstat(raw.fileno()).st_size)
        root = _open_root(dest, label)
        tree = _Tree(root, label, len(os.fsencode(os.path.abspath(dest))))
        try:
            with (
                gzip.GzipFile(fileobj=raw, mode="rb") as unzipped,
                tarfile.open(
                    fileobj=_CountingReader(unzipped, budget),
                    mode="r|",
                    tarinfo=_GuardedTarInfo,
                ) as tar,
            ):
                while True:
                    setattr(tar, _META_DEPTH, 0)
                    member = tar.next()
                    if member is None:
                        break
                    tar.members.clear()  # type: ignore[attr-defined]  # stream mode keeps them all
                    files += 1
                    budget.member = member.name
                    if files > limits.max_files:
                        raise InvalidArgumentError(
                            f"{label} has more than {limits.max_files} members (stopped at '{member.name}')"
                        )
                    written += _extract_member(tar, member, tree, budget)
            tree.make_symlinks()
        except _Refused as exc:
            raise tree.refuse(str(exc)) from None
        except RecursionError:
            raise tree.refuse("metadata headers nested too deep") from None
        except (gzip.BadGzipFile, zlib.error, EOFError) as exc:
            raise InvalidArgumentError(f"{label} is not a valid tar.gz: {exc}") from None
        except tarfile.TarError as exc:
            if files == 0:
                raise InvalidArgumentError(f"{label} is not a valid tar.gz: {exc}") from None
            raise InvalidArgumentError(f"{label} is corrupt after {files} members: {exc}") from None
        except OSError as exc:
            if exc.errno in (errno.ENAMETOOLONG, errno.EILSEQ, errno.EINVAL):
                raise tree.refuse(f"member '{_cut(budget.member)}' cannot be written: {exc.strerror}") from None
            raise
        finally:
            tree.close()
            os.close(root)
    if files == 0:
        raise InvalidArgumentError(f"{label} is empty")
    return ExtractResult(files, written)


def _extract_member(tar: tarfile.TarFile, member: tarfile.TarInfo, tree: _Tree, budget: _Budget) -> int:
    """Write one member (a symlink is only recorded); the bytes of content written."""
    name = member.name
    parts = tree.check_name(name)
    if member.isdir():
        if parts:
            tree.mkdir(parts, name)
        return 0
    if not parts:
        raise tree.refuse(f"member '{name}' names the archive's top folder but is not a folder")
    if member.issym() or member.islnk():
        if "\0" in member.linkname:
            raise tree.refuse(f"link {name!r} has a NUL byte in its target")
        if member.issym():
            tree.defer_symlink(parts, member.linkname, name)
            return 0
        target = member.linkname
        if _is_absolute(target) or _has_dotdot(target):
            raise tree.refuse(f"hard link '{name}' points outside the archive ('{target}')")
        copied = tree.hard_link(parts, tree.check_name(target), name)
        budget.check(budget.count + copied, copied)
        return copied
    if member.ischr() or member.isblk() or member.isfifo() or member.isdev():
        raise tree.refuse(f"member '{name}' is a device or FIFO, which models never need")
    if member.issparse():
        raise tree.refuse(f"member '{name}' is a sparse file, which models never need")
    if not member.isreg():
        raise tree.refuse(f"member '{name}' has an unsupported type {member.type!r}")
    budget.check(budget.count + member.size, member.size)
    source = tar.extractfile(member)
    if source is None:  # pragma: no cover - isreg() members always have content
        raise tree.refuse(f"member '{name}' has no content")

    def chunks() -> Iterator[bytes]:
        with source:
            while chunk := source.read(CHUNK):
                yield chunk

    return tree.write(parts, name, member.mode, member.mtime, chunks())


# -- folders -----------------------------------------------------------------------------------


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
            raise InvalidArgumentError(f"{label}: an entry was replaced by a link while copying") from None
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
                raise tree.refuse(f"link '{shown}' names another link, '{_show(tuple(where))}'") from None
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
