"""Starting a coroutine at once, without a task when it finishes without waiting.

``asyncio.create_task`` runs nothing now: it makes a task, schedules its first step for a later
turn of the loop and registers it among the loop's tasks, 4-5 us of CPU before the coroutine
starts. A request the model side answers without waiting (a model run inline on the event
loop, an instance free) needs none of that. :func:`start` runs the coroutine's first step now;
if it finishes there, that is all; if it waits for a future, a task takes over from exactly
where it waited (Python 3.12's eager tasks, which this is for 3.11).

The first step runs outside any task (``asyncio.current_task()`` is None there, as in a
callback), in the caller's context: the code started this way must not need a task of its
own before its first wait. After it, the coroutine runs in its task as usual, and cancelling
the task cancels the coroutine where it waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any

__all__ = ["start"]


def start(coro: Coroutine[Any, Any, None], name: str | None = None) -> asyncio.Task[None] | None:
    """Run ``coro`` until it first waits, now; None if it finished (its exceptions raise
    here), else the task that runs the rest of it."""
    try:
        waiting = coro.send(None)
    except StopIteration:
        return None
    return asyncio.get_running_loop().create_task(_rest(coro, waiting), name=name)


class _Wait:
    """Waits for the future the coroutine yielded, as the coroutine's own ``await`` would
    have: the task sees that future (its blocking flag already set) and resumes us when it is
    done."""

    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[Any]) -> None:
        self.future = future

    def __await__(self) -> Generator[Any, None, None]:
        yield self.future


async def _rest(coro: Coroutine[Any, Any, None], waiting: Any) -> None:
    """The rest of ``coro``, which waits on ``waiting`` (a future, or None for a bare yield)."""
    while True:
        error: BaseException | None = None
        try:
            if waiting is None:
                await asyncio.sleep(0)
            else:
                await _Wait(waiting)
        except asyncio.CancelledError as exc:
            # This task was cancelled. If the future it waited on was cancelled with it, the
            # coroutine learns it from that future; if not (it was done already), it is told.
            if waiting is None or not waiting.cancelled():
                error = exc
        except BaseException:  # the future's own error: the coroutine reads it from the future
            pass
        try:
            waiting = coro.send(None) if error is None else coro.throw(error)
        except StopIteration:
            return
