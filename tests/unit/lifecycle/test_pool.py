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


def test_what_arrives_is_handled_before_the_caller_resumes() -> None:
    """``arrived`` sees the result on the event loop before the awaiting caller resumes, and
    a task it wakes runs first; a step that raised, or a caller cancelled, is not handed to it."""
    pool = LoadPool(1)

    def fail() -> None:
        raise ValueError("bad")

    async def main() -> None:
        order: list[object] = []
        woken = asyncio.get_running_loop().create_future()

        async def other() -> None:
            await woken
            order.append("other")

        waiting = asyncio.ensure_future(other())

        def arrived(result: int) -> None:
            order.append(("arrived", result, threading.current_thread() is threading.main_thread()))
            woken.set_result(None)

        assert await pool.run(pow, 2, 3, arrived=arrived) == 8
        order.append("caller")
        await waiting
        assert order == [("arrived", 8, True), "other", "caller"]
        with pytest.raises(ValueError, match="bad"):
            await pool.run(fail, arrived=order.append)
        gate = threading.Event()
        step = asyncio.ensure_future(pool.run(gate.wait, arrived=order.append))
        await asyncio.sleep(0.01)
        step.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await step
        assert order == [("arrived", 8, True), "other", "caller"]

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()
