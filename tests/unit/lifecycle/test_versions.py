"""Versions a client names: integers from 1 to 2^63-1, or empty for the latest."""

from __future__ import annotations

from pathlib import Path

import pytest

from quiver.errors import InvalidArgumentError
from quiver.lifecycle.model import MAX_VERSION, parse_version
from quiver.repository.local import ModelSource


@pytest.mark.parametrize(
    ("text", "number"), [("", None), ("1", 1), ("42", 42), ("007", 7), (str(MAX_VERSION), MAX_VERSION)]
)
def test_good_versions(text: str, number: int | None) -> None:
    assert parse_version("m", text) == number


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("0", "not a positive integer"),
        ("-1", "not a positive integer"),
        ("abc", "not a number"),
        ("1.5", "not a number"),
        ("+1", "not a number"),
        (" 1", "not a number"),
        ("1\x00", "not a number"),
        ("\u0661", "not a number"),  # an Arabic-Indic one: digits are ASCII
        ("²", "not a number"),
        (str(MAX_VERSION + 1), "too large"),
        ("9" * 5000, "too large"),
    ],
)
def test_bad_versions_name_version_and_model(text: str, why: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        parse_version("my_model", text)
    assert why in info.value.message and "model 'my_model'" in info.value.message
    assert "\x00" not in info.value.message and len(info.value.message) < 300


def test_version_folders_as_triton_reads_them(tmp_path: Path) -> None:
    for name in ("1", "3", "0", "01", "x", "²"):
        (tmp_path / name).mkdir()
    (tmp_path / "2").write_text("a file, not a folder")
    assert ModelSource("m", tmp_path.parent, tmp_path).versions() == [1, 3]
