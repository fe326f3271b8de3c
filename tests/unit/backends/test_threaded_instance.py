"""The inline-execution rule of ThreadedInstance: fast calls on the loop, slow ones on the thread."""

from __future__ import annotations

import asyncio
import threading
import time

from quiver.backends.base import ExecuteResult, ThreadedInstance
from quiver.types import InferenceRequest, InferenceResponse


class Sleeper(ThreadedInstance):
    inline_safe = True

    def __init__(self) -> None:
        super().__init__("sleeper")
        self.seconds = 0.0
        self.threads: list[str] = []

    def execute(self, requests: list[InferenceRequest]) -> ExecuteResult:
        self.threads.append(threading.current_thread().name)
        if self.seconds:
            time.sleep(self.seconds)
        return [InferenceResponse("sleeper", "1", []) for _ in requests]


def run(instance: ThreadedInstance, times: int = 1) -> None:
    async def main() -> None:
        for _ in range(times):
            await instance.run([InferenceRequest("sleeper", "", [])])

    asyncio.run(main())


def test_first_call_is_threaded_then_fast_calls_run_inline() -> None:
    instance = Sleeper()
    try:
        run(instance, times=3)
        assert instance.threads[0].startswith("quiver-sleeper")
        assert instance.threads[1:] == ["MainThread", "MainThread"]
        assert instance.runs_inline
    finally:
        instance.unload()


def test_one_slow_call_sends_the_next_back_to_the_thread() -> None:
    instance = Sleeper()
    try:
        run(instance, times=2)
        assert instance.runs_inline
        instance.seconds = 0.01  # 10 ms: far over the threshold
        run(instance)
        assert not instance.runs_inline
        run(instance)
        assert instance.threads[-1].startswith("quiver-sleeper")
    finally:
        instance.unload()


def test_not_inline_safe_always_uses_its_thread() -> None:
    instance = Sleeper()
    instance.inline_safe = False
    try:
        run(instance, times=3)
        assert all(name.startswith("quiver-sleeper") for name in instance.threads)
    finally:
        instance.unload()


def test_threshold_zero_disables_inline() -> None:
    instance = Sleeper()
    instance.inline_threshold_ns = 0
    try:
        run(instance, times=3)
        assert not instance.runs_inline
        assert all(name.startswith("quiver-sleeper") for name in instance.threads)
    finally:
        instance.unload()
