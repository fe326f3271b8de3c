"""Waiting for a Python worker's answer without sleeping (``answer-spin-microseconds``): the
server's side. On a virtual machine, waking a sleeping event loop on another vCPU costs the
worker that wakes it (its ``write`` sends the interrupt) and the loop more than a small model's
whole ``execute``; a loop that keeps turning meanwhile is awake when the answer comes.

The spin keeps the loop turning (a callback that schedules itself: the loop polls its sockets
without sleeping, so other connections are served meanwhile, and the answer arrives through the
channel as always), never blocking it; it runs only when it costs no other request anything and
is likely to end with the answer:

- the worker holds this batch alone and the loop has been idle since the last one finished
  (one caller at a time: a busy loop is awake anyway);
- the instance's recent answers, from send to done, came within the limit: a spin lasts at most
  twice their average (plus a little), so a model that takes longer is never spun for, and one
  that becomes quick again is spun for again, as its answers show;
- the worker ran its last batch on another CPU than the loop's (its ``done`` says which): a
  worker woken on the loop's own CPU (where Linux puts a task woken by a pipe's writer, whose
  wake-up is "sync") runs only once the loop lets go of it, so spinning there only delays the
  answer and burns the CPU it needs;
- the machine has a core to spare (:func:`~quiver.ipc.inbox.spare_core`, with the
  ``answer-spin-pressure`` limit): spinning on a busy machine takes CPU from the work it waits
  for;
- spinning pays here and now: the answers it waited for came in under :data:`_PAYS` times the
  time of those the loop slept for. One batch in :data:`_SAMPLE_EVERY` that may be spun for
  does the other thing, so both averages stay current. On a virtual machine whose host takes
  its vCPUs away (steal time, which CPU pressure does not show), a spinning loop competes with
  the worker it waits for: in one run there, spinning cost the server about 100 us of CPU per
  request and left the latency where it was, or made it worse (an alternating run of the same
  hour put the three ways within its noise).
"""

from __future__ import annotations

import asyncio
import time

from quiver.ipc.inbox import current_cpu, spare_core

#: A batch sent this long after the previous one finished finds the loop idle (spinning for its
#: answer then costs no other request anything).
_IDLE_GAP_S = 50e-6
#: Added to twice the recent answers' average to give a spin's longest wait.
_MARGIN_S = 20e-6
#: Spins go on while the answers spun for average under this share of those slept for.
_PAYS = 0.9
#: One batch in this many that could be spun for does the other thing (sleeps while spinning
#: pays, spins while it does not): both averages stay current as the machine changes.
_SAMPLE_EVERY = 8
#: What :meth:`AnswerSpin.wait` did for a batch (0: neither, it was not one to spin for).
SPUN, SLEPT = 1, 2
#: The answers' clock (a test's fake replaces it).
_monotonic_ns = time.monotonic_ns


class AnswerSpin:
    """Spins of up to ``seconds`` for one worker instance's answers."""

    __slots__ = ("_answer_s", "_apart", "_eligible", "_last_done", "_limit", "_pressure", "_times")

    def __init__(self, seconds: float, pressure: float = 10.0) -> None:
        self._limit = seconds
        self._pressure = pressure  # the CPU pressure (percent) above which it does not spin
        self._answer_s = 0.0  # recent batches' time from send to done (seconds, averaged)
        self._last_done = 0.0
        #: Whether the worker's last answer came from another CPU than the loop's (True until
        #: one says, and where the system does not say).
        self._apart = True
        #: Recent answer times (seconds, averaged, each at most the limit) of the batches that
        #: could be spun for, by what the loop did: [unused, spun, slept]; 0.0 until one such
        #: batch finished.
        self._times = [0.0, 0.0, 0.0]
        self._eligible = 0  # batches that could be spun for, so far

    def pays(self) -> bool:
        """Whether spinning is worth it now: the answers spun for came sooner enough than those
        slept for (True until both are known)."""
        spun, slept = self._times[SPUN], self._times[SLEPT]
        return not spun or not slept or spun < _PAYS * slept

    def wait(self, loop: asyncio.AbstractEventLoop, done: asyncio.Future[None], alone: bool) -> int:
        """Keep ``loop`` turning until ``done`` or the spin is over, if it should spin now
        (``alone``: the worker holds this batch only). Returns what it did for this batch,
        for :meth:`finished`: :data:`SPUN`, :data:`SLEPT` (a batch it could have spun for),
        or 0."""
        if not alone or not self._apart:
            return 0
        now = time.perf_counter()
        # How long an answer takes when spun for: what the spin waits for (a model whose slept
        # answers grew past the limit while spun ones stayed quick is still spun for).
        answer = min(self._answer_s, self._times[SPUN] or self._answer_s)
        if now - self._last_done <= _IDLE_GAP_S or answer >= self._limit or not spare_core(self._pressure):
            return 0
        self._eligible += 1
        if self.pays() == (self._eligible % _SAMPLE_EVERY == 0):  # not paying, or the sample's turn
            return SLEPT
        until = now + min(self._limit, 2 * answer + _MARGIN_S)
        call_soon, clock = loop.call_soon, time.perf_counter

        def turn() -> None:
            if not done.done() and clock() < until:
                call_soon(turn)

        call_soon(turn)
        return SPUN

    def placed(self, worker_cpu: int | None) -> None:
        """The worker ran its last batch on ``worker_cpu`` (None: not known); called on the
        loop's thread as its answer arrives."""
        own = current_cpu()
        self._apart = worker_cpu is None or own is None or worker_cpu != own

    def finished(self, sent_ns: int, mode: int = 0) -> None:
        """A batch of this instance sent at ``sent_ns`` (``time.monotonic_ns()``) is done;
        ``mode``: what :meth:`wait` did for it."""
        self._last_done = time.perf_counter()
        answer = (_monotonic_ns() - sent_ns) / 1e9
        self._answer_s += (answer - self._answer_s) / 8
        if mode:
            sample = min(answer, self._limit)  # a stall (a cold first call, a pause) weighs no more than the limit
            times = self._times
            times[mode] = sample if not times[mode] else times[mode] + (sample - times[mode]) / 8


__all__ = ["SLEPT", "SPUN", "AnswerSpin"]
