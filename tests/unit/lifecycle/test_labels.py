"""Label files of every form give the same labels, line i for class i."""

from __future__ import annotations

from quiver.lifecycle.loader import parse_labels

LABELS = ["cat", "dog", "", "bird"]


def test_every_form() -> None:
    text = "\n".join(LABELS)
    for raw in (
        text.encode() + b"\n",
        text.encode(),
        text.replace("\n", "\r\n").encode() + b"\r\n",
        text.replace("\n", "\r").encode(),
        b"\xef\xbb\xbf" + text.encode(),
        text.encode("utf-16"),
        text.encode("utf-16-be").join([b"\xfe\xff", b""]),
    ):
        assert parse_labels(raw) == LABELS, raw


def test_only_newlines_end_lines() -> None:
    # form feeds and Unicode line separators inside a label do not shift the classes
    assert parse_labels("a\x0cb\nc\u2028d\ne\n".encode()) == ["a\x0cb", "c\u2028d", "e"]


def test_bytes_that_are_not_utf8_are_latin1() -> None:
    assert parse_labels("caf\xe9\nna\xefve\n".encode("latin-1")) == ["caf\xe9", "na\xefve"]
