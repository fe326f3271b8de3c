"""quiver.eager.start: a coroutine runs now; one that finishes needs no task, one that waits
goes on in a task that behaves as if it had been one from the start (results, errors and
cancellation reach the coroutine where it waits)."""

from __future__ import annotations

import asyncio

import pytest

from quiver import eager


def test_a_coroutine_that_does_not_wait_runs_now_without_a_task() -> None:
    async def main() -> None:
        ran: list[str] = []

        async def work() -> None:
            ran.append("ran")

        before = len(asyncio.all_tasks())
        assert eager.start(work()) is None
        assert ran == ["ran"]  # before this function went on
        assert len(asyncio.all_tasks()) == before

    asyncio.run(main())


def test_an_error_before_the_first_wait_raises_at_the_start() -> None:
    async def main() -> None:
        async def work() -> None:
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            eager.start(work())

    asyncio.run(main())


def test_a_coroutine_that_waits_goes_on_in_a_task_with_results_and_errors() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        first, second = loop.create_future(), loop.create_future()
        seen: list[object] = []

        async def work() -> None:
            seen.append("started")
            seen.append(await first)
            await asyncio.sleep(0)  # a bare yield
            try:
                await second
            except KeyError as exc:
                seen.append(f"error {exc}")
            seen.append(asyncio.current_task() is task)

        task = eager.start(work(), name="rest")
        assert task is not None and task.get_name() == "rest"
        assert seen == ["started"]
        first.set_result(7)
        await asyncio.sleep(0.01)
        second.set_exception(KeyError("k"))
        await task
        assert seen == ["started", 7, "error 'k'", True]

    asyncio.run(main())


@pytest.mark.parametrize("future_done", [False, True])
def test_cancelling_the_task_cancels_the_coroutine_where_it_waits(future_done: bool) -> None:
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        waited = loop.create_future()
        seen: list[str] = []

        async def work() -> None:
            try:
                await waited
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise
            seen.append("not cancelled")

        task = eager.start(work())
        assert task is not None
        await asyncio.sleep(0)  # the task now waits on the future
        if future_done:  # done, but the task not resumed yet when it is cancelled
            waited.set_result(None)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return seen

    assert asyncio.run(main()) == ["cancelled"]
