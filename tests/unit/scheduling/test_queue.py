"""Batch forming rules of the dynamic batcher, driven by a fake clock (no sleeps)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from quiver.errors import UnavailableError
from quiver.scheduling.queue import BatchQueue, PendingRequest, QueuePolicy
from quiver.types import DataType, InferenceRequest, Tensor

US = 1000


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def pending(
    loop: asyncio.AbstractEventLoop, rows: int = 1, at: int = 0, level: int = 0, width: int = 4, name: str = "r"
) -> PendingRequest:
    tensor = Tensor("X", DataType.FP32, (rows, width), np.zeros((rows, width), np.float32))
    request = InferenceRequest("m", "", [tensor], id=name)
    return PendingRequest(request, loop.create_future(), rows, (("X", DataType.FP32, (width,)),), at, level=level)


def ids(batch: list[PendingRequest] | None) -> list[str]:
    assert batch is not None
    return [p.request.id for p in batch]


def test_no_delay_sends_what_is_there(loop: asyncio.AbstractEventLoop) -> None:
    queue = BatchQueue(max_batch_size=8)
    for name in "abc":
        queue.push(pending(loop, name=name))
    batch, wake = queue.form(now=0)
    assert ids(batch) == ["a", "b", "c"] and wake == 0
    assert len(queue) == 0
    assert queue.form(now=0) == (None, 0)


def test_rows_not_requests_fill_the_batch(loop: asyncio.AbstractEventLoop) -> None:
    queue = BatchQueue(max_batch_size=8)
    for name, rows in (("a", 3), ("b", 4), ("c", 2), ("d", 1)):
        queue.push(pending(loop, rows=rows, name=name))
    batch, _ = queue.form(now=0)
    assert ids(batch) == ["a", "b"]  # 7 rows; c (2) would make 9
    batch, _ = queue.form(now=0)
    assert ids(batch) == ["c", "d"]


def test_delay_waits_for_more_then_sends(loop: asyncio.AbstractEventLoop) -> None:
    queue = BatchQueue(max_batch_size=4, max_queue_delay_ns=100 * US)
    queue.push(pending(loop, at=0, name="a"))
    assert queue.form(now=10 * US) == (None, 100 * US)
    queue.push(pending(loop, at=20 * US, name="b"))
    assert queue.form(now=50 * US) == (None, 100 * US)
    batch, _ = queue.form(now=100 * US)
    assert ids(batch) == ["a", "b"]


def test_full_batch_goes_before_the_delay(loop: asyncio.AbstractEventLoop) -> None:
    queue = BatchQueue(max_batch_size=4, max_queue_delay_ns=1_000_000 * US)
    for name in "abcd":
        queue.push(pending(loop, name=name))
    batch, _ = queue.form(now=1)
    assert ids(batch) == ["a", "b", "c", "d"]


def test_preferred_batch_size_goes_at_once(loop: asyncio.AbstractEventLoop) -> None:
    queue = BatchQueue(max_batch_size=8, preferred_batch_sizes=(2, 4), max_queue_delay_ns=1_000 * US)
    for name in "abc":
        queue.push(pending(loop, name=name))
    batch, _ = queue.form(now=1)
    assert ids(batch) == ["a", "b"]  # 2 is preferred; 3 is not, so c waits
    assert queue.form(now=2) == (None, 1_000 * US)
    batch, _ = queue.form(now=1_000 * US)
    assert ids(batch) == ["c"]


def test_different_shapes_are_never_mixed(loop: asyncio.AbstractEventLoop) -> None:
    queue = BatchQueue(max_batch_size=8)
    queue.push(pending(loop, width=4, name="a"))
    queue.push(pending(loop, width=5, name="b"))
    queue.push(pending(loop, width=4, name="c"))
    assert ids(queue.form(now=0)[0]) == ["a", "c"]
    assert ids(queue.form(now=0)[0]) == ["b"]


def test_priority_levels_are_served_in_order(loop: asyncio.AbstractEventLoop) -> None:
    queue = BatchQueue(max_batch_size=2, policies=[QueuePolicy(), QueuePolicy()])
    queue.push(pending(loop, level=1, name="low1"))
    queue.push(pending(loop, level=1, name="low2"))
    queue.push(pending(loop, level=0, name="high"))
    assert ids(queue.form(now=0)[0]) == ["high", "low1"]
    assert ids(queue.form(now=0)[0]) == ["low2"]


def test_full_queue_rejects(loop: asyncio.AbstractEventLoop) -> None:
    queue = BatchQueue(max_batch_size=8, policies=[QueuePolicy(max_queue_size=2)])
    queue.push(pending(loop))
    queue.push(pending(loop))
    with pytest.raises(UnavailableError, match="queue of priority level 1 is full"):
        queue.push(pending(loop))


def test_timeout_reject_and_override(loop: asyncio.AbstractEventLoop) -> None:
    queue = BatchQueue(
        max_batch_size=8,
        max_queue_delay_ns=10_000 * US,
        policies=[QueuePolicy(default_timeout_ns=100 * US, allow_timeout_override=True)],
    )
    queue.push(pending(loop, name="default"))
    queue.push(pending(loop, name="longer"), timeout_us=500)
    assert queue.next_deadline() == 100 * US
    expired = queue.expire(now=100 * US)
    assert ids(expired) == ["default"]
    assert queue.next_deadline() == 500 * US
    assert ids(queue.expire(now=500 * US)) == ["longer"]
    assert len(queue) == 0


def test_timeout_override_ignored_when_not_allowed(loop: asyncio.AbstractEventLoop) -> None:
    queue = BatchQueue(max_batch_size=8, policies=[QueuePolicy(default_timeout_ns=100 * US)])
    queue.push(pending(loop), timeout_us=1)
    assert queue.next_deadline() == 100 * US


def test_timeout_delay_moves_behind_everything(loop: asyncio.AbstractEventLoop) -> None:
    queue = BatchQueue(
        max_batch_size=1, policies=[QueuePolicy(default_timeout_ns=100 * US, delay_on_timeout=True)]
    )
    queue.push(pending(loop, at=0, name="late"))
    assert queue.expire(now=200 * US) == []
    queue.push(pending(loop, at=200 * US, name="fresh"))
    assert ids(queue.form(now=200 * US)[0]) == ["fresh"]
    assert ids(queue.form(now=200 * US)[0]) == ["late"]


def test_cancelled_requests_cost_nothing(loop: asyncio.AbstractEventLoop) -> None:
    queue = BatchQueue(max_batch_size=8)
    gone = pending(loop, name="gone")
    queue.push(gone)
    queue.push(pending(loop, name="kept"))
    gone.future.cancel()
    assert ids(queue.form(now=0)[0]) == ["kept"]
    assert len(queue) == 0


def test_no_batching_takes_one_request(loop: asyncio.AbstractEventLoop) -> None:
    queue = BatchQueue(max_batch_size=0, max_queue_delay_ns=100 * US)
    queue.push(pending(loop, name="a"))
    queue.push(pending(loop, name="b"))
    assert ids(queue.form(now=0)[0]) == ["a"]


def test_callers_that_left_do_not_fill_the_queue(loop: asyncio.AbstractEventLoop) -> None:
    queue = BatchQueue(max_batch_size=8, policies=[QueuePolicy(max_queue_size=2)])
    queue.push(pending(loop, name="live"))
    gone = pending(loop, name="gone")
    queue.push(gone)
    gone.future.cancel()
    queue.push(pending(loop, name="new"))  # the cancelled one gave its place up
    assert ids(queue.form(now=0)[0]) == ["live", "new"]
