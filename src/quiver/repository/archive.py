"""Safe extraction of model archives (``.tar.gz``) and copies of model folders.

An archive comes from a bucket anyone with write access can fill, so extraction trusts
nothing in it:

- member names that are absolute or contain a ``..`` component are refused (even when the
  path would stay inside: such an archive is not one a model tool made);
- links: symbolic and hard links are allowed only when they resolve inside the destination
  (Python's ``tarfile`` ``'data'`` filter semantics); a link that is absolute or points
  outside is refused. Triton repositories built by tools (``huggingface`` snapshots, for
  one) do carry inner links, and the filter makes writing through a link impossible;
- devices, FIFOs and other special files are refused; permissions are normalised by the
  ``'data'`` filter (no setuid, no group/other write);
- caps on the total bytes extracted and the number of members: the declared size of each
  member is checked *before* a byte of it is written, so a gzip bomb stops at the cap
  instead of filling the disk, and oversized metadata headers (PAX, GNU long names) are
  refused before ``tarfile`` reads them into memory.

Extraction streams (``tarfile`` stream mode, 16 KiB copies): no member is read into memory
whole. Every refusal is an :class:`InvalidArgumentError` naming the archive and the member.
The destination is left partly written on error; callers extract into a temporary folder
and delete it (see :mod:`quiver.repository.cache`).
"""

from __future__ import annotations

import gzip
import os
import shutil
import stat as stat_mod
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from quiver.errors import InvalidArgumentError

DEFAULT_MAX_BYTES = 64 << 30
DEFAULT_MAX_FILES = 100_000
MAX_HEADER_BYTES = 1 << 20  # PAX / GNU long-name headers larger than this are refused

_META_TYPES = frozenset(
    {tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE}
    | {tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK}
)


@dataclass(frozen=True, slots=True)
class ExtractLimits:
    """Caps on one extraction: total bytes of file content and number of members."""

    max_bytes: int = DEFAULT_MAX_BYTES
    max_files: int = DEFAULT_MAX_FILES


@dataclass(frozen=True, slots=True)
class ExtractResult:
    """What an extraction or copy produced: files (all members, folders included) and bytes."""

    files: int
    bytes: int


class _HeaderTooLarge(Exception):
    def __init__(self, name: str, size: int) -> None:
        super().__init__(name)
        self.name = name
        self.size = size


class _GuardedTarInfo(tarfile.TarInfo):
    """Refuses metadata headers whose payload ``tarfile`` would read into memory whole."""

    def _proc_member(self, tarfile: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _META_TYPES and self.size > MAX_HEADER_BYTES:
            raise _HeaderTooLarge(self.name, self.size)
        return super()._proc_member(tarfile)  # type: ignore[misc, no-any-return]


def _has_dotdot(name: str) -> bool:
    return ".." in name.replace("\\", "/").split("/")


def _check_member(archive: str, member: tarfile.TarInfo) -> None:
    name = member.name
    if name.startswith(("/", "\\")) or os.path.isabs(name) or (len(name) > 1 and name[1] == ":"):
        raise InvalidArgumentError(f"archive '{archive}': member '{name}' has an absolute path")
    if _has_dotdot(name):
        raise InvalidArgumentError(f"archive '{archive}': member '{name}' contains '..'")
    if member.issym() or member.islnk():
        kind = "symlink" if member.issym() else "hard link"
        target = member.linkname
        if member.islnk() and (target.startswith("/") or _has_dotdot(target)):
            raise InvalidArgumentError(
                f"archive '{archive}': {kind} '{name}' points outside the archive ('{target}')"
            )
    elif member.ischr() or member.isblk() or member.isfifo() or member.isdev():
        raise InvalidArgumentError(
            f"archive '{archive}': member '{name}' is a device or FIFO, which models never need"
        )
    elif not (member.isreg() or member.isdir()):
        raise InvalidArgumentError(
            f"archive '{archive}': member '{name}' has an unsupported type {member.type!r}"
        )


def extract_archive(
    archive: Path, dest: Path, *, limits: ExtractLimits | None = None, name: str | None = None
) -> ExtractResult:
    """Extract the ``.tar.gz`` file ``archive`` into the existing folder ``dest``.

    ``name`` is what error messages call the archive (its storage key); the file name by
    default. Raises :class:`InvalidArgumentError` for an archive that is not a tar.gz, is
    empty, or holds a member refused by the rules in this module's docstring; ``OSError``
    (a full disk) passes through.
    """
    limits = limits or ExtractLimits()
    label = name or archive.name
    dest_real = os.path.realpath(dest)
    files = 0
    total = 0
    try:
        with (
            open(archive, "rb") as raw,
            gzip.GzipFile(fileobj=raw, mode="rb") as unzipped,
            tarfile.open(fileobj=unzipped, mode="r|", tarinfo=_GuardedTarInfo) as tar,
        ):
            for member in tar:
                files += 1
                if files > limits.max_files:
                    raise InvalidArgumentError(
                        f"archive '{label}' has more than {limits.max_files} members "
                        f"(stopped at '{member.name}')"
                    )
                _check_member(label, member)
                if member.isreg():
                    if total + member.size > limits.max_bytes:
                        raise InvalidArgumentError(
                            f"archive '{label}' expands past the cap of {limits.max_bytes} bytes "
                            f"(member '{member.name}' of {member.size} bytes after {total} bytes)"
                        )
                    total += member.size
                try:
                    safe = tarfile.data_filter(member, dest_real)
                except tarfile.FilterError as exc:
                    raise InvalidArgumentError(
                        f"archive '{label}': member '{member.name}' refused: {exc}"
                    ) from None
                tar.extract(safe, dest_real, set_attrs=True, filter="fully_trusted")
    except _HeaderTooLarge as exc:
        raise InvalidArgumentError(
            f"archive '{label}': metadata header of member '{exc.name}' is {exc.size} bytes, "
            f"more than {MAX_HEADER_BYTES}"
        ) from None
    except (gzip.BadGzipFile, zlib.error, EOFError) as exc:
        raise InvalidArgumentError(f"archive '{label}' is not a valid tar.gz: {exc}") from None
    except tarfile.TarError as exc:
        if files == 0:
            raise InvalidArgumentError(
                f"archive '{label}' is not a valid tar.gz: {exc}"
            ) from None
        raise InvalidArgumentError(
            f"archive '{label}' is corrupt after {files} members: {exc}"
        ) from None
    if files == 0:
        raise InvalidArgumentError(f"archive '{label}' is empty")
    return ExtractResult(files, total)


def copy_folder(src: Path, dest: Path, *, limits: ExtractLimits | None = None) -> ExtractResult:
    """Copy the model folder ``src`` into the folder ``dest`` (created if missing), under the same caps.

    File symlinks that resolve inside ``src`` are copied as the files they name; links that
    leave ``src``, folder symlinks and special files are refused (as archives' are).
    """
    limits = limits or ExtractLimits()
    src_real = os.path.realpath(src)
    dest.mkdir(parents=True, exist_ok=True)
    files = 0
    total = 0
    for folder, dirs, names in os.walk(src_real):
        rel = os.path.relpath(folder, src_real)
        target_folder = dest if rel == "." else dest / rel
        for entry in sorted(dirs) + sorted(names):
            path = os.path.join(folder, entry)
            shown = os.path.normpath(os.path.join(rel, entry))
            files += 1
            if files > limits.max_files:
                raise InvalidArgumentError(
                    f"folder '{src}' has more than {limits.max_files} entries (stopped at '{shown}')"
                )
            if os.path.islink(path):
                real = os.path.realpath(path)
                if os.path.commonpath([real, src_real]) != src_real:
                    raise InvalidArgumentError(
                        f"folder '{src}': link '{shown}' points outside the folder"
                    )
                if os.path.isdir(real):
                    raise InvalidArgumentError(f"folder '{src}': '{shown}' is a folder symlink")
            st = os.stat(path)
            if stat_mod.S_ISDIR(st.st_mode):
                (target_folder / entry).mkdir(exist_ok=True)
                continue
            if not stat_mod.S_ISREG(st.st_mode):
                raise InvalidArgumentError(f"folder '{src}': '{shown}' is not a regular file")
            if total + st.st_size > limits.max_bytes:
                raise InvalidArgumentError(
                    f"folder '{src}' is larger than the cap of {limits.max_bytes} bytes "
                    f"(at '{shown}')"
                )
            total += st.st_size
            shutil.copyfile(path, target_folder / entry)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
    return ExtractResult(files, total)
