"""The logging extension's log_file: refused unless allowed, then opened inside the log folder
without following any link (Triton's CVE-2024-0087)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from quiver import logs
from quiver.errors import InvalidArgumentError


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    """``--log-file-dir`` set to a fresh folder; the root logger and the module restored after."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    saved = dict(logs._settings), logs._handler, logs._file_dir
    path = tmp_path / "logs"
    path.mkdir()
    logs.configure(log_file_dir=str(path))
    try:
        yield path
    finally:
        if logs._handler is not None and logs._handler is not saved[1]:
            root.removeHandler(logs._handler)
            logs._handler.close()
        if logs._file_dir is not None and logs._file_dir is not saved[2]:
            os.close(logs._file_dir[1])
        logs._settings.clear()
        logs._settings.update(saved[0])
        logs._handler, logs._file_dir = saved[1], saved[2]
        root.handlers[:] = handlers
        root.setLevel(level)


def test_refused_without_a_folder(folder: Path) -> None:
    logs.configure()  # no --log-file-dir: the API may not change log_file
    with pytest.raises(InvalidArgumentError, match="--allow-log-file-api and --log-file-dir"):
        logs.update({"log_file": str(folder / "x.log")})
    assert not (folder / "x.log").exists()
    assert logs.update({"log_verbose_level": 2})["log_verbose_level"] == 2


def test_a_fifo_is_refused_without_blocking(folder: Path) -> None:
    os.mkfifo(folder / "pipe")
    with pytest.raises(InvalidArgumentError, match=r"cannot open it|not a regular file"):
        logs.update({"log_file": "pipe"})


def test_a_hard_link_is_refused(folder: Path, tmp_path: Path) -> None:
    outside = tmp_path / "precious"
    outside.write_text("keep\n")
    os.link(outside, folder / "linked.log")
    with pytest.raises(InvalidArgumentError, match="hard links"):
        logs.update({"log_file": "linked.log"})
    assert outside.read_text() == "keep\n"


def test_a_link_swapped_in_later_is_not_followed(folder: Path, tmp_path: Path) -> None:
    """The file stays the one opened: changing other settings never reopens it by name."""
    logs.update({"log_file": "quiver.log"})
    target = tmp_path / "elsewhere.log"
    (folder / "quiver.log").rename(folder / "rotated.log")
    (folder / "quiver.log").symlink_to(target)
    logs.update({"log_verbose_level": 1, "log_format": "ISO8601"})
    logging.getLogger("quiver.test").warning("still here")
    assert not target.exists()
    assert "still here" in (folder / "rotated.log").read_text()
    with pytest.raises(InvalidArgumentError, match="symbolic link"):
        logs.update({"log_file": "quiver.log"})  # asking for it again does not follow the link
    assert not target.exists()


def test_a_folder_link_deeper_down_is_refused(folder: Path, tmp_path: Path) -> None:
    (folder / "a" / "b").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    (folder / "a" / "b" / "c").symlink_to(tmp_path / "out")
    with pytest.raises(InvalidArgumentError, match="'c' is a symbolic link"):
        logs.update({"log_file": "a/b/c/x.log"})
    assert logs.update({"log_file": "a/b/x.log"})["log_file"] == str(folder.resolve() / "a" / "b" / "x.log")
    assert list((tmp_path / "out").iterdir()) == []


def test_start_up_folder_must_exist(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="--log-file-dir"):
        logs.configure(log_file_dir=str(tmp_path / "missing"))
