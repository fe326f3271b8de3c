"""Safe extraction: hostile archives, built here with ``tarfile``, are refused with a message
naming archive and member, and nothing is ever created outside the destination; good
archives (inner links included) extract intact."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import sys
import tarfile
from pathlib import Path

import pytest

from quiver.errors import InternalError, InvalidArgumentError
from quiver.repository.archive import ExtractLimits, copy_folder, extract_archive
from support.archives import cve_2025_4517_archive

Member = tuple[tarfile.TarInfo, bytes | None]


def make_tar(path: Path, members: list[Member], *, fmt: int = tarfile.PAX_FORMAT, level: int = 6) -> Path:
    with tarfile.open(path, "w:gz", format=fmt, compresslevel=level) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def file(name: str, data: bytes = b"x", mode: int = 0o644) -> Member:
    info = tarfile.TarInfo(name)
    info.mode = mode
    return info, data


def folder(name: str, mode: int = 0o755) -> Member:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = mode
    return info, None


def link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> Member:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info, None


def hard(name: str, target: str) -> Member:
    return link(name, target, tarfile.LNKTYPE)


def pax(name: str, headers: dict[str, str], data: bytes | None = b"") -> Member:
    info = tarfile.TarInfo(name)
    info.pax_headers = headers
    return info, data


class Box:
    """A destination three folders below a sentinel folder ``outside`` that holds a file
    ``flag``: ``snapshot()`` lists everything under ``outside`` but the destination (names,
    kinds, contents), to compare before and after an extraction."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.outside = tmp_path / "outside"
        self.dest = self.outside / "l1" / "l2" / "dest"
        self.dest.mkdir(parents=True)
        (self.outside / "flag").write_bytes(b"original")
        self.archive = tmp_path / "evil.tar.gz"

    def snapshot(self) -> dict[str, str]:
        seen: dict[str, str] = {}
        for folder, dirs, files in os.walk(self.tmp):
            here = Path(folder)
            if here == self.dest:
                dirs[:] = []
                continue
            for name in dirs + files:
                path = here / name
                rel = str(path.relative_to(self.tmp))
                if path == self.dest or path == self.archive:
                    continue
                if path.is_symlink():
                    seen[rel] = "-> " + os.readlink(path)
                elif path.is_file():
                    seen[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
                else:
                    seen[rel] = "dir"
        return seen

    def fresh_dest(self) -> Path:
        for folder, dirs, files in os.walk(self.dest, topdown=False):
            for name in files:
                os.unlink(os.path.join(folder, name))
            for name in dirs:
                path = os.path.join(folder, name)
                os.unlink(path) if os.path.islink(path) else os.rmdir(path)
        return self.dest

    def refused(self, members: list[Member] | bytes, match: str, limits: ExtractLimits | None = None) -> str:
        if isinstance(members, bytes):
            self.archive.write_bytes(members)
        else:
            make_tar(self.archive, members)
        before = self.snapshot()
        with pytest.raises(InvalidArgumentError, match=match) as info:
            extract_archive(self.archive, self.fresh_dest(), limits=limits, name="models/evil.tar.gz")
        assert "archive 'models/evil.tar.gz'" in str(info.value)
        assert self.snapshot() == before, "a file was created or changed outside the destination"
        assert (self.outside / "flag").read_bytes() == b"original"
        return str(info.value)


@pytest.fixture
def box(tmp_path: Path) -> Box:
    return Box(tmp_path)


# -- CVE-2025-4517 ---------------------------------------------------------------------------


def test_the_poc_escapes_this_pythons_tarfile(tmp_path: Path) -> None:
    """The proof that the archive below is a real attack here: Python's own extraction with
    the 'data' filter writes outside its folder (skipped on a Python whose tarfile is fixed)."""
    box = Box(tmp_path)
    box.archive.write_bytes(cve_2025_4517_archive(len(str(box.dest))))
    try:
        with tarfile.open(box.archive) as tar:
            tar.extractall(box.dest, filter="data")
    except (tarfile.TarError, OSError) as exc:
        pytest.skip(f"this Python's tarfile refuses the proof of concept: {exc!r}")
    if not (box.outside / "pwned").exists():
        pytest.skip(f"this Python's tarfile ({sys.version.split()[0]}) is not fooled by the proof of concept")
    assert (box.outside / "pwned").read_bytes() == b"pwned"
    assert (box.outside / "flag").read_bytes() == b"overwritten"


def test_cve_2025_4517_symlink_chain_past_path_max_is_refused(box: Box) -> None:
    message = box.refused(cve_2025_4517_archive(len(str(box.dest))), r"passes through the symlink 'a'")
    assert "member 'a/b/c/d/e/f/g/h/i/j/k/l/m/n/o/p/lll" in message
    assert not list(box.dest.rglob("*pwned*")) and not list(box.dest.rglob("flaglink"))


def test_cve_2025_4517_inside_a_model_folder(box: Box) -> None:
    archive = cve_2025_4517_archive(len(str(box.dest)), prefix="model/")
    box.refused(archive, r"member 'model/a/b/.*' passes through the symlink 'model/a'")


def test_the_chain_without_long_names_is_refused_at_its_first_step(box: Box) -> None:
    box.refused(
        [folder("d"), link("a", "d"), folder("d/d"), link("d/b", "d"), link("a/b/up", "../../../.."),
         file("a/b/up/escaped", b"pwned")],
        r"member 'a/b/up' passes through the symlink 'a'",
    )  # fmt: skip


# -- names -----------------------------------------------------------------------------------


def test_dotdot_is_refused(box: Box) -> None:
    box.refused([file("model/../../../../escaped", b"pwn")], r"member '.*escaped' contains '\.\.'")


def test_dotdot_staying_inside_is_refused_too(box: Box) -> None:
    box.refused([file("a/../b")], r"member 'a/\.\./b' contains")


@pytest.mark.parametrize("name", ["/tmp/escaped", "\\escaped", "C:/escaped"])
def test_absolute_path_is_refused(box: Box, name: str) -> None:
    box.refused([file(name)], "absolute path")


def test_absolute_path_into_the_sentinel_is_refused(box: Box) -> None:
    box.refused([file(str(box.outside / "escaped"))], "absolute path")


def test_nul_in_a_name_is_refused(box: Box) -> None:
    box.refused([pax("m/a", {"path": "m/a\x00b"}, b"x")], r"NUL byte")
    box.refused([_sym_pax("m/l", "x\x00y")], r"NUL byte")


def _sym_pax(name: str, target: str) -> Member:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.pax_headers = {"linkpath": target}
    return info, None


def test_overlong_names_are_refused(box: Box) -> None:
    box.refused([file("m/" + "x" * 300)], r"name component longer than 255 bytes")
    deep = "/".join(["y" * 250] * 20)
    box.refused([file(deep)], r"name longer than the model cache's folder allows")


# -- links -----------------------------------------------------------------------------------


def test_symlink_out_is_refused(box: Box) -> None:
    box.refused([link("model/link", "../../escaped")], r"symlink 'model/link' points outside the archive")
    box.refused([link("up", "..")], r"symlink 'up' points outside the archive")


def test_absolute_symlink_is_refused(box: Box) -> None:
    box.refused([link("model/link", "/etc/passwd")], r"symlink 'model/link' points outside.*absolute")


def test_symlink_through_another_symlink_is_refused(box: Box) -> None:
    box.refused(
        [folder("sub"), file("sub/f"), link("a", "sub"), link("b", "a/f")],
        r"symlink 'b' -> 'a/f' passes through another link, 'a'",
    )
    box.refused([file("f"), link("a", "f"), link("b", "a")], r"symlink 'b' -> 'a' passes through another link")
    box.refused([link("loop", "loop")], r"symlink 'loop' -> 'loop' passes through another link")
    box.refused(
        [folder("x"), link("x/a", "."), link("b", "x/a/../../..")],
        r"symlink 'b' -> 'x/a/\.\./\.\./\.\.' passes through another link, 'x/a'",
    )


def test_member_written_through_a_symlink_member_is_refused(box: Box) -> None:
    box.refused([folder("sub"), link("link", "sub"), file("link/evil")], r"member 'link/evil' passes through the symlink 'link'")
    box.refused([link("dir", ".."), file("dir/escaped")], r"'dir/escaped' passes through the symlink 'dir'")
    # The other order: the folder is made first, then the link may not replace it.
    box.refused([file("link/evil"), link("link", "..")], r"member 'link' \(symlink\) would replace the folder")


def test_hardlink_out_is_refused(box: Box) -> None:
    box.refused([hard("model/hard", "../escaped")], r"hard link 'model/hard' points outside")
    box.refused([hard("model/hard2", "/etc/passwd")], r"points outside")
    box.refused([hard("model/hard3", str(box.outside / "flag"))], r"points outside")


def test_hardlink_to_a_link_or_through_one_is_refused(box: Box) -> None:
    box.refused([file("f"), link("s", "f"), hard("h", "s")], r"hard link 'h' must name a regular file.*'s' is a symlink")
    box.refused(
        [folder("sub"), file("sub/f"), link("l", "sub"), hard("h", "l/f")],
        r"hard link 'h' must name a regular file.*'l/f' is not in the archive",
    )
    box.refused([hard("h", "later"), file("later")], r"'later' is not in the archive before it")
    box.refused([file("f"), hard("h1", "f"), hard("h2", "h1")], r"'h1' is a hard link")


def test_writing_through_a_hardlink_is_refused(box: Box) -> None:
    """The proof of concept's last move: a hard link, then a file of the same name."""
    box.refused([file("f", b"inside"), hard("h", "f"), file("h", b"overwrite")], r"member 'h' \(file\) would replace the hard link")


@pytest.mark.parametrize(
    ("members", "match"),
    [
        ([file("a"), folder("a")], r"member 'a' \(folder\) would replace the file"),
        ([folder("a"), file("a")], r"member 'a' \(file\) would replace the folder"),
        ([file("a"), link("a", "b")], r"member 'a' \(symlink\) would replace the file"),
        ([file("b"), link("a", "b"), file("a")], r"member 'a' \(file\) would replace the symlink"),
        ([file("a/b"), file("a/b/c")], r"member 'a/b/c' is under 'a/b', which is a file"),
    ],
)
def test_replacing_anything_but_a_file_by_a_file_is_refused(box: Box, members: list[Member], match: str) -> None:
    box.refused(members, match)


# -- types -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE])
def test_devices_and_fifos_are_refused(box: Box, kind: bytes) -> None:
    info = tarfile.TarInfo("model/dev")
    info.type = kind
    box.refused([(info, None)], "member 'model/dev' is a device or FIFO")


def test_gnu_sparse_member_is_refused(box: Box) -> None:
    info = tarfile.TarInfo("model/sparse")
    info.type = tarfile.GNUTYPE_SPARSE
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.GNU_FORMAT) as tar:
        tar.addfile(info)
    box.refused(buffer.getvalue(), r"member 'model/sparse' is a sparse file")


@pytest.mark.parametrize(
    ("headers", "data"),
    [
        ({"GNU.sparse.size": "10", "GNU.sparse.numblocks": "1", "GNU.sparse.offset": "0", "GNU.sparse.numbytes": "10"}, b"x" * 10),
        ({"GNU.sparse.map": "0,10", "GNU.sparse.name": "m/s", "GNU.sparse.realsize": "10"}, b"x" * 10),
        ({"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "m/s", "GNU.sparse.realsize": "10"},
         b"1\n0\n10\n".ljust(512, b"\0") + b"x" * 10),
    ],
    ids=["pax-0.0", "pax-0.1", "pax-1.0"],
)  # fmt: skip
def test_pax_sparse_members_are_refused(box: Box, headers: dict[str, str], data: bytes) -> None:
    box.refused([pax("m/s", headers, data)], r"sparse file")


# -- limits ----------------------------------------------------------------------------------


class _Zeros(io.RawIOBase):
    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        n = min(len(buffer), self.left)
        buffer[:n] = b"\0" * n
        self.left -= n
        return n


def zeros_archive(path: Path, sizes: list[int]) -> Path:
    with tarfile.open(path, "w:gz", compresslevel=9) as tar:
        for i, size in enumerate(sizes):
            info = tarfile.TarInfo(f"model/weights{i}.bin")
            info.size = size
            tar.addfile(info, _Zeros(size))
    return path


def test_gzip_bomb_stops_at_the_byte_cap_before_writing(box: Box) -> None:
    zeros_archive(box.archive, [200 << 20])
    assert box.archive.stat().st_size < 1 << 20
    message = box.refused(box.archive.read_bytes(), r"expands past the cap of 1048576 bytes.*weights0.bin", ExtractLimits(max_bytes=1 << 20))
    assert "of 209715200 bytes" in message
    assert not (box.dest / "model/weights0.bin").exists()


def test_gzip_bomb_is_stopped_by_the_default_ratio(box: Box) -> None:
    """The issue's bomb in small: ~1000 times; refused at the member's declared size, before
    its file is created, with the default limits."""
    zeros_archive(box.archive, [200 << 20])
    message = box.refused(box.archive.read_bytes(), r"expands more than 100 times its \d+ compressed bytes")
    assert "member 'model/weights0.bin' of 209715200 bytes" in message
    assert not (box.dest / "model").exists()


def test_bomb_of_many_small_members_stops_at_the_ratio(box: Box) -> None:
    zeros_archive(box.archive, [1 << 20] * 40)
    limits = ExtractLimits(max_ratio=10, ratio_floor=4 << 20)
    box.refused(box.archive.read_bytes(), r"expands more than 10 times", limits)
    on_disk = sum(p.stat().st_size for p in box.dest.rglob("*") if p.is_file())
    assert on_disk <= 4 << 20


def test_bomb_of_headers_and_padding_is_counted(box: Box) -> None:
    """Empty members carrying large PAX headers: no file content at all, but the
    decompressed stream is what counts, so it stops at the caps."""
    members = [pax(f"m/{i}", {"comment": " " * (512 << 10)}) for i in range(40)]
    make_tar(box.archive, members, level=9)
    data = box.archive.read_bytes()
    assert len(data) < 1 << 20
    box.refused(data, r"expands more than 10 times .* at member 'm/\d+'", ExtractLimits(max_ratio=10, ratio_floor=4 << 20))
    box.refused(data, r"expands past the cap of 8388608 bytes \(at member 'm/\d+'", ExtractLimits(max_bytes=8 << 20))


def test_chained_metadata_headers_are_refused(box: Box) -> None:
    """Metadata headers in a row: tarfile recurses on each one; refused at the ninth."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(20):
            record = f"comment={i}\n".encode()
            line = f"{len(record) + 3} ".encode() + record
            info = tarfile.TarInfo(f"PaxHeader{i}")
            info.type = tarfile.XHDTYPE
            info.size = len(line)
            tar.addfile(info, io.BytesIO(line))
        info = tarfile.TarInfo("m/f")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    box.refused(buffer.getvalue(), r"more than 8 metadata headers in a row")


def test_huge_pax_header_is_refused_before_reading_it(box: Box) -> None:
    box.refused([pax("m/f", {"comment": "x" * (2 << 20)})], r"metadata header of member .* is \d+ bytes, more than 1048576")


def test_member_count_cap(box: Box) -> None:
    box.refused([file(f"m/{i}") for i in range(20)], "more than 10 members", ExtractLimits(max_files=10))
    # Members that create nothing count too (a folder named again and again).
    box.refused([folder("m")] * 50, r"more than 10 members \(stopped at 'm'\)", ExtractLimits(max_files=10))


def test_ratio_applies_only_past_its_floor_and_spares_real_data(tmp_path: Path) -> None:
    small = zeros_archive(tmp_path / "small.tar.gz", [3 << 20])  # ~1000x, under the floor
    dest = tmp_path / "small"
    dest.mkdir()
    assert extract_archive(small, dest, limits=ExtractLimits(ratio_floor=4 << 20)).bytes == 3 << 20
    payload = os.urandom(6 << 20)  # incompressible, past the floor
    real = make_tar(tmp_path / "real.tar.gz", [file("m/w.bin", payload)])
    dest = tmp_path / "real"
    dest.mkdir()
    extract_archive(real, dest, limits=ExtractLimits(max_ratio=1.5, ratio_floor=1 << 20))
    assert (dest / "m/w.bin").read_bytes() == payload


# -- good archives ---------------------------------------------------------------------------


def test_good_archive_extracts_a_repository(tmp_path: Path) -> None:
    archive = make_tar(
        tmp_path / "m.tar.gz",
        [file("resnet/config.pbtxt", b"name: 'resnet'"), file("resnet/1/model.onnx", b"\0" * 5000),
         link("resnet/1/alias.onnx", "model.onnx"), hard("resnet/hard.onnx", "resnet/1/model.onnx")],
    )  # fmt: skip
    dest = tmp_path / "out"
    dest.mkdir()
    result = extract_archive(archive, dest)
    assert (dest / "resnet/config.pbtxt").read_bytes() == b"name: 'resnet'"
    assert (dest / "resnet/1/alias.onnx").read_bytes() == b"\0" * 5000
    assert os.readlink(dest / "resnet/1/alias.onnx") == "model.onnx"
    assert (dest / "resnet/hard.onnx").read_bytes() == b"\0" * 5000
    assert result.bytes == 5000 + len(b"name: 'resnet'")
    assert result.files == 4


def test_huggingface_snapshot_with_inner_links_extracts_intact(tmp_path: Path) -> None:
    """The layout of a huggingface cache: blobs by hash, snapshots of links into them, a ref
    file; a link to a folder; bytes intact."""
    weights, config = os.urandom(3 << 20), b'{"architectures": ["Bert"]}'
    blob_w, blob_c = hashlib.sha256(weights).hexdigest(), hashlib.sha1(config).hexdigest()
    rev = "0123456789abcdef0123456789abcdef01234567"
    archive = make_tar(
        tmp_path / "hf.tar.gz",
        [folder("./"), folder("./blobs"), file(f"./blobs/{blob_w}", weights), file(f"./blobs/{blob_c}", config),
         file("./refs/main", rev.encode()), folder(f"./snapshots/{rev}/onnx"),
         link(f"./snapshots/{rev}/onnx/model.onnx", f"../../../blobs/{blob_w}"),
         link(f"./snapshots/{rev}/config.json", f"../../blobs/{blob_c}"),
         link("./snapshots/latest", rev), link("./top", ".")],
    )  # fmt: skip
    dest = tmp_path / "out"
    dest.mkdir()
    extract_archive(archive, dest)
    snapshot = dest / "snapshots" / rev
    assert hashlib.sha256((snapshot / "onnx/model.onnx").read_bytes()).hexdigest() == blob_w
    assert (snapshot / "config.json").read_bytes() == config
    assert (dest / "snapshots/latest/config.json").read_bytes() == config
    assert (dest / "snapshots/latest").is_symlink() and (dest / "top").resolve() == dest.resolve()


def test_modes_are_normalised_and_duplicates_replace_files(tmp_path: Path) -> None:
    archive = make_tar(
        tmp_path / "m.tar.gz",
        [folder("m", 0o555), file("m/run.sh", b"#!/bin/sh\n", 0o6777), file("m/data", b"old", 0o666),
         file("m/data", b"new", 0o600), folder("m"), file("./m//plain", b"p", 0o4700)],
    )  # fmt: skip
    dest = tmp_path / "out"
    dest.mkdir()
    old = os.umask(0o022)
    try:
        extract_archive(archive, dest)
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE((dest / p).stat().st_mode)  # noqa: E731
    assert mode("m") == 0o755 and mode("m/run.sh") == 0o755 and mode("m/plain") == 0o755
    assert mode("m/data") == 0o644
    assert (dest / "m/data").read_bytes() == b"new"


def test_destination_must_be_empty(tmp_path: Path) -> None:
    archive = make_tar(tmp_path / "m.tar.gz", [file("a")])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "junk").write_text("?")
    with pytest.raises(InternalError, match="not empty"):
        extract_archive(archive, tmp_path / "out")


# -- not archives ----------------------------------------------------------------------------


def test_not_a_tar_gz(tmp_path: Path) -> None:
    for name, data in [("plain.tar.gz", b"this is not gzip"), ("gz.tar.gz", gzip.compress(b"not a tar" * 100))]:
        archive = tmp_path / name
        archive.write_bytes(data)
        dest = tmp_path / f"out-{name}"
        dest.mkdir()
        with pytest.raises(InvalidArgumentError, match=rf"archive '{name}' is not a valid tar.gz"):
            extract_archive(archive, dest)


def test_truncated_archive(tmp_path: Path) -> None:
    good = make_tar(tmp_path / "good.tar.gz", [file("m/a", os.urandom(100_000)), file("m/b", os.urandom(100_000))])
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(InvalidArgumentError, match=r"archive 'cut.tar.gz'"):
        extract_archive(cut, dest)


@pytest.mark.parametrize("data", [b"", None])
def test_empty(tmp_path: Path, data: bytes | None) -> None:
    archive = tmp_path / "empty.tar.gz"
    if data is None:
        make_tar(archive, [])
    else:
        archive.write_bytes(data)
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(InvalidArgumentError, match=r"archive 'empty.tar.gz' is (empty|not a valid)"):
        extract_archive(archive, dest)


# -- copy_folder -----------------------------------------------------------------------------


def test_copy_folder(tmp_path: Path) -> None:
    src = tmp_path / "model"
    (src / "1").mkdir(parents=True)
    (src / "config.pbtxt").write_text("x")
    (src / "1" / "model.onnx").write_bytes(b"0" * 10)
    (src / "1" / "alias.onnx").symlink_to("model.onnx")
    (src / "1" / "absolute.onnx").symlink_to(src / "1" / "model.onnx")
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o4775)
    dest = tmp_path / "out"
    dest.mkdir()
    result = copy_folder(src, dest)
    assert (dest / "1" / "alias.onnx").read_bytes() == b"0" * 10
    assert (dest / "1" / "absolute.onnx").read_bytes() == b"0" * 10
    assert not (dest / "1" / "alias.onnx").is_symlink()
    assert stat.S_IMODE((dest / "run.sh").stat().st_mode) & 0o7022 == 0
    assert result.bytes == 31 + len("#!/bin/sh\n")
    (tmp_path / "secret").write_text("s")
    (src / "leak").symlink_to(tmp_path / "secret")
    with pytest.raises(InvalidArgumentError, match=r"link 'leak' points outside"):
        copy_folder(src, tmp_path / "out2")
    (src / "leak").unlink()
    (src / "leak").symlink_to("../secret")
    with pytest.raises(InvalidArgumentError, match=r"link 'leak' points outside"):
        copy_folder(src, tmp_path / "out2b")
    (src / "leak").unlink()
    with pytest.raises(InvalidArgumentError, match=r"larger than the cap"):
        copy_folder(src, tmp_path / "out3", limits=ExtractLimits(max_bytes=15))
    with pytest.raises(InvalidArgumentError, match=r"more than 3 entries"):
        copy_folder(src, tmp_path / "out4", limits=ExtractLimits(max_files=3))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda src, out: (src / "sub").symlink_to(out), r"'sub' is a folder symlink|points outside"),
        (lambda src, out: (src / "sub").symlink_to("1"), r"'sub' is a folder symlink"),
        (lambda src, out: ((src / "a").symlink_to("1"), (src / "b").symlink_to("a/model.onnx")),
         r"link 'b' passes through another link, 'a'|'a' is a folder symlink"),
        (lambda src, out: ((src / "x").symlink_to("1/model.onnx"), (src / "y").symlink_to("x")),
         r"link 'y' names another link, 'x'"),
        (lambda src, out: (src / "1" / "via").symlink_to("../1/../../outside/f"), r"points outside the folder"),
        (lambda src, out: os.mkfifo(src / "fifo"), r"'fifo' is not a regular file"),
    ],
    ids=["folder-link-out", "folder-link-in", "through-link", "link-to-link", "climbs-out", "fifo"],
)  # fmt: skip
def test_copy_folder_refuses_links_it_cannot_trust(tmp_path: Path, make: object, match: str) -> None:
    src = tmp_path / "model"
    (src / "1").mkdir(parents=True)
    (src / "1" / "model.onnx").write_bytes(b"m")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_text("secret")
    make(src, outside)  # type: ignore[operator]
    with pytest.raises(InvalidArgumentError, match=match):
        copy_folder(src, tmp_path / "out")
    assert sorted(p.name for p in outside.iterdir()) == ["f"]


def test_copy_folder_never_writes_through_a_link_in_the_destination(tmp_path: Path) -> None:
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.pbtxt").write_text("x")
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "config.pbtxt").symlink_to(tmp_path / "victim")
    with pytest.raises(InternalError, match="not empty"):
        copy_folder(src, dest)
    assert not (tmp_path / "victim").exists()


def test_symlinks_go_through_folders_of_the_archive_only(box: Box) -> None:
    """Every folder a link's target goes through must be one the archive made: on a file
    system that ignores case, 'a' could be the link 'A'; a file cannot be gone through."""
    box.refused([link("A", "."), link("b", "a/..")], r"symlink 'b' -> 'a/\.\.' goes through 'a', which is not in the archive")
    box.refused([file("f"), link("b", "f/x")], r"symlink 'b' -> 'f/x' goes through 'f', which is a file")
    box.refused([link("l", "x" * 300 + "/.." * 1300)], r"target longer than PATH_MAX")


def test_nesting_is_capped(box: Box) -> None:
    box.refused([file("/".join(["d"] * 129) + "/f")], r"nested more than 128 folders deep")


def test_deep_and_wide_archives_extract_in_linear_time(tmp_path: Path) -> None:
    """5,000 files 120 folders deep: the rules on names and links take time linear in a
    name's length (a table of every prefix took 450 s for 13,000 members 1,800 deep), and
    each member opens one folder, not 120."""
    import time

    deep = "/".join(["d"] * 120)
    archive = make_tar(tmp_path / "deep.tar.gz", [file(f"{deep}/{i}", b"") for i in range(5000)])
    dest = tmp_path / "out"
    dest.mkdir()
    start = time.monotonic()
    assert extract_archive(archive, dest).files == 5000
    assert time.monotonic() - start < 10
    assert len(os.listdir(dest / deep)) == 5000
