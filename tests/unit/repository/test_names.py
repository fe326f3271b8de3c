"""The one validator of client-supplied names and paths: what the filesystem would refuse,
or what could leave its folder, is INVALID_ARG naming it; everything Triton and SageMaker
names use passes."""

from __future__ import annotations

import pytest

from quiver.errors import InvalidArgumentError
from quiver.repository.names import (
    MAX_KEY_BYTES,
    NAME_MAX,
    check_file_paths,
    check_key,
    check_key_name,
    check_local_path,
    check_model_name,
)

LONG = "m" * (NAME_MAX + 1)


@pytest.mark.parametrize("name", ["resnet50", "my model", "ünïcödé", "pipe.tar.gz::preprocess", "a" * NAME_MAX, "é" * 127])
def test_good_model_names(name: str) -> None:
    assert check_model_name(name) == name


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("", "empty"),
        (".", "folder name"),
        ("..", "folder name"),
        ("a/b", "folder name"),
        ("a\\b", "folder name"),
        ("a\x00b", "NUL or control character"),
        ("a\nb", "NUL or control character"),
        (LONG, f"{NAME_MAX + 1} bytes, more than the {NAME_MAX}"),
        ("é" * 128, "256 bytes"),  # 128 characters, 256 bytes encoded
        ("k.tar.gz::" + LONG, "its component"),
        ("bad\udcffname", "not valid UTF-8"),
    ],
)
def test_bad_model_names(name: str, why: str) -> None:
    with pytest.raises(InvalidArgumentError, match="is not a valid model name") as info:
        check_model_name(name)
    assert why in info.value.message
    assert len(info.value.message) < 400  # a long name is cut short in the message


def test_key_names_are_letters_digits_and_a_few_signs() -> None:
    for name in ("resnet_v0.tar.gz", "m-1.tgz", "sm+hash=1@x,y", "a" * (NAME_MAX - 7) + ".tar.gz"):
        check_key_name(name)
    for name in ("sp ace.tar.gz", "a..b", ".hidden", "x" * (NAME_MAX - 6) + ".tar.gz", "ü.tar.gz"):
        with pytest.raises(InvalidArgumentError, match="is not a valid model name"):
            check_key_name(name)


def test_storage_keys() -> None:
    for key in ("a", "a/b/c.onnx", "prefix/", "m/1/" + "x" * NAME_MAX):
        check_key(key)
    check_key("", allow_empty=True)
    too_long = "/".join(["d" * 200] * 6)
    for key, why in [
        ("", "empty"),
        ("/abs", "relative"),
        ("a\\b", "relative"),
        ("a/../b", "'..'"),
        ("a/./b", "'.'"),
        ("a//b", "empty components"),
        ("a/\x00", "NUL"),
        ("a/" + LONG, "its component"),
        (too_long, f"more than {MAX_KEY_BYTES}"),
    ]:
        with pytest.raises(InvalidArgumentError, match="invalid storage key") as info:
            check_key(key)
        assert why in info.value.message, key


def test_file_parameter_paths() -> None:
    check_file_paths(["1/model.onnx", "1/sub/weights.bin", "2/model.onnx"], "m")
    for paths, why in [
        (["model.onnx"], "not inside a version folder"),
        (["v1/model.onnx"], "not inside a version folder"),
        (["1/"], "not inside a version folder"),
        (["/1/model.onnx"], "relative"),
        (["1/../../etc/passwd"], "'..'"),
        (["1/a\x00b"], "NUL"),
        (["1/" + LONG], "its component"),
        (["1/a", "1/a/b"], "'file:1/a' is a file too"),
    ]:
        with pytest.raises(InvalidArgumentError, match=r"failed to load 'm': file parameter 'file:") as info:
            check_file_paths(paths, "m")
        assert why in info.value.message, paths


def test_local_paths() -> None:
    check_local_path("/opt/ml/models/resnet/model")
    check_local_path("relative/dir/")
    for path, why in [
        ("", "empty"),
        ("/tmp/a\x00b", "NUL"),
        ("/tmp/" + LONG, "its component"),
        ("/" + "/".join(["d" * 200] * 21), "more than 4096"),
    ]:
        with pytest.raises(InvalidArgumentError, match="url") as info:
            check_local_path(path, "url")
        assert why in info.value.message
