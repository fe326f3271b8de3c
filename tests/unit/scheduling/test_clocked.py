"""The schedulers' timers run on the injected clock: with the fake clock, the dynamic batcher's
queue delay and queue timeout and the sequence batcher's idle release happen exactly when the
clock is moved there, with no sleeps."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb

from quiver.backends.base import ExecuteResult, ExecutionTiming
from quiver.clock import FakeClock
from quiver.config import ModelConfig
from quiver.errors import InvalidArgumentError, UnavailableError
from quiver.metrics.statistics import ModelStatistics
from quiver.scheduling import DynamicBatcher, SequenceBatcher, create_scheduler
from quiver.scheduling.queue import BatchQueue, QueuePolicy
from quiver.types import DataType, InferenceRequest, InferenceResponse, Tensor

US = 1000


class Recorder:
    """A fake instance: answers each request with its id, records the batches."""

    def __init__(self) -> None:
        self.name = "i0"
        self.timing = ExecutionTiming()
        self.batches: list[list[str]] = []

    async def run(self, requests: list[InferenceRequest]) -> ExecuteResult:
        self.batches.append([r.id for r in requests])
        return [InferenceResponse("m", "1", [], r.id) for r in requests]

    def unload(self) -> None:
        pass


def request(name: str, **parameters: Any) -> InferenceRequest:
    data = np.zeros((1, 1), np.float32)
    return InferenceRequest("m", "", [Tensor("X", DataType.FP32, (1, 1), data)], id=name, parameters=parameters)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_dynamic_batcher_waits_out_the_queue_delay_on_the_clock() -> None:
    clock = FakeClock()
    instance = Recorder()
    batcher = DynamicBatcher(
        "m", [instance], ModelStatistics(), BatchQueue(max_batch_size=4, max_queue_delay_ns=500 * US), clock=clock
    )

    async def main() -> None:
        first = asyncio.ensure_future(batcher.enqueue(request("a")))
        await settle()
        clock.advance(200 * US)
        second = asyncio.ensure_future(batcher.enqueue(request("b")))
        await settle()
        assert instance.batches == [] and clock.pending == [500 * US]
        clock.advance(299 * US)
        await settle()
        assert instance.batches == []
        clock.advance(1 * US)  # the oldest has waited the delay: the batch goes as it is
        await settle()
        assert [r.id for r in await asyncio.gather(first, second)] == ["a", "b"]
        await batcher.stop()

    asyncio.run(main())
    assert instance.batches == [["a", "b"]]


def test_dynamic_batcher_times_a_request_out_of_the_queue_on_the_clock() -> None:
    clock = FakeClock()
    instance = Recorder()
    stats = ModelStatistics()
    queue = BatchQueue(
        max_batch_size=4, max_queue_delay_ns=1000 * US, policies=[QueuePolicy(default_timeout_ns=50 * US)]
    )
    batcher = DynamicBatcher("m", [instance], stats, queue, clock=clock)

    async def main() -> None:
        waiting = asyncio.ensure_future(batcher.enqueue(request("a")))
        await settle()
        assert clock.pending == [50 * US]  # the timeout comes before the delay
        clock.advance(50 * US)
        await settle()
        with pytest.raises(UnavailableError, match="timed out in the queue after 50 us"):
            await waiting
        await batcher.stop()

    asyncio.run(main())
    assert instance.batches == [] and stats.fail_reasons == {"REJECTED": 1}


SEQUENCE_CONFIG = """
name: "m"
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
sequence_batching { max_sequence_idle_microseconds: 1000 }
"""


def test_sequence_batcher_releases_an_idle_sequence_on_the_clock() -> None:
    clock = FakeClock()
    instance = Recorder()
    config = ModelConfig.from_proto(text_format.Parse(SEQUENCE_CONFIG, pb.ModelConfig()), "m/config.pbtxt")
    batcher = create_scheduler(config, [instance], ModelStatistics(), clock=clock)
    assert isinstance(batcher, SequenceBatcher)

    async def main() -> None:
        await batcher.enqueue(request("a", sequence_id=7, sequence_start=True))
        await settle()
        assert list(batcher.table.sequences) == [7] and clock.pending == [1000 * US]
        clock.advance(999 * US)
        await batcher.enqueue(request("b", sequence_id=7))  # activity: the idle time starts again
        await settle()
        clock.advance(1 * US)  # the first alarm finds it active, and is set again
        await settle()
        assert list(batcher.table.sequences) == [7] and clock.pending == [1999 * US]
        clock.advance(998 * US)
        assert list(batcher.table.sequences) == [7]
        clock.advance(1 * US)
        assert batcher.table.sequences == {}  # released by the alarm, no request needed
        with pytest.raises(InvalidArgumentError, match="must specify the START flag"):
            await batcher.enqueue(request("c", sequence_id=7))
        await batcher.stop()

    asyncio.run(main())
    assert instance.batches == [["a"], ["b"]]


class Held(Recorder):
    """A fake instance that queues requests itself (``slots``) and holds each batch until
    ``gate`` opens."""

    slots = 3

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def run(self, requests: list[InferenceRequest]) -> ExecuteResult:
        self.batches.append([r.id for r in requests])
        await self.gate.wait()
        return [InferenceResponse("m", "1", [], r.id) for r in requests]


@pytest.mark.parametrize(
    ("queue", "priority_levels", "in_flight"),
    [
        (BatchQueue(max_batch_size=0), 0, 3),  # one request per batch, no policy: as without a batcher
        (BatchQueue(max_batch_size=1), 0, 3),
        (BatchQueue(max_batch_size=4), 0, 1),  # batches form from what waits meanwhile
        (BatchQueue(max_batch_size=0, policies=[QueuePolicy(default_timeout_ns=60_000_000 * US)]), 0, 1),
        (BatchQueue(max_batch_size=0, policies=[QueuePolicy(max_queue_size=8)]), 0, 1),
        (BatchQueue(max_batch_size=0, policies=[QueuePolicy(), QueuePolicy()]), 2, 1),
    ],
)
def test_dynamic_batcher_hands_an_instance_its_slots_only_where_nothing_changes(
    queue: BatchQueue, priority_levels: int, in_flight: int
) -> None:
    instance = Held()
    batcher = DynamicBatcher("m", [instance], ModelStatistics(), queue, priority_levels=priority_levels)

    async def main() -> None:
        calls = [asyncio.ensure_future(batcher.enqueue(request(str(i)))) for i in range(4)]
        await settle()
        assert len(instance.batches) == in_flight
        instance.gate.set()
        assert sorted(r.id for r in await asyncio.gather(*calls)) == ["0", "1", "2", "3"]
        await batcher.stop()

    asyncio.run(main())
