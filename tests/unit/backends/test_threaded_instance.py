"""The inline-execution rule of ThreadedInstance: fast calls on the loop, slow ones on the
thread, and a first call guessed from the creation time."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import numpy as np

from quiver.backends.base import (
    FIRST_CALL_DIVISOR,
    FIRST_CALL_MAX_INPUT_BYTES,
    ExecuteResult,
    ThreadedInstance,
)
from quiver.types import DataType, InferenceRequest, InferenceResponse, Tensor


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


class Guesser(Sleeper):
    first_call_guess = True


def run_with(instance: ThreadedInstance, data: np.ndarray) -> None:
    async def main() -> None:
        await instance.run([InferenceRequest("sleeper", "", [Tensor("INPUT0", DataType.FP32, data.shape, data)])])

    asyncio.run(main())


def test_a_first_call_guessed_cheap_from_the_creation_time_runs_inline() -> None:
    """Created in 0.4 ms: the first call is guessed at 50 us, under the 200 us threshold, and a
    small request runs inline, without starting the instance's thread."""
    instance = Guesser()
    instance.created_in(400_000)
    try:
        run_with(instance, np.zeros(4, np.float32))
        assert instance.threads == ["MainThread"]
        assert instance.runs_inline  # measured now, and fast
    finally:
        instance.unload()


def test_the_first_call_goes_to_the_thread_when_the_guess_does_not_hold() -> None:
    # a slow creation: guessed over the threshold
    slow = Guesser()
    slow.created_in(FIRST_CALL_DIVISOR * 300_000)
    # a first request with large inputs: no guess trusted
    large = Guesser()
    large.created_in(400_000)
    # a framework whose first call is not guessed
    plain = Sleeper()
    plain.created_in(400_000)
    try:
        run_with(slow, np.zeros(4, np.float32))
        run_with(large, np.zeros(FIRST_CALL_MAX_INPUT_BYTES // 4 + 1, np.float32))
        run_with(plain, np.zeros(4, np.float32))
        for instance in (slow, large, plain):
            assert instance.threads[0].startswith("quiver-sleeper"), instance.threads
        # measured now (fast): the next calls run inline as usual
        run_with(large, np.zeros(FIRST_CALL_MAX_INPUT_BYTES // 4 + 1, np.float32))
        assert large.threads[1] == "MainThread"
    finally:
        for instance in (slow, large, plain):
            instance.unload()


def test_threshold_zero_also_keeps_a_guessed_first_call_on_the_thread() -> None:
    instance = Guesser()
    instance.inline_threshold_ns = 0
    instance.created_in(0)
    try:
        run_with(instance, np.zeros(4, np.float32))
        assert instance.threads[0].startswith("quiver-sleeper")
    finally:
        instance.unload()


def test_answers_at_once_only_when_the_next_run_is_inline() -> None:
    instance = Sleeper()
    try:
        instance.created_in(1_000)  # a first call guessed cheap still is not promised
        assert not instance.answers_at_once
        run(instance, times=2)
        assert instance.runs_inline and instance.answers_at_once
        instance.seconds = 0.01
        run(instance)  # one slow call: the next goes to the thread
        assert not instance.answers_at_once
    finally:
        instance.unload()


class _Awaiting(Sleeper):
    """Overrides run (as the Python backend's instance must): it may await even when inline."""

    async def run(self, requests: list[InferenceRequest]) -> ExecuteResult:
        await asyncio.sleep(0)
        return await super().run(requests)


def test_an_instance_with_its_own_run_never_promises_to_answer_at_once() -> None:
    instance = _Awaiting()
    try:
        run(instance, times=3)
        assert instance.runs_inline and not instance.answers_at_once
    finally:
        instance.unload()


class _Blocked(ThreadedInstance):
    """Runs on its thread until ``go`` is set."""

    def __init__(self) -> None:
        super().__init__("blocked")
        self.started = threading.Event()
        self.go = threading.Event()
        self.finished = threading.Event()

    def execute(self, requests: list[InferenceRequest]) -> ExecuteResult:
        self.started.set()
        self.go.wait(10)
        self.finished.set()
        return [InferenceResponse("blocked", "1", []) for _ in requests]


def test_a_call_cancelled_twice_still_holds_its_caller_until_the_thread_is_done() -> None:
    """The thread cannot be stopped, so the caller (and the instance pool that lent the
    instance) waits for it however many times it is cancelled: a second cancel must not free
    the instance while its thread still runs."""
    instance = _Blocked()

    async def main() -> None:
        call = asyncio.ensure_future(instance.run([InferenceRequest("blocked", "", [])]))
        while not instance.started.is_set():
            await asyncio.sleep(0.005)
        call.cancel()
        await asyncio.sleep(0.02)
        call.cancel()
        await asyncio.sleep(0.05)
        assert not call.done()  # still waiting for the thread
        instance.go.set()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        assert call.cancelled() and instance.finished.is_set()

    try:
        asyncio.run(main())
    finally:
        instance.go.set()
        instance.unload()
