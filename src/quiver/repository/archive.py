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

The no-follow writer is :mod:`quiver.repository.nofollow`; the caps are
:mod:`quiver.repository.limits`. :func:`copy_folder` (:mod:`quiver.repository.folder_copy`,
re-exported here) copies a local model folder under the same rules.
"""

from __future__ import annotations

import errno
import gzip
import io
import os
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from quiver.errors import InvalidArgumentError
from quiver.repository.folder_copy import copy_folder
from quiver.repository.limits import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_FILES,
    DEFAULT_MAX_RATIO,
    DEFAULT_RATIO_FLOOR,
    ExtractLimits,
    ExtractResult,
)
from quiver.repository.nofollow import (
    CHUNK,
    _cut,
    _has_dotdot,
    _is_absolute,
    _open_root,
    _Refused,
    _Tree,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_FILES",
    "DEFAULT_MAX_RATIO",
    "DEFAULT_RATIO_FLOOR",
    "ExtractLimits",
    "ExtractResult",
    "copy_folder",
    "extract_archive",
]

MAX_HEADER_BYTES = 1 << 20  # PAX / GNU long-name headers larger than this are refused
MAX_META_HEADERS = 8  # metadata headers in a row before one member (tarfile recurses on each)

_META_TYPES = frozenset(
    {tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE}
    | {tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK}
)
_META_DEPTH = "_quiver_meta_depth"  # attribute on the TarFile: metadata headers in a row


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
