"""The served-model table and index: lookups (with the reasons a model is not served), what a
load installs, taking models out of service, residency listeners, last use on the fake clock."""

from __future__ import annotations

from typing import Any

import pytest
from lifecycle_fakes import FakeClock

from quiver.errors import InvalidArgumentError, NotFoundError, UnavailableError
from quiver.lifecycle.loader import LoadOutcome
from quiver.lifecycle.model import Model, ModelState
from quiver.lifecycle.table import ModelTable


def model(name: str, version: int) -> Model:
    fake: Any = None  # the table never looks at config, scheduler or instances
    return Model(name, version, fake, fake, [])


def test_install_serves_the_latest_version_and_lists_failures() -> None:
    clock = FakeClock()
    table = ModelTable(clock)
    heard: list[tuple[str, bool]] = []
    table.add_listener(lambda name, resident: heard.append((name, resident)))
    table.mark("m", ModelState.LOADING)
    assert table.index()[0].state is ModelState.LOADING and not table.serving("m")
    table.install("m", LoadOutcome(None, [model("m", 1), model("m", 3)], {2: "version 2 is broken"}))
    assert [(s.version, s.state, s.reason) for s in table.index()] == [
        ("1", ModelState.READY, ""),
        ("2", ModelState.UNAVAILABLE, "version 2 is broken"),
        ("3", ModelState.READY, ""),
    ]
    assert heard == [("m", True)]
    clock.advance(5)
    latest = table.get("m", use=True)
    assert latest.version == 3 and latest.last_used == clock.now() / 1e9
    assert latest.loaded_at == pytest.approx(latest.last_used - 5)
    assert table.get("m", "1").version == 1
    assert [m.version for m in table.loaded("m")] == [1, 3]


def test_why_a_model_is_not_served() -> None:
    table = ModelTable(FakeClock())
    with pytest.raises(NotFoundError, match="unknown model: 'x'"):
        table.get("x")
    with pytest.raises(InvalidArgumentError, match="not a number"):
        table.get("x", "abc")
    table.mark("broken", ModelState.UNAVAILABLE, "no version folder")
    with pytest.raises(UnavailableError, match=r"not ready \(UNAVAILABLE\): no version folder"):
        table.get("broken")
    assert table.reason("broken") == "no version folder" and table.reason("other") == "not loaded"
    table.install("m", LoadOutcome(None, [model("m", 2)], {}))
    with pytest.raises(NotFoundError, match="version 5 is not served; versions served: 2"):
        table.get("m", "5")
    assert not table.is_ready("m", "5") and table.is_ready("m")


def test_take_and_take_all() -> None:
    table = ModelTable(FakeClock())
    heard: list[tuple[str, bool]] = []
    table.add_listener(lambda name, resident: heard.append((name, resident)))
    table.install("a", LoadOutcome(None, [model("a", 1)], {}))
    table.install("b", LoadOutcome(None, [model("b", 1)], {}))
    taken = table.take("a")
    assert [m.name for m in taken] == ["a"] and not table.serving("a") and table.take("a") == []
    assert table.was_ready("a")  # the index still says READY until the life cycle marks it
    table.mark_versions("a", taken, ModelState.UNAVAILABLE, "unloaded")
    assert not table.was_ready("a") and table.reason("a") == "unloaded"
    assert [m.name for m in table.take_all()] == ["b"]
    assert table.models == [] and [s.state for s in table.index() if s.name == "b"] == [ModelState.UNLOADING]
    assert heard == [("a", True), ("b", True), ("a", False)]


def test_a_failing_listener_does_not_stop_the_others(caplog: pytest.LogCaptureFixture) -> None:
    table = ModelTable(FakeClock())
    heard: list[str] = []

    def broken(name: str, resident: bool) -> None:
        raise RuntimeError("router down")

    table.add_listener(broken)
    table.add_listener(lambda name, resident: heard.append(name))
    table.install("a", LoadOutcome(None, [model("a", 1)], {}))
    assert heard == ["a"] and "residency listener failed for model 'a'" in caplog.text


def test_lookups_are_counted_for_policies_that_care() -> None:
    table = ModelTable(FakeClock())
    used: list[str] = []
    table.on_use = lambda m: used.append(m.name)
    table.install("a", LoadOutcome(None, [model("a", 1), model("a", 2)], {}))
    table.get("a", use=True)
    table.get("a", "1", use=True)  # a request for one version is a use too
    table.latest("a")  # the life cycle's own look: not a use
    assert used == ["a", "a"]


def test_looks_that_run_nothing_are_not_uses() -> None:
    """Readiness, metadata and config look a model up without running it: the eviction policy
    does not count them and the model's last use stays when it was (a probe polling readiness
    must not keep a model in memory)."""
    clock = FakeClock()
    table = ModelTable(clock)
    used: list[str] = []
    table.on_use = lambda m: used.append(m.name)
    table.install("a", LoadOutcome(None, [model("a", 1)], {}))
    before = table.get("a").last_used
    clock.advance(5)
    assert table.is_ready("a") and table.is_ready("a", "1")
    assert table.get("a").last_used == table.get("a", "1").last_used == before
    assert used == []
    assert table.get("a", use=True).last_used == clock.now() / 1e9 and used == ["a"]
