"""The GPU load limit's decisions (--model-load-gpu-limit) against a fake NVML reading: no
real GPU is needed (none was available where these were written)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from quiver.cli_types import _fraction
from quiver.lifecycle.manager import ModelRepositoryManager
from quiver.lifecycle.memory import GpuMemoryLimit, ModelIdentity

GB = 1 << 30


class FakeGpus:
    def __init__(self, used: dict[int, int], total: int = 16 * GB) -> None:
        self.used = used
        self.total = total

    def __call__(self) -> dict[int, tuple[int, int]]:
        return {d: (u, self.total) for d, u in self.used.items()}


def test_fraction_is_checked() -> None:
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            GpuMemoryLimit(bad, reader=FakeGpus({0: 0}))
    assert GpuMemoryLimit(1.0, reader=FakeGpus({0: 0})).fraction == 1.0
    assert _fraction("0.75") == 0.75
    for text in ("0", "1.01", "half"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"fraction|number"):
            _fraction(text)


def test_fits_or_reports_bytes_over_per_device() -> None:
    gpus = FakeGpus({0: 10 * GB, 1: 2 * GB})
    limit = GpuMemoryLimit(0.75, reader=gpus)  # 12 GB of 16 per device
    assert limit.over({0: 1 * GB}) == {}
    assert limit.over({0: 3 * GB}) == {0: 1 * GB}
    assert limit.over({0: 3 * GB, 1: 3 * GB}) == {0: 1 * GB}
    assert limit.over({1: 10 * GB}) == {}  # exactly at the limit fits
    assert limit.over({1: 11 * GB}) == {1: 1 * GB}
    # A model that grew no GPU memory (a KIND_CPU model) is never held back.
    gpus.used[0] = 15 * GB
    assert limit.over({0: 0, 1: 0}) == {}
    assert limit.over({}) == {}


def test_a_model_never_measured_is_refused_only_while_a_gpu_is_past_the_limit() -> None:
    gpus = FakeGpus({0: 11 * GB, 1: 0})
    limit = GpuMemoryLimit(0.75, reader=gpus)
    assert limit.over(None) == {}
    gpus.used[0] = 13 * GB
    assert limit.over(None) == {0: 1 * GB}


def test_reservations_of_loads_under_way_count_until_settled() -> None:
    gpus = FakeGpus({0: 8 * GB})
    limit = GpuMemoryLimit(0.75, reader=gpus)
    limit.reserve("a", {0: 3 * GB})
    assert limit.over({0: 2 * GB}) == {0: 1 * GB}  # 8 + 3 pending + 2 > 12
    assert limit.over({0: 3 * GB}, exclude="a") == {}  # its own reservation is not counted twice
    limit.settle("a")
    assert limit.over({0: 2 * GB}) == {}


def test_measured_gpu_sizes_are_remembered_per_identity_then_per_name() -> None:
    limit = GpuMemoryLimit(0.5, reader=FakeGpus({0: 0}))
    v1 = ModelIdentity("m", "", "files-1")
    assert limit.predict(v1) is None
    limit.record(v1, {0: 2 * GB, 1: -5})
    assert limit.predict(v1) == {0: 2 * GB, 1: 0}
    assert limit.predict(ModelIdentity("m", "", "files-2")) == {0: 2 * GB, 1: 0}
    assert limit.predict(ModelIdentity("other", "", "files-1")) is None


def test_without_a_reading_nothing_is_held_back() -> None:
    limit = GpuMemoryLimit(0.1, reader=lambda: None)
    assert limit.read() is None
    assert limit.over(None) == {} and limit.over({0: 100 * GB}) == {}

    def broken() -> dict[int, tuple[int, int]]:
        raise RuntimeError("NVML went away")

    assert GpuMemoryLimit(0.1, reader=broken).over(None) == {}


def test_manager_without_a_gpu_accepts_the_limit_and_says_once_it_has_no_effect(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="quiver.lifecycle.admission"):
        manager = ModelRepositoryManager([tmp_path], gpu_limit=0.5, gpu_reader=lambda: None)
    notes = [r for r in caplog.records if "--model-load-gpu-limit" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO and "no effect" in notes[0].getMessage()
    assert manager.admission.gpu is None
    with_gpu = ModelRepositoryManager([tmp_path], gpu_limit=0.5, gpu_reader=FakeGpus({0: 0}))
    gpu = with_gpu.admission.gpu
    assert gpu is not None and gpu.fraction == 0.5
