"""The load pool: a cancelled caller waits for its thread and discards what it produced."""

from __future__ import annotations

import asyncio
import threading

import pytest

from quiver.lifecycle.pool import LoadPool


def test_a_cancelled_step_waits_for_its_thread_and_discards_the_result() -> None:
    pool = LoadPool(2)
    started, release = threading.Event(), threading.Event()
    discarded: list[str] = []

    def load() -> str:
        started.set()
        assert release.wait(5)
        return "model"

    async def discard(result: str) -> None:
        discarded.append(result)

    async def main() -> None:
        task = asyncio.ensure_future(pool.run(load, discard=discard))
        await asyncio.to_thread(started.wait, 5)
        task.cancel()
        await asyncio.sleep(0.02)
        assert not task.done()  # the thread is still running: the cancellation waits for it
        task.cancel()  # cancelled again: still waits
        await asyncio.sleep(0.02)
        assert not task.done()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert discarded == ["model"]

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()


def test_results_and_errors_come_back() -> None:
    pool = LoadPool(1)

    def fail() -> None:
        raise ValueError("bad")

    async def main() -> None:
        assert await pool.run(pow, 2, 10) == 1024
        with pytest.raises(ValueError, match="bad"):
            await pool.run(fail)

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()
