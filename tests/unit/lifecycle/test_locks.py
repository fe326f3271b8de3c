"""Per-model locks: an operation pins its model from the moment it waits, and the lock order
(see quiver.lifecycle.locks) is asserted."""

from __future__ import annotations

import asyncio

import pytest

from quiver.lifecycle.dependencies import DependencyGraph
from quiver.lifecycle.locks import ModelLocks


def test_an_operation_is_busy_while_it_waits_and_while_it_holds() -> None:
    released: list[int] = []
    locks = ModelLocks(DependencyGraph(), on_release=lambda: released.append(1))
    order: list[str] = []

    async def op(tag: str, gate: asyncio.Event) -> None:
        async with locks.hold("m"):
            order.append(f"{tag}+")
            await gate.wait()
            order.append(f"{tag}-")

    async def main() -> None:
        first, second = asyncio.Event(), asyncio.Event()
        a = asyncio.ensure_future(op("a", first))
        b = asyncio.ensure_future(op("b", second))
        await asyncio.sleep(0.01)
        assert locks.busy("m") and order == ["a+"]  # b waits, and counts as busy
        first.set()
        await asyncio.sleep(0.01)
        assert locks.busy("m") and order == ["a+", "a-", "b+"] and released == []
        second.set()
        await asyncio.gather(a, b)
        assert not locks.busy("m") and released == [1]

    asyncio.run(main())


def test_a_task_never_waits_for_a_lock_it_holds() -> None:
    locks = ModelLocks(DependencyGraph())

    async def main() -> None:
        async with locks.hold("m"):
            assert locks.held() == ["m"]
            with pytest.raises(AssertionError, match="already holds the lock of 'm'"):
                async with locks.hold("m"):
                    pass
        assert locks.held() == [] and not locks.busy("m")

    asyncio.run(main())


def test_locks_go_from_an_ensemble_to_what_it_needs_never_back() -> None:
    graph = DependencyGraph()
    graph.set_composing("outer", ["inner", "post"])
    locks = ModelLocks(graph)

    async def main() -> None:
        with graph.loading("inner", ["pre"]):
            async with locks.hold("outer"), locks.hold("inner"), locks.hold("pre"):  # down: allowed
                assert locks.held() == ["outer", "inner", "pre"]
            async with locks.hold("pre"):
                # outer needs pre through inner (loading): taking it now would be against the order
                with pytest.raises(AssertionError, match="taking the lock of 'outer' while holding that of pre"):
                    async with locks.hold("outer"):
                        pass
                async with locks.hold("unrelated"):  # a model that needs nothing held: allowed
                    pass

    asyncio.run(main())


def test_other_tasks_do_not_inherit_the_locks_held() -> None:
    locks = ModelLocks(DependencyGraph())

    async def elsewhere() -> list[str]:
        return locks.held()

    async def main() -> None:
        async with locks.hold("m"):
            assert await asyncio.ensure_future(elsewhere()) == []

    asyncio.run(main())
