"""MemoryMeter and SizePredictor: fakes for the pure logic, a real onnxruntime session for the
one measured test (the budget's ledger is tested in test_budget.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from lifecycle_fakes import FakeClock

from quiver.lifecycle import memory
from quiver.lifecycle.memory import (
    DEFAULT_FILE_FACTOR,
    DEFAULT_OVERHEAD_BYTES,
    MemoryMeter,
    ModelIdentity,
    SizePredictor,
    TrimSchedule,
    gpu_memory_used,
    heap_in_use,
    limit_arenas,
)

MB = 1 << 20


# -- MemoryMeter ------------------------------------------------------------------------------


class FakeProcess:
    """RSS and GPU readings that a fake load moves, and a clock it advances."""

    def __init__(self) -> None:
        self.rss_bytes = 100 * MB
        self.gpu: dict[int, int] | None = None
        self.clock = FakeClock()

    def rss(self) -> int:
        return self.rss_bytes

    def gpu_used(self) -> dict[int, int] | None:
        return None if self.gpu is None else dict(self.gpu)


def test_meter_reports_rss_growth_and_duration() -> None:
    proc = FakeProcess()
    meter = MemoryMeter(rss=proc.rss, gpu=proc.gpu_used, clock=proc.clock, trim=False)

    def load() -> str:
        proc.rss_bytes += 42 * MB
        proc.clock.advance(1.5)
        return "model"

    result, footprint = meter.measure(load)
    assert result == "model"
    assert footprint.host_bytes == 42 * MB
    assert footprint.seconds == pytest.approx(1.5)
    assert footprint.gpu_bytes is None and footprint.gpu_total is None


def test_meter_measures_by_the_heap_when_asked_and_able_else_by_rss() -> None:
    """``heap=True``: the heap reading's growth, RSS never read; without a heap reader (not
    glibc, or glibc before 2.33) the same call measures by RSS."""
    proc = FakeProcess()
    heap = {"bytes": 7 * MB}

    def rss_not_read() -> int:
        raise AssertionError("RSS read for a load measured by the heap")

    def load() -> None:
        heap["bytes"] += 30 * MB
        proc.rss_bytes += 31 * MB

    meter = MemoryMeter(rss=rss_not_read, heap=lambda: heap["bytes"], gpu=None, trim=False)
    _, footprint = meter.measure(load, heap=True)
    assert (footprint.host_bytes, footprint.by) == (30 * MB, "heap")
    assert meter.reads_heap

    meter = MemoryMeter(rss=proc.rss, heap=lambda: heap["bytes"], gpu=None, trim=False)
    _, footprint = meter.measure(load)  # a framework not known to allocate from the heap alone
    assert (footprint.host_bytes, footprint.by) == (31 * MB, "rss")

    meter = MemoryMeter(rss=proc.rss, heap=None, gpu=None, trim=False)
    assert not meter.reads_heap
    _, footprint = meter.measure(load, heap=True)
    assert (footprint.host_bytes, footprint.by) == (31 * MB, "rss")


@pytest.mark.skipif(heap_in_use is None, reason="glibc's mallinfo2 (2.33+) is not available here")
def test_the_heap_reading_sees_what_a_load_keeps_and_not_what_it_freed() -> None:
    """The real ``mallinfo2`` reading: a load that keeps 24 MB and frees a 40 MB temporary (and
    many small ones) measures 24 MB, without any trim."""
    kept: list[np.ndarray] = []

    def load() -> None:
        scratch = [np.ones(1000, np.float64) for _ in range(2000)]  # small blocks, freed
        temporary = np.ones(40 * MB // 8, np.float64)
        kept.append(np.ones(24 * MB // 8, np.float64) + temporary[: 24 * MB // 8])
        del temporary, scratch

    _, footprint = MemoryMeter(gpu=None, trim=False).measure(load, heap=True)
    assert footprint.by == "heap"
    assert 24 * MB <= footprint.host_bytes < 25 * MB, footprint


def test_meter_clamps_shrinking_rss_and_reports_gpu_per_device() -> None:
    proc = FakeProcess()
    proc.gpu = {0: 1000, 1: 500}
    meter = MemoryMeter(rss=proc.rss, gpu=proc.gpu_used, clock=proc.clock, trim=False)

    def load() -> None:
        proc.rss_bytes -= 5 * MB  # the allocator gave memory back meanwhile
        proc.gpu = {0: 4000, 1: 400}

    _, footprint = meter.measure(load)
    assert footprint.host_bytes == 0
    assert footprint.gpu_bytes == {0: 3000, 1: 0}
    assert footprint.gpu_total == 3000


def test_meter_gpu_reader_that_fails_degrades_to_none() -> None:
    def broken() -> dict[int, int] | None:
        raise RuntimeError("driver went away")

    _, footprint = MemoryMeter(gpu=broken, trim=False).measure(lambda: None)
    assert footprint.gpu_bytes is None


def test_no_gpu_here_means_none_silently() -> None:
    assert gpu_memory_used() is None  # this machine has no GPU (CI neither): stated, not hidden
    _, footprint = MemoryMeter().measure(lambda: None)
    assert footprint.gpu_bytes is None


def test_meter_propagates_load_errors_and_releases_the_lock() -> None:
    meter = MemoryMeter(trim=False)

    def fail() -> None:
        raise ValueError("bad model")

    with pytest.raises(ValueError):
        meter.measure(fail)
    assert meter.measure(lambda: 7)[0] == 7


def test_measured_loads_never_overlap_each_other_or_shared_loads() -> None:
    meter = MemoryMeter(trim=False)
    lock = threading.Lock()
    active = {"measured": 0, "shared": 0}
    seen: list[tuple[int, int]] = []

    def body(kind: str) -> None:
        with lock:
            active[kind] += 1
            seen.append((active["measured"], active["shared"]))
        time.sleep(0.01)
        with lock:
            active[kind] -= 1

    threads = [
        threading.Thread(target=meter.measure, args=(lambda: body("measured"),)) for _ in range(4)
    ] + [threading.Thread(target=meter.shared, args=(lambda: body("shared"),)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 8
    for measured, shared in seen:
        assert measured <= 1
        assert not (measured and shared)


def _weights_model(path: Path, megabytes: int) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    width = 1024  # one 1024x1024 FP32 weight is 4 MB
    rng = np.random.default_rng(0)
    nodes, weights = [], []
    previous = "INPUT0"
    layers = megabytes // 4
    for i in range(layers):
        weights.append(
            numpy_helper.from_array(rng.standard_normal((width, width), dtype=np.float32), f"W{i}")
        )
        output = "OUTPUT0" if i == layers - 1 else f"h{i}"
        nodes.append(helper.make_node("MatMul", [previous, f"W{i}"], [output]))
        previous = output
    graph = helper.make_graph(
        nodes,
        "weights",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", width])],
        weights,
    )
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path
    )


def test_meter_sees_a_real_onnxruntime_session_grow_rss(tmp_path: Path) -> None:
    import onnxruntime as ort

    path = tmp_path / "model.onnx"
    _weights_model(path, 52)
    assert path.stat().st_size >= 50 * MB

    def load() -> ort.InferenceSession:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        session.run(None, {"INPUT0": np.ones((2, 1024), np.float32)})  # warmup, as a load does
        return session

    session, footprint = MemoryMeter().measure(load)
    assert footprint.host_bytes >= 30 * MB, footprint
    assert footprint.host_bytes < 4 * path.stat().st_size, footprint  # retained, not transient
    assert footprint.seconds > 0
    # The file-based prediction for the same files lands near the measurement.
    predicted = SizePredictor().predict(ModelIdentity("m", "1", "x"), path)
    assert predicted.source == "files"
    assert 0.5 * footprint.host_bytes <= predicted.bytes <= 2 * footprint.host_bytes
    del session


# -- SizePredictor ----------------------------------------------------------------------------


def test_predictor_falls_back_from_measurement_to_files_to_default(tmp_path: Path) -> None:
    predictor = SizePredictor(file_factor=1.5, overhead_bytes=1000, default_bytes=5000)
    ident = ModelIdentity("resnet", "1", "etag-a")
    assert predictor.predict(ident).bytes == 5000
    assert predictor.predict(ident).source == "default"

    folder = tmp_path / "resnet" / "1"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(b"x" * 10_000)
    (folder.parent / "config.pbtxt").write_bytes(b"y" * 2_000)
    by_files = predictor.predict(ident, tmp_path / "resnet")
    assert (by_files.bytes, by_files.source) == (1000 + 18_000, "files")
    assert predictor.predict(ident, [folder]).bytes == 1000 + 15_000
    assert predictor.predict(ident, tmp_path / "missing").source == "default"

    predictor.record(ident, 123_456)
    assert predictor.measured(ident) == 123_456
    assert (predictor.predict(ident, folder).bytes, predictor.predict(ident).source) == (
        123_456,
        "measured",
    )
    predictor.record(ident, 100_000)  # the latest measurement wins
    assert predictor.predict(ident).bytes == 100_000

    # New content of the same model: the files, raised to the earlier measurement when larger.
    changed = ModelIdentity("resnet", "1", "etag-b")
    assert predictor.predict(changed, folder) == predictor.predict(changed, folder)
    assert (
        predictor.predict(changed, folder).bytes,
        predictor.predict(changed, folder).source,
    ) == (
        100_000,
        "previous",
    )
    assert predictor.predict(changed).source == "previous"
    predictor.record(ident, 10)
    assert predictor.predict(changed, folder).source == "files"
    # Never below the per-model overhead, even when a load measured ~0 (allocator reuse).
    assert predictor.predict(ident).bytes == 1000

    predictor.forget(ident)
    assert predictor.measured(ident) is None


def test_a_model_counts_at_least_the_overhead_and_its_files() -> None:
    """What a load commits: its measurement, never below the overhead plus its file bytes; and
    that is what a reload of the same files is predicted at (the same floor both ways)."""
    predictor = SizePredictor(file_factor=1.5, overhead_bytes=1000)
    for files in (10_000, 10_001, 7):
        estimate = predictor.from_bytes(files)
        assert predictor.counted(10, estimate) == 1000 + files
        assert predictor.counted(50_000, estimate) == 50_000
    assert predictor.counted(10, None) == 1000
    ident = ModelIdentity("m", "", "f")
    size = predictor.counted(10, predictor.from_bytes(10_000))
    predictor.record(ident, size)
    assert predictor.predict(ident).bytes == size == 11_000
    default = SizePredictor()  # the benchmark's models: 2 MiB overhead, measured ~64 KB by the heap
    assert default.counted(65_504, default.from_bytes(170)) == DEFAULT_OVERHEAD_BYTES + 170


def test_predictor_defaults_and_validation() -> None:
    predictor = SizePredictor()
    assert predictor.file_factor == DEFAULT_FILE_FACTOR
    assert predictor.overhead_bytes == DEFAULT_OVERHEAD_BYTES
    with pytest.raises(ValueError):
        SizePredictor(file_factor=0)
    with pytest.raises(ValueError):
        SizePredictor(overhead_bytes=-1)


def test_unloads_trim_the_heap_once_enough_was_freed() -> None:
    trims = TrimSchedule(after_bytes=10)
    assert [trims.freed(4), trims.freed(4), trims.freed(4)] == [False, False, True]
    assert trims.freed(9) is False  # counted afresh after a trim
    assert trims.freed(30) is True  # one large model: at once


# -- limit_arenas -------------------------------------------------------------------------------

_ARENAS = """
import ctypes, sys, threading
from quiver.lifecycle.memory import limit_arenas
if sys.argv[1] == "limit":
    assert limit_arenas(2)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
start = threading.Barrier(8)
def allocate():
    start.wait()
    for _ in range(2000):
        libc.free(libc.malloc(256))
threads = [threading.Thread(target=allocate) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
libc.malloc_stats()  # one "Arena N:" block per arena, on stderr
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or heap_in_use is None, reason="glibc only")
@pytest.mark.parametrize("limit", [True, False])
def test_limit_arenas_caps_the_arenas_threads_get(limit: bool) -> None:
    """Eight threads allocating at once get arenas of their own up to glibc's default (8 per
    core); with the limit they share two (the heap reading walks each arena)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
    done = subprocess.run(
        [sys.executable, "-c", _ARENAS, "limit" if limit else "default"],
        capture_output=True, text=True, env=env, timeout=60, check=True,
    )  # fmt: skip
    arenas = sum(line.startswith("Arena ") for line in done.stderr.splitlines())
    if limit:
        assert 1 <= arenas <= 2
    else:
        assert arenas > 2  # the test's own check: without the limit, threads do get arenas


@pytest.mark.parametrize(
    ("variable", "value"), [("MALLOC_ARENA_MAX", "4"), ("GLIBC_TUNABLES", "glibc.malloc.arena_max=4")]
)
def test_limit_arenas_leaves_an_explicit_arena_max_alone(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(memory, "_MALLOPT", lambda option, number: asked.append((option, number)) or 1)
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert limit_arenas(3) is True and asked == [(-8, 3)]  # M_ARENA_MAX, when nothing says otherwise
    asked.clear()
    monkeypatch.setenv(variable, value)
    assert limit_arenas(3) is False
    assert asked == []
