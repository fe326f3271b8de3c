"""What the frontend-worker tests share: a server's worker processes, and calls kept running
from background threads while a worker or the model side is killed under them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from support.server import QuiverServer


def worker_pids(server: QuiverServer) -> list[int]:
    """The pids of the server's frontend worker processes (one just killed and not yet reaped,
    a zombie, or gone is left out)."""
    assert server.process is not None
    pids = []
    for child in psutil.Process(server.process.pid).children():
        try:
            if "frontend_worker" in " ".join(child.cmdline()):
                pids.append(child.pid)
        except psutil.Error:
            continue
    return pids


def wait_replaced(server: QuiverServer, victim: int, count: int = 2, timeout: float = 30.0) -> None:
    """Until ``count`` workers run and ``victim`` is not one of them (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = worker_pids(server)
        if len(pids) == count and victim not in pids:
            return
        time.sleep(0.1)


class BackgroundCalls:
    """``call`` made over and over from ``threads`` threads until :meth:`stop`: what it returned
    (``results``, their count ``answered``) and what it raised of ``errors`` (``failures``;
    a thread pauses ``pause`` seconds after each)."""

    def __init__(
        self,
        call: Callable[[], Any],
        errors: tuple[type[BaseException], ...] = (Exception,),
        threads: int = 4,
        pause: float = 0.0,
    ) -> None:
        self.results: list[Any] = []
        self.failures: list[BaseException] = []
        self._call = call
        self._errors = errors
        self._pause = pause
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(threads)]

    @property
    def answered(self) -> int:
        return len(self.results)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.results.append(self._call())
            except self._errors as exc:
                self.failures.append(exc)
                if self._pause:
                    time.sleep(self._pause)

    def start(self) -> BackgroundCalls:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> int:
        """Stop and join every thread; how many are still running (a call that hung)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)
        return sum(thread.is_alive() for thread in self._threads)
