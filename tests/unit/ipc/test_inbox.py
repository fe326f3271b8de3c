"""The inbox: whichever thread waits reads the channel, and what it reads for others reaches them."""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from quiver.ipc.channel import EMPTY, Channel, encode, pipe_pair
from quiver.ipc.inbox import Inbox, current_cpu


class _End:
    """A buffered channel over a pair of pipes, its inbox, and what its dispatch saw."""

    def __init__(self) -> None:
        ours, theirs = pipe_pair()
        self.channel = Channel(ours, buffered=True)
        self.peer = Channel(theirs)
        self.jobs: deque[dict[str, Any]] = deque()
        self.answers: dict[int, concurrent.futures.Future[dict[str, Any]]] = {}
        self.readers: list[str] = []
        self.ended = threading.Event()
        self.inbox = Inbox(self.channel, self.dispatch, self.ended.set)

    def dispatch(self, message: dict[str, Any]) -> None:
        self.readers.append(threading.current_thread().name)
        if message["op"] == "execute":
            self.jobs.append(message)
        elif message["op"] == "answer":
            self.answers[message["id"]].set_result(message)

    def close(self) -> None:
        self.channel.close()
        self.peer.close()


@pytest.fixture
def end() -> Any:
    end = _End()
    yield end
    end.close()


def test_the_waiting_thread_reads_its_own_message(end: _End) -> None:
    end.peer.send({"op": "execute", "batch": 1})
    assert end.inbox.wait(lambda: bool(end.jobs), timeout=5)
    assert end.jobs.popleft()["batch"] == 1
    assert end.readers == [threading.current_thread().name]  # no other thread involved


def test_a_message_for_another_thread_reaches_it(end: _End) -> None:
    """The main thread blocks reading for its next batch; a model thread waits for a BLS
    answer: the main thread reads the answer and wakes the model thread."""
    future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
    end.answers[7] = future
    main = threading.Thread(target=lambda: end.inbox.wait(lambda: bool(end.jobs), timeout=10), name="main")
    main.start()
    time.sleep(0.05)  # main holds the reader's role, blocked in the channel
    got: list[bool] = []
    model = threading.Thread(target=lambda: got.append(end.inbox.wait(future.done, timeout=10)), name="model")
    model.start()
    time.sleep(0.05)
    end.peer.send({"op": "answer", "id": 7})
    model.join(5)
    assert got == [True] and future.result(0)["id"] == 7
    assert end.readers == ["main"]
    end.peer.send({"op": "execute", "batch": 2})
    main.join(5)
    assert not main.is_alive() and end.jobs[0]["batch"] == 2


def test_a_waiter_takes_over_reading_when_the_reader_stops(end: _End) -> None:
    """While the main thread runs a batch (not reading), a model thread reads for itself."""
    future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
    end.answers[1] = future
    end.peer.send({"op": "answer", "id": 1})
    assert end.inbox.wait(future.done, timeout=5)
    assert future.result(0)["id"] == 1


def test_wait_times_out_and_spins_then_sleeps(end: _End) -> None:
    began = time.monotonic()
    assert not end.inbox.wait(lambda: bool(end.jobs), timeout=0.1, spin=0.02)
    assert 0.09 < time.monotonic() - began < 2
    # the role was given back: another wait can read
    end.peer.send({"op": "execute", "batch": 3})
    assert end.inbox.wait(lambda: bool(end.jobs), timeout=5, spin=0.001)


def test_drain_dispatches_what_arrived_without_waiting(end: _End) -> None:
    end.inbox.drain()
    assert not end.jobs
    end.peer.send_many([{"op": "execute", "batch": 1}, {"op": "execute", "batch": 2}])
    deadline = time.monotonic() + 5
    while len(end.jobs) < 2 and time.monotonic() < deadline:
        end.inbox.drain()
    assert [job["batch"] for job in end.jobs] == [1, 2]


def test_the_channels_end_is_reported_once_and_raises(end: _End) -> None:
    end.peer.close()
    with pytest.raises(EOFError):
        end.inbox.wait(lambda: False, timeout=5)
    assert end.ended.is_set()


def test_receive_waits_at_most_its_timeout() -> None:
    ours, theirs = pipe_pair()
    channel, peer = Channel(ours, buffered=True), Channel(theirs)
    assert channel.receive(0) is EMPTY
    began = time.monotonic()
    assert channel.receive(0.05) is EMPTY
    assert time.monotonic() - began >= 0.04
    peer.send({"op": "x", "n": 1})
    assert channel.receive(5) == {"op": "x", "n": 1}
    peer.close()
    assert channel.receive(5) is None
    channel.close()


def test_spinning_needs_a_spare_core(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from quiver.ipc import inbox

    # where Linux reports CPU pressure: spare while tasks waited little for a CPU
    pressure = tmp_path / "cpu"
    monkeypatch.setattr(inbox, "PRESSURE_FILE", str(pressure))
    pressure.write_text("some avg10=3.50 avg60=20.00 avg300=1.00 total=1\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    assert inbox.cpu_pressure() == 3.5
    monkeypatch.setattr(inbox, "_looked", (0.0, None, False))
    assert inbox.spare_core()
    assert not inbox.spare_core(2.0)  # a lower limit
    pressure.write_text("some avg10=42.10 avg60=1.00 avg300=1.00 total=1\n")
    assert inbox.spare_core()  # looked up at most once a second
    monkeypatch.setattr(inbox, "_looked", (0.0, None, False))
    assert not inbox.spare_core()
    assert inbox.spare_core(50.0) and inbox.spare_core(100.0)
    # else the load average
    pressure.unlink()
    assert inbox.cpu_pressure() is None
    cores = inbox._CORES
    monkeypatch.setattr(inbox, "_looked", (0.0, None, False))
    monkeypatch.setattr(inbox.os, "getloadavg", lambda: (cores - 1.0, 0.0, 0.0))
    assert inbox.spare_core()
    monkeypatch.setattr(inbox.os, "getloadavg", lambda: (cores + 3.0, 0.0, 0.0))
    assert inbox.spare_core()  # looked up at most once a second
    monkeypatch.setattr(inbox, "_looked", (0.0, None, False))
    assert not inbox.spare_core()


def test_receive_waits_for_the_rest_of_a_frame_until_its_deadline() -> None:
    """A frame that arrives in pieces is whole by the deadline: received, not EMPTY."""
    ours, theirs = pipe_pair()
    channel, peer = Channel(ours, buffered=True), Channel(theirs)
    frame = encode({"op": "x", "text": "y" * 1000})
    os.write(theirs[1], frame[:10])
    later = threading.Timer(0.1, os.write, (theirs[1], frame[10:]))
    later.start()
    try:
        assert channel.receive(5) == {"op": "x", "text": "y" * 1000}
        os.write(theirs[1], frame[:10])
        assert channel.receive(0.05) is EMPTY  # the rest never came: at the deadline
    finally:
        later.join()
        channel.close()
        peer.close()


def test_take_returns_the_message_it_reads_and_dispatches_the_others(end: _End) -> None:
    """The main thread's wait for its next batch: a batch it reads comes back as it is (not
    dispatched), the messages before it are dispatched in order."""
    future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
    end.answers[4] = future
    end.peer.send_many([{"op": "answer", "id": 4}, {"op": "execute", "batch": 1}, {"op": "execute", "batch": 2}])
    assert end.inbox.take("execute", end.jobs)["batch"] == 1
    assert future.result(0)["id"] == 4
    assert end.readers == [threading.current_thread().name]  # the answer only
    assert end.inbox.take("execute", end.jobs)["batch"] == 2
    assert not end.jobs


def test_take_returns_what_another_thread_queued(end: _End) -> None:
    """A batch that a model's thread read (waiting for its BLS answer) is queued, and taken
    from the queue, first."""
    end.jobs.append({"op": "execute", "batch": 5})
    end.peer.send({"op": "execute", "batch": 6})
    assert end.inbox.take("execute", end.jobs)["batch"] == 5
    assert end.inbox.take("execute", end.jobs)["batch"] == 6


def test_take_waits_while_another_thread_reads(end: _End) -> None:
    """While a model's thread holds the reader's role, take() waits for what it queues."""
    future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
    end.answers[9] = future
    model = threading.Thread(target=lambda: end.inbox.wait(future.done, timeout=10), name="model")
    model.start()
    time.sleep(0.05)  # the model's thread reads
    got: list[dict[str, Any]] = []
    main = threading.Thread(target=lambda: got.append(end.inbox.take("execute", end.jobs)), name="main")
    main.start()
    time.sleep(0.05)
    end.peer.send_many([{"op": "execute", "batch": 7}, {"op": "answer", "id": 9}])
    model.join(5)
    main.join(5)
    assert got and got[0]["batch"] == 7


def test_take_reports_the_channels_end(end: _End) -> None:
    end.peer.close()
    with pytest.raises(EOFError):
        end.inbox.take("execute", end.jobs)
    assert end.ended.is_set()


def test_current_cpu_is_one_this_thread_may_run_on() -> None:
    cpu = current_cpu()
    if sys.platform.startswith("linux"):
        assert cpu in os.sched_getaffinity(0)
    else:  # pragma: no cover - other systems may not say
        assert cpu is None or cpu >= 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU affinity is Linux's")
def test_current_cpu_names_the_cpu_the_thread_is_pinned_to() -> None:
    allowed = os.sched_getaffinity(0)
    try:
        for cpu in sorted(allowed)[:4]:
            os.sched_setaffinity(0, {cpu})
            assert current_cpu() == cpu
    finally:
        os.sched_setaffinity(0, allowed)
