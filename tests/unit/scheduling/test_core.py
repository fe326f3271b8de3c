"""The scheduler core on the fake clock: the alarm, workers that wait for work and for the
alarm (never polling), in-flight accounting, the ordered stop (and a cancelled one), a failing
batch, a crashed worker; the instance pool and execution accounting.

The policy here is a minimal one written against the core as the real schedulers are: a FIFO
queue sent in batches of up to two once its head has waited ``DELAY`` ns.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable

import pytest

from quiver.backends.base import ExecuteResult, ExecutionTiming
from quiver.clock import FakeClock
from quiver.errors import InternalError, InvalidArgumentError, QuiverError, UnavailableError
from quiver.metrics.statistics import ModelStatistics
from quiver.scheduling.core import Alarm, ErrorFactory, Execution, InstancePool, SchedulerCore
from quiver.types import InferenceRequest, InferenceResponse

DELAY = 100


class Echo:
    """A fake instance: answers each request with its id; ``fail`` ids come back as errors;
    ``gate``, when set, holds executions until opened; ``cost`` advances the clock."""

    def __init__(self, clock: FakeClock, name: str = "i0", cost: int = 0) -> None:
        self.name = name
        self.clock = clock
        self.cost = cost
        self.timing = ExecutionTiming()
        self.batches: list[list[str]] = []
        self.gate: asyncio.Event | None = None
        self.raise_on: str | None = None

    async def run(self, requests: list[InferenceRequest]) -> ExecuteResult:
        self.batches.append([r.id for r in requests])
        if self.gate is not None:
            await self.gate.wait()
        if self.raise_on in self.batches[-1]:
            raise RuntimeError("a bug in the execution path")
        self.clock.advance(self.cost)
        return [
            InvalidArgumentError(f"bad {r.id}") if r.id.startswith("fail") else InferenceResponse("m", "1", [], r.id)
            for r in requests
        ]

    def unload(self) -> None:
        pass


Queued = tuple[InferenceRequest, "asyncio.Future[InferenceResponse]", int]


class Fifo:
    """A minimal batching policy on a SchedulerCore."""

    def __init__(self, clock: FakeClock, instances: list[Echo], *, run_queued_at_stop: bool = False) -> None:
        self.stats = ModelStatistics()
        self.core = SchedulerCore("model 'm'", self.stats, clock)
        self.queue: deque[Queued] = deque()
        self.crash_on: str | None = None
        self.core.use_workers(
            list(instances),
            name="test-worker",
            next_batch=self.next_batch,
            execute=self.execute,
            futures=lambda batch: (future for _, future, _ in batch),
            fail_queued=self.fail_queued,
            run_queued_at_stop=run_queued_at_stop,
        )

    async def enqueue(self, name: str) -> InferenceResponse:
        core = self.core
        core.open()
        now = core.clock.now()
        future: asyncio.Future[InferenceResponse] = asyncio.get_running_loop().create_future()
        self.queue.append((InferenceRequest("m", "", [], id=name), future, now))
        with core.accept(now):
            core.wake_one()
            return await future

    async def next_batch(self, index: int) -> list[Queued] | None:
        core = self.core
        while True:
            queue = self.queue
            if queue and queue[0][0].id == self.crash_on:
                raise RuntimeError("a bug in batch forming")
            if queue and (len(queue) >= 2 or core.clock.now() >= queue[0][2] + DELAY):
                return [queue.popleft() for _ in range(min(2, len(queue)))]
            if core.stopping and not queue:
                return None
            if queue:
                core.alarm.at(queue[0][2] + DELAY)
            await core.wait_for_work()

    async def execute(self, instance: Echo, batch: list[Queued]) -> None:
        core = self.core
        execution = await Execution.run(instance, [r for r, _, _ in batch], len(batch), core.stats, core.clock)
        for (_, future, enqueued), result in zip(batch, execution.results, strict=True):
            execution.answer(future, result, enqueued)

    def fail_queued(self, error: ErrorFactory) -> None:
        while self.queue:
            _, future, _ = self.queue.popleft()
            if not future.done():
                future.set_exception(error())


async def settle() -> None:
    """Let every ready task run (no time passes: the clock is fake)."""
    for _ in range(20):
        await asyncio.sleep(0)


def run(main: Callable[[], Awaitable[None]]) -> None:
    """Run ``main``; no task may be left behind."""

    async def checked() -> None:
        await main()
        left = asyncio.all_tasks() - {asyncio.current_task()}
        assert not left, f"tasks left behind: {left}"

    asyncio.run(checked())


# ------------------------------------------------------------------------------ the alarm


def test_alarm_keeps_the_earliest_time_and_fires_once_at_it() -> None:
    clock = FakeClock()
    fired: list[int] = []
    alarm = Alarm(clock, lambda: fired.append(clock.now()))
    alarm.at(300)
    alarm.at(100)  # earlier: replaces 300
    alarm.at(200)  # later than what is set: ignored
    assert clock.pending == [100]
    clock.advance(150)
    assert fired == [100]
    alarm.at(400)
    alarm.at(250)
    clock.advance(1_000)
    assert fired == [100, 250]
    alarm.at(2_000)
    alarm.cancel()
    clock.advance(5_000)
    assert fired == [100, 250] and clock.pending == []


# ---------------------------------------------------------------------------- the workers


def test_workers_wait_for_the_alarm_on_the_clock_and_count_in_flight() -> None:
    clock = FakeClock()
    instance = Echo(clock, cost=7)
    fifo = Fifo(clock, [instance])

    async def main() -> None:
        first = asyncio.ensure_future(fifo.enqueue("a"))
        await settle()
        assert instance.batches == [] and fifo.core.inflight == 1 and fifo.stats.pending == 1
        assert clock.pending == [DELAY]  # the worker asked the alarm, and waits
        clock.advance(DELAY - 1)
        await settle()
        assert instance.batches == []
        clock.advance(1)  # the alarm fires and wakes the worker
        await settle()
        assert instance.batches == [["a"]]
        assert (await first).id == "a"
        assert fifo.core.inflight == 0 and fifo.stats.pending == 0

        both = [asyncio.ensure_future(fifo.enqueue(n)) for n in ("b", "c")]  # a full batch: at once
        await settle()
        assert [r.id for r in await asyncio.gather(*both)] == ["b", "c"]
        await fifo.core.stop()

    run(main)
    assert instance.batches == [["a"], ["b", "c"]]
    assert fifo.stats.success.count == 3 and fifo.stats.execution_count == 2
    assert fifo.stats.success.ns == (DELAY + 7) + 7 + 7  # times from the fake clock
    assert fifo.stats.compute_infer.ns == 3 * 7  # the backend does not split its time


def test_stop_fails_the_queued_awaits_the_workers_and_refuses_new_requests() -> None:
    clock = FakeClock()
    instances = [Echo(clock, "i0"), Echo(clock, "i1")]
    fifo = Fifo(clock, instances)

    async def main() -> None:
        queued = asyncio.ensure_future(fifo.enqueue("a"))
        await settle()
        await fifo.core.stop()
        with pytest.raises(UnavailableError, match="model 'm' is unloading"):
            await queued
        assert fifo.core.inflight == 0 and clock.pending == []  # the alarm was cancelled
        with pytest.raises(UnavailableError, match="model 'm' is unloading"):
            await fifo.enqueue("late")

    run(main)
    assert instances[0].batches == instances[1].batches == []
    assert fifo.stats.fail_reasons == {"REJECTED": 1}  # the late one; queued ones never ran


def test_stop_can_run_out_the_queue_first() -> None:
    clock = FakeClock()
    instance = Echo(clock)
    fifo = Fifo(clock, [instance], run_queued_at_stop=True)

    async def main() -> None:
        queued = asyncio.ensure_future(fifo.enqueue("a"))
        await settle()
        stopping = asyncio.ensure_future(fifo.core.stop())
        await settle()
        assert not stopping.done()  # the head still waits for its delay
        clock.advance(DELAY)
        await stopping
        assert (await queued).id == "a"

    run(main)
    assert instance.batches == [["a"]]


def test_stop_waits_for_running_executions() -> None:
    clock = FakeClock()
    instance = Echo(clock)
    instance.gate = asyncio.Event()
    fifo = Fifo(clock, [instance])

    async def main() -> None:
        assert instance.gate is not None
        running = [asyncio.ensure_future(fifo.enqueue(n)) for n in ("a", "b")]
        await settle()
        stopping = asyncio.ensure_future(fifo.core.stop())
        await settle()
        assert not stopping.done() and fifo.core.inflight == 2
        instance.gate.set()
        await stopping
        assert fifo.core.inflight == 0
        assert [r.id for r in await asyncio.gather(*running)] == ["a", "b"]

    run(main)


def test_a_cancelled_stop_cancels_and_awaits_the_workers() -> None:
    clock = FakeClock()
    instance = Echo(clock)
    instance.gate = asyncio.Event()  # never opened: the execution hangs
    fifo = Fifo(clock, [instance])

    async def main() -> None:
        running = [asyncio.ensure_future(fifo.enqueue(n)) for n in ("a", "b")]
        queued = asyncio.ensure_future(fifo.enqueue("c"))
        await settle()
        stopping = asyncio.ensure_future(fifo.core.stop())
        await settle()
        stopping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopping
        for request in (*running, queued):  # no caller is left waiting
            with pytest.raises(UnavailableError, match="is unloading"):
                await request
        assert fifo.core.inflight == 0

    run(main)  # and the worker task is gone


def test_a_failing_batch_fails_its_requests_and_the_worker_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    instance = Echo(clock)
    instance.raise_on = "x"
    fifo = Fifo(clock, [instance])

    async def main() -> None:
        failed = [asyncio.ensure_future(fifo.enqueue(n)) for n in ("x", "y")]
        for request in failed:
            with pytest.raises(InternalError, match="model 'm': batch execution failed"):
                await request
        answered = [asyncio.ensure_future(fifo.enqueue(n)) for n in ("fail-z", "w")]
        with pytest.raises(InvalidArgumentError, match="bad fail-z"):
            await answered[0]
        assert (await answered[1]).id == "w"
        await fifo.core.stop()

    with caplog.at_level(logging.ERROR, logger="quiver.scheduling.core"):
        run(main)
    assert [r.getMessage() for r in caplog.records] == ["model 'm': batch execution failed"]
    assert caplog.records[0].exc_info is not None
    assert fifo.stats.fail_reasons == {"BACKEND": 1}


def test_a_crashed_worker_is_surfaced(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    fifo = Fifo(clock, [Echo(clock)])
    fifo.crash_on = "boom"

    async def main() -> None:
        first = asyncio.ensure_future(fifo.enqueue("boom"))
        second = asyncio.ensure_future(fifo.enqueue("next"))
        for request in (first, second):  # what was queued fails, nobody hangs
            with pytest.raises(InternalError, match=r"a scheduler worker crashed .*a bug in batch forming"):
                await request
        with pytest.raises(InternalError, match="a scheduler worker crashed"):
            await fifo.enqueue("later")  # refused until the model is loaded again
        await fifo.core.stop()

    with caplog.at_level(logging.ERROR, logger="quiver.scheduling.core"):
        run(main)
    assert [r.getMessage() for r in caplog.records] == ["model 'm': scheduler worker test-worker-0 crashed"]
    exc_info = caplog.records[0].exc_info
    assert exc_info is not None and isinstance(exc_info[1], RuntimeError)  # logged once, with its traceback
    assert fifo.stats.fail_reasons == {"REJECTED": 1}


# ----------------------------------------------------------------- in-flight accounting


def test_admission_counts_cancelled_callers_and_errors_on_the_clock() -> None:
    clock = FakeClock(start=1_000)
    stats = ModelStatistics()
    core = SchedulerCore("ensemble 'e'", stats, clock)

    async def wait_then(error: BaseException | None) -> None:
        with core.accept(clock.now(), error_reason="BACKEND"):
            clock.advance(5)
            await asyncio.sleep(0)
            if error is not None:
                raise error

    async def main() -> None:
        cancelled = asyncio.ensure_future(wait_then(None))
        await asyncio.sleep(0)
        assert core.inflight == 1 and stats.pending == 1
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        with pytest.raises(InvalidArgumentError):
            await wait_then(InvalidArgumentError("bad"))
        await wait_then(None)
        assert core.inflight == 0 and stats.pending == 0
        with pytest.raises(QuiverError):
            raise core.reject(InvalidArgumentError("refused"))
        await core.stop()
        with pytest.raises(UnavailableError, match="ensemble 'e' is unloading"):
            core.open()

    run(main)
    assert stats.fail_reasons == {"CANCELED": 1, "BACKEND": 1, "REJECTED": 2}
    assert stats.fail.ns == 5 + 5  # the two that were accepted, timed on the fake clock


def test_stop_waits_until_nothing_is_in_flight() -> None:
    clock = FakeClock()
    core = SchedulerCore("ensemble 'e'", ModelStatistics(), clock)

    async def main() -> None:
        gate = asyncio.Event()

        async def request() -> None:
            with core.accept(clock.now()):
                await gate.wait()

        running = asyncio.ensure_future(request())
        await settle()
        stopping = asyncio.ensure_future(core.stop())
        await settle()
        assert not stopping.done()
        gate.set()
        await stopping
        await running

    run(main)


# ---------------------------------------------------------- instance pool and execution


def test_instance_pool_lends_in_arrival_order_and_skips_callers_that_left() -> None:
    clock = FakeClock()
    only = Echo(clock)

    async def main() -> None:
        pool = InstancePool([only])
        assert await pool.acquire() is only
        waiters = [asyncio.ensure_future(pool.acquire()) for _ in range(3)]
        await settle()
        waiters[0].cancel()
        await settle()
        pool.release(only)
        await settle()
        assert waiters[1].done() and not waiters[2].done()
        pool.release(await waiters[1])
        assert await waiters[2] is only

    run(main)


async def _user(pool: InstancePool, order: list[str], tag: str, keep: bool = False) -> None:
    """A request that takes an instance from ``pool``, notes ``tag`` in ``order``, and frees
    it (unless ``keep``)."""
    instance = await pool.acquire()
    order.append(tag)
    if not keep:
        pool.release(instance)


def test_an_instance_that_answers_at_once_is_lent_to_no_one_when_freed() -> None:
    clock = FakeClock()
    only = Echo(clock)
    only.answers_at_once = True  # type: ignore[attr-defined]  # its calls never wait (it runs inline)

    async def main() -> None:
        pool = InstancePool([only])
        assert pool.take() is only
        order: list[str] = []
        user = functools.partial(_user, pool, order)

        users = [asyncio.ensure_future(user("a", keep=True)), asyncio.ensure_future(user("b")),
                 asyncio.ensure_future(user("c"))]
        await settle()
        pool.release(only)
        # freed, it waits for no one: a request that comes before the woken ones run takes it
        assert pool.take() is only
        pool.release(only)
        await settle()
        # the woken take it in turn: "a" keeps it, so "b" and "c" go back to the head of the
        # line, before "d" who came later
        assert order == ["a"]
        late = asyncio.ensure_future(user("d"))
        await settle()
        assert order == ["a"]
        pool.release(only)
        await asyncio.gather(*users, late)
        assert order == ["a", "b", "c", "d"]

    run(main)


def test_an_instance_with_two_slots_is_lent_twice_after_every_instance_once() -> None:
    clock = FakeClock()
    single, double = Echo(clock, "single"), Echo(clock, "double")
    double.slots = 2  # type: ignore[attr-defined]

    async def main() -> None:
        pool = InstancePool([double, single])
        lent = [await pool.acquire() for _ in range(3)]
        assert lent == [double, single, double]
        waiter = asyncio.ensure_future(pool.acquire())
        await settle()
        assert not waiter.done()  # every slot is out
        pool.release(double)
        assert await waiter is double

    run(main)


def test_execution_records_backend_timing_when_it_has_one() -> None:
    clock = FakeClock()
    instance = Echo(clock, cost=50)
    instance.timing = ExecutionTiming(input_ns=1, infer_ns=2, output_ns=3)
    stats = ModelStatistics()

    async def main() -> None:
        requests = [InferenceRequest("m", "", [], id="ok"), InferenceRequest("m", "", [], id="fail")]
        clock.advance(10)
        execution = await Execution.run(instance, requests, 4, stats, clock)
        assert (execution.dispatched, execution.done) == (10, 60)
        assert execution.outcome(execution.results[0], enqueued=0, rows=4).id == "ok"
        with pytest.raises(InvalidArgumentError):
            execution.outcome(execution.results[1], enqueued=5)

    run(main)
    assert stats.execution_count == 1 and set(stats.batches) == {4}
    assert (stats.compute_input.ns, stats.compute_infer.ns, stats.compute_output.ns) == (1, 2, 3)
    assert (stats.success.ns, stats.queue.ns, stats.inference_count) == (60, 10, 4)
    assert stats.fail_reasons == {"BACKEND": 1} and stats.fail.ns == 55


def test_an_execution_that_waited_in_the_instance_counts_that_wait_as_queue_time() -> None:
    clock = FakeClock()
    instance = Echo(clock, cost=50)
    stats = ModelStatistics()

    async def main() -> None:
        clock.advance(10)
        instance.timing = ExecutionTiming(started_ns=30)  # it waited in the instance until 30
        execution = await Execution.run(instance, [InferenceRequest("m", "", [], id="ok")], 1, stats, clock)
        assert (execution.dispatched, execution.done, execution.infer_ns) == (30, 60, 30)
        execution.outcome(execution.results[0], enqueued=0)
        instance.timing = ExecutionTiming(started_ns=5)  # not between dispatch and done: ignored
        execution = await Execution.run(instance, [InferenceRequest("m", "", [], id="ok")], 1, stats, clock)
        assert (execution.dispatched, execution.done) == (60, 110)
        execution.outcome(execution.results[0], enqueued=60)

    run(main)
    assert (stats.queue.ns, stats.compute_infer.ns) == (30, 80)


def test_the_pool_lends_the_instance_holding_fewest_and_reads_its_slots_each_time() -> None:
    clock = FakeClock()
    first, second = Echo(clock, "first"), Echo(clock, "second")
    first.slots = second.slots = 3  # type: ignore[attr-defined]

    async def main() -> None:
        pool = InstancePool([first, second])
        assert [await pool.acquire() for _ in range(4)] == [first, second, first, second]
        first.slots = 1  # type: ignore[attr-defined]  # it holds 2 already: lent no more for now
        assert pool.take() is second
        waiter = asyncio.ensure_future(pool.acquire())
        await settle()
        assert not waiter.done()
        pool.release(first)  # first holds 1 of its 1 now: still full
        await settle()
        assert not waiter.done()
        pool.release(second)
        assert await waiter is second

    run(main)


def test_woken_waiters_that_find_it_taken_go_before_requests_that_queued_meanwhile() -> None:
    only = Echo(FakeClock())
    only.answers_at_once = True  # type: ignore[attr-defined]

    async def main() -> None:
        pool = InstancePool([only])
        assert pool.take() is only
        order: list[str] = []
        user = functools.partial(_user, pool, order)

        users = [asyncio.ensure_future(user(t, keep=(t == "a"))) for t in "abc"]
        await settle()
        for tag in "de":  # twice: the count of those back at the head starts again each time
            # a newcomer whose first step runs before the woken ones: it finds the instance
            # taken again and queues; the woken ones, who came first, go back before it
            users.append(asyncio.ensure_future(user(tag)))
            pool.release(only)
            assert pool.take() is only
            await settle()
        assert order == []
        pool.release(only)
        await settle()
        assert order == ["a"]  # "a" keeps it
        pool.release(only)
        await asyncio.gather(*users)
        assert order == ["a", "b", "c", "d", "e"]

    run(main)


def test_a_waiter_woken_then_cancelled_takes_nothing_and_the_others_still_get_it() -> None:
    only = Echo(FakeClock())
    only.answers_at_once = True  # type: ignore[attr-defined]

    async def main() -> None:
        pool = InstancePool([only])
        assert pool.take() is only
        first, second = asyncio.ensure_future(pool.acquire()), asyncio.ensure_future(pool.acquire())
        await settle()
        pool.release(only)  # both woken with None
        first.cancel()  # before it runs: it must neither take nor release anything
        await settle()
        assert first.cancelled()
        assert second.done()  # not left waiting for a wake-up that went to the cancelled one
        assert second.result() is only
        assert pool.take() is None  # lent once, not twice (a release(None) would free it)
        pool.release(only)
        assert pool.take() is only
        pool.release(only)

    run(main)
