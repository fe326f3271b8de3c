"""InstanceThread: an instance's own thread, calls handed to it from the event loop and back."""

from __future__ import annotations

import asyncio
import threading

import pytest

from quiver.backends.instance_thread import InstanceThread


def _thread_name(_: object) -> str:
    return threading.current_thread().name


def _raise(message: str) -> None:
    raise ValueError(message)


def test_call_runs_on_the_instance_thread_and_answers_on_the_loop() -> None:
    worker = InstanceThread("quiver-test")

    async def main() -> list[str]:
        return list(await asyncio.gather(*(worker.call(_thread_name, None) for _ in range(20))))

    try:
        names = asyncio.run(main())
        assert names == ["quiver-test"] * 20
    finally:
        worker.shutdown()


def test_an_exception_reaches_the_awaiting_task() -> None:
    worker = InstanceThread("quiver-test")

    async def main() -> None:
        await worker.call(_raise, "boom in the model")

    try:
        with pytest.raises(ValueError, match="boom in the model"):
            asyncio.run(main())
    finally:
        worker.shutdown()


def test_calls_run_one_at_a_time_in_order() -> None:
    worker = InstanceThread("quiver-test")
    seen: list[int] = []
    active = 0
    overlapped = False
    lock = threading.Lock()

    def record(i: int) -> int:
        nonlocal active, overlapped
        with lock:
            active += 1
            overlapped |= active > 1
        seen.append(i)
        with lock:
            active -= 1
        return i

    async def main() -> list[int]:
        return list(await asyncio.gather(*(worker.call(record, i) for i in range(50))))

    try:
        assert asyncio.run(main()) == list(range(50))
        assert seen == list(range(50))
        assert not overlapped
    finally:
        worker.shutdown()


def test_a_cancelled_caller_does_not_stop_the_call() -> None:
    worker = InstanceThread("quiver-test")
    release = threading.Event()
    finished = threading.Event()

    def slow(_: object) -> str:
        release.wait(10)
        finished.set()
        return "done"

    async def main() -> None:
        future = worker.call(slow, None)
        future.cancel()
        release.set()

    try:
        asyncio.run(main())
        assert finished.wait(10)  # ran to its end; its answer went nowhere
    finally:
        worker.shutdown()


def test_submit_and_shutdown_work_as_an_executor() -> None:
    worker = InstanceThread("quiver-test")
    assert worker.submit(_thread_name, None).result(10) == "quiver-test"
    with pytest.raises(ValueError, match="from submit"):
        worker.submit(_raise, "from submit").result(10)
    ran = threading.Event()
    worker.submit(ran.set)
    worker.shutdown(wait=True)  # what was queued runs first
    assert ran.is_set()
    with pytest.raises(RuntimeError, match="quiver-test is shut down"):
        worker.submit(ran.set)
    worker.shutdown()  # twice is fine


def test_shutdown_before_any_work_starts_no_thread() -> None:
    before = threading.active_count()
    worker = InstanceThread("quiver-test")
    worker.shutdown()
    assert threading.active_count() == before
