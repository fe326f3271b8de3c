"""Which model an archive serves, and the namespaced names of the others."""

from __future__ import annotations

from pathlib import Path

import pytest

from quiver.errors import InvalidArgumentError
from quiver.lifecycle.archives import archive_layout, check_key_name
from quiver.lifecycle.loader import read_config

ENSEMBLE = """
name: "{name}"
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] }} ]
ensemble_scheduling {{ step [ {{ model_name: "{step}" model_version: -1 input_map {{ key: "INPUT0" value: "IN" }} output_map {{ key: "OUTPUT0" value: "OUT" }} }} ] }}
"""


def folder(root: Path, name: str, config: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(config)


def test_single_model_folder_is_served_under_the_key(tmp_path: Path) -> None:
    (tmp_path / "1").mkdir()
    (tmp_path / "config.pbtxt").write_text('name: "whatever" backend: "identity"')
    source, members = archive_layout("m.tar.gz", "m.tar.gz", tmp_path)
    assert (source.name, source.path, members) == ("m.tar.gz", tmp_path, [])
    proto, _ = read_config(source, strict=False)
    assert proto.name == "m.tar.gz"  # the config's own name need not match


def test_the_top_level_ensemble_is_served_and_steps_are_namespaced(tmp_path: Path) -> None:
    folder(tmp_path, "pre", 'backend: "identity"')
    folder(tmp_path, "inner", ENSEMBLE.format(name="inner", step="pre"))
    folder(tmp_path, "outer", ENSEMBLE.format(name="outer", step="inner"))
    source, members = archive_layout("a.tgz", "a.tgz", tmp_path)
    assert source.path.name == "outer"
    assert sorted(m.name for m in members) == ["a.tgz::inner", "a.tgz::pre"]
    proto, _ = read_config(source, strict=False)
    assert [s.model_name for s in proto.ensemble_scheduling.step] == ["a.tgz::inner"]
    inner = next(m for m in members if m.name == "a.tgz::inner")
    proto, _ = read_config(inner, strict=False)
    assert proto.name == "a.tgz::inner"
    assert [s.model_name for s in proto.ensemble_scheduling.step] == ["a.tgz::pre"]


def test_ambiguous_and_empty_archives(tmp_path: Path) -> None:
    folder(tmp_path, "x", 'backend: "identity"')
    folder(tmp_path, "y", 'backend: "identity"')
    with pytest.raises(InvalidArgumentError, match=r"archive 'k\.tar\.gz' holds several models"):
        archive_layout("k.tar.gz", "k.tar.gz", tmp_path)
    empty = tmp_path / "empty"
    (empty / "stuff").mkdir(parents=True)
    with pytest.raises(InvalidArgumentError, match="holds no model"):
        archive_layout("e.tar.gz", "e.tar.gz", empty)


@pytest.mark.parametrize("name", ["..", "a/b.tar.gz", "/abs.tar.gz", ".hidden", "a..b.tar.gz", "sp ace", "a::b", "x" * 256])
def test_bad_key_names(name: str) -> None:
    with pytest.raises(InvalidArgumentError, match="is not a valid model name"):
        check_key_name(name)


def test_good_key_names() -> None:
    for name in ("resnet_v0.tar.gz", "m-1.tgz", "A1", "sm+hash=1@x,y"):
        check_key_name(name)
