"""Optimized graphs kept (backends/onnxruntime_optimized.py), with the real optimizer process:
a copy is written once per model file, holds the optimized graph and answers as the model
does; a file rewritten is another key; copies that are links, broken or over the budget are
not used; a file the optimizer fails on is not tried again."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from quiver.backends import onnxruntime_optimized as om
from quiver.backends.base import SERVER
from support.models import add_constant_onnx, foldable_onnx


def run(path: str, optimize: bool = True) -> np.ndarray:
    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"INPUT0": np.arange(8, dtype=np.float32).reshape(2, 4)})[0])


def quiet(tmp_path: Path, **options: Any) -> om.OptimizedModels:
    """Copies under ``tmp_path``, for a server that is always between requests."""
    return om.OptimizedModels(tmp_path / "optimized", idle_ns=lambda: 10**9, **options)


@pytest.fixture
def kept(tmp_path: Path) -> Iterator[om.OptimizedModels]:
    models = quiet(tmp_path, budget=1 << 20)
    yield models
    models.stop()


def write(tmp_path: Path, name: str, model: onnx.ModelProto) -> str:
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    return str(path)


def optimized(kept: om.OptimizedModels, source: str, level: str = "all") -> tuple[str, str]:
    key = kept.key(source, level)
    assert key is not None
    assert kept.find(key) is None
    kept.submit(source, level, key)
    assert kept.wait_idle(60)
    copy = kept.find(key)
    assert copy is not None, f"no copy of {source} kept (failures: {kept.failures})"
    return key, copy


def test_a_copy_holds_the_optimized_graph_and_answers_as_the_model(kept: om.OptimizedModels, tmp_path: Path) -> None:
    source = write(tmp_path, "m", foldable_onnx(3.0))
    _key, copy = optimized(kept, source)
    assert len(onnx.load(source).graph.node) == 2
    assert [n.op_type for n in onnx.load(copy).graph.node] == ["Add"]  # the constants' Mul folded
    np.testing.assert_array_equal(run(copy, optimize=False), run(source))
    np.testing.assert_array_equal(run(copy, optimize=False), np.arange(8, dtype=np.float32).reshape(2, 4) + 6.0)
    assert kept.made == 1 and kept.failures == 0
    assert not [p for p in kept.root.iterdir() if p.name.startswith(".tmp-")]


def test_the_key_is_the_file_and_the_level(kept: om.OptimizedModels, tmp_path: Path) -> None:
    source = write(tmp_path, "m", foldable_onnx(1.0))
    first = kept.key(source, "all")
    assert first == kept.key(source, "all")
    assert first != kept.key(source, "basic")
    os.rename(source, tmp_path / "old.onnx")  # replaced: another file at the same path
    write(tmp_path, "m", foldable_onnx(1.0))
    assert kept.key(source, "all") != first
    model = foldable_onnx(1.0)
    model.doc_string = "rewritten in place"
    with open(source, "r+b") as file:  # rewritten in place: same inode, other size and times
        file.write(model.SerializeToString())
    assert kept.key(source, "all") not in (first, None)
    assert kept.key(str(tmp_path / "missing.onnx"), "all") is None
    assert kept.key(str(tmp_path), "all") is None  # not a regular file


def test_a_link_in_place_of_a_copy_is_removed_not_followed(kept: om.OptimizedModels, tmp_path: Path) -> None:
    source = write(tmp_path, "m", foldable_onnx(1.0))
    key = kept.key(source, "all")
    assert key is not None
    kept.root.mkdir(parents=True)
    kept.path(key).symlink_to(source)
    assert kept.find(key) is None
    assert not kept.path(key).is_symlink()
    assert Path(source).exists()  # the link's target is left alone


def test_a_file_the_optimizer_fails_on_is_not_tried_again(kept: om.OptimizedModels, tmp_path: Path) -> None:
    source = tmp_path / "broken.onnx"
    source.write_bytes(b"not a model")
    key = kept.key(str(source), "all")
    assert key is not None
    kept.submit(str(source), "all", key)
    assert kept.wait_idle(60)
    assert kept.find(key) is None and kept.failures == 1
    kept.submit(str(source), "all", key)
    assert kept.wait_idle(60)
    assert kept.failures == 1  # not asked again
    good = write(tmp_path, "good", foldable_onnx(2.0))
    optimized(kept, good)  # the optimizer still serves others


def test_copies_stay_within_the_budget_least_recently_used_first(tmp_path: Path) -> None:
    kept = quiet(tmp_path)
    try:
        sources = [write(tmp_path, f"m{i}", foldable_onnx(float(i))) for i in range(3)]
        keys = [optimized(kept, s)[0] for s in sources[:2]]
        kept.budget = int(os.path.getsize(kept.path(keys[0])) * 2.5)  # room for two copies
        time.sleep(0.01)
        assert kept.find(keys[0]) is not None  # used: m1 is now the least recently used
        optimized(kept, sources[2])
        assert kept.find(keys[0]) is not None
        assert kept.find(keys[1]) is None
        assert sum(p.stat().st_size for p in kept.root.iterdir()) <= kept.budget
    finally:
        kept.stop()


def test_a_server_finds_the_copies_of_the_one_before(tmp_path: Path) -> None:
    source = write(tmp_path, "m", foldable_onnx(1.0))
    first = quiet(tmp_path)
    try:
        key, _copy = optimized(first, source)
    finally:
        first.stop()
    stale = first.root / ".tmp-1-left-by-a-killed-server.onnx"
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    second = quiet(tmp_path)
    try:
        assert second.find(key) is not None
        other = write(tmp_path, "other", foldable_onnx(2.0))
        optimized(second, other)  # its thread starts and reads the folder
        assert not stale.exists()
    finally:
        second.stop()


def test_settings_are_checked_and_off_unless_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for bad in ({om.CACHE: "maybe"}, {om.CACHE_SIZE: "4G"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            om.check_settings(bad)
    om.check_settings({om.CACHE: "1", om.CACHE_SIZE: "1024"})
    monkeypatch.setattr(SERVER, "cache_dir", tmp_path)
    monkeypatch.setattr(SERVER, "backend_config", {})
    monkeypatch.setattr(om, "_decided", [])
    assert om.optimized_models() is None
    monkeypatch.setattr(SERVER, "backend_config", {"onnxruntime": {om.CACHE: "1", om.CACHE_SIZE: "1024"}})
    monkeypatch.setattr(om, "_decided", [])
    made = om.optimized_models()
    assert made is not None and made.budget == 1024
    assert made.root.parent == tmp_path / "onnxruntime-optimized"


@pytest.mark.parametrize(("script", "timeout"), [("exit 1", 60.0), ("kill -SEGV $$", 60.0), ("exec sleep 30", 1.0)])
def test_an_optimizer_that_dies_or_hangs_costs_only_that_file(tmp_path: Path, script: str, timeout: float) -> None:
    """An optimizer process that crashes (as ONNX Runtime might on a hostile model) or never
    answers is ended; that file gets no copy and is not tried again; nothing is left behind."""
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\n{script}\n")
    python.chmod(0o755)
    kept = quiet(tmp_path, python=str(python), timeout_seconds=timeout)
    try:
        source = write(tmp_path, "m", foldable_onnx(1.0))
        key = kept.key(source, "all")
        assert key is not None
        started = time.monotonic()
        kept.submit(source, "all", key)
        assert kept.wait_idle(30)
        assert time.monotonic() - started < 20
        if script.startswith("exec sleep"):  # no answer in time: once may be a starved CPU
            assert kept.failures == 0
            kept.submit(source, "all", key)
            assert kept.wait_idle(30)
        assert kept.find(key) is None and kept.failures == 1 and kept.made == 0
        assert [p.name for p in kept.root.iterdir()] == []
        kept.submit(source, "all", key)
        assert kept.wait_idle(30) and kept.failures == 1  # not tried again
    finally:
        kept.stop()


def test_a_job_waits_for_a_lull_between_requests(tmp_path: Path) -> None:
    """The optimizer runs between requests: while the server's idle detector says a request
    came within the lull, the job waits (here until the test releases it)."""
    released: list[bool] = []
    kept = om.OptimizedModels(tmp_path / "optimized", idle_ns=lambda: 10**9 if released else 0)
    try:
        source = write(tmp_path, "m", foldable_onnx(1.0))
        key = kept.key(source, "all")
        assert key is not None
        kept.submit(source, "all", key)
        assert not kept.wait_idle(1.0)  # busy: still waiting
        assert kept.made == 0 and kept.find(key) is None and kept._process is None  # not even started
        released.append(True)
        assert kept.wait_idle(60)
        assert kept.find(key) is not None
    finally:
        kept.stop()


def test_a_copy_larger_than_the_budget_is_not_kept_nor_made_again(tmp_path: Path) -> None:
    kept = quiet(tmp_path, budget=10)
    try:
        source = write(tmp_path, "m", foldable_onnx(1.0))
        key = kept.key(source, "all")
        assert key is not None
        kept.submit(source, "all", key)
        assert kept.wait_idle(60)
        assert kept.find(key) is None and kept.failures == 1
        kept.submit(source, "all", key)
        assert kept.wait_idle(60) and kept.failures == 1 and kept.made == 0
    finally:
        kept.stop()


def test_a_graph_that_names_external_data_is_not_kept(kept: om.OptimizedModels, tmp_path: Path) -> None:
    """Its copy would look for the data beside itself, among the cache's files: it is opened
    in an empty folder of its own first, fails there, and is not kept."""
    model = add_constant_onnx(1.0)  # (nothing to fold: the graph keeps naming its weights)
    for tensor in model.graph.initializer:  # as raw bytes, which go to the external file
        tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
    folder = tmp_path / "external"
    folder.mkdir()
    onnx.save(model, str(folder / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.bin", size_threshold=0)  # fmt: skip
    assert (folder / "weights.bin").exists()
    run(str(folder / "model.onnx"))  # the model itself is fine
    source = str(folder / "model.onnx")
    key = kept.key(source, "all")
    assert key is not None
    kept.submit(source, "all", key)
    assert kept.wait_idle(60)
    assert kept.find(key) is None and kept.failures == 1
    assert [p.name for p in kept.root.iterdir()] == []


def test_stop_ends_an_optimizer_that_hangs_at_once(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexec sleep 60\n")
    python.chmod(0o755)
    kept = quiet(tmp_path, python=str(python))
    source = write(tmp_path, "m", foldable_onnx(1.0))
    key = kept.key(source, "all")
    assert key is not None
    kept.submit(source, "all", key)
    deadline = time.monotonic() + 10
    while kept._process is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process = kept._process
    assert process is not None
    started = time.monotonic()
    kept.stop()
    assert time.monotonic() - started < 5
    assert process.poll() is not None and kept._process is None and kept._thread is None
    assert kept.failures == 0  # stopped, not failed


def test_a_first_load_looks_for_no_copy_on_disk_once_the_folder_was_read(
    kept: om.OptimizedModels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    optimized(kept, write(tmp_path, "a", foldable_onnx(1.0)))  # the optimizer ran: the folder was read
    key = kept.key(write(tmp_path, "b", foldable_onnx(2.0)), "all")
    assert key is not None
    looked: list[str] = []
    lstat = os.lstat
    monkeypatch.setattr(om.os, "lstat", lambda path, *a, **k: looked.append(str(path)) or lstat(path, *a, **k))
    assert kept.find(key) is None
    assert looked == []


def test_a_copy_another_server_made_after_the_folder_was_read_is_found(tmp_path: Path) -> None:
    first, second = quiet(tmp_path), quiet(tmp_path)  # two servers sharing one cache folder
    try:
        optimized(first, write(tmp_path, "a", foldable_onnx(1.0)))  # the first read the folder
        source = write(tmp_path, "b", foldable_onnx(2.0))
        key, copy = optimized(second, source)  # the second made b's copy since
        assert first.find(key) is None  # not known to the first yet: not looked for
        first.submit(source, "all", key)  # its optimizer meets the copy there...
        assert first.wait_idle(60)
        assert first.find(key) == copy  # ...and it is found from then on, not made again
        assert first.made == 1 and second.made == 1
    finally:
        first.stop()
        second.stop()
