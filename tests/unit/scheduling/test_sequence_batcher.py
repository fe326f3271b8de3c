"""The sequence batcher: slot and sequence bookkeeping with a fake clock, config validation,
and the scheduler over fake instances (tensor injection, state, stop)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb

from quiver.backends.base import ExecuteResult, ExecutionTiming
from quiver.config import ModelConfig
from quiver.config.sequence import sequence_settings
from quiver.errors import ConfigError, InvalidArgumentError, UnavailableError, UnsupportedError
from quiver.metrics.statistics import ModelStatistics
from quiver.scheduling import SequenceBatcher, create_scheduler
from quiver.scheduling.sequence import SequenceItem, SequenceTable, correlation_id
from quiver.types import DataType, InferenceRequest, InferenceResponse, Tensor

US = 1000


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def item(
    loop: asyncio.AbstractEventLoop, name: str, at: int = 0, start: bool = False, end: bool = False
) -> SequenceItem:
    request = InferenceRequest("m", "", [], id=name)
    return SequenceItem(request, loop.create_future(), at, start=start, end=end)


def names(batch: list[Any] | None) -> list[str]:
    assert batch is not None
    return [entry.request.id for _, entry in batch]


# ------------------------------------------------------------------------ bookkeeping


def test_a_sequence_must_start(loop: asyncio.AbstractEventLoop) -> None:
    table = SequenceTable("m")
    with pytest.raises(InvalidArgumentError, match="sequence 7 to model 'm' must specify the START"):
        table.admit(7, item(loop, "a"), now=0)
    table.admit(7, item(loop, "a", start=True), now=0)
    table.admit(7, item(loop, "b", end=True), now=0)
    # After an END was admitted, only a START may follow.
    with pytest.raises(InvalidArgumentError):
        table.admit(7, item(loop, "c"), now=0)
    table.admit(7, item(loop, "d", start=True), now=0)


def test_direct_binds_sequences_to_slots_and_batches_per_instance(loop: asyncio.AbstractEventLoop) -> None:
    table = SequenceTable("m", instances=2, slots_per_instance=2, max_batch_size=2)
    seqs = [table.admit(cid, item(loop, f"s{cid}", start=True), now=0) for cid in (1, 2, 3)]
    # Spread over the instances first: 1 -> (0,0), 2 -> (1,0), 3 -> (0,1).
    assert [s.slot for s in seqs] == [(0, 0), (1, 0), (0, 1)]
    batch, _ = table.form(0, now=0)
    assert names(batch) == ["s1", "s3"]
    assert table.form(0, now=0) == (None, 0)  # both busy
    batch, _ = table.form(1, now=0)
    assert names(batch) == ["s2"]


def test_one_request_per_sequence_at_a_time_and_in_order(loop: asyncio.AbstractEventLoop) -> None:
    table = SequenceTable("m", slots_per_instance=4, max_batch_size=4)
    seq = table.admit(1, item(loop, "a", start=True), now=0)
    table.admit(1, item(loop, "b"), now=0)
    table.admit(2, item(loop, "x", start=True), now=0)
    batch, _ = table.form(0, now=0)
    assert names(batch) == ["a", "x"]
    assert table.form(0, now=0) == (None, 0)  # b waits for a
    for sequence, entry in batch or []:
        table.done(sequence, entry, now=1)
    batch, _ = table.form(0, now=1)
    assert names(batch) == ["b"]
    assert seq.busy


def test_end_releases_the_slot_to_the_backlog(loop: asyncio.AbstractEventLoop) -> None:
    table = SequenceTable("m", slots_per_instance=1)
    first = table.admit(1, item(loop, "a", start=True, end=True), now=0)
    second = table.admit(2, item(loop, "b", start=True), now=0)
    assert second.slot is None and list(table.backlog) == [second]
    batch, _ = table.form(0, now=0)
    assert names(batch) == ["a"]
    placed = table.done(first, batch[0][1], now=1)  # type: ignore[index]
    assert placed == [second] and second.slot == (0, 0)
    assert 1 not in table.sequences
    assert names(table.form(0, now=1)[0]) == ["b"]


def test_restart_keeps_the_slot_and_the_order(loop: asyncio.AbstractEventLoop) -> None:
    table = SequenceTable("m", slots_per_instance=2, max_batch_size=2)
    seq = table.admit(1, item(loop, "a", start=True), now=0)
    again = table.admit(1, item(loop, "b", start=True), now=0)
    assert again is seq and [i.request.id for i in seq.queue] == ["a", "b"]


def test_idle_sequences_expire_on_the_fake_clock(loop: asyncio.AbstractEventLoop) -> None:
    table = SequenceTable("m", slots_per_instance=1, max_idle_ns=100 * US)
    seq = table.admit(1, item(loop, "a", start=True), now=0)
    waiting = table.admit(2, item(loop, "b", start=True), now=0)
    assert table.next_expiry() == 0  # nothing idle: both have requests
    batch, _ = table.form(0, now=0)
    assert table.expire(now=10_000 * US) == []  # busy is not idle
    table.done(seq, batch[0][1], now=50 * US)  # type: ignore[index]
    assert table.next_expiry() == 150 * US
    assert table.expire(now=149 * US) == []
    assert table.expire(now=150 * US) == [seq]
    assert 1 not in table.sequences and waiting.slot == (0, 0)
    with pytest.raises(InvalidArgumentError, match="START"):
        table.admit(1, item(loop, "c"), now=151 * US)


def test_direct_delay_waits_for_every_live_sequence(loop: asyncio.AbstractEventLoop) -> None:
    table = SequenceTable("m", slots_per_instance=2, max_batch_size=2, max_queue_delay_ns=100 * US)
    one = table.admit(1, item(loop, "a", start=True), now=0)
    two = table.admit(2, item(loop, "x", start=True), now=0)
    batch, _ = table.form(0, now=0)
    assert names(batch) == ["a", "x"]  # every live sequence is ready: no wait
    for sequence, entry in batch or []:
        table.done(sequence, entry, now=0)
    table.admit(1, item(loop, "b", at=10 * US), now=10 * US)
    assert table.form(0, now=20 * US) == (None, 110 * US)
    table.admit(2, item(loop, "y", at=30 * US), now=30 * US)
    assert names(table.form(0, now=30 * US)[0]) == ["b", "y"]
    assert one.busy and two.busy


def test_oldest_batches_oldest_first_one_per_sequence(loop: asyncio.AbstractEventLoop) -> None:
    table = SequenceTable("m", strategy="oldest", instances=2, max_batch_size=2)
    table.admit(1, item(loop, "a1", at=3, start=True), now=3)
    table.admit(1, item(loop, "a2", at=4), now=4)
    table.admit(2, item(loop, "b1", at=1, start=True), now=1)
    table.admit(3, item(loop, "c1", at=2, start=True), now=2)
    assert names(table.form(0, now=5)[0]) == ["b1", "c1"]
    assert names(table.form(1, now=5)[0]) == ["a1"]  # a2 waits for a1
    assert table.form(0, now=5) == (None, 0)


def test_oldest_preferred_size_delay_and_candidates(loop: asyncio.AbstractEventLoop) -> None:
    table = SequenceTable(
        "m",
        strategy="oldest",
        max_batch_size=4,
        capacity=3,
        preferred_batch_sizes=(2,),
        max_queue_delay_ns=100 * US,
    )
    table.admit(1, item(loop, "a", at=0, start=True), now=0)
    assert table.form(0, now=10 * US) == (None, 100 * US)
    table.admit(2, item(loop, "b", at=20 * US, start=True), now=20 * US)
    assert names(table.form(0, now=20 * US)[0]) == ["a", "b"]  # preferred size 2
    table.admit(3, item(loop, "c", at=30 * US, start=True), now=30 * US)
    fourth = table.admit(4, item(loop, "d", at=30 * US, start=True), now=30 * US)
    assert fourth.slot is None  # 3 candidates at most: backlog
    assert names(table.form(0, now=130 * US)[0]) == ["c"]  # the delay passed


def test_correlation_ids() -> None:
    assert correlation_id({"sequence_id": 5}) == 5
    assert correlation_id({"sequence_id": "abc"}) == "abc"
    assert correlation_id({"sequence_id": 0}) is None
    assert correlation_id({"sequence_id": ""}) is None
    assert correlation_id({}) is None
    assert correlation_id({"sequence_id": True}) is None
    assert correlation_id({"sequence_id": -1}) == 2**64 - 1


# ------------------------------------------------------------------------ configuration

BASE = """
name: "acc"
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


def config(sequence: str, base: str = BASE) -> ModelConfig:
    proto = text_format.Parse(base + sequence, pb.ModelConfig())
    return ModelConfig.from_proto(proto, "acc/config.pbtxt")


def test_settings_of_a_full_section() -> None:
    settings = sequence_settings(
        config(
            """
            sequence_batching {
              max_sequence_idle_microseconds: 5000
              oldest { max_candidate_sequences: 8 preferred_batch_size: [ 2, 4 ] max_queue_delay_microseconds: 7 }
              control_input [
                { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
                { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
              ]
              state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ 1 ]
                        initial_state { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true name: "zeros" } } ]
            }
            """
        )
    )
    assert settings.strategy == "oldest"
    assert settings.max_idle_ns == 5_000_000 and settings.max_queue_delay_ns == 7000
    assert settings.max_candidate_sequences == 8 and settings.preferred_batch_sizes == (2, 4)
    assert settings.injected_inputs == {
        "START": DataType.FP32,
        "CORRID": DataType.UINT64,
        "STATE_IN": DataType.FP32,
    }
    assert list(settings.state_outputs) == ["STATE_OUT"]
    assert sequence_settings(config("sequence_batching { }")).strategy == "direct"
    assert sequence_settings(config("sequence_batching { }")).max_idle_ns == 1_000_000_000


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            'control_input [ { name: "INPUT" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [0, 1] } ] } ]',
            r"control_input\[0\]: 'INPUT' is also a model input",
        ),
        (
            'control_input [ { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID } ] } ]',
            "CONTROL_SEQUENCE_CORRID needs a 'data_type'",
        ),
        (
            'control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START } ] } ]',
            "needs exactly one of int32_false_true",
        ),
        (
            'control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [1] } ] } ]',
            "must have 2 values",
        ),
        (
            'state [ { input_name: "SI" output_name: "SO" dims: [ 1 ] } ]',
            r"state\[0\] \('SI'\): 'data_type' is missing",
        ),
        (
            'state [ { input_name: "SI" output_name: "SO" data_type: TYPE_FP32 dims: [ 0 ] } ]',
            "'dims' \\[0\\] must be",
        ),
        (
            'state [ { input_name: "SI" output_name: "SO" data_type: TYPE_FP32 } ]',
            "'dims' \\[\\] must be non-empty",
        ),
        (
            'state [ { input_name: "SI" output_name: "SO" data_type: TYPE_FP32 dims: [ 2 ] '
            "initial_state { dims: [ 3 ] zero_data: true } } ]",
            "do not fit",
        ),
        ("oldest { preferred_batch_size: [ 9 ] }", "preferred_batch_size 9"),
    ],
)
def test_invalid_sections_name_model_and_field(section: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        sequence_settings(config(f"sequence_batching {{ {section} }}"))
    assert "model 'acc': sequence_batching" in str(info.value)


def test_unknown_control_kind_from_json_config() -> None:
    proto = text_format.Parse(BASE + "sequence_batching { }", pb.ModelConfig())
    control = proto.sequence_batching.control_input.add(name="K").control.add()
    control.kind = 9  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="unknown control kind 9"):
        sequence_settings(ModelConfig.from_proto(proto, "acc"))


def test_iterative_sequence_is_unsupported() -> None:
    with pytest.raises(UnsupportedError, match="iterative_sequence"):
        sequence_settings(config("sequence_batching { iterative_sequence: true }"))


def test_initial_state_from_a_data_file(tmp_path: Path) -> None:
    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "init.bin").write_bytes(np.array([1.5, 2.5], np.float32).tobytes())
    section = (
        'sequence_batching { state [ { input_name: "SI" output_name: "SO" data_type: TYPE_FP32 '
        'dims: [ 2 ] initial_state { data_type: TYPE_FP32 dims: [ 2 ] data_file: "init.bin" } } ] }'
    )
    settings = sequence_settings(config(section), tmp_path)
    np.testing.assert_array_equal(settings.states[0].initial, [1.5, 2.5])
    with pytest.raises(ConfigError, match="not found"):
        sequence_settings(config(section.replace("init.bin", "other.bin")), tmp_path)


# ------------------------------------------------------------------------ the scheduler


class Accumulator:
    """A fake instance: OUTPUT = INPUT + STATE_IN, STATE_OUT = OUTPUT; records batches."""

    def __init__(self, name: str = "i0") -> None:
        self.name = name
        self.timing = ExecutionTiming()
        self.batches: list[list[InferenceRequest]] = []
        self.gate: asyncio.Event | None = None

    async def run(self, requests: list[InferenceRequest]) -> ExecuteResult:
        self.batches.append(requests)
        if self.gate is not None:
            await self.gate.wait()
        results: ExecuteResult = []
        for request in requests:
            x = request.input("INPUT")
            state = request.input("STATE_IN")
            assert x is not None and state is not None
            total = x.data + state.data
            results.append(
                InferenceResponse(
                    "acc",
                    "1",
                    [
                        Tensor("OUTPUT", DataType.FP32, total.shape, total),
                        Tensor("STATE_OUT", DataType.FP32, total.shape, total),
                    ],
                )
            )
        return results

    def unload(self) -> None:
        pass


SECTION = """
sequence_batching {
  max_sequence_idle_microseconds: 60000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] }
  ]
  state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
}
"""


def request(cid: Any, value: float, start: bool = False, end: bool = False) -> InferenceRequest:
    data = np.array([[value]], np.float32)
    params: dict[str, Any] = {"sequence_start": start, "sequence_end": end}
    if cid is not None:
        params["sequence_id"] = cid
    return InferenceRequest("acc", "", [Tensor("INPUT", DataType.FP32, (1, 1), data)], parameters=params)


def value(response: InferenceResponse) -> float:
    assert [t.name for t in response.outputs] == ["OUTPUT"]  # the state is taken out
    return float(response.outputs[0].data.reshape(-1)[0])


def test_scheduler_keeps_state_per_sequence_and_injects_controls() -> None:
    instance = Accumulator()
    stats = ModelStatistics()
    scheduler = create_scheduler(config(SECTION), [instance], stats)
    assert isinstance(scheduler, SequenceBatcher)

    async def main() -> None:
        assert value(await scheduler.enqueue(request(1, 1.0, start=True))) == 1.0
        assert value(await scheduler.enqueue(request("x", 10.0, start=True))) == 10.0
        assert value(await scheduler.enqueue(request(1, 2.0))) == 3.0
        assert value(await scheduler.enqueue(request("x", 5.0, end=True))) == 15.0
        assert value(await scheduler.enqueue(request(1, 4.0, start=True))) == 4.0  # restart
        with pytest.raises(InvalidArgumentError, match="sequence x to model 'acc' must specify the START"):
            await scheduler.enqueue(request("x", 1.0))
        with pytest.raises(InvalidArgumentError, match="model 'acc' must specify a non-zero"):
            await scheduler.enqueue(request(None, 1.0))
        await scheduler.stop()

    asyncio.run(main())
    first = instance.batches[0][0]
    controls = {t.name: (t.shape, t.data.tolist()) for t in first.inputs if t.name != "INPUT"}
    assert controls == {
        "START": ((1, 1), [[1]]),
        "READY": ((1, 1), [[True]]),
        "CORRID": ((1, 1), [[b"1"]]),
        "STATE_IN": ((1, 1), [[0.0]]),
    }
    assert stats.success.count == 5 and stats.execution_count == 5
    assert stats.fail_reasons.get("REJECTED") == 2


def test_concurrent_sequences_batch_and_stop_fails_the_queued() -> None:
    instance = Accumulator()
    stats = ModelStatistics()
    scheduler = create_scheduler(config(SECTION), [instance], stats)

    async def main() -> None:
        instance.gate = asyncio.Event()
        running = [asyncio.ensure_future(scheduler.enqueue(request(c, 1.0, start=True))) for c in (1, 2)]
        await asyncio.sleep(0.01)
        queued = asyncio.ensure_future(scheduler.enqueue(request(1, 1.0)))
        await asyncio.sleep(0.01)
        assert len(instance.batches) == 1 and len(instance.batches[0]) == 2  # one batch, two sequences
        stopping = asyncio.ensure_future(scheduler.stop())
        await asyncio.sleep(0.01)
        instance.gate.set()
        await stopping
        assert [value(await r) for r in running] == [1.0, 1.0]
        with pytest.raises(UnavailableError):
            await queued
        assert scheduler.inflight == 0 and not scheduler.table.sequences

    asyncio.run(main())
