"""Reading one channel from several threads, without a reader thread.

Whichever thread waits for something (the worker's main thread for its next batch, a model's
thread for the answer to its BLS call) takes the reader's role if no other thread holds it,
reads messages and dispatches each one, until what it waits for has happened; then it hands
the role back and wakes the others, one of whom takes it if it still waits (leader/followers).
A message meant for another thread reaches it through :meth:`Inbox.dispatch`'s effects (a job
queued, a future completed) and a notification.

A batch is therefore read and run by the same thread: no hand-over from a reader thread, whose
wake-up costs more than the rest of a small call on a virtual machine. A thread waiting for its
next batch may also spin for a moment (read without sleeping) before it blocks: a peer that
answers back and forth, as a server does under load, then finds this end awake.

Worker-safe: the standard library only (see :mod:`quiver.ipc`).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from quiver.ipc.channel import EMPTY, Channel

_CORES = os.cpu_count() or 1
#: When the machine was last looked at, its CPU pressure then (None: not known) and whether its
#: load average left a core idle.
_looked: tuple[float, float | None, bool] = (0.0, None, False)
#: Linux's pressure stall information for the CPU (the share of time some task waited for one).
PRESSURE_FILE = "/proc/pressure/cpu"
#: Above this share (percent, over the last 10 seconds) of time with a task waiting for a CPU,
#: no core is spare (:func:`spare_core`'s default).
PRESSURE_LIMIT = 10.0


def _sched_getcpu() -> Callable[[], int] | None:
    """The C library's ``sched_getcpu`` (a vDSO read, no system call), where it has one."""
    try:  # (a worker's Python may lack ctypes: a build without libffi)
        import ctypes

        function = ctypes.CDLL(None).sched_getcpu
    except (ImportError, AttributeError, OSError):  # pragma: no cover - not glibc/musl on Linux
        return None
    function.restype = ctypes.c_int
    function.argtypes = ()
    return function


_getcpu = _sched_getcpu()


def current_cpu() -> int | None:
    """The CPU the calling thread runs on now (None: the system does not say)."""
    if _getcpu is None:
        return None
    cpu = _getcpu()
    return cpu if cpu >= 0 else None


def cpu_pressure() -> float | None:
    """The percentage of the last 10 seconds in which some task waited for a CPU (``some
    avg10``); None where the system does not say (no PSI)."""
    try:
        with open(PRESSURE_FILE, "rb") as file:
            line = file.readline()
        return float(line.split(b"avg10=", 1)[1].split(None, 1)[0])
    except (OSError, IndexError, ValueError):
        return None


def spare_core(limit: float = PRESSURE_LIMIT) -> bool:
    """Whether the machine has a core to spare for spinning (looked up at most once a second):
    tasks waited for a CPU less than ``limit`` percent of the last 10 seconds, where Linux says
    (pressure stall information; a ``limit`` of 100 or more: always), else the load average over
    the last minute leaves at least one core idle. Spinning on a machine without one takes CPU
    from the work it waits for."""
    global _looked
    now = time.monotonic()
    when, pressure, idle = _looked
    if now - when > 1.0:
        pressure = cpu_pressure()
        if pressure is None:
            try:
                idle = os.getloadavg()[0] <= _CORES - 1
            except OSError:  # pragma: no cover - no load average on this system
                idle = False
        _looked = (now, pressure, idle)
    if pressure is not None:
        return pressure < limit or limit >= 100
    return idle


class Inbox:
    """The messages of ``channel``, read by the threads that wait for them.

    ``dispatch`` handles one message on the reading thread (it must not wait for another
    message); ``closed`` runs on the thread that reads the channel's end (and should not
    return: the peer is gone; if it does, the waiting thread gets EOFError).
    """

    def __init__(
        self, channel: Channel, dispatch: Callable[[dict[str, Any]], None], closed: Callable[[], None]
    ) -> None:
        self._channel = channel
        self._dispatch = dispatch
        self._closed = closed
        # ``with self._lock`` holds the condition's lock (the C lock itself: cheaper than the
        # condition's own context manager, a Python method)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._reading = False
        self._waiters = 0

    def wait(self, ready: Callable[[], bool], timeout: float | None = None, spin: float = 0.0) -> bool:
        """Until ``ready()`` (True) or ``timeout`` seconds pass (False), reading and dispatching
        messages whenever no other thread does. ``spin``: seconds to read without sleeping
        before blocking, each time this thread starts to read."""
        if timeout is None and spin <= 0:  # the usual: the main thread waits for its next batch
            lock = self._lock
            with lock:
                if ready():
                    return True
                reader = not self._reading
                if reader:
                    self._reading = True
            if reader:
                try:
                    receive, dispatch = self._channel.receive, self._dispatch
                    while True:
                        message: Any = receive(None)  # (no deadline: never EMPTY)
                        if message is None:
                            self._closed()
                            raise EOFError("the channel's peer closed it")
                        dispatch(message)
                        if self._waiters:  # what another thread waits for may have happened
                            with lock:
                                self._cond.notify_all()
                        if ready():
                            return True
                finally:
                    with lock:
                        self._reading = False
                        if self._waiters:
                            self._cond.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                while not ready():
                    if not self._reading:
                        self._reading = True
                        break
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._waiters += 1
                    try:
                        self._cond.wait(remaining)
                    finally:
                        self._waiters -= 1
                else:
                    return True
            try:
                if self._read_until(ready, deadline, spin):
                    return True
                if deadline is not None and time.monotonic() >= deadline:
                    return ready()
            finally:
                with self._lock:
                    self._reading = False
                    if self._waiters:
                        self._cond.notify_all()

    def take(self, op: str, queue: deque[dict[str, Any]]) -> dict[str, Any]:
        """The next message whose ``op`` is ``op``, as :meth:`wait` for ``queue`` to fill and
        its first taken: ``queue`` is where ``dispatch`` puts such messages (and others this
        caller waits for) that another thread read. Read here, such a message is returned as
        it comes, without ``dispatch`` (the main thread's usual wait for its next batch)."""
        lock = self._lock
        with lock:
            if queue:
                return queue.popleft()
            reader = not self._reading
            if reader:
                self._reading = True
        if not reader:  # another thread reads: it queues what comes
            self.wait(lambda: bool(queue))
            return queue.popleft()
        try:
            receive, dispatch = self._channel.receive, self._dispatch
            while True:
                message: Any = receive(None)  # (no deadline: never EMPTY)
                if message is None:
                    self._closed()
                    raise EOFError("the channel's peer closed it")
                if message["op"] == op:
                    return message  # type: ignore[no-any-return]
                dispatch(message)
                if self._waiters:  # what another thread waits for may have happened
                    with lock:
                        self._cond.notify_all()
                if queue:
                    return queue.popleft()
        finally:
            with lock:
                self._reading = False
                if self._waiters:
                    self._cond.notify_all()

    def drain(self) -> None:
        """Dispatch what has arrived, without waiting (nothing when another thread reads)."""
        with self._lock:
            if self._reading:
                return
            self._reading = True
        try:
            while (message := self._channel.receive(0)) is not EMPTY:
                self._handle(message)
        finally:
            with self._lock:
                self._reading = False
                if self._waiters:
                    self._cond.notify_all()

    def _read_until(self, ready: Callable[[], bool], deadline: float | None, spin: float) -> bool:
        channel, dispatch = self._channel, self._dispatch
        while not ready():
            message: Any = EMPTY
            if spin > 0:
                until = time.monotonic() + spin
                while (message := channel.receive(0)) is EMPTY and time.monotonic() < until:
                    pass
            if message is EMPTY:
                message = channel.receive(None if deadline is None else max(0.0, deadline - time.monotonic()))
                if message is EMPTY:
                    return False  # the deadline passed
            if message is None:
                self._closed()
                raise EOFError("the channel's peer closed it")
            dispatch(message)
            if self._waiters:  # what another thread waits for may have happened
                with self._lock:
                    self._cond.notify_all()
        return True

    def _handle(self, message: Any) -> None:
        if message is None:
            self._closed()
            raise EOFError("the channel's peer closed it")
        self._dispatch(message)
        if self._waiters:  # what another thread waits for may have happened
            with self._lock:
                self._cond.notify_all()


__all__ = ["Inbox", "cpu_pressure", "current_cpu", "spare_core"]
