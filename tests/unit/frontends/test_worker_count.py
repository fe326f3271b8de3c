"""``--frontend-workers auto``: the cores this process may use, and the count they give."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from quiver.frontends.worker_count import auto_frontend_workers, usable_cores


def test_auto_is_off_below_four_cores_then_cores_minus_two_up_to_three() -> None:
    assert [auto_frontend_workers(n) for n in range(1, 9)] == [0, 0, 0, 2, 3, 3, 3, 3]


def test_usable_cores_is_the_affinity_without_a_quota(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    assert usable_cores(tmp_path / "absent") == affinity
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(tmp_path / "cpu.max") == affinity


@pytest.mark.parametrize(("line", "cores"), [("50000 100000", 1), ("100000 100000", 1), ("150000 100000", 2)])
def test_a_cgroup_quota_lowers_the_count_rounded_up(tmp_path: Path, line: str, cores: int) -> None:
    (tmp_path / "cpu.max").write_text(line + "\n")
    assert usable_cores(tmp_path / "cpu.max") == min(cores, len(os.sched_getaffinity(0)))


@pytest.mark.parametrize("line", ["", "garbage", "100000 0", "-5 x"])
def test_an_unreadable_quota_is_ignored(tmp_path: Path, line: str) -> None:
    (tmp_path / "cpu.max").write_text(line)
    assert usable_cores(tmp_path / "cpu.max") == len(os.sched_getaffinity(0))
