"""The server's spin for a quick worker's answer: the loop keeps turning (other callbacks run
meanwhile) only while the worker holds the batch alone, the loop was idle, recent answers were
quick and a core is spare; it ends with the answer or at twice the recent answers' average."""

from __future__ import annotations

import asyncio
import time

import pytest

from quiver.backends import python_worker_spin
from quiver.backends.python_worker_spin import AnswerSpin


@pytest.fixture(autouse=True)
def spare(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(python_worker_spin, "spare_core", lambda limit: True)


def _quick(spin: AnswerSpin, answer_s: float = 100e-6) -> None:
    for _ in range(40):  # recent answers of about ``answer_s``
        spin.finished(time.monotonic_ns() - int(answer_s * 1e9))
    time.sleep(0.001)  # the loop has been idle since


def test_an_idle_loop_keeps_turning_for_a_quick_answer_and_serves_others_meanwhile() -> None:
    spin = AnswerSpin(0.5)
    _quick(spin, 0.1)  # (long, so that a busy machine does not end the spin first)
    loop = asyncio.new_event_loop()
    try:
        done = loop.create_future()
        ran: list[int] = []
        spin.wait(loop, done, True)
        loop.call_soon(ran.append, 1)  # another connection's work
        for _ in range(5):
            loop._run_once()  # type: ignore[attr-defined]  # a callback is always ready: it never sleeps
        assert loop._ready and ran == [1]  # type: ignore[attr-defined]
        done.set_result(None)  # the answer: the spin ends
        loop._run_once()  # type: ignore[attr-defined]
        assert not loop._ready  # type: ignore[attr-defined]
    finally:
        loop.close()


def test_no_spin_when_not_alone_after_a_busy_loop_or_slow_answers() -> None:
    spin = AnswerSpin(300e-6)
    _quick(spin)
    loop = asyncio.new_event_loop()
    try:
        scheduled = len(loop._ready)  # type: ignore[attr-defined]  # the pure-Python loop's queue
        done = loop.create_future()
        spin.wait(loop, done, False)  # the worker holds others
        assert len(loop._ready) == scheduled  # type: ignore[attr-defined]
        spin.finished(time.monotonic_ns())  # one just finished: the loop is busy
        spin.wait(loop, done, True)
        assert len(loop._ready) == scheduled  # type: ignore[attr-defined]
        slow = AnswerSpin(300e-6)
        _quick(slow, 2e-3)  # answers take 2 ms
        slow.wait(loop, done, True)
        assert len(loop._ready) == scheduled  # type: ignore[attr-defined]
        time.sleep(0.001)
        spin.wait(loop, done, True)  # idle again, quick answers: it spins
        assert len(loop._ready) == scheduled + 1  # type: ignore[attr-defined]
    finally:
        loop.close()


def test_a_spin_ends_at_twice_the_recent_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    spin = AnswerSpin(300e-6)
    _quick(spin, 100e-6)
    loop = asyncio.new_event_loop()
    try:
        done = loop.create_future()
        spin.wait(loop, done, True)
        began = time.perf_counter()
        while loop._ready:  # type: ignore[attr-defined]
            loop._run_once()  # type: ignore[attr-defined]
        # about 2 x 100 us + 20 us; generous for a busy machine, far below a sleep's timeout
        assert time.perf_counter() - began < 0.1
    finally:
        loop.close()


def test_no_spin_without_a_spare_core(monkeypatch: pytest.MonkeyPatch) -> None:
    limits: list[float] = []
    monkeypatch.setattr(python_worker_spin, "spare_core", lambda limit: limits.append(limit) or False)
    spin = AnswerSpin(300e-6, 25.0)
    _quick(spin)
    loop = asyncio.new_event_loop()
    try:
        scheduled = len(loop._ready)  # type: ignore[attr-defined]
        spin.wait(loop, loop.create_future(), True)
        assert len(loop._ready) == scheduled  # type: ignore[attr-defined]
        assert limits == [25.0]  # asked with its pressure limit
    finally:
        loop.close()


def test_no_spin_for_a_worker_on_the_loops_own_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker woken on the loop's CPU runs only once the loop lets go of it: spinning there
    only delays its answer. The spin comes back once an answer comes from another CPU, and
    stays where the CPU is not known."""
    monkeypatch.setattr(python_worker_spin, "current_cpu", lambda: 0)
    spin = AnswerSpin(300e-6)
    _quick(spin)
    loop = asyncio.new_event_loop()
    try:
        done = loop.create_future()
        scheduled = len(loop._ready)  # type: ignore[attr-defined]
        spin.placed(0)  # the last answer came from the loop's CPU
        spin.wait(loop, done, True)
        assert len(loop._ready) == scheduled  # type: ignore[attr-defined]
        for cpu in (1, None):  # from another CPU, or from one the worker could not name
            spin.placed(cpu)
            spin.wait(loop, done, True)
            assert len(loop._ready) == scheduled + 1  # type: ignore[attr-defined]
            loop._ready.clear()  # type: ignore[attr-defined]
        monkeypatch.setattr(python_worker_spin, "current_cpu", lambda: None)  # the loop's not known
        spin.placed(0)
        spin.wait(loop, done, True)
        assert len(loop._ready) == scheduled + 1  # type: ignore[attr-defined]
    finally:
        loop.close()


def _one(spin: AnswerSpin, loop: asyncio.AbstractEventLoop, spun_s: float, slept_s: float, clock: list[int]) -> bool:
    """One batch after an idle gap: whether the loop spun for it; its answer took ``spun_s`` if
    it did, else ``slept_s`` (on the fake answers' clock ``clock``)."""
    time.sleep(0.0002)  # the loop idle since the last answer
    ready = loop._ready  # type: ignore[attr-defined]
    scheduled = len(ready)
    sent = clock[0]
    mode = spin.wait(loop, loop.create_future(), True)
    spun = len(ready) > scheduled
    assert (mode == python_worker_spin.SPUN) == spun  # else SLEPT, or 0: not one to spin for
    ready.clear()
    clock[0] += int((spun_s if spun else slept_s) * 1e9)
    spin.finished(sent, mode)
    return spun


def test_spinning_stops_while_it_does_not_pay_and_comes_back_when_it_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine where spinning brings the answer no sooner (a host taking the vCPUs away),
    the loop sleeps but for one batch in eight, which keeps measuring the spin; once spun
    answers come sooner again, it spins for seven in eight, the eighth measuring the sleep."""
    clock = [time.monotonic_ns()]
    monkeypatch.setattr(python_worker_spin, "_monotonic_ns", lambda: clock[0])
    spin = AnswerSpin(300e-6)
    _quick(spin)
    loop = asyncio.new_event_loop()
    try:
        for _ in range(40):  # spinning saves nothing: 100 us either way
            _one(spin, loop, 100e-6, 100e-6, clock)
        assert not spin.pays()
        spun = sum(_one(spin, loop, 100e-6, 100e-6, clock) for _ in range(64))
        assert spun == 8  # the samples only
        for _ in range(80):  # now a spun answer takes 60 us, a slept one 120 us
            _one(spin, loop, 60e-6, 120e-6, clock)
        assert spin.pays()
        spun = sum(_one(spin, loop, 60e-6, 120e-6, clock) for _ in range(64))
        assert spun == 56  # all but the samples of the sleep
    finally:
        loop.close()


def test_a_stall_weighs_no_more_than_the_limit_and_slow_sleeps_do_not_end_the_spin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Answers slept for that grow past the limit while spun ones stay quick do not make the
    instance one never spun for; and a 50 ms stall on a spun batch (a cold first call, a
    pause) counts as the limit, so spinning comes back within tens of batches, not hundreds."""
    clock = [time.monotonic_ns()]
    monkeypatch.setattr(python_worker_spin, "_monotonic_ns", lambda: clock[0])
    loop = asyncio.new_event_loop()
    try:
        spin = AnswerSpin(300e-6)
        _quick(spin)
        for _ in range(80):  # spun answers 60 us, slept ones 400 us (over the 300 us limit)
            _one(spin, loop, 60e-6, 400e-6, clock)
        assert sum(_one(spin, loop, 60e-6, 400e-6, clock) for _ in range(64)) == 56

        stalled = AnswerSpin(300e-6)
        clock[0] = time.monotonic_ns()  # (its recent answers are read on the real clock)
        _quick(stalled)
        assert _one(stalled, loop, 50e-3, 50e-3, clock)  # its first spun batch stalls
        for _ in range(100):  # then spun answers take 60 us, slept ones 120 us
            _one(stalled, loop, 60e-6, 120e-6, clock)
        assert sum(_one(stalled, loop, 60e-6, 120e-6, clock) for _ in range(64)) == 56
    finally:
        loop.close()
