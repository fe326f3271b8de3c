"""Per-model locks and the order they are taken in.

Each model has one ``asyncio.Lock``: loads, reloads and unloads of one model happen one after
another, while other models load in parallel. The lock is only a mutex. Whether a model may
be evicted is a separate, explicit question (:mod:`quiver.lifecycle.pins`): a task that waits
for or holds a model's lock counts as one *operation* on it (:meth:`ModelLocks.busy`), and a
model with an operation is pinned.

**Lock order.** A task holds at most one chain of model locks, always taken from an ensemble
towards what it needs, never back:

1. A load takes the model's lock. An ensemble's load, holding its lock, pins all its
   composing models (so none is evicted while it loads) and then loads those not yet READY
   one at a time, in sorted name order, each under its own lock, released before the next
   one is taken; a composing model that is itself an ensemble does the same, depth first. A
   task loading ``pipeline -> (preprocess, resnet)`` therefore holds ``pipeline`` then
   ``pipeline + preprocess``, then ``pipeline`` then ``pipeline + resnet``. A composing model
   named in a chain already held is a cycle, refused before any lock is taken.
2. A load that must make room evicts its victims while holding its own chain. An eviction
   first unloads the victim's loaded dependents (ensembles that need it), each under its own
   lock taken and released alone, then takes the victim's lock. Victims are only models not
   pinned when they were chosen, and the composing models of an ensemble are pinned while
   the ensemble, or anything it needs (through nested ensembles), has an operation or a
   request in flight: so no dependent an eviction takes needs a lock the evicting task holds.
3. An unload through the repository API, a poll or a cascade takes no lock while it unloads
   dependents: each dependent is unloaded under its own lock, then the model under its lock.
   Unloading an archive's served model unloads the rest of its namespace while holding the
   served model's lock (the namespace's ensembles before the models they need).

:meth:`ModelLocks.hold` asserts the two rules that make this deadlock-free and are cheap to
check: a task never waits for a lock it holds, and never takes the lock of a model that
needs (through the ensemble graph) one whose lock it holds.

Other locks never wait on a model lock while held: the disk cache's and the framework-priming
lock are taken alone; the memory meter's shared/exclusive lock is taken on load threads only.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from quiver.lifecycle.dependencies import DependencyGraph
from quiver.lifecycle.pins import Pins

__all__ = ["ModelLocks"]


class ModelLocks:
    def __init__(self, graph: DependencyGraph, on_release: Callable[[], None] | None = None) -> None:
        self._graph = graph
        self._locks: dict[str, asyncio.Lock] = {}
        self._operations = Pins(on_release)
        self._held: dict[asyncio.Task[object], list[str]] = {}

    @property
    def on_release(self) -> Callable[[], None] | None:
        """Called when a model's last operation ends (it may no longer be pinned)."""
        return self._operations.on_release

    @on_release.setter
    def on_release(self, callback: Callable[[], None] | None) -> None:
        self._operations.on_release = callback

    def busy(self, name: str) -> bool:
        """Whether a load or unload of ``name`` holds or waits for its lock."""
        return self._operations.pinned(name)

    def held(self) -> list[str]:
        """The model locks the current task holds, outermost first."""
        task = asyncio.current_task()
        return list(self._held.get(task, ())) if task is not None else []

    @contextlib.asynccontextmanager
    async def hold(self, name: str) -> AsyncIterator[None]:
        """Hold ``name``'s lock (an operation on it from the moment it waits)."""
        task = asyncio.current_task()
        assert task is not None
        held = self._held.get(task)
        if held:
            assert name not in held, f"lock order: this task already holds the lock of '{name}'"
            needs = self._graph.closure(name).intersection(held)
            assert not needs, (
                f"lock order: taking the lock of '{name}' while holding that of "
                f"{', '.join(sorted(needs))}, which it needs"
            )
        try:
            with self._operations.holding(name):
                lock = self._locks.get(name)
                if lock is None:
                    lock = self._locks[name] = asyncio.Lock()
                async with lock:
                    chain = self._held.setdefault(task, [])
                    chain.append(name)
                    try:
                        yield
                    finally:
                        chain.pop()
                        if not chain:
                            del self._held[task]
        finally:
            if not self._operations.pinned(name):
                self._locks.pop(name, None)  # no one waits for it: no lock kept per model ever seen
