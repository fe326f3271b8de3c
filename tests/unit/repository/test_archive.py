"""Safe extraction: each hostile archive is refused with a message naming archive and member."""

from __future__ import annotations

import gzip
import io
import shutil
import tarfile
from pathlib import Path

import pytest

from quiver.errors import InvalidArgumentError
from quiver.repository.archive import ExtractLimits, copy_folder, extract_archive


def make_tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info, None


def refused(tmp_path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]], match: str, **kw: int) -> None:
    archive = make_tar(tmp_path / "evil.tar.gz", members)
    dest = tmp_path / "out"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir()
    with pytest.raises(InvalidArgumentError, match=match) as info:
        extract_archive(archive, dest, limits=ExtractLimits(**kw) if kw else None, name="models/evil.tar.gz")
    assert "models/evil.tar.gz" in str(info.value)
    assert not (tmp_path / "escaped").exists()


def test_good_archive_extracts_a_repository(tmp_path: Path) -> None:
    archive = make_tar(
        tmp_path / "m.tar.gz",
        [file("resnet/config.pbtxt", b"name: 'resnet'"), file("resnet/1/model.onnx", b"\0" * 5000),
         link("resnet/1/alias.onnx", "model.onnx"), link("resnet/hard.onnx", "resnet/1/model.onnx", tarfile.LNKTYPE)],
    )
    dest = tmp_path / "out"
    dest.mkdir()
    result = extract_archive(archive, dest)
    assert (dest / "resnet/config.pbtxt").read_bytes() == b"name: 'resnet'"
    assert (dest / "resnet/1/alias.onnx").read_bytes() == b"\0" * 5000
    assert (dest / "resnet/hard.onnx").read_bytes() == b"\0" * 5000
    assert result.bytes == 5000 + len(b"name: 'resnet'")


def test_dotdot_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, [file("model/../../escaped", b"pwn")], r"member '.*escaped' contains '\.\.'")


def test_dotdot_staying_inside_is_refused_too(tmp_path: Path) -> None:
    refused(tmp_path, [file("a/../b")], r"member 'a/\.\./b' contains")


def test_absolute_path_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, [file(str(tmp_path / "escaped"))], "absolute path")


def test_symlink_out_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, [link("model/link", "../../escaped")], "member 'model/link' refused")


def test_absolute_symlink_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, [link("model/link", "/etc/passwd")], "member 'model/link' refused")


def test_writing_through_an_inner_symlink_that_leaves_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, [link("dir", ".."), file("dir/escaped")], "refused|contains")


def test_hardlink_out_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, [link("model/hard", "../escaped", tarfile.LNKTYPE)], "hard link 'model/hard' points outside")
    refused(tmp_path, [link("model/hard2", "/etc/passwd", tarfile.LNKTYPE)], "points outside")


@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE])
def test_devices_and_fifos_are_refused(tmp_path: Path, kind: bytes) -> None:
    info = tarfile.TarInfo("model/dev")
    info.type = kind
    refused(tmp_path, [(info, None)], "member 'model/dev' is a device or FIFO")


def test_gzip_bomb_stops_at_the_byte_cap_before_writing(tmp_path: Path) -> None:
    # 200 MB of zeros declared by one member; the archive itself is tiny.
    archive = tmp_path / "bomb.tar.gz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo("model/weights.bin")
        info.size = 200 << 20
        tar.addfile(info, _Zeros(info.size))
    assert archive.stat().st_size < 1 << 20
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(InvalidArgumentError, match=r"expands past the cap of 1048576 bytes.*weights.bin"):
        extract_archive(archive, dest, limits=ExtractLimits(max_bytes=1 << 20))
    assert not (dest / "model/weights.bin").exists()


def test_file_count_cap(tmp_path: Path) -> None:
    refused(tmp_path, [file(f"m/{i}") for i in range(20)], "more than 10 members", max_files=10)


def test_huge_pax_header_is_refused_before_reading_it(tmp_path: Path) -> None:
    archive = tmp_path / "pax.tar.gz"
    with tarfile.open(archive, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("m/f")
        info.pax_headers = {"comment": "x" * (2 << 20)}
        tar.addfile(info, io.BytesIO(b""))
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(InvalidArgumentError, match=r"metadata header"):
        extract_archive(archive, dest)


def test_not_a_tar_gz(tmp_path: Path) -> None:
    for name, data in [("plain.tar.gz", b"this is not gzip"), ("gz.tar.gz", gzip.compress(b"not a tar" * 100))]:
        archive = tmp_path / name
        archive.write_bytes(data)
        dest = tmp_path / f"out-{name}"
        dest.mkdir()
        with pytest.raises(InvalidArgumentError, match=rf"archive '{name}' is not a valid tar.gz"):
            extract_archive(archive, dest)


def test_truncated_archive(tmp_path: Path) -> None:
    good = make_tar(tmp_path / "good.tar.gz", [file("m/a", b"a" * 100_000), file("m/b", b"b" * 100_000)])
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


def test_copy_folder(tmp_path: Path) -> None:
    src = tmp_path / "model"
    (src / "1").mkdir(parents=True)
    (src / "config.pbtxt").write_text("x")
    (src / "1" / "model.onnx").write_bytes(b"0" * 10)
    (src / "1" / "alias.onnx").symlink_to("model.onnx")
    dest = tmp_path / "out"
    dest.mkdir()
    result = copy_folder(src, dest)
    assert (dest / "1" / "alias.onnx").read_bytes() == b"0" * 10
    assert not (dest / "1" / "alias.onnx").is_symlink()
    assert result.bytes == 21
    (tmp_path / "secret").write_text("s")
    (src / "leak").symlink_to(tmp_path / "secret")
    with pytest.raises(InvalidArgumentError, match=r"link 'leak' points outside"):
        copy_folder(src, tmp_path / "out2")
    (src / "leak").unlink()
    with pytest.raises(InvalidArgumentError, match=r"larger than the cap"):
        copy_folder(src, tmp_path / "out3", limits=ExtractLimits(max_bytes=15))


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
