"""quiver.profiling: a process profiles itself only when QUIVER_PROFILE_DIR is set, and leaves
a profile pstats can read."""

from __future__ import annotations

import pstats
from pathlib import Path

import pytest

from quiver import profiling


@pytest.fixture(autouse=True)
def _fresh() -> None:
    profiling._profile = None
    profiling._path = None


def _work() -> int:
    return sum(i * i for i in range(1000))


def test_nothing_is_profiled_without_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(profiling.ENV, raising=False)
    profiling.start("server")
    _work()
    profiling.dump()
    assert profiling._profile is None
    assert list(tmp_path.iterdir()) == []


def test_a_profile_is_written_once_where_the_variable_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "profiles"
    monkeypatch.setenv(profiling.ENV, str(folder))
    profiling.start("frontend")
    _work()
    profiling.dump()
    profiling.dump()  # a second call (atexit after an explicit dump) changes nothing
    files = list(folder.iterdir())
    assert len(files) == 1 and files[0].name.startswith("frontend-") and files[0].suffix == ".prof"
    stats = pstats.Stats(str(files[0]))
    assert any(name == "_work" for (_, _, name) in stats.stats)  # type: ignore[attr-defined]
