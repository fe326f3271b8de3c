"""Pins: explicit counts with an idle event, and the release callback loads wait on."""

from __future__ import annotations

import asyncio

import pytest

from quiver.lifecycle.pins import Pins


def test_a_model_is_pinned_while_its_count_is_above_zero() -> None:
    released: list[int] = []
    pins = Pins(lambda: released.append(1))
    pins.pin("a", "b")
    pins.pin("a")
    assert pins.count("a") == 2 and pins.pinned("b") and pins.names == {"a", "b"}
    pins.unpin("a")
    assert pins.pinned("a") and released == []  # still one left: nothing was released
    pins.unpin("a", "b")
    assert not pins.pinned("a") and not pins.pinned("b") and pins.names == frozenset()
    assert released == [1]  # one call for one unpin, however many it released
    with pytest.raises(KeyError):
        pins.unpin("a")  # an unpin without its pin is a bug, not silently ignored


def test_holding_releases_on_error() -> None:
    pins = Pins()
    with pytest.raises(RuntimeError), pins.holding("a"):
        assert pins.pinned("a")
        raise RuntimeError("boom")
    assert not pins.pinned("a")


def test_idle_waits_for_the_last_pin() -> None:
    pins = Pins()

    async def main() -> None:
        await asyncio.wait_for(pins.idle("a"), 1)  # not pinned: at once
        pins.pin("a")
        pins.pin("a")
        waiter = asyncio.ensure_future(pins.idle("a"))
        await asyncio.sleep(0)
        pins.unpin("a")
        await asyncio.sleep(0)
        assert not waiter.done()
        pins.unpin("a")
        await asyncio.wait_for(waiter, 1)
        pins.pin("a")  # pinned again: a new wait waits again
        again = asyncio.ensure_future(pins.idle("a"))
        await asyncio.sleep(0)
        assert not again.done()
        pins.unpin("a")
        await asyncio.wait_for(again, 1)

    asyncio.run(main())
